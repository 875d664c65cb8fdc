"""Every committed figure, drawn from small synthetic results whose points and names crowd each other: no two texts
overlap, every axis that shows numbers names its unit, and `--replot` redraws from the results JSON alone."""

import dataclasses
import json
import re

import pytest

from experiments.common import main as run_benchmark
from experiments.mla import latent
from experiments.quality import quality
from experiments.speed import decode, scaling
from experiments.translation import report as translation_report
from experiments.uptraining import uptraining
from hf_attn_zoo.evaluation import attention_maps, plot_attention, plotting

from test_integrations import byte_model

pytest.importorskip("matplotlib")

# what may stand first in an axis label's parentheses: its unit (perplexity is per token; a fraction has none)
UNITS = (
    "s",
    "tokens/s",
    "bytes per token",
    "MiB",
    "minutes",
    "tokens",
    "millions",
    "thousands",
    "per token",
    "fraction",
    "probability",
    "BLEU",
)


@pytest.fixture
def drawn(monkeypatch):
    """The figures the drivers save, kept for inspection (a closed figure can still be drawn)."""
    figures = []

    def keep(figure, path, dpi=None):
        plotting.save_figure(figure, path, dpi)
        figures.append(figure)

    for module in (quality, scaling, decode, uptraining, latent, attention_maps, translation_report):
        monkeypatch.setattr(module, "save_figure", keep)
    return figures


def shown_ticks(axis) -> list:
    # the ticks a draw actually renders (those in view); the others keep stale labels that are never drawn
    return [tick for tick in axis._update_ticks() if tick.get_visible()]


def texts(figure) -> list:
    """Every text the figure renders: titles, axis labels, drawn tick labels, annotations, legend entries."""
    from matplotlib.text import Text

    tick_labels = {
        id(label)
        for axes in figure.axes
        for axis in (axes.xaxis, axes.yaxis)
        for tick in axis.get_major_ticks() + axis.get_minor_ticks()
        for label in (tick.label1, tick.label2)
    }
    shown = [t for t in figure.findobj(Text) if id(t) not in tick_labels]
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            for tick in shown_ticks(axis):
                shown += [label for label in (tick.label1, tick.label2) if label.get_visible()]
    return [t for t in shown if t.get_visible() and t.get_text().strip()]


def assert_readable(figure) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    FigureCanvasAgg(figure)  # closing the figure detached its canvas; the same renderer as the saved image
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in texts(figure)]
    frame = figure.bbox
    for text, box in boxes:  # nothing cut off at the edge of the image
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1 and frame.y0 - 1 <= box.y0, text
        assert box.y1 <= frame.y1 + 1, text
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            labels = [t.label1.get_text() for t in shown_ticks(axis) if t.label1.get_visible()]
            labels = [label for label in labels if label.strip()]
            if not labels:  # a panel sharing its neighbour's axis, or a colour bar's blank side
                continue
            name = axis.get_label_text()
            assert name, f"an axis showing {labels[:3]} has no label"
            numeric = all(re.fullmatch(r"[−\-0-9.,$^{}\\mathdefault×]+", label) for label in labels)
            if numeric:
                unit = re.search(r"\(([^)]*)\)", name)
                assert unit, f"{name!r}: no unit in parentheses"
                parts = [part.strip() for part in re.split(r"[,;]", unit.group(1))]
                assert any(part.startswith(UNITS) for part in parts), f"{name!r}: no unit"


def test_colours_are_fixed_per_name():
    assert plotting.colour("gqa") == plotting.colour("gqa") != plotting.colour("mqa")
    assert plotting.colour("some_new_variant") == plotting.colour("some_new_variant")


def crowded_board() -> list[dict]:
    """Quality-board rows where several configurations share a cache size and nearly a perplexity."""
    rows = []
    close = {"gqa": 190.0, "mla": 191.0, "topk": 190.5, "mqa": 185.0, "single_head": 197.0, "additive": 197.5}
    sweep = {"alibi": 186.0, "none": 210.0, "sinusoidal": 189.0}
    cells = [(v, quality.default_positions(v), p) for v, p in close.items()] + [
        ("gqa", k, p) for k, p in sweep.items()
    ]
    cache = {"mqa": 1024.0, "single_head": 4096.0, "additive": 4096.0}
    for variant, positions, perplexity in cells:
        for seed in (0, 1):
            rows.append(
                {
                    "cell": f"{variant}-{positions}-seed{seed}",
                    "variant": variant,
                    "positions": positions,
                    "seed": seed,
                    "test_perplexity": perplexity + seed,
                    "cache_bytes_per_token": cache.get(variant, 1024.0),
                    "train_seconds": 200.0 + seed,
                    "extrapolation": {str(n): {"perplexity": perplexity * (1 + n / 4096)} for n in (256, 512, 1024)},
                }
            )
    return rows


