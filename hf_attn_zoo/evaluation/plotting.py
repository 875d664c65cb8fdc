"""The house style of every figure the project draws, and labels that never print over each other.

Plots are optional (the `plots` extra: `pip install -e ".[plots]"` in a clone of hf_attn_zoo) and always go to files,
never to a window. Every figure is drawn inside `house_style()` (one set of sizes, fonts and grid), colours a variant
(or a pooling method) by `colour(name)` so that it looks the same in every figure, and names its points either in a
legend or with `place_labels`, which puts each label where its box overlaps no other label and no marker.
"""

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

# sizes and fonts of every figure; `house_style()` applies them
STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 110,
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "legend.framealpha": 0.9,
    "axes.grid": True,
    "axes.grid.which": "both",
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.markersize": 5,
    "lines.linewidth": 1.5,
    "errorbar.capsize": 3,
}

# one colour per registered variant and per conversion method, the same in every figure; the MHA family in blues
# and greens would be unreadable side by side, so the families are spread over distinct hues instead
COLOURS = {
    # variants
    "mha": "tab:blue",
    "gqa": "tab:orange",
    "mqa": "tab:green",
    "single_head": "tab:red",
    "sliding_window": "tab:purple",
    "linformer": "tab:brown",
    "aft_full": "tab:pink",
    "aft_local": "tab:gray",
    "aft_simple": "tab:olive",
    "topk": "tab:cyan",
    "additive": "#2e8b57",
    "differential": "#b8860b",
    "mla": "#000080",
    "linear": "#dc143c",
    "bigbird": "#6a5acd",
    "mamba": "#008b8b",
    # pooling (MHA -> GQA/MQA) and MLA conversion methods
    "mean": "tab:blue",
    "first": "tab:orange",
    "random": "tab:olive",
    "aligned": "tab:green",
    "grouped": "tab:red",
    "grouped_aligned": "tab:purple",
    "rorope": "tab:brown",
    "scratch": "tab:gray",
    # baselines: the reference every figure compares against
    "llama": "black",
    "parent": "black",
}

# the position types of the backbone, told apart by line and marker where one variant appears with several
POSITION_STYLES = {
    "rope": {"linestyle": "-", "marker": "o"},
    "alibi": {"linestyle": "--", "marker": "s"},
    "sinusoidal": {"linestyle": ":", "marker": "^"},
    "learned": {"linestyle": "-.", "marker": "D"},
    "none": {"linestyle": (0, (1, 1)), "marker": "v"},
}


def headless_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (works without a display), or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def house_style() -> contextlib.AbstractContextManager:
    """The rc settings of every figure, for a `with` block that draws and saves one (matplotlib reads most of them
    when an artist is made, so the block must hold the whole drawing, not only the figure's creation)."""
    import matplotlib

    return matplotlib.rc_context(STYLE)


def colour(name: str) -> str:
    """The colour of a variant, a conversion method or a baseline in every figure; other names get a stable colour
    of their own (by hash: the same name keeps it from figure to figure)."""
    if name in COLOURS:
        return COLOURS[name]
    from matplotlib import colormaps

    palette = colormaps["tab20"].colors
    return palette[zlib.crc32(name.encode()) % len(palette)]


def save_figure(figure, path: str | Path, dpi: int | None = None) -> None:
    """Lay `figure` out (unless it has its own layout engine), write it to `path` and free it (pyplot keeps every open
    figure alive; a closed figure can still be drawn, as the plot tests do)."""
    from matplotlib import pyplot

    if figure.get_layout_engine() is None:
        figure.tight_layout()
    figure.savefig(path, dpi=dpi or STYLE["savefig.dpi"])
    pyplot.close(figure)


