"""Train a translator in an hour: what the shipped Bible recipes reach, from the outputs of the two commands a user
runs (docs/translation.md, "Train a translator in an hour").

For each run folder (the recipe's `training.output_dir`) this reads:
- `training_summary.json`, written by `hf-attn-zoo train`: parameters, steps, seconds, and the validation scores
  of every evaluation with the seconds since training began (`elapsed_seconds`): the curve of validation BLEU
  against minutes;
- `test_scores.json`, written by `hf-attn-zoo translate-eval RUN/final --data RUN/test_pairs.jsonl --num_beams 4
  --out RUN/test_scores.json`: the test BLEU and chrF and every translation;
and writes into `--out`: `hour.json` (the numbers, and each run's translations of ten test verses picked by a fixed
rule: the verses at 0, 1/10, ..., 9/10 of the test file), `hour.md` (the table and those verses beside each run's
translation) and `hour.png` (validation BLEU against minutes, one line per run). The runs of an earlier `hour.json`
in `--out` are kept (their run folders need not exist any more; a run folder given again replaces its row, in place),
so a new run joins the earlier ones; `--fresh` starts from the runs given alone.

    PYTHONPATH=. python experiments/translation/hour.py runs/bible_en_es_rnn runs/bible_en_es_transformer
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_attn_zoo.evaluation.plotting import headless_pyplot, house_style, save_figure  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = 10


def read_run(folder: Path) -> dict:
    """One run's numbers: its curve, its test scores and its translations."""
    summary_path, test_path = folder / "training_summary.json", folder / "test_scores.json"
    if not summary_path.is_file():
        raise SystemExit(f"{summary_path} is missing: train first (hf-attn-zoo train RECIPE).")
    if not test_path.is_file():
        raise SystemExit(
            f"{test_path} is missing: score the test pairs first (hf-attn-zoo translate-eval {folder}/final "
            f"--data {folder}/test_pairs.jsonl --num_beams 4 --out {test_path})."
        )
    summary, test = json.loads(summary_path.read_text()), json.loads(test_path.read_text())
    curve = [
        {
            "minutes": round(entry["elapsed_seconds"] / 60, 2),
            "step": entry["step"],
            "bleu": entry["eval_bleu"],
            "chrf": entry["eval_chrf"],
        }
        for entry in summary["evaluations"]
        if "elapsed_seconds" in entry
    ]
    pairs = [json.loads(line) for line in (folder / "test_pairs.jsonl").read_text().splitlines()]
    if len(test["translations"]) != len(pairs):
        raise SystemExit(
            f"{test_path} holds {len(test['translations'])} translations for the {len(pairs)} pairs of "
            f"{folder / 'test_pairs.jsonl'}: score that file again (translate-eval ... --out {test_path})."
        )
    return {
        "name": folder.name,
        "variant": summary["variant"],
        "parameters": summary["parameters"],
        "steps": summary["steps"],
        "train_minutes": round(summary["seconds"] / 60, 1),
        "averaged_checkpoints": summary.get("averaged_checkpoints", []),
        "validation_bleu": summary["validation_bleu"],
        "curve": curve,
        "test": {key: test[key] for key in ("bleu", "chrf", "num_beams", "pairs", "decode_seconds", "bleu_signature")},
        "examples": [
            {
                "ref": pairs[i].get("ref", i),
                "source": pairs[i]["source"],
                "target": pairs[i]["target"],
                "translation": test["translations"][i],
            }
            for i in picked(len(pairs))
        ],
    }


