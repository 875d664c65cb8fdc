"""Training and `generate()` speed of zoo models against transformers' `LlamaForCausalLM`, in the same process.

llama     A zoo variant of the MHA family (`--variant gqa`, or mha, mqa, single_head) against Llama holding the same
          weights (the zoo model is converted from it with `from_llama`), same config, same attention backend:
          training tokens/s (batch 8 x 256, forward + backward + AdamW on random tokens; both models as they come:
          logits and transformers' causal LM loss; a second, labelled row times the zoo's opt-in fused head + loss
          against the same Llama) and greedy `generate()` tokens/s (prompt 128, 128 new tokens, batches 1 and 8).
          Model: 6 layers x 256, 8 heads, 2 key/value heads, vocabulary 16384 (8.4M parameters); sizes, batches and
          lengths are options.
          Writes results/speed_<variant>_vs_llama.md and .json.
training  Every variant's `small` preset against `LlamaForCausalLM` at the same width, depth, MLP and head counts:
          training tokens/s at batch 8 x 256 and 1 x 2048, vocabulary 8192, eager and compiled (`torch.compile`,
          inductor; both models in the same mode). Writes results/training_throughput_<size>.md and .json.

Each sample is the best of a few runs, samples alternate between the two models (A B, B A, ...) and the ratio
zoo / Llama is the median of the ratios of back-to-back pairs (common.py); above 1.0 the zoo model is faster.

    python -m experiments llama [--repeats 9] [--variant mqa] [--output_dir DIR]
    python -m experiments training [--variants gqa mha] [--size small] [--shapes 8x256 1x2048] [--modes eager]
"""

import copy
import json
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from experiments.common import (
    Benchmark,
    Results,
    alternate,
    compare,
    fastest,
    llama_like,
    main,
    paired_ratio,
    write_results,
)
from hf_attn_zoo.convert.llama import from_llama, in_mha_family
from hf_attn_zoo.models import VARIANTS, get_variant


@dataclass
class SpeedSetup(Results):
    """A zoo variant against LlamaForCausalLM holding the same weights: training and generate() tokens/s."""

    variant: str = field(default="gqa", metadata={"help": "MHA-family variant to compare with Llama"})
    vocab_size: int = field(default=16384, metadata={"help": "vocabulary of both models"})
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    intermediate_size: int = field(default=688, metadata={"help": "MLP width"})
    num_hidden_layers: int = field(default=6, metadata={"help": "layers"})
    num_attention_heads: int = field(default=8, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=2, metadata={"help": "key/value heads"})
    train_batch_size: int = field(default=8, metadata={"help": "training batch size"})
    train_seq_len: int = field(default=256, metadata={"help": "training sequence length"})
    train_steps: int = field(default=4, metadata={"help": "timed training steps per sample; the fastest counts"})
    prompt_len: int = field(default=128, metadata={"help": "generate(): prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "generate(): new tokens per row"})
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "generate() batches"})
    decode_runs: int = field(default=3, metadata={"help": "generate() calls per sample; the fastest counts"})
    repeats: int = field(default=5, metadata={"help": "alternating samples per model and metric"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "attention backend of both models"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})
    fuse_linear_cross_entropy: bool = field(
        default=True,
        metadata={
            "help": "besides the row of both defaults, a training row of the zoo with its opt-in fused head + loss "
            "(`fuse_linear_cross_entropy=True`: no logits) against Llama's default"
        },
    )


DEFAULTS = "both defaults: logits + causal LM loss"
FUSED = "opt-in: zoo fused head + loss, no logits; Llama default"


