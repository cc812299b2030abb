"""Loss curves as a PNG file, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["plot_curves"]


def plot_curves(
    curves: Mapping[str, Sequence[float]],
    path: str | os.PathLike,
    *,
    x: Sequence[float] | None = None,
    xlabel: str = "epoch",
    ylabel: str = "loss",
    title: str | None = None,
) -> str:
    """Draw each named curve against ``x`` (default 1, 2, ...) and save the figure to ``path``.

    The y axis is logarithmic when the values span more than two decades. Returns the path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    values = []
    for label, ys in curves.items():
        xs = list(x) if x is not None else list(range(1, len(ys) + 1))
        ax.plot(xs[: len(ys)], ys, marker="o", markersize=3, label=label)
        values += [v for v in ys if v == v and v > 0]
    if values and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend()
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, format="png")
    return path