def test_quality_figures_label_every_point_apart(drawn, tmp_path):
    board = {"defining": {"cache_tokens": 1024, "lengths": [256, 512, 1024]}, "rows": crowded_board()}
    for name, draw in quality.board_figures(board).items():
        assert draw(tmp_path / name)
    assert len(drawn) == 3
    frontier = drawn[0]
    named = {t.get_text() for t in frontier.axes[0].texts}
    assert {"gqa", "mla", "topk", "gqa (alibi)", "single_head", "additive"} <= named
    for figure in drawn:
        assert_readable(figure)


def translation_board() -> list[dict]:
    """Translation-board rows where five models share a cache size and nearly a BLEU, with every uptraining method,
    and alignment maps of a short and a long (length-limited) translation."""
    caches = {("rnn", "none"): 0.0, ("rnn", "bahdanau"): 2232.0, ("rnn", "luong"): 1480.0}
    caches |= {("transformer", "gqa"): 1024.0, ("transformer", "mqa"): 512.0, ("encoder", "aft_simple"): 1024.0}
    configs = [*caches, ("transformer", "mha"), ("transformer", "additive")]
    configs += [("encoder", v) for v in ("sliding_window", "linformer", "topk")]
    source = ["When", " he", " had", " destroyed", " seven", " nations", " in", " the", " land", "."]
    maps = [
        {"source": source, "target": ["Y", " cuando"] * 5, "weights": [[0.1] * 10] * 10},
        {"source": source, "target": [" de"] * 64, "weights": [[0.1] * 10] * 64},
    ]
    rows = []
    for index, (family, config) in enumerate(configs):
        for seed in range(3):
            rows.append(
                {
                    "cell": f"{family}-{config}-seed{seed}",
                    "family": family,
                    "config": config,
                    "seed": seed,
                    "bleu": 1.0 + 0.05 * index + 0.1 * seed,
                    "cache_bytes_per_source_token": caches.get((family, config), 2048.0),
                    "bleu_by_length": {b: {"pairs": 50, "bleu": 1.0 + seed} for b in ("1-16", "17-24", "25-64")},
                    **({"alignment": maps} if seed == 0 and config in ("bahdanau", "mha") else {}),
                }
            )
    rows.append({"cell": "parent-mha-seed0", "family": "parent", "config": "mha", "seed": 0, "bleu": 3.0})
    for target in ("gqa", "mqa"):
        for method in ("mean", "aligned", "grouped", "grouped_aligned"):
            for alpha, seeds in ((0.0, [0]), (0.05, [0, 1, 2])):
                for seed in seeds:
                    config = f"{target}-{method}-{alpha:g}"
                    rows.append(
                        {
                            "cell": f"uptrain-{config}-seed{seed}",
                            "family": "uptrain",
                            "config": config,
                            "seed": seed,
                            "target": target,
                            "method": method,
                            "alpha": alpha,
                            "bleu": 0.5 + 40 * alpha + 0.1 * seed,
                        }
                    )
    return rows


def test_translation_figures_label_every_point_apart(drawn, tmp_path):
    board = {"defining": {"buckets": [16, 24, 64]}, "rows": translation_board()}
    for name, draw in translation_report.board_figures(board).items():
        assert draw(tmp_path / name), name
    assert len(drawn) == 4
    named = {t.get_text() for t in drawn[0].axes[0].texts}
    assert {"Transformer MHA", "sliding_window encoder-decoder", "RNN, no attention"} <= named
    for figure in drawn:
        assert_readable(figure)


def test_speed_figures(drawn, tmp_path):
    variants = ["mha", "gqa", "mqa", "sliding_window", "linformer", "aft_simple"]
    results = {
        name: {
            "forward": [
                {"length": n, "seconds": 1e-4 * n * (1 + i / 100), "peak_bytes": 2**20 * n / 64} for n in (512, 1024)
            ]
        }
        for i, name in enumerate(variants)
    }
    assert scaling.scaling_figures({"setup": {}, "results": results})["scaling.png"](tmp_path / "scaling.png")
    rows = [
        {"variant": name, "batch_size": b, "decode_zoo": 100.0 * b + i, "decode_llama": 99.0 * b}
        for b in (1, 8)
        for i, name in enumerate(variants)
    ]
    assert decode.decode_figures(rows)["decode.png"](tmp_path / "decode.png")
    for figure in drawn:
        assert_readable(figure)