@dataclass
class SpeedReport:
    setup: SpeedSetup
    parameters: int
    # metric name -> {"llama": [tokens/s per repeat], "zoo": [...]}
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    machine: str = field(default_factory=lambda: f"{platform.machine()}, torch {torch.__version__}")

    def median(self, metric: str, model: str) -> float:
        return statistics.median(self.samples[metric][model])

    def ratio(self, metric: str) -> float:
        return paired_ratio(self.samples[metric]["zoo"], self.samples[metric]["llama"])

    def table(self) -> str:
        s = self.setup
        lines = [
            f"`{s.variant}` vs `LlamaForCausalLM`: {self.parameters / 1e6:.1f}M parameters "
            f"({s.num_hidden_layers} layers x {s.hidden_size}, {s.num_attention_heads} heads, "
            f"{s.num_key_value_heads} KV heads), {s.attn_implementation}, {torch.get_num_threads()} threads, "
            f"best-of-run samples, medians of {s.repeats} alternating repeats ({self.machine}); training rows: "
            f"{DEFAULTS} = each model as it comes, Llama with transformers' `ForCausalLMLoss`, the zoo with "
            f"`causal_lm_loss` (the same value from the same logits, a shorter backward); {FUSED} = the zoo with "
            "`fuse_linear_cross_entropy=True`, an opt-in",
            "",
            "| metric | Llama tokens/s | zoo tokens/s | zoo / Llama |",
            "| --- | ---: | ---: | ---: |",
        ]
        for metric in self.samples:
            lines.append(
                f"| {metric} | {self.median(metric, 'llama'):,.0f} | {self.median(metric, 'zoo'):,.0f} "
                f"| {self.ratio(metric):.3f} |"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "ratios": {metric: self.ratio(metric) for metric in self.samples}}


