"""Prefill and decode speed of zoo variants against `LlamaForCausalLM` of the same size, in the same process.

decode       Every variant against Llama of the same width, depth and head counts: greedy `generate()` of 256
             tokens after a 512-token prompt at batch 1 and 8; prefill tokens/s (a generation of one token),
             decode tokens/s (the rest of a generation) and the bytes the cache holds per token at the end.
             Writes results/decode.md, decode.json and, with matplotlib, decode.png.
fast-decode  The MHA family and sliding window: decode tokens/s with the dynamic cache, the static cache
             (`cache_implementation="static"`) and the static cache with the compiled decode step
             (`hf_attn_zoo.decoding.generate_compiled`), against Llama doing the same, and whether every mode gives
             the dynamic cache's tokens. Writes results/fast_decode.md and .json.

Models: the scaling benchmark's (scaling.py: each variant's `small` preset at 6 layers x 256, vocabulary 16384).
Each sample is the best of a few runs; samples alternate between the zoo model and Llama, and ratios are medians of
back-to-back pairs (common.py).

    python -m experiments decode [--variants gqa mqa] [--batch_sizes 1 8] [--output_dir DIR]
    python -m experiments fast-decode [--variants gqa] [--new_tokens 128]
"""

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from experiments.common import (
    Benchmark,
    Results,
    alternate,
    compare,
    llama_like,
    main,
    paired_ratio,
    prefill_and_decode_seconds,
    write_results,
)
from experiments.speed.scaling import ScalingSetup, benchmark_model, cache_nbytes
from hf_attn_zoo.decoding import generate_compiled
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, save_figure
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.compat_zoo import returned_cache


