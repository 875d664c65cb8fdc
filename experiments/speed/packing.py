"""Padding-free training (`data.packing=documents`) against EOS-separated packing (`data.packing=eos`).

Both train the demo's model (`hf-attn-zoo demo`: gqa, 4 layers x 192, blocks of 128 tokens, Python's standard
library) on the same blocks for the same steps; the only difference is whether a token may attend across a document
boundary. Runs alternate between the two modes (eos, documents, documents, eos, ...) so that drift of the machine
hits both alike. Reported per run: training tokens/s, the run's own validation perplexity (its packing, its targets)
and the perplexity the harness (`hf_attn_zoo.evaluation.perplexity.score_texts`) gives on the held-out documents,
each scored alone, with and without a BOS token in front. Runs already trained (their training_summary.json in
`--runs_dir`) are scored again, not retrained. Writes results/packing.md and .json.

    python -m experiments packing [--steps 600] [--seeds 0 1] [--variant gqa] [--output_dir DIR]
"""

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.common import REPOSITORY, Benchmark, Results, main, write_results
from hf_attn_zoo.data import load_text_splits
from hf_attn_zoo.demo import demo_recipe
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.train import run_training
from hf_attn_zoo_cli import DemoOptions

MODES = ("eos", "documents")


@dataclass
class PackingSetup(Results):
    """Padding-free training against EOS-separated packing on the demo's model: speed and held-out perplexity."""

    steps: int = field(default=600, metadata={"help": "optimizer steps per run (the demo's 600)"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "one run per mode and seed"})
    variant: str = field(default="gqa", metadata={"help": "registered variant"})
    runs_dir: str = field(default=str(REPOSITORY / "runs" / "packing"), metadata={"help": "training runs (resumable)"})


def run(mode: str, seed: int, steps: int, variant: str, root: Path) -> dict:
    options = DemoOptions(
        variant=variant, max_steps=steps, seed=seed, packing=mode, output_dir=str(root / f"{mode}-{seed}")
    )
    model_args, data_args, training_args = demo_recipe(options)
    training_args.report_to = []
    summary_path = Path(training_args.output_dir) / "training_summary.json"
    summary = (
        json.loads(summary_path.read_text())
        if summary_path.is_file()
        else run_training(model_args, data_args, training_args)
    )
    final = Path(training_args.output_dir) / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    texts = load_text_splits(data_args)["validation"]["text"]
    scores = {
        f"harness_perplexity_{'bos' if bos else 'no_bos'}": score_texts(
            model, tokenizer, texts, max_length=256, stride=128, batch_size=8, add_bos=bos
        ).perplexity
        for bos in (True, False)
    }
    return {
        "mode": mode,
        "seed": seed,
        "steps": summary["steps"],
        "tokens_per_second": summary["tokens_per_second"],
        "validation_perplexity": summary["validation_perplexity"],
        **{key: round(value, 3) for key, value in scores.items()},
    }


def table(rows: list[dict]) -> str:
    """One row per run, then the paired comparison: a seed fixes the split, the initialisation and the data order,
    so the two modes are compared within a seed (documents / eos) and the spread of those ratios is the noise."""
    lines = [
        "| packing | seed | tokens/s | own validation perplexity | held-out docs, BOS + text | held-out docs, text |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in sorted(rows, key=lambda row: (row["seed"], row["mode"])):
        lines.append(
            f"| `{row['mode']}` | {row['seed']} | {row['tokens_per_second']:,.0f} "
            f"| {row['validation_perplexity']:.2f} | {row['harness_perplexity_bos']:.2f} "
            f"| {row['harness_perplexity_no_bos']:.2f} |"
        )
    by_seed = {(row["seed"], row["mode"]): row for row in rows}
    seeds = sorted({seed for seed, mode in by_seed if (seed, "eos") in by_seed and (seed, "documents") in by_seed})
    lines += ["", "| documents / eos | per seed | mean |", "| --- | --- | ---: |"]
    for key, label in (("tokens_per_second", "tokens/s"), ("harness_perplexity_bos", "held-out perplexity")):
        ratios = [by_seed[seed, "documents"][key] / by_seed[seed, "eos"][key] for seed in seeds]
        spread = f" ± {statistics.stdev(ratios):.3f}" if len(ratios) > 1 else ""
        cells = ", ".join(f"{ratio:.3f}" for ratio in ratios)
        lines.append(f"| {label} | {cells} | {statistics.mean(ratios):.3f}{spread} |")
    return "\n".join(lines)


def run_packing(setup: PackingSetup) -> list[dict]:
    rows = []
    for i, seed in enumerate(setup.seeds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # alternate the order: eos, documents, documents, eos
            rows.append(run(mode, seed, setup.steps, setup.variant, Path(setup.runs_dir)))
            print(json.dumps(rows[-1]), flush=True)
    write_results(setup.output_dir, "packing", rows, table(rows))
    return rows


BENCHMARKS = {"packing": Benchmark(PackingSetup, run_packing)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