def training_tokens_per_second(model, batch_size: int, seq_len: int, steps: int, vocab_size: int) -> float:
    """Forward, backward and an AdamW step on random tokens (the data does not change the arithmetic); the fastest
    of `steps` timed steps."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocate optimizer state outside the timing
    return batch_size * seq_len / fastest(step, steps)


@torch.no_grad()
def decode_tokens_per_second(
    model, batch_size: int, prompt_len: int, new_tokens: int, vocab_size: int, runs: int = 3
) -> float:
    """Greedy `generate()` of exactly `new_tokens` tokens per row, prefill included as a user would see it; the
    fastest of `runs` calls."""
    model.eval()
    prompt = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return batch_size * new_tokens / fastest(lambda: model.generate(prompt, **kwargs), runs)


def build_pair(setup: SpeedSetup) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    """A Llama model and the zoo model with the same config and the same weights."""
    if not in_mha_family(setup.variant):
        raise ValueError(f"variant={setup.variant!r}: the Llama comparison covers the MHA family (mha, gqa, mqa).")
    llama_config = LlamaConfig(
        vocab_size=setup.vocab_size,
        hidden_size=setup.hidden_size,
        intermediate_size=setup.intermediate_size,
        num_hidden_layers=setup.num_hidden_layers,
        num_attention_heads=setup.num_attention_heads,
        num_key_value_heads=setup.num_key_value_heads,
        max_position_embeddings=max(setup.train_seq_len, setup.prompt_len + setup.new_tokens),
        tie_word_embeddings=True,
        eos_token_id=None,
        attn_implementation=setup.attn_implementation,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config)
    return llama, from_llama(llama, variant=setup.variant)


def compare_with_llama(setup: SpeedSetup, log: Callable[[str], None] = print) -> SpeedReport:
    if setup.threads:
        torch.set_num_threads(setup.threads)
    llama, zoo = build_pair(setup)
    report = SpeedReport(setup=copy.deepcopy(setup), parameters=sum(p.numel() for p in zoo.parameters()))

    def training(model, fused: bool = False) -> float:
        if fused and model is zoo:
            zoo.config.fuse_linear_cross_entropy = True
        try:
            return training_tokens_per_second(
                model, setup.train_batch_size, setup.train_seq_len, setup.train_steps, setup.vocab_size
            )
        finally:
            zoo.config.fuse_linear_cross_entropy = False

    shape = f"batch {setup.train_batch_size} x {setup.train_seq_len}"
    metrics = {f"training ({shape}), {DEFAULTS}": training}
    if setup.fuse_linear_cross_entropy:
        metrics[f"training ({shape}), {FUSED}"] = lambda m: training(m, fused=True)
    for batch_size in setup.decode_batch_sizes:
        metrics[f"generate decode (batch {batch_size}, prompt {setup.prompt_len}, {setup.new_tokens} new)"] = (
            lambda m, b=batch_size: decode_tokens_per_second(
                m, b, setup.prompt_len, setup.new_tokens, setup.vocab_size, setup.decode_runs
            )
        )

    def progress(repeat: int, samples: dict) -> None:
        ratios = ", ".join(f"{s['zoo'][-1] / s['llama'][-1]:.3f}" for s in samples.values())
        log(f"repeat {repeat + 1}/{setup.repeats}: zoo / Llama {ratios}")

    report.samples = alternate({"llama": llama, "zoo": zoo}, metrics, setup.repeats, after_repeat=progress)
    return report


def run_llama(setup: SpeedSetup) -> SpeedReport:
    report = compare_with_llama(setup)
    write_results(setup.output_dir, f"speed_{setup.variant}_vs_llama", report.as_dict(), report.table())
    return report


MODES = ("eager", "compiled")


def loss_mode(fused: bool) -> str:
    """What the training columns measured of the loss, said in every table."""
    if fused:
        return (
            "the zoo model with its fused head + loss (`fuse_linear_cross_entropy=True`, an opt-in: no logits), "
            "Llama with transformers' plain head and loss"
        )
    return "both models with transformers' plain head and loss (logits materialised)"


@dataclass
class TrainingThroughputSetup(Results):
    """Training tokens/s of every variant's preset against LlamaForCausalLM of the same width, depth, MLP and heads,
    eager and compiled, at a short and a long sequence."""

    variants: list[str] = field(default_factory=list, metadata={"help": "variants (default: all registered)"})
    size: str = field(default="small", metadata={"help": "preset size: tiny, small or base"})
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary of both models"})
    shapes: list[str] = field(
        default_factory=lambda: ["8x256", "1x2048"],
        metadata={"help": "BATCHxLENGTH of a training step, each measured (the defaults hold 2,048 tokens each)"},
    )
    modes: list[str] = field(
        default_factory=lambda: list(MODES),
        metadata={"help": "eager and/or compiled (torch.compile, inductor, one graph per shape; both models alike)"},
    )
    steps: int = field(default=3, metadata={"help": "timed steps per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})
    max_position_embeddings: int = field(
        default=2048,
        metadata={
            "help": "positions every model is sized for (at least the longest shape), whichever shapes one run "
            "measures, so that rows of separate runs time the same model (Linformer's and AFT's parameters grow "
            "with it)"
        },
    )

    fuse_linear_cross_entropy: bool = field(
        default=True,
        metadata={"help": "the zoo models train with their fused head + loss (the opt-in config field); Llama never"},
    )

    def parsed_shapes(self) -> list[tuple[int, int]]:
        shapes = []
        for shape in self.shapes:
            batch, _, length = shape.partition("x")
            if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 1):
                raise SystemExit(f"--shapes {shape}: write BATCHxLENGTH, e.g. 8x256")
            shapes.append((int(batch), int(length)))
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown:
            raise SystemExit(f"--modes {' '.join(unknown)}: use some of {' '.join(MODES)}")
        return shapes


def training_throughput(setup: TrainingThroughputSetup, log: Callable[[str], None] = print) -> list[dict]:
    """Training tokens/s of each variant's preset and of the same-size Llama, alternating, in this process: one row
    per variant, mode and shape. Compiled, each model is compiled once per shape before its first timed sample."""
    shapes = setup.parsed_shapes()
    rows = []
    for name in setup.variants or list(VARIANTS):
        variant = get_variant(name)
        preset = variant.preset(setup.size).get("max_position_embeddings", 0)
        positions = max(preset, setup.max_position_embeddings, *(n for _, n in shapes))
        torch.manual_seed(0)
        zoo = variant.build(
            setup.size,
            vocab_size=setup.vocab_size,
            max_position_embeddings=positions,
            fuse_linear_cross_entropy=setup.fuse_linear_cross_entropy,
        )
        llama = LlamaForCausalLM(llama_like(zoo.config))
        for mode in setup.modes:
            models = {"zoo": zoo, "llama": llama}
            if mode == "compiled":
                models = {label: torch.compile(model, dynamic=False) for label, model in models.items()}
            for batch, length in shapes:
                measure = lambda model, b=batch, n=length: training_tokens_per_second(  # noqa: E731
                    model, b, n, setup.steps, setup.vocab_size
                )
                samples = alternate(models, {"training": measure}, setup.repeats)["training"]
                row = {"variant": name, "mode": mode, "batch": batch, "seq_len": length}
                row["parameters"] = sum(p.numel() for p in zoo.parameters())
                row.update(compare(samples, "tokens_per_second"))
                rows.append(row)
                log(
                    f"{name:15s} {mode:8s} {batch}x{length}: {row['tokens_per_second_zoo']:8,.0f} tokens/s, Llama "
                    f"{row['tokens_per_second_llama']:8,.0f} ({row['tokens_per_second_ratio']:.2f}x)"
                )
    return rows


def _row_key(row: dict) -> tuple:
    return row["variant"], row["mode"], row["batch"], row["seq_len"]


def _row_order(row: dict) -> tuple:
    """Registry order (unregistered variants last), then mode, then the shape's length."""
    known = list(VARIANTS)
    variant = known.index(row["variant"]) if row["variant"] in known else len(known)
    return variant, MODES.index(row["mode"]), row["seq_len"], row["batch"]