@dataclass
class DecodeSetup(Results):
    """Prefill and decode tokens/s and cache bytes per token of every variant against the same-size Llama."""

    variants: list[str] = field(default_factory=list, metadata={"help": "variants (default: all registered)"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "generate() batches"})
    prompt_len: int = field(default=512, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=256, metadata={"help": "generated tokens per row"})
    runs: int = field(default=2, metadata={"help": "calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


@torch.no_grad()
def prefill_and_decode(model, prompt: torch.Tensor, new_tokens: int, runs: int) -> tuple[float, float, int]:
    """(prefill tokens/s, decode tokens/s, bytes the cache holds after a generation of `new_tokens`), greedy."""
    model.eval()
    kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    last = {}

    def generate(count: int):
        last["output"] = model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)

    first, rest = prefill_and_decode_seconds(generate, new_tokens, runs)
    rows, prompt_len = prompt.shape
    return rows * prompt_len / first, rows * (new_tokens - 1) / rest, cache_nbytes(returned_cache(last["output"]))


def decode_benchmark(setup: DecodeSetup, log: Callable[[str], None] = print) -> list[dict]:
    size = ScalingSetup()
    rows = []
    for name in setup.variants or list(VARIANTS):
        zoo = benchmark_model(name, size, max_length=setup.prompt_len + setup.new_tokens)
        llama = LlamaForCausalLM(llama_like(zoo.config)).eval()
        for batch_size in setup.batch_sizes:
            shape = (batch_size, setup.prompt_len)
            prompt = torch.randint(0, size.vocab_size, shape, generator=torch.Generator().manual_seed(1))

            def measure(model, prompt=prompt) -> tuple[float, float, int]:
                return prefill_and_decode(model, prompt, setup.new_tokens, setup.runs)

            samples = alternate({"zoo": zoo, "llama": llama}, {"generate": measure}, setup.repeats)["generate"]
            tokens = batch_size * (setup.prompt_len + setup.new_tokens - 1)
            row = {"variant": name, "batch_size": batch_size}
            for index, kind in enumerate(("prefill", "decode")):
                row.update(compare({label: [s[index] for s in samples[label]] for label in samples}, kind))
            for label in samples:
                row[f"cache_bytes_per_token_{label}"] = samples[label][-1][2] / tokens
            rows.append(row)
            log(
                f"{name:15s} batch {batch_size}: prefill {row['prefill_zoo']:8,.0f}/s ({row['prefill_ratio']:.2f}x), "
                f"decode {row['decode_zoo']:6,.0f}/s ({row['decode_ratio']:.2f}x), "
                f"cache {row['cache_bytes_per_token_zoo']:,.0f} B/token"
            )
    return rows


def decode_table(rows: list[dict], setup: DecodeSetup) -> str:
    lines = [
        f"`generate()` of {setup.new_tokens} tokens after a {setup.prompt_len}-token prompt, greedy, the scaling "
        f"benchmark's configs (6 layers x 256), {torch.get_num_threads()} CPU threads; `LlamaForCausalLM` of the same "
        f"width, depth and head counts alternating in the same process; medians of {setup.repeats} best-of-"
        f"{setup.runs} samples. Cache: bytes the cache holds per token (prompt and generated) at the end.",
        "",
        "| variant | batch | prefill tok/s | vs Llama | decode tok/s | vs Llama | cache B/token | Llama's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['variant']}` | {row['batch_size']} | {row['prefill_zoo']:,.0f} | {row['prefill_ratio']:.2f} "
            f"| {row['decode_zoo']:,.0f} | {row['decode_ratio']:.2f} | {row['cache_bytes_per_token_zoo']:,.0f} "
            f"| {row['cache_bytes_per_token_llama']:,.0f} |"
        )
    return "\n".join(lines)


def decode_plot(rows: list[dict], path: Path) -> bool:
    """Decode tokens/s per variant (horizontal bars in the variant's house colour, names unrotated on the y axis),
    the same-size Llama's rate as a black tick on each bar; one panel per batch size."""
    plt = headless_pyplot()
    if plt is None:
        return False
    batch_sizes = sorted({row["batch_size"] for row in rows})
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    with house_style():
        figure, axes = plt.subplots(
            1,
            len(batch_sizes),
            figsize=(6 * len(batch_sizes), 0.3 * len(variants) + 2.5),
            squeeze=False,
            sharey=True,
            layout="constrained",
        )
        for axis, batch_size in zip(axes[0], batch_sizes):
            by_variant = {row["variant"]: row for row in rows if row["batch_size"] == batch_size}
            shown = [v for v in variants if v in by_variant]
            y = range(len(shown))
            axis.barh(y, [by_variant[v]["decode_zoo"] for v in shown], color=[colour(v) for v in shown])
            axis.scatter(
                [by_variant[v]["decode_llama"] for v in shown],
                y,
                color=colour("llama"),
                marker="|",
                s=250,
                linewidths=2.5,
                label="LlamaForCausalLM, same size",
                zorder=3,
            )
            axis.set_yticks(list(y), shown)
            axis.invert_yaxis()  # the first variant on top, as in the table
            axis.set(xlabel="decode speed (tokens/s)", title=f"generate() decode, batch {batch_size}")
            axis.grid(False, axis="y")
        axes[0][0].set_ylabel("variant")
        figure.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center")
        save_figure(figure, path)
    return True


def decode_figures(rows: list[dict]) -> dict:
    """decode.png from decode.json's contents, for a run and `--replot`."""
    return {"decode.png": lambda path: decode_plot(rows, path)}


def run_decode(setup: DecodeSetup) -> list[dict]:
    """Measure, then write the rows beside those of earlier runs: a run over some variants or batch sizes replaces
    their rows and keeps the others (each row is its own ratio, measured back to back)."""
    rows = decode_benchmark(setup)
    earlier = Path(setup.output_dir) / "decode.json"
    if earlier.exists():
        measured = {(row["variant"], row["batch_size"]) for row in rows}
        known = list(VARIANTS)
        rows = sorted(
            [r for r in json.loads(earlier.read_text()) if (r["variant"], r["batch_size"]) not in measured] + rows,
            key=lambda r: (known.index(r["variant"]) if r["variant"] in known else len(known), r["batch_size"]),
        )
    write_results(setup.output_dir, "decode", rows, decode_table(rows, setup), decode_figures(rows))
    return rows


@dataclass
class FastDecodeSetup(Results):
    """Decode tokens/s with the dynamic cache, the static cache and the compiled step, against the same-size Llama."""

    variants: list[str] = field(
        default_factory=lambda: ["mha", "gqa", "mqa", "sliding_window"], metadata={"help": "variants to measure"}
    )
    batch_size: int = field(default=1, metadata={"help": "rows per generate()"})
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "generated tokens per row"})
    runs: int = field(default=2, metadata={"help": "calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


FAST_DECODE_MODES = ("dynamic", "static", "compiled")


@torch.no_grad()
def decode_rate(model, mode: str, prompt: torch.Tensor, new_tokens: int, runs: int) -> tuple[float, torch.Tensor]:
    """(decode tokens/s, tokens) of greedy generation in `mode`; a compiled step is warmed up (compiled) before
    timing."""
    kwargs = dict(do_sample=False, pad_token_id=0)

    def generate(count: int) -> torch.Tensor:
        if mode == "compiled":
            # the same total cache length for both calls, so they share one compiled graph
            return generate_compiled(model, prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)
        cache = {"cache_implementation": "static"} if mode == "static" else {}
        return model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **cache, **kwargs)

    tokens = generate(new_tokens)  # warm-up: compiles the decode step
    _, rest = prefill_and_decode_seconds(generate, new_tokens, runs)
    return prompt.shape[0] * (new_tokens - 1) / rest, tokens


def fast_decode_benchmark(setup: FastDecodeSetup, log: Callable[[str], None] = print) -> list[dict]:
    size = ScalingSetup()
    shape = (setup.batch_size, setup.prompt_len)
    prompt = torch.randint(1, size.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    rows = []
    for name in setup.variants:
        zoo = benchmark_model(name, size, max_length=setup.prompt_len + setup.new_tokens)
        llama = LlamaForCausalLM(llama_like(zoo.config)).eval()
        # every repeat measures every mode on both models back to back, so that each ratio (zoo / Llama in one mode,
        # compiled / dynamic for one model) compares samples taken moments apart on a machine whose load drifts
        measures = {
            mode: lambda model, mode=mode: decode_rate(model, mode, prompt, setup.new_tokens, setup.runs)
            for mode in FAST_DECODE_MODES
        }
        samples = alternate({"zoo": zoo, "llama": llama}, measures, setup.repeats, warm_up=False)
        rates = {
            mode: {label: [rate for rate, _ in samples[mode][label]] for label in ("zoo", "llama")} for mode in samples
        }
        reference = samples["dynamic"]["zoo"][0][1]  # every mode must produce the dynamic cache's tokens
        row = {"variant": name, "batch_size": setup.batch_size}
        for mode in FAST_DECODE_MODES:
            row.update(compare(rates[mode], mode))
            row[f"{mode}_same_tokens"] = all(torch.equal(tokens, reference) for _, tokens in samples[mode]["zoo"])
        for label in ("zoo", "llama"):
            row[f"compiled_over_dynamic_{label}"] = paired_ratio(rates["compiled"][label], rates["dynamic"][label])
        torch._dynamo.reset()  # the next variant compiles its own graphs
        rows.append(row)
        log(
            f"{name:15s} "
            + ", ".join(
                f"{mode} {row[f'{mode}_zoo']:6,.0f}/s ({row[f'{mode}_ratio']:.2f}x)" for mode in FAST_DECODE_MODES
            )
        )
    return rows


def fast_decode_table(rows: list[dict], setup: FastDecodeSetup) -> str:
    threads = torch.get_num_threads()
    lines = [
        f"Decode tokens/s, greedy, batch {setup.batch_size}, {setup.new_tokens} tokens after a {setup.prompt_len}-"
        f"token prompt, {threads} CPU threads, the scaling benchmark's configs (6 layers x 256): dynamic cache, "
        f'`cache_implementation="static"`, and the static cache with the `torch.compile`d decode step '
        f"(`hf_attn_zoo.decoding.generate_compiled`); `LlamaForCausalLM` of the same size doing the same, "
        f"alternating in the same process, medians of {setup.repeats} best-of-{setup.runs} samples; compiled/dyn.: "
        f"the compiled step's speed-up for each model; same: every mode gave the dynamic cache's tokens.",
        "",
        "| variant | dynamic | vs Llama | static | vs Llama | compiled | vs Llama | compiled/dyn. | Llama's | same |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        same = all(row[f"{mode}_same_tokens"] for mode in FAST_DECODE_MODES)
        lines.append(
            f"| `{row['variant']}` | "
            + " | ".join(f"{row[f'{mode}_zoo']:,.0f} | {row[f'{mode}_ratio']:.2f}" for mode in FAST_DECODE_MODES)
            + f" | {row['compiled_over_dynamic_zoo']:.2f} | {row['compiled_over_dynamic_llama']:.2f} "
            f"| {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)


def run_fast_decode(setup: FastDecodeSetup) -> list[dict]:
    rows = fast_decode_benchmark(setup)
    write_results(setup.output_dir, "fast_decode", rows, fast_decode_table(rows, setup))
    return rows


BENCHMARKS = {
    "decode": Benchmark(DecodeSetup, run_decode, figures=decode_figures, results="decode"),
    "fast-decode": Benchmark(FastDecodeSetup, run_fast_decode),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
