"""The translation board's report, from its rows: board.md (the tables over seeds and the claims' verdicts), the
figures (frontier.png, lengths.png, uptraining.png, alignment.png; `--replot` redraws them from board.json alone),
and, for the committed board, the verdicts in docs/translation.md and the README's results row."""

import statistics
from collections.abc import Callable
from pathlib import Path

from experiments.common import REPOSITORY, draw_figures, figure, mean_spread, replace_between
from experiments.translation.cells import STUDY, TranslationSetup, bucket_names
from experiments.translation.claims import bucket_bleu, groups, label, values, verdict_block
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, place_labels, save_figure

DOCS = REPOSITORY / "docs" / "translation.md"
README = REPOSITORY / "README.md"
README_ROW = "| How much does attention help a small translator? |"
MARKERS = ("<!-- translation board verdicts: begin -->", "<!-- translation board verdicts: end -->")


# the RNNs in colours of their own, dark enough to read as text (the variants keep the house colours)
RNN_COLOURS = {"none": "dimgray", "bahdanau": "#8b0000", "luong": "#006400"}


def shade(key: tuple[str, str]) -> str:
    return RNN_COLOURS.get(key[1], "black") if key[0] == "rnn" else colour(key[1])


ALIGNMENT_ERROR_NOTE = (
    "No alignment-error figure: the corpus is aligned by verse only, it has no gold word alignments, and making them "
    "(annotating verses by hand, or a statistical aligner such as fast_align run over the corpus as a silver "
    "reference) is not cheap here; the maps in alignment.png are shown for reading, not scored."
)