def uptraining_results() -> list[dict]:
    results = [
        {
            "name": "parent-mha",
            "groups": 4,
            "method": "-",
            "alpha": 0.0,
            "test_perplexity": 120.0,
            "train_tokens": 4_000_000,
            "steps": 1000,
            "validation_curve": [{"step": s, "perplexity": 400 / (1 + s / 100)} for s in (0, 250, 500, 1000)],
        }
    ]
    for groups in (2, 1):
        for method in ("mean", "first", "aligned", "grouped", "scratch"):
            for alpha in (0.0, 0.05, 0.1):
                if method == "scratch" and alpha == 0:
                    continue
                perplexity = 121.0 + alpha + (300 if alpha == 0 else 0)
                results.append(
                    {
                        "name": f"g{groups}-{method}-{alpha}",
                        "groups": groups,
                        "method": method,
                        "alpha": alpha,
                        "test_perplexity": perplexity,
                    }
                )
    results.append({"name": "continued", "groups": 4, "method": "continued", "alpha": 0.05, "test_perplexity": 119})
    return results


def test_uptraining_and_latent_figures(drawn, tmp_path):
    data = {"setup": {}, "results": uptraining_results()}
    for name, draw in uptraining.uptraining_figures(data).items():
        assert draw(tmp_path / name)
    run = {"recovery": [{"step": s, "tokens": 2048 * s, "held_out_perplexity": 30 + 100 / (1 + s)} for s in (0, 10)]}
    smollm2 = {"setup": {}, "gqa": {"held_out_perplexity": 20.0}, "runs": {"mean": run, "aligned": run}}
    assert uptraining.smollm2_figures(smollm2)["recovery.png"](tmp_path / "recovery.png")
    scores = {"converted": 200.0, "uptrained": 30.0}
    result = {
        "gqa": {"cache_bytes_per_token": 46080.0, "held_out_perplexity": 20.0},
        "conversions": [
            {
                "method": m,
                "kv_lora_rank": r,
                "qk_rope_head_dim": r // 2,
                "cache_bytes_per_token": 180.0 * r,
                "held_out_perplexity": 100.0 + r,
            }
            for m in ("rorope", "mean")
            for r in (32, 64)
        ],
        "uptrained": [
            {"method": "rorope", "cache_bytes_per_token": 180.0 * 64, "held_out_perplexity": {"uptrained": 31.0}}
        ],
        "mqa": {m: {"cache_bytes_per_token": 15360.0, "held_out_perplexity": scores} for m in ("aligned", "mean")},
    }
    assert latent.latent_figures(result)["cache.png"](tmp_path / "cache.png")
    assert len(drawn) == 4
    for figure in drawn:
        assert_readable(figure)


def test_attention_map_is_readable(drawn, tmp_path):
    model, tokenizer = byte_model("mha")
    plot_attention(model.eval(), tokenizer, "attention, mapped", path=tmp_path / "map.png")
    (figure,) = drawn
    assert_readable(figure)


def test_replot_redraws_from_the_results_alone(tmp_path, monkeypatch):
    rows = [{"variant": "gqa", "batch_size": 1, "decode_zoo": 100.0, "decode_llama": 90.0}]
    (tmp_path / "decode.json").write_text(json.dumps(rows))
    (tmp_path / "decode.md").write_text("the table\n")
    benchmark = dataclasses.replace(decode.BENCHMARKS["decode"], run=lambda setup: pytest.fail("--replot ran it"))
    monkeypatch.setitem(decode.BENCHMARKS, "decode", benchmark)
    assert run_benchmark(decode.BENCHMARKS, ["decode", "--replot", "--output_dir", str(tmp_path)]) == 0
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "decode.json").read_text()) == rows
    assert (tmp_path / "decode.md").read_text() == "the table\n"
    with pytest.raises(SystemExit, match="fast-decode draws no figures"):
        run_benchmark(decode.BENCHMARKS, ["fast-decode", "--replot", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no .*scaling.json"):
        run_benchmark(scaling.BENCHMARKS, ["--replot", "--output_dir", str(tmp_path)])