def ticks_at(axis, values: Sequence[float]) -> None:
    """Ticks of a (log) axis exactly at `values`, labelled plainly (512, not 5×10²) and without minor labels, which
    on a log axis crowd each other."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    values = sorted(set(values))
    axis.set_major_locator(FixedLocator(values))
    axis.set_ticklabels([f"{value:g}" for value in values])
    axis.set_minor_formatter(NullFormatter())


def _directions(count: int) -> list[tuple[float, float]]:
    """Unit vectors, up-right first (where a reader looks for a point's name), then alternating around the circle."""
    angles = [math.radians(30 + 360 * step / count) for step in range(count)]
    order = sorted(range(count), key=lambda i: min(i, count - i))  # 0, 1, count-1, 2, count-2, ...
    return [(math.cos(angles[i]), math.sin(angles[i])) for i in order]


def _candidates(radii: Sequence[float] = (5, 9, 14, 20, 28, 38, 50, 65, 85, 110, 140)) -> Iterator[tuple]:
    for ring, radius in enumerate(radii):
        for dx, dy in _directions(8 if ring < 2 else 16):
            yield radius * dx, radius * dy


def place_labels(
    axis,
    points: Sequence[tuple[float, float]],
    labels: Sequence[str],
    colours: Sequence | None = None,
    spans: Sequence[tuple[float, float]] | None = None,
    fontsize: float | None = None,
) -> list:
    """Name each point of `axis` (data coordinates) with its label, placed greedily: the first spot on growing rings
    around the point whose text box, measured by the renderer, lies inside the axes and overlaps no label placed
    before, no marker and no error bar (`spans`: each point's (low, high) in y). A label placed away from its point
    gets a thin leader line. Points in crowded places are labelled first, while spots near them are free.

    The figure is laid out first (`tight_layout`, as `save_figure` does) so that the boxes are measured where they
    will be drawn; `save_figure` must not change the layout afterwards (add legends and titles before). Returns the
    annotations. A label no spot fits (none does only in a figure too small for its labels) goes where it overlaps
    least."""
    from matplotlib import rcParams
    from matplotlib.transforms import Bbox

    figure = axis.figure
    if figure.get_layout_engine() is None:
        figure.tight_layout()
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    frame = axis.get_window_extent(renderer)
    to_display = axis.transData.transform
    to_data = axis.transData.inverted().transform
    pixels_per_point = figure.dpi / 72
    at = [tuple(to_display(point)) for point in points]
    half = (rcParams["lines.markersize"] / 2 + 1) * pixels_per_point
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in at]
    for (x, _), (low, high) in zip(points, spans or []):
        (x0, y0), (_, y1) = to_display((x, low)), to_display((x, high))
        taken.append(Bbox.from_extents(x0 - 1, y0, x0 + 1, y1))
    taken += [text.get_window_extent(renderer) for text in axis.texts if text.get_text()]
    legend = axis.get_legend()
    if legend is not None:
        taken.append(legend.get_window_extent(renderer))
    crowd = [sum(math.dist(a, b) < 60 * pixels_per_point for b in at) for a in at]
    placed = [None] * len(points)
    for index in sorted(range(len(points)), key=lambda i: -crowd[i]):
        best = None  # (overlap, annotation, box, offset) of the least bad spot, for a label no spot fits
        for dx, dy in _candidates():
            annotation = axis.annotate(
                labels[index],
                points[index],
                xytext=(dx, dy),
                textcoords="offset points",
                ha="left" if dx > 1 else "right" if dx < -1 else "center",
                va="bottom" if dy > 1 else "top" if dy < -1 else "center",
                color=None if colours is None else colours[index],
                fontsize=fontsize or rcParams["legend.fontsize"],
                annotation_clip=False,
            )
            annotation.set_in_layout(False)  # the layout is settled; labels live inside the axes
            box = annotation.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            overlap = sum(_overlap_area(box, other) for other in taken) + (0 if inside else box.width * box.height)
            if best is None or overlap < best[0]:
                if best is not None:
                    best[1].remove()
                best = (overlap, annotation, box, (dx, dy))
            else:
                annotation.remove()
            if overlap == 0:
                break
        _, annotation, box, (dx, dy) = best
        taken.append(box.expanded(1.0, 1.0).padded(pixels_per_point))
        placed[index] = annotation
        if math.hypot(dx, dy) > 15:  # far from its point: a leader line says which point it names
            corner = (min(max(at[index][0], box.x0), box.x1), min(max(at[index][1], box.y0), box.y1))
            line = axis.plot(
                *zip(points[index], to_data(corner)), color="0.55", linewidth=0.6, zorder=1, scalex=False, scaley=False
            )[0]
            line.set_in_layout(False)
    return placed


def _overlap_area(a, b) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0
