"""Time to a target loss on a budget frontier (the scoring of ``ds-hybrid bench``).

A system runs at several step budgets, each with its own full warmup-cosine schedule. Its
time to reach a validation loss ``L`` is the least time at which any of its runs reaches
``L``: where a run's validation curve first crosses it, or, between two budgets whose
final losses bracket ``L``, the time interpolated between their end points (a budget in
between would end there). The same rule scores plain DeepSpeed and the hybrid, so a
schedule's length cannot flatter either: each may pick its best budget.

Times are either seconds of training (evaluation excluded) or Full-step equivalents: each
step's cost from a profile of step kinds measured in one process, which machine noise
between runs cannot move.
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

Curve = Sequence[tuple[float, float]]   # (time, validation loss), time increasing


def time_to_target(curve: Curve, target: float) -> float | None:
    """First time at which the validation curve reaches ``target`` (linear between points)."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            if v0 <= target or v1 == v0:
                return t0 if v0 <= target else t1
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
    return None


def frontier_time(runs: Iterable[dict], target: float, key: str = "val_curve") -> float | None:
    """Least time at which any budget's run reaches ``target``: curve crossings, and the
    interpolation between budgets' end points. ``runs``: rows with ``key`` (a curve)."""
    runs = [r for r in runs if r.get(key)]
    times = [t for t in (time_to_target(r[key], target) for r in runs) if t is not None]
    ends = sorted((r[key][-1] for r in runs), key=lambda p: p[0])
    for (t0, f0), (t1, f1) in zip(ends, ends[1:]):
        if f0 >= target >= f1 and f0 > f1:
            times.append(t0 + (t1 - t0) * (f0 - target) / (f0 - f1))
    return min(times) if times else None


def step_costs_curve(val_points: Sequence[tuple[int, float]], step_costs: Sequence[float]) -> list[tuple[float, float]]:
    """A validation curve against cumulative cost: ``step_costs[i]`` is step i+1's cost."""
    cum = [0.0]
    for c in step_costs:
        cum.append(cum[-1] + c)
    return [(cum[min(step, len(cum) - 1)], loss) for step, loss in val_points]


def mean_spread(values: Iterable[float | None]) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "n": len(vals)}


def ratios(arm_runs: list[dict], base_runs: list[dict], targets: dict[str, float], key: str) -> dict:
    """For each named target: the arm's frontier time, the baseline's, and their ratio."""
    out = {}
    for name, target in targets.items():
        t_arm, t_base = frontier_time(arm_runs, target, key), frontier_time(base_runs, target, key)
        out[name] = {"target": target, "time": t_arm, "baseline_time": t_base,
                     "ratio": t_arm / t_base if t_arm is not None and t_base else None}
    return out
