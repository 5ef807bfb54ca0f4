"""Loss curve of a hybrid run, with its phases shaded, as a PNG."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

PHASES: tuple[str, ...] = ("warmup", "full", "predict", "correct")
PHASE_COLOURS: dict[str, str] = {
    "warmup": "#9e9e9e",   # grey
    "full": "#1f77b4",     # blue
    "predict": "#2ca02c",  # green
    "correct": "#ff7f0e",  # orange
    "partial": "#17becf",  # cyan: a Full step with predicted lower layer groups
}


def _phase_runs(steps: Sequence[int], phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Contiguous runs ``(phase, first_step, last_step)`` of equal phase."""
    runs: list[tuple[str, int, int]] = []
    for step, phase in zip(steps, phases):
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], step)
        else:
            runs.append((phase, step, step))
    return runs


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    # Linear interpolation clamped at the ends (xs sorted ascending, non-empty).
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def plot_loss_with_phases(records: Iterable[Mapping[str, Any]],
                          path: str | os.PathLike[str],
                          title: str = "Training loss by phase",
                          val_points: Sequence[tuple[int, float]] | None = None) -> Path:
    """Draw training loss vs step with phases shaded; write a PNG to ``path``.

    ``records``: dicts with ``step`` (int), ``phase`` (one of ``PHASES``), ``loss``
    (float, or None where no loss was observed) and ``rolled_back`` (bool), drawn
    with an ``x`` (at the step's loss, or the curve's value there when unobserved).
    ``val_points``: ``(step, val_loss)`` pairs drawn as a second line.
    Returns the path written. Works without a display (Agg canvas, no pyplot).
    """
    # Imported here so importing ds_hybrid never pulls matplotlib in, and the Agg
    # canvas is used directly: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    recs = sorted((dict(r) for r in records), key=lambda r: int(r["step"]))
    if not recs:
        raise ValueError("plot_loss_with_phases: no records to plot")
    for r in recs:
        if r["phase"] not in PHASE_COLOURS:
            raise ValueError(f"plot_loss_with_phases: step {r['step']} has unknown phase "
                             f"{r['phase']!r}; expected one of {', '.join(PHASES)}")

    steps = [int(r["step"]) for r in recs]
    observed = [(s, float(r["loss"])) for s, r in zip(steps, recs)
                if r.get("loss") is not None and math.isfinite(float(r["loss"]))]

    fig = Figure(figsize=(10, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    # Shade each run of equal phase over [first - 0.5, last + 0.5] so single-step
    # runs stay visible and neighbouring runs meet without gaps.
    for phase, first, last in _phase_runs(steps, [r["phase"] for r in recs]):
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLOURS[phase], alpha=0.15, lw=0)
    handles: list[Any] = [Patch(color=PHASE_COLOURS[p], alpha=0.3, label=p)
                          for p in PHASES if any(r["phase"] == p for r in recs)]

    if observed:
        xs, ys = zip(*observed)
        (line,) = ax.plot(xs, ys, color="black", lw=1.0, marker=".", ms=3,
                          label="train loss")
        handles.append(line)
        rolled = [s for s, r in zip(steps, recs) if r.get("rolled_back")]
        if rolled:
            by_step = dict(observed)
            ry = [by_step.get(s, _interp(s, xs, ys)) for s in rolled]
            handles.append(ax.scatter(rolled, ry, marker="x", color="red", s=40,
                                      zorder=3, label="rolled back"))
    elif any(r.get("rolled_back") for r in recs):
        # No loss to place the marks at: mark the steps along the bottom axis.
        rolled = [s for s, r in zip(steps, recs) if r.get("rolled_back")]
        handles.append(ax.scatter(rolled, [0.0] * len(rolled), marker="x", color="red",
                                  s=40, zorder=3, label="rolled back"))

    if val_points:
        vp = sorted((int(s), float(v)) for s, v in val_points)
        (vline,) = ax.plot([s for s, _ in vp], [v for _, v in vp], color="purple",
                           lw=1.5, marker="o", ms=4, label="validation loss")
        handles.append(vline)

    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    fig.tight_layout()

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
