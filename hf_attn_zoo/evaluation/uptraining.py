"""The uptraining experiment of Ainslie et al. 2023 (GQA), small: pool a multi-head parent's key/value heads into G,
uptrain for a fraction α of the parent's pretraining tokens, and compare test perplexities.

The runs are the shipped recipes: `configs/train/sotu_mha.yaml` trains the parent (8 heads, 6 x 256, ~9M
parameters) and `configs/uptrain/sotu_gqa.yaml` converts and uptrains it, with G, the pooling method and α
overridden over the grid G in {1, 2, 4} x method in {mean, first, random} at α = 0.05, and for `mean` also α in
{0, 0.025, 0.10}. Data: the State of the Union addresses (one file per address, `YEAR_president_party.txt`): up to
2000 train, 2001-2010 validate, 2011-2021 are the test set, scored with the perplexity harness (windows of the
training length, half-overlapping). Every run writes its result to `<output_dir>/runs/<name>.json` and is skipped
when that file exists, and an interrupted run resumes from its last checkpoint, so a stopped experiment goes on
where it stopped; `scale` multiplies the parent's steps, and with them every uptraining budget.
"""

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoints import write_atomically
from ..training import complete_checkpoints, load_recipe, run_training
from .perplexity import score_texts
from .plotting import headless_pyplot, save_figure

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class UptrainingSetup:
    data_dir: str = field(default="../shared/data/sotu", metadata={"help": "State of the Union folder"})
    output_dir: str = field(default="benchmarks/uptrain/results", metadata={"help": "runs, results, table, plot"})
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
        raise FileNotFoundError(f"no addresses in {data_dir}: the experiment needs ../shared/data/sotu")
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
    write_atomically(out / "results.json", json.dumps({"setup": asdict(setup), "results": results}, indent=2))
    (out / "results.md").write_text(table(results) + "\n")
    plot(results, out / "alpha.png")
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
    data_dir: str = field(default="../shared/data/sotu", metadata={"help": "State of the Union folder"})
    output_dir: str = field(default="benchmarks/uptrain/smollm2", metadata={"help": "run, results, plot"})
    recipe: str = field(default=str(CONFIGS / "uptrain" / "smollm2_mqa.yaml"), metadata={"help": "uptraining"})
    steps: int | None = field(default=None, metadata={"help": "uptraining steps (default: the recipe's)"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate (default: the recipe's)"})
    eval_every: int = field(default=20, metadata={"help": "steps between held-out evaluations"})
    held_out_chars: int = field(default=20000, metadata={"help": "characters of the 2011-2021 addresses scored"})


GPL3 = Path("/usr/share/common-licenses/GPL-3")


def gpl_perplexity(model, tokenizer) -> float | None:
    """Perplexity on BOS + the first 2047 tokens of the GPL (one window of 2048), when the file is there."""
    if not GPL3.is_file():
        return None
    ids = tokenizer(GPL3.read_text(), add_special_tokens=False)["input_ids"][:2047]
    return score_texts(model, tokenizer, [tokenizer.decode(ids)], max_length=2048).perplexity


def run_smollm2(setup: SmolLM2Setup, log=print) -> dict:
    """SmolLM2-135M (GGUF) -> zoo_gqa (logits checked against transformers' Llama) -> mean-pooled zoo_mqa ->
    uptrained on the SOTU training addresses, with held-out perplexity along the way."""
    import torch

    from ..convert import from_llama, mha_to_gqa
    from ..convert.gguf import plain_checkpoint, smollm2_gguf

    out = Path(setup.output_dir)
    source = plain_checkpoint(smollm2_gguf())
    llama = AutoModelForCausalLM.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    zoo = from_llama(llama).eval()
    sample = tokenizer("We hold these truths to be self-evident, that all men are created equal", return_tensors="pt")
    with torch.no_grad():
        difference = (zoo(**sample).logits - llama(**sample).logits).abs().max().item()
    mqa = mha_to_gqa(zoo, 1).eval()
    result = {
        "import_max_abs_logit_difference": difference,
        "gpl_perplexity": {
            "llama": gpl_perplexity(llama, tokenizer),
            "zoo_gqa": gpl_perplexity(zoo, tokenizer),
            "zoo_mqa_pooled": gpl_perplexity(mqa, tokenizer),
        },
    }
    log(f"imported: max |logit difference| {difference:.2e}; GPL perplexity {result['gpl_perplexity']}")
    splits = split_by_year(setup.data_dir)
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
    result["gpl_perplexity"]["zoo_mqa_uptrained"] = gpl_perplexity(uptrained, tokenizer)
    # the held-out text through the harness, for the model before pooling too: where recovery would end
    result["held_out_perplexity"] = held_out_perplexities(
        {"zoo_gqa": zoo, "zoo_mqa_pooled": mqa, "zoo_mqa_uptrained": uptrained}, tokenizer, held_out, data_args
    )
    write_atomically(out / "results.json", json.dumps({"setup": asdict(setup), **result}, indent=2))
    plot_recovery(result["recovery"], out / "recovery.png", reference=result["held_out_perplexity"]["zoo_gqa"])
    log(json.dumps(result, indent=2))
    return result


def held_out_perplexities(models: dict, tokenizer, held_out: Path, data_args) -> dict[str, float]:
    text = held_out.read_text()
    block = data_args.block_size
    return {
        name: score_texts(model, tokenizer, [text], max_length=block, batch_size=4).perplexity
        for name, model in models.items()
    }


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