def picked(count: int) -> list[int]:
    """The fixed rule for the examples: evenly spaced through the test file, its first verse included."""
    return [index * count // EXAMPLES for index in range(EXAMPLES)]


def markdown(runs: list[dict]) -> str:
    lines = [
        "| recipe | variant | parameters | steps | training minutes | validation BLEU | test BLEU | test chrF |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        test = run["test"]
        lines.append(
            f"| {run['name']} | {run['variant']} | {run['parameters'] / 1e6:.2f}M | {run['steps']:,} | "
            f"{run['train_minutes']} | {run['validation_bleu']:.1f} | {test['bleu']:.1f} | {test['chrf']:.1f} |"
        )
    lines += [
        "",
        f"Test: {runs[0]['test']['pairs']} verses, beam {runs[0]['test']['num_beams']}; "
        f"`{runs[0]['test']['bleu_signature']}`.",
        "",
        *curve_table(runs),
        "",
    ]
    for index, example in enumerate(runs[0]["examples"]):
        lines.append(f"**{example['ref']}** — {example['source']}")
        lines.append("")
        lines.append(f"- reference: {example['target']}")
        lines += [f"- {run['name']}: {run['examples'][index]['translation']}" for run in runs]
        lines.append("")
    return "\n".join(lines)


def merged(earlier: list[dict], runs: list[dict]) -> list[dict]:
    """The earlier rows with each run given replacing its namesake in place, new runs after them."""
    given = {run["name"]: run for run in runs}
    rows = [given.pop(row["name"], row) for row in earlier]
    return rows + [run for run in runs if run["name"] in given]


def curve_table(runs: list[dict]) -> list[str]:
    """Validation BLEU at each evaluated step, one row per run (a step a run did not evaluate: blank), so that
    runs compare at equal steps as well as at equal minutes; the weights of that step, where the final model (the
    table's validation BLEU) averaged checkpoints."""
    steps = sorted({point["step"] for run in runs for point in run["curve"]})
    lines = [
        "Validation BLEU (greedy) at each evaluation, by step:",
        "",
        "| recipe | " + " | ".join(f"{step:,}" for step in steps) + " |",
        "|---|" + "---:|" * len(steps),
    ]
    for run in runs:
        at = {}
        for point in run["curve"]:  # the Trainer's evaluation of a step's weights, not the averaged final's
            at.setdefault(point["step"], point["bleu"])
        lines.append(f"| {run['name']} | " + " | ".join(f"{at[s]:.1f}" if s in at else "" for s in steps) + " |")
    return lines


def plot(runs: list[dict], path: Path) -> bool:
    pyplot = headless_pyplot()
    if pyplot is None:
        return False
    with house_style():
        figure, axis = pyplot.subplots(figsize=(6, 3.6))
        for run in runs:
            axis.plot(
                [0] + [p["minutes"] for p in run["curve"]],
                [0] + [p["bleu"] for p in run["curve"]],
                marker="o",
                label=f"{run['name']} (test {run['test']['bleu']:.1f})",
            )
        axis.set_xlabel("minutes of training (evaluations included)")
        axis.set_ylabel("validation BLEU (Mark, greedy)")
        axis.legend()
        save_figure(figure, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="*", type=Path, help="run folders (each recipe's training.output_dir); none: redraw hour.json's"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of hour.json, hour.md, hour.png")
    parser.add_argument("--fresh", action="store_true", help="drop the runs of the earlier hour.json in --out")
    args = parser.parse_args(argv)
    runs = [read_run(folder) for folder in args.runs]
    earlier_path = args.out / "hour.json"
    if earlier_path.is_file() and not args.fresh:
        runs = merged(json.loads(earlier_path.read_text()), runs)
    if not runs:
        raise SystemExit(f"no runs: name run folders (there is no {earlier_path} to redraw, or --fresh was given).")
    # the same verses in the same order: every run scored the same test file
    if len({tuple(example["source"] for example in run["examples"]) for run in runs}) != 1:
        raise SystemExit(
            "the runs' test_pairs.jsonl differ: compare runs of the same data and split "
            f"(or --fresh to drop the runs of {earlier_path})."
        )
    args.out.mkdir(parents=True, exist_ok=True)
    earlier_path.write_text(json.dumps(runs, indent=2, ensure_ascii=False) + "\n")
    (args.out / "hour.md").write_text(markdown(runs) + "\n")
    drawn = plot(runs, args.out / "hour.png")
    print(markdown(runs))
    print(f"written: {args.out}/hour.json, hour.md" + (", hour.png" if drawn else " (no matplotlib: no hour.png)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