def board_table(rows: list[dict], setup: TranslationSetup) -> str:
    grouped = groups(rows)
    failed = [row for row in rows if "error" in row]
    first = next(iter(grouped.values()))[0] if grouped else {}
    lines = [
        "Translation board: English -> Spanish Bible verses, split by book (validation "
        f"{', '.join(setup.validation_books)}; "
        f"test {', '.join(setup.test_books)}); one BPE of {setup.vocab_size} tokens trained on the training books; "
        f"{first.get('train_pairs', 0):,} training pairs ({first.get('dropped_pairs', 0):,} longer than "
        f"{setup.max_length} tokens dropped). Every cell trained on {setup.budget / 1e3:g}k source + target tokens "
        f"through the training path by its family's recipe ({Path(setup.recipe).name}; RNNs "
        f"{Path(setup.rnn_recipe).name}: batches, optimizer, label smoothing and dropout as they say, warm-up "
        f"{setup.warmup_fraction:g} of the steps, then cosine decay), Transformers "
        f"{setup.num_layers} + {setup.num_layers} layers x {setup.hidden_size} with {setup.num_attention_heads} "
        "heads; "
        f"parameters matched within 1% of the MHA Transformer's. Test: {setup.test_pairs} verses of the test books; "
        f"BLEU/chrF greedy and beam {setup.num_beams}. Mean ± standard deviation over the seeds (n).",
        "",
        "| model | n | params | RNN state / MLP | BLEU | chrF | BLEU beam | chrF beam | test ppl | val ppl | "
        "cross cache B/src token | train tokens/s | train min | decode tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, cells in grouped.items():
        if key[0] == "uptrain":
            continue
        head = cells[0]
        width = head.get("rnn_hidden_size", head.get("intermediate_size")) or "as MHA's"
        lines.append(
            f"| {label(key)} | {len(cells)} | {head['parameters']:,} | {width} | {figure(values(grouped, key))} | "
            f"{figure(values(grouped, key, 'chrf'))} | {figure(values(grouped, key, 'bleu_beam'))} | "
            f"{figure(values(grouped, key, 'chrf_beam'))} | {figure(values(grouped, key, 'test_perplexity'), 1)} | "
            f"{figure(values(grouped, key, 'validation_perplexity'), 1)} | "
            f"{head['cache_bytes_per_source_token']:,.0f} | "
            f"{figure(values(grouped, key, 'tokens_per_second'), 0)} | "
            f"{figure([r['train_seconds'] / 60 for r in cells], 1)} | "
            f"{figure(values(grouped, key, 'decode_tokens_per_second'), 0)} |"
        )
    names = bucket_names(setup.buckets)
    counts = first.get("bleu_by_length", {})
    lines += [
        "",
        "Greedy test BLEU by source length (tokens; verses per bucket in the header):",
        "",
        "| model | " + " | ".join(f"{n} ({counts.get(n, {}).get('pairs', 0)})" for n in names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for key, cells in grouped.items():
        if key[0] in ("rnn", "transformer", "parent"):
            lines.append(f"| {label(key)} | " + " | ".join(figure(bucket_bleu(cells, n)) for n in names) + " |")
    uptrained = [k for k in grouped if k[0] == "uptrain"]
    if uptrained:
        lines += [
            "",
            f"Uptraining: the MHA parent ({setup.parent_factor:g} budgets, seed {setup.seeds[0]}: one parent) "
            f"converted to GQA-{setup.gqa_key_value_heads} and MQA in the decoder's self- and cross-attention (the "
            "encoder keeps MHA), then uptrained on alpha of the parent's steps (greedy test BLEU/chrF).",
            "",
            "| model | method | alpha | n | params | BLEU | chrF | test ppl | cross cache B/src token | uptrain s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key in [("parent", "mha"), ("transformer", "gqa"), ("transformer", "mqa")]:
            if key in grouped:
                head = grouped[key][0]
                lines.append(
                    f"| {label(key)} | {'trained' if key[0] == 'parent' else 'from scratch'} | | "
                    f"{len(grouped[key])} | {head['parameters']:,} | {figure(values(grouped, key))} | "
                    f"{figure(values(grouped, key, 'chrf'))} | {figure(values(grouped, key, 'test_perplexity'), 1)} | "
                    f"{head['cache_bytes_per_source_token']:,.0f} | |"
                )
        for key in uptrained:
            cells, head = grouped[key], grouped[key][0]
            lines.append(
                f"| {head['target'].upper()} uptrained | {head['method']} | {head['alpha']:g} | {len(cells)} | "
                f"{head['parameters']:,} | {figure(values(grouped, key))} | {figure(values(grouped, key, 'chrf'))} | "
                f"{figure(values(grouped, key, 'test_perplexity'), 1)} | "
                f"{head['cache_bytes_per_source_token']:,.0f} | "
                f"{figure([r['train_seconds'] + r.get('conversion_seconds', 0) for r in cells], 0)} |"
            )
    total = sum(row.get("cell_seconds", 0) for row in rows)
    lines += [
        "",
        f"Time: {total / 60:.0f} minutes of cells in all (training, evaluation and conversion; one thread each).",
        "",
        "Claims of the notes and the papers, checked (A beats B only where the seeds' ranges, in brackets, do not "
        "overlap):",
        "",
        verdict_block(rows, setup),
        "",
        "Alignment: alignment.png draws the last decoder layer's cross-attention (mean over heads) of "
        f"{setup.alignment_verses} test verses for the attention RNNs and the MHA Transformer. {ALIGNMENT_ERROR_NOTE}",
    ]
    if failed:
        lines += ["", "Failed cells (a rerun tries them again):", ""]
        lines += [f"- {row['cell']}: {row['error']}" for row in failed]
    return "\n".join(lines)


def plot_frontier(rows: list[dict], path: Path) -> bool:
    """Greedy test BLEU (mean, a bar of one standard deviation) of every model against the bytes its decoder keeps
    per source token."""
    plt = headless_pyplot()
    grouped = {k: v for k, v in groups(rows).items() if k[0] in ("rnn", "transformer", "encoder")}
    if plt is None or not grouped:
        return False
    with house_style():
        fig, axis = plt.subplots(figsize=(9, 6))
        points, names, colours, spans = [], [], [], []
        for key, cells in grouped.items():
            mean, spread = mean_spread([r["bleu"] for r in cells])
            x = cells[0]["cache_bytes_per_source_token"]
            tint = shade(key)
            axis.errorbar([x], [mean], yerr=[spread], fmt="s" if key[0] == "rnn" else "o", color=tint)
            points.append((x, mean))
            names.append(label(key))
            colours.append(tint)
            spans.append((mean - spread, mean + spread))
        axis.margins(x=0.15, y=0.12)
        axis.set_xlabel("cross-attention cache (bytes per token of the source, float32)")
        axis.set_ylabel("test score (BLEU, greedy)")
        axis.set_title("mean of the seeds, bar: one standard deviation; square: RNN, circle: Transformer")
        place_labels(axis, points, names, colours, spans)
        save_figure(fig, path)
    return True


def plot_lengths(rows: list[dict], buckets: list[int], path: Path) -> bool:
    """Greedy test BLEU by source-length bucket for the RNNs and the MHA Transformer (Bahdanau et al.'s Fig. 2)."""
    plt = headless_pyplot()
    grouped = groups(rows)
    shown = [
        k for k in [("rnn", "none"), ("rnn", "bahdanau"), ("rnn", "luong"), ("transformer", "mha")] if k in grouped
    ]
    if plt is None or not shown:
        return False
    names = bucket_names(buckets)
    with house_style():
        fig, axis = plt.subplots(figsize=(8, 5), layout="constrained")
        for key in shown:
            means = [mean_spread(bucket_bleu(grouped[key], n)) for n in names]
            axis.errorbar(
                range(len(names)),
                [m for m, _ in means],
                yerr=[s for _, s in means],
                marker="o",
                color=shade(key),
                label=label(key),
            )
        axis.set_xticks(range(len(names)), [f"{n} tokens" for n in names])
        axis.set_xlabel("source length (tokens)")
        axis.set_ylabel("test score (BLEU, greedy)")
        axis.set_title("BLEU by source length, mean of the seeds, bar: one standard deviation")
        fig.legend(loc="outside right upper")
        save_figure(fig, path)
    return True


def plot_uptraining(rows: list[dict], path: Path) -> bool:
    """Greedy test BLEU against alpha, one line per conversion method, GQA and MQA side by side; the parent and the
    from-scratch cells as horizontal lines."""
    plt = headless_pyplot()
    grouped = groups(rows)
    uptrained = [k for k in grouped if k[0] == "uptrain"]
    if plt is None or not uptrained:
        return False
    with house_style():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, layout="constrained")
        for axis, target in zip(axes, ("gqa", "mqa")):
            methods = sorted({grouped[k][0]["method"] for k in uptrained if grouped[k][0]["target"] == target})
            for method in methods:
                points = sorted(
                    (grouped[k][0]["alpha"], mean_spread(values(grouped, k)))
                    for k in uptrained
                    if grouped[k][0]["target"] == target and grouped[k][0]["method"] == method
                )
                axis.errorbar(
                    [a for a, _ in points],
                    [m for _, (m, _) in points],
                    yerr=[s for _, (_, s) in points],
                    marker="o",
                    color=colour(method),
                    label=method,
                )
            for key, name, style in ((("parent", "mha"), "parent", "--"), (("transformer", target), "scratch", ":")):
                if key in grouped:
                    axis.axhline(
                        statistics.fmean(values(grouped, key)),
                        color=colour(name),
                        linestyle=style,
                        label=f"{label(key)}",
                    )
            axis.set_title(f"{target.upper()} in the decoder (self + cross)")
            axis.set_xlabel("alpha (fraction of the parent's steps)")
            axis.legend(loc="lower right")
        axes[0].set_ylabel("test score (BLEU, greedy)")
        save_figure(fig, path)
    return True


ALIGNMENT_ROWS = 40  # target tokens drawn per verse: a weak model's translation can run to the length limit


def plot_alignment(rows: list[dict], path: Path) -> bool:
    """The stored cross-attention maps: one row per model, one column per verse, each panel as tall as its
    translation (at most `ALIGNMENT_ROWS` tokens) so that its token names never overlap."""
    plt = headless_pyplot()
    drawn = [row for row in rows if "error" not in row and row.get("alignment")]
    if plt is None or not drawn:
        return False
    columns = max(len(row["alignment"]) for row in drawn)
    tall = [max(min(len(e["target"]), ALIGNMENT_ROWS) for e in row["alignment"]) for row in drawn]
    heights = [1.6 + 0.16 * n for n in tall]  # inches: a 7-point token name is about 0.12 inch
    with house_style():
        fig, axes = plt.subplots(
            len(drawn),
            columns,
            figsize=(6.5 * columns, sum(heights) + 0.6),
            squeeze=False,
            layout="constrained",
            gridspec_kw={"height_ratios": heights},
        )
        for row, line in zip(drawn, axes):
            for axis, entry in zip(line, row["alignment"]):
                entry = {**entry, "target": entry["target"][:ALIGNMENT_ROWS]}
                weights = entry["weights"][:ALIGNMENT_ROWS]
                axis.imshow(weights, cmap="Greys", vmin=0, vmax=1, aspect="auto")
                axis.grid(False)
                axis.set_xticks(
                    range(len(entry["source"])),
                    [repr(t)[1:-1] or "␣" for t in entry["source"]],
                    rotation=90,
                    fontsize=7,
                )
                axis.set_yticks(
                    range(len(entry["target"])), [repr(t)[1:-1] or "␣" for t in entry["target"]], fontsize=7
                )
                axis.set_title(label((row["family"], row["config"])), fontsize=9)
                axis.set_xlabel("source tokens (English)")
                axis.set_ylabel("translation tokens (Spanish)")
            for axis in line[len(row["alignment"]) :]:
                axis.set_visible(False)
        fig.suptitle(
            "cross-attention weight of each target token (rows) on the source tokens (columns), last layer, "
            f"first {ALIGNMENT_ROWS} target tokens"
        )
        save_figure(fig, path)
    return True


def board_figures(board: dict) -> dict[str, Callable[[Path], bool]]:
    """The board's figures from board.json's contents, for a run and `--replot`."""
    rows, defining = board["rows"], board["defining"]
    return {
        "frontier.png": lambda path: plot_frontier(rows, path),
        "lengths.png": lambda path: plot_lengths(rows, defining["buckets"], path),
        "uptraining.png": lambda path: plot_uptraining(rows, path),
        "alignment.png": lambda path: plot_alignment(rows, path),
    }


def write_docs(block: str, docs: Path = DOCS) -> bool:
    """Replace the verdicts between the markers of docs/translation.md with the board's own; False where the page
    has no markers."""
    return replace_between(docs, MARKERS, block)


def readme_row(rows: list[dict], setup: TranslationSetup) -> str:
    """The README's results row, from the board: greedy test BLEU and test perplexity of the RNNs and the
    Transformers (means of the seeds)."""
    grouped = groups(rows)
    keys = [
        ("rnn", "none"),
        ("rnn", "bahdanau"),
        ("transformer", "mha"),
        ("transformer", "gqa"),
        ("transformer", "mqa"),
    ]
    shown = [k for k in keys if k in grouped]
    bleu = ", ".join(f"{label(k)} {statistics.fmean(values(grouped, k)):.2f}" for k in shown)
    ppl = ", ".join(f"{statistics.fmean(values(grouped, k, 'test_perplexity')):.0f}" for k in shown)
    parameters = grouped[("transformer", "mha")][0]["parameters"] if ("transformer", "mha") in grouped else 0
    budget = f"{setup.budget / 1e6:g}M" if setup.budget >= 1e6 else f"{setup.budget / 1e3:g}k"
    cells = sum(len(grouped[k]) for k in shown)
    measured = (
        f"English -> Spanish at {budget} tokens a cell, {parameters / 1e6:.1f}M parameters, mean of the seeds "
        f"({cells} cells so far): greedy test BLEU {bleu}; test perplexity {ppl}"
    )
    return f"{README_ROW} {measured} | [translation study](docs/translation.md#the-translation-study) |"


def write_readme(row: str, readme: Path = README) -> bool:
    """Replace the README's translation row (the line that starts with `README_ROW`); False where it has none."""
    if not readme.is_file():
        return False
    lines = readme.read_text().split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    for index in found:
        lines[index] = row
    if found:
        readme.write_text("\n".join(lines))
    return bool(found)


def write_board(setup: TranslationSetup, rows: list[dict], log: Callable[[str], None] = print) -> None:
    """board.md (tables, claims) and the plots, from the rows so far; the docs' verdicts for the committed board."""
    folder = Path(setup.output_dir)
    table = board_table(rows, setup)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "board.md").write_text(table + "\n")
    drawn = draw_figures(folder, board_figures({"defining": setup.defining(), "rows": rows}))
    if folder.resolve() == (STUDY / "results").resolve():
        write_docs(verdict_block(rows, setup))
        write_readme(readme_row(rows, setup))
    log(table)
    log(f"written to {folder}: board.json, board.md, {', '.join(drawn)}")
