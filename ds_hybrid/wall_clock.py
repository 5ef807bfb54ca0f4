"""DeepSpeed's ``wall_clock_breakdown`` timers, summed per kind of step.

With ``"wall_clock_breakdown": true`` DeepSpeed times every forward, backward (its inner part
and its gradient reduction) and optimizer step, logs them and resets them at each
gradient-accumulation boundary. That log mixes step kinds: a Predict step's verification
forward goes through ``engine.forward``, and a Predict step may call DeepSpeed's ``step()`` only
to advance its counters, so the log puts those forwards into whatever step reaches the next
boundary. Here every interval those timers measure is also kept aside as it ends, and booked
to the phase of the ``train_step`` it happened in; plain DeepSpeed's steps are read by exactly
the same code, and DeepSpeed's own log is left as it was.
"""
from __future__ import annotations

from deepspeed.utils.timer import SynchronizedWallClockTimer

# DeepSpeed's global timer names (deepspeed.utils.timer): totals over a step's micro-batches.
TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


class _KeptTimer(SynchronizedWallClockTimer.Timer):
    """DeepSpeed's timer, which also hands each interval it measures to ``kept`` as it stops
    (seconds on a host timer; a pair of CUDA events on a GPU, read at the end of the step)."""

    def __init__(self, name: str, kept: list):
        super().__init__(name)
        self._kept = kept

    def stop(self, reset=False, record=False):
        super().stop(reset=reset, record=record)
        self._kept.append((self.name_, self.event_timers[-1]))


def _ms(interval) -> float:
    return interval * 1e3 if isinstance(interval, float) else interval.get_elapsed_msec()


class WallClockBreakdown:
    """Milliseconds of DeepSpeed's forward, backward and step timers, per phase of step."""

    def __init__(self, engine):
        self.ms: dict[str, dict[str, float]] = {}      # phase -> timer -> total ms
        self.steps: dict[str, int] = {}                # phase -> steps booked
        # The real steps whose first forward checked a predicted update (a Predict run's or a
        # partial step's), by the check's outcome ("kept", "rolled_back"), booked again here: a
        # rolled-back update's step runs its forward twice, and the first step after a run is
        # where the run's own costs land (its memory freed, its commit), so the phase's mean
        # alone cannot say what a steady real step costs.
        self.check_ms: dict[str, dict[str, float]] = {}   # outcome -> timer (and "whole") -> total ms
        self.check_steps: dict[str, int] = {}
        self._kept: list = []                          # (timer, interval) since the last booking
        for name in TIMERS:
            engine.timers.timers[name] = _KeptTimer(name, self._kept)

    def before_step(self) -> None:
        """Drop what was timed between steps (an evaluation's forwards are no step's)."""
        self._kept.clear()

    def after_step(self, phase: str, checked: bool | None = None, whole_s: float | None = None) -> None:
        """Book the intervals the step that just ended measured to its phase; a step whose first
        forward checked a predicted update (``checked``: kept or rolled back) also to that outcome,
        with the whole step's ``whole_s``."""
        by_timer = self.ms.setdefault(phase, {name: 0.0 for name in TIMERS})
        outcome = None if checked is None else ("kept" if checked else "rolled_back")
        by_check = None if outcome is None else self.check_ms.setdefault(outcome,
                                                                          dict.fromkeys(TIMERS + ("whole",), 0.0))
        for name, interval in self._kept:
            ms = _ms(interval)
            by_timer[name] += ms
            if by_check is not None:
                by_check[name] += ms
        self._kept.clear()
        self.steps[phase] = self.steps.get(phase, 0) + 1
        if by_check is not None:
            by_check["whole"] += 1e3 * (whole_s or 0.0)
            self.check_steps[outcome] = self.check_steps.get(outcome, 0) + 1

    def book_so_far_as_warmup(self) -> None:
        """Move every step booked so far to ``warmup`` (``ds-hybrid train --profile-warmup``: a
        plain run's first steps left out of its Full figures, as a hybrid run's Warmup is)."""
        warm = self.ms.setdefault("warmup", {name: 0.0 for name in TIMERS})
        for phase in [p for p in self.ms if p != "warmup"]:
            for name, v in self.ms.pop(phase).items():
                warm[name] += v
            self.steps["warmup"] = self.steps.get("warmup", 0) + self.steps.pop(phase, 0)

    def summary(self) -> dict:
        """Per phase: steps and mean ms per step of each timer; ``real``: the whole real steps
        (warmup, full, correct) together, the unit a plain DeepSpeed step is compared with;
        ``checks`` (where a step checked a predicted update): the same for those steps by outcome,
        ``kept`` and ``rolled_back``, with the whole step's mean ms as ``whole``."""
        out = {phase: {"steps": n, "mean_ms": {k: v / n for k, v in self.ms[phase].items()}}
               for phase, n in self.steps.items() if n}
        whole = [p for p in ("warmup", "full", "correct") if self.steps.get(p)]
        n = sum(self.steps[p] for p in whole)
        if n:
            out["real"] = {"steps": n, "mean_ms": {k: sum(self.ms[p][k] for p in whole) / n for k in TIMERS}}
        if self.check_steps:
            out["checks"] = {o: {"steps": c, "mean_ms": {k: v / c for k, v in self.check_ms[o].items()}}
                             for o, c in self.check_steps.items()}
        return out
