"""The main job, end to end on CPU in seconds: build a zoo model with a byte-level tokenizer, generate a sample,
score held-out text (corpus-level token perplexity), save the checkpoint and reload it through the Auto classes."""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .data import byte_level_tokenizer, stdlib_corpus_files, tokenizer_fields
from .models import get_variant


@dataclass
class DemoOptions:
    variant: str = field(default="gqa", metadata={"help": "registered variant name (see `hf-attn-zoo list`)"})
    position_embedding_type: str | None = field(
        default=None, metadata={"help": "rope, alibi, sinusoidal, learned or none; default: the variant's own"}
    )
    prompt: str = field(default="def main():\n", metadata={"help": "text to continue"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens to generate"})
    score_chars: int = field(default=8192, metadata={"help": "characters of held-out text to score"})
    output_dir: str = field(default="outputs/demo", metadata={"help": "where the checkpoint is saved"})
    seed: int = field(default=0, metadata={"help": "random seed"})


@torch.no_grad()
def token_perplexity(model, tokenizer, text: str, window: int) -> tuple[float, int]:
    """exp(total NLL / predicted tokens) over disjoint windows of `window` tokens: (perplexity, tokens scored)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1][None]  # window inputs plus the token after them
        logits = model(chunk[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total_nll, total_tokens = total_nll + nll.item(), total_tokens + chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens), total_tokens


def run_demo(options: DemoOptions) -> dict:
    start = time.perf_counter()
    torch.manual_seed(options.seed)
    tokenizer = byte_level_tokenizer()
    variant = get_variant(options.variant)
    # head counts and the rest stay at the variant's defaults (8 query heads; 2 KV heads for gqa, 1 for mqa, ...)
    positions = (
        {} if options.position_embedding_type is None else {"position_embedding_type": options.position_embedding_type}
    )
    config = variant.config(
        **tokenizer_fields(tokenizer), hidden_size=128, num_hidden_layers=4, max_position_embeddings=1024, **positions
    )
    model = variant.causal_lm_class(config).eval()
    print(
        f"{variant.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{config.position_embedding_type} positions, untrained"
    )

    held_out = stdlib_corpus_files()[-1].read_text(encoding="utf-8")[: options.score_chars]
    perplexity, tokens = token_perplexity(model, tokenizer, held_out, window=512)
    print(f"perplexity on {tokens} held-out tokens: {perplexity:.1f} (uniform guessing: {len(tokenizer)})")

    inputs = tokenizer(options.prompt, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=options.max_new_tokens, do_sample=True, top_k=50)
    print("sample:", repr(tokenizer.decode(generated[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)))

    output_dir = Path(options.output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    AutoTokenizer.from_pretrained(output_dir)
    assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits), "reloaded checkpoint differs"
    print(f"saved to {output_dir} and reloaded with AutoModelForCausalLM ({time.perf_counter() - start:.1f} s)")
    return {"perplexity": perplexity, "tokens": tokens, "output_dir": str(output_dir)}
