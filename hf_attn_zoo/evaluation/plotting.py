"""Benchmark plots are optional (the `plots` extra: `pip install -e ".[plots]"` in a clone of hf_attn_zoo) and always
go to files, never to a window."""

from pathlib import Path


def headless_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (works without a display), or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def save_figure(figure, path: str | Path, dpi: int = 110) -> None:
    """Lay `figure` out, write it to `path` and free it (pyplot keeps every open figure alive)."""
    from matplotlib import pyplot

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot.close(figure)
