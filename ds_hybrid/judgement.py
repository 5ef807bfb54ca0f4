"""Delayed-effect judgement of whole-model Predict runs.

The check of a Predict run (the next real step's forward, or a verification forward)
looks at one loss right after it, which is negative even for drift steps that pay off
over the following real steps (``benchmarks/progress_probe.py``). This module judges a run
by what comes after it: the losses of the next ``steps`` real steps against a forecast of
the same real steps without the run, a least-squares line through the ``window`` real-step
losses before it, indexed by real steps only (with the batch-difficulty statistic as a
second regressor when the engine measures it, which takes out much of the batch noise).

A run that bought progress leaves the real steps after it below the line (a negative
effect); a run worth nothing leaves them on it (the skip control: the predicted steps only
advanced the schedule); a harmful one leaves them above. A line through a curving loss is
itself off by some amount (on ``cpu-small`` +0.007 after runs and after no runs alike), so
the same judgement is also made over stretches of real steps with no run in them (placebo
judgements), and the net effect of runs is their mean effect minus the placebos'. A window
with an earlier run in it would carry that run's own jump into the line, so with ``clean``
(the engine's setting) a run or placebo is judged only from a window free of runs: runs at
least ``window`` real steps apart (``full_steps`` >= ``judge.window``). One run's
effect is far below the batch noise on small models (``docs/predicted-steps.md``), so the
verdict is taken over all judged runs and placebos: ``harmful()`` is true once the net
effect is above zero by ``z`` standard errors; the engine then stops taking Predict runs.

Every input is a value all ranks share (all-reduced losses), and the engine passes the
verdict through its rank-0 agreement, so the ranks decide alike.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class _Open:
    """A run being judged: its forecast line and the residuals seen so far."""
    coef: list[float]          # intercept, slope per real step, difficulty coefficient (0 without)
    start: int                 # real-step index of the first real step after the run
    predicted_steps: int       # 0: a placebo (real steps with no run before them)
    residuals: list[float] = field(default_factory=list)


class _Mean:
    """A running mean and its standard error."""

    def __init__(self, n: int = 0, total: float = 0.0, total_sq: float = 0.0):
        self.n, self.total, self.total_sq = n, total, total_sq

    def add(self, x: float) -> None:
        self.n, self.total, self.total_sq = self.n + 1, self.total + x, self.total_sq + x * x

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def stderr(self) -> float | None:
        if self.n < 2:
            return None
        var = max(self.total_sq / self.n - (self.total / self.n) ** 2, 0.0) * self.n / (self.n - 1)
        return math.sqrt(var / self.n)


class DelayedJudgement:
    def __init__(self, steps: int = 8, window: int = 16, min_runs: int = 6, z: float = 2.0, clean: bool = True):
        self.steps, self.window, self.min_runs, self.z, self.clean = steps, window, min_runs, z, clean
        self.last_run = None                        # real index of the last run's end
        self.history: deque = deque(maxlen=window)   # (real index, loss, difficulty or None)
        self.real_index = 0
        self.open: _Open | None = None              # the run (or placebo) being judged
        self.effects: deque = deque(maxlen=4096)    # (first real index judged, predicted steps (0: placebo), effect)
        self.runs, self.placebos = _Mean(), _Mean()

    # -- inputs ------------------------------------------------------------------
    def real_step(self, loss: float | None, difficulty: float | None = None) -> None:
        """A whole real step's shared loss (and batch difficulty, when measured)."""
        if loss is None or not math.isfinite(loss):
            return
        if self.open is not None:
            o = self.open
            if o.coef[2] != 0.0 and difficulty is None:
                self.open = None   # the forecast needs the difficulty this step lacks: drop the run
            else:
                expected = o.coef[0] + o.coef[1] * self.real_index + o.coef[2] * (difficulty or 0.0)
                o.residuals.append(loss - expected)
                if len(o.residuals) >= self.steps:
                    self._close()
        self.history.append((self.real_index, float(loss), difficulty))
        self.real_index += 1
        if self.open is None:
            coef = self._fit()   # nothing being judged: a placebo over the next real steps (a clean window)
            if coef is not None:
                self.open = _Open(coef, self.real_index, 0)

    def run_ended(self, predicted_steps: int) -> bool:
        """A Predict run was taken and kept: open its judgement (closing the previous one
        with the real steps it had; a placebo with a run inside it is dropped). False when
        there is not yet a window to forecast from."""
        if self.open is not None and self.open.predicted_steps == 0:
            self.open = None
        self._close()
        coef = self._fit()
        self.last_run = self.real_index
        if coef is None:
            return False
        self.open = _Open(coef, self.real_index, predicted_steps)
        return True

    # -- verdict -----------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.runs.n

    def mean_effect(self) -> float | None:
        """Mean effect of the judged runs (loss above their forecast; negative: they paid)."""
        return self.runs.mean()

    def net_effect(self) -> tuple[float | None, float | None]:
        """(runs' mean effect minus the placebos', its standard error)."""
        a, b = self.runs, self.placebos
        if a.n < 2 or b.n < 2:
            return None, None
        return a.mean() - b.mean(), math.hypot(a.stderr(), b.stderr())

    def harmful(self) -> bool:
        """The judged runs, together, left the loss above what the placebos show by ``z``
        standard errors (at least ``min_runs`` runs and placebos each)."""
        if self.runs.n < self.min_runs or self.placebos.n < self.min_runs:
            return False
        net, se = self.net_effect()
        return net is not None and net > self.z * se

    def summary(self) -> dict:
        net, se = self.net_effect()
        placebo = self.placebos.mean()
        runs = [e for _, k, e in self.effects if k > 0]
        return {"judged_runs": self.runs.n, "mean_effect": self.runs.mean(), "stderr": self.runs.stderr(),
                "placebos": self.placebos.n, "placebo_effect": placebo, "net_effect": net, "net_stderr": se,
                # runs whose effect is below the placebos' mean: judged to have paid
                "paid_share": (sum(e < placebo for e in runs) / len(runs)) if runs and placebo is not None else None,
                "harmful": self.harmful(), "steps": self.steps}

    # -- internals ---------------------------------------------------------------
    def _close(self) -> None:
        o, self.open = self.open, None
        if o is None or not o.residuals:
            return
        effect = sum(o.residuals) / len(o.residuals)
        if o.predicted_steps == 0 and len(o.residuals) < self.steps:
            return   # placebos are whole (one cut short by a run had the run inside it)
        self.effects.append((o.start, o.predicted_steps, effect))
        (self.placebos if o.predicted_steps == 0 else self.runs).add(effect)

    def _fit(self) -> list[float] | None:
        """Least squares through the window: loss ~ a + b * real index (+ c * difficulty)."""
        if len(self.history) < self.window:
            return None
        if self.clean and self.last_run is not None and self.real_index - self.window < self.last_run:
            return None   # a run inside the window
        xs = torch.tensor([h[0] for h in self.history], dtype=torch.float64)
        ys = torch.tensor([h[1] for h in self.history], dtype=torch.float64)
        cols = [torch.ones_like(xs), xs - xs[-1]]
        with_d = all(h[2] is not None for h in self.history)
        if with_d:
            ds = torch.tensor([h[2] for h in self.history], dtype=torch.float64)
            if float(ds.std()) > 0:
                cols.append(ds)
            else:
                with_d = False
        sol = torch.linalg.lstsq(torch.stack(cols, 1), ys.unsqueeze(1)).solution.squeeze(1).tolist()
        a, b = sol[0] - sol[1] * float(xs[-1]), sol[1]   # back to absolute real indices
        return [a, b, sol[2] if with_d else 0.0]

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"history": list(self.history), "real_index": self.real_index, "last_run": self.last_run,
                "open": None if self.open is None else vars(self.open).copy(),
                "effects": list(self.effects), "runs": vars(self.runs).copy(), "placebos": vars(self.placebos).copy()}

    def load_state_dict(self, sd: dict) -> None:
        self.history = deque((tuple(h) for h in sd["history"]), maxlen=self.window)
        self.real_index, self.last_run = sd["real_index"], sd["last_run"]
        self.open = None if sd["open"] is None else _Open(**sd["open"])
        self.effects = deque((tuple(e) for e in sd["effects"]), maxlen=4096)
        self.runs, self.placebos = _Mean(**sd["runs"]), _Mean(**sd["placebos"])