def training_throughput_table(rows: list[dict], setup: TrainingThroughputSetup) -> str:
    modes = [mode for mode in MODES if any(row["mode"] == mode for row in rows)]
    lines = [
        f"Training tokens/s, `{setup.size}` presets (vocabulary {setup.vocab_size}), forward + backward + AdamW, one "
        f"process, {torch.get_num_threads()} CPU threads; `LlamaForCausalLM` at the same width, depth, MLP and head "
        "counts, alternating in the same process, in the same mode (compiled: `torch.compile`, inductor, both "
        f"models); medians of {setup.repeats} best-of-{setup.steps}-steps samples, ratios the medians of "
        f"back-to-back pairs. Loss: {loss_mode(setup.fuse_linear_cross_entropy)}.",
        "",
        "| variant | parameters | batch x T | "
        + " | ".join(f"{m} zoo | {m} Llama | {m} zoo / Llama" for m in modes)
        + " |",
        "| --- | ---: | ---: |" + " ---: | ---: | ---: |" * len(modes),
    ]
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        cells.setdefault((row["variant"], row["parameters"], row["batch"], row["seq_len"]), {})[row["mode"]] = row
    for (variant, parameters, batch, length), by_mode in cells.items():
        line = f"| `{variant}` | {parameters / 1e6:.1f}M | {batch} x {length} |"
        for mode in modes:
            row = by_mode.get(mode)
            line += (
                " | | |"
                if row is None
                else (
                    f" {row['tokens_per_second_zoo']:,.0f} | {row['tokens_per_second_llama']:,.0f} | "
                    f"{row['tokens_per_second_ratio']:.2f} |"
                )
            )
        lines.append(line)
    return "\n".join(lines)


def run_training_throughput(setup: TrainingThroughputSetup) -> list[dict]:
    """Measure, then write the rows beside those of earlier runs into the same files: a run over some variants,
    modes or shapes replaces their rows and keeps the others (each row is its own ratio, measured back to back)."""
    rows = training_throughput(setup)
    earlier = Path(setup.output_dir) / f"training_throughput_{setup.size}.json"
    if earlier.exists():
        measured = {_row_key(row) for row in rows}
        rows = sorted(
            [r for r in json.loads(earlier.read_text()) if _row_key(r) not in measured] + rows, key=_row_order
        )
    write_results(setup.output_dir, f"training_throughput_{setup.size}", rows, training_throughput_table(rows, setup))
    return rows


BENCHMARKS = {
    "llama": Benchmark(SpeedSetup, run_llama),
    "training": Benchmark(TrainingThroughputSetup, run_training_throughput),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
