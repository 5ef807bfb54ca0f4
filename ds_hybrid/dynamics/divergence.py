"""Divergence monitor: levels with actions, from shared scalars only.

Signals (each checked on every step that has them):

* NaN/Inf loss or gradient norm                     -> ROLLBACK
* loss z-score against the prediction, z = (observed - predicted) / std:
  z > z_rollback -> ROLLBACK; z > z_warn -> SHORTEN
* gradient-norm explosion: norm > explode x running median -> FORCE_FULL;
  vanishing: norm < vanish x running median                -> FORCE_FULL
* oscillation: the sign of the loss change flips in at least ``osc_share`` of
  the last ``osc_window`` real steps while their amplitude exceeds the noise -> SHORTEN

Actions, in rising order: SHORTEN halves the next Predict horizon; FORCE_FULL
makes the next decision a Full phase; ROLLBACK, in a Predict step, undoes the
steps since the last good point (and forces Full). The engine feeds every rank
the same all-reduced values, so every rank reaches the same level.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections import deque


class Level(enum.IntEnum):
    OK = 0
    SHORTEN = 1
    FORCE_FULL = 2
    ROLLBACK = 3


class DivergenceMonitor:
    def __init__(self, z_warn: float = 2.0, z_rollback: float = 4.0, explode: float = 10.0, vanish: float = 1e-3,
                 osc_window: int = 12, osc_share: float = 0.8):
        self.z_warn, self.z_rollback = z_warn, z_rollback
        self.explode, self.vanish = explode, vanish
        self.osc_window, self.osc_share = osc_window, osc_share
        self.grad_norms: deque[float] = deque(maxlen=64)
        self.losses: deque[float] = deque(maxlen=osc_window + 1)
        self.counts = {lvl.name: 0 for lvl in Level}
        self.reasons: dict[str, int] = {}
        self.last: Level = Level.OK

    def _raise(self, level: Level, current: Level, reason: str) -> Level:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return max(level, current)

    def check(self, loss: float | None, predicted: float | None = None, std: float | None = None,
              grad_norm: float | None = None, real: bool = True) -> Level:
        lvl = Level.OK
        if loss is not None and not math.isfinite(loss):
            lvl = self._raise(Level.ROLLBACK, lvl, "nonfinite_loss")
        if grad_norm is not None and not math.isfinite(grad_norm):
            lvl = self._raise(Level.ROLLBACK, lvl, "nonfinite_grad")
        if (loss is not None and math.isfinite(loss) and predicted is not None and math.isfinite(predicted)
                and std is not None and std > 0 and math.isfinite(std)):
            z = (loss - predicted) / std
            if z > self.z_rollback:
                lvl = self._raise(Level.ROLLBACK, lvl, "loss_z")
            elif z > self.z_warn:
                lvl = self._raise(Level.SHORTEN, lvl, "loss_z_warn")
        if grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 0:
            if len(self.grad_norms) >= 8:
                med = statistics.median(self.grad_norms)
                if grad_norm > self.explode * med:
                    lvl = self._raise(Level.FORCE_FULL, lvl, "grad_explosion")
                elif grad_norm < self.vanish * med:
                    lvl = self._raise(Level.FORCE_FULL, lvl, "grad_vanishing")
            self.grad_norms.append(grad_norm)
        if real and loss is not None and math.isfinite(loss):
            self.losses.append(loss)
            if self._oscillating(std):
                lvl = self._raise(Level.SHORTEN, lvl, "oscillation")
        self.counts[lvl.name] += 1
        self.last = lvl
        return lvl

    def _oscillating(self, std: float | None) -> bool:
        if len(self.losses) <= self.osc_window:
            return False
        x = list(self.losses)
        d = [b - a for a, b in zip(x, x[1:])]
        flips = sum(1 for a, b in zip(d, d[1:]) if a * b < 0)
        amp = statistics.fmean(abs(v) for v in d)
        noise = std if std is not None and math.isfinite(std) and std > 0 else 0.0
        return flips >= self.osc_share * (len(d) - 1) and amp > 2.0 * noise

    def state_dict(self) -> dict:
        return {"grad_norms": list(self.grad_norms), "losses": list(self.losses), "counts": dict(self.counts),
                "reasons": dict(self.reasons), "last": int(self.last)}

    def load_state_dict(self, sd: dict) -> None:
        self.grad_norms = deque(sd["grad_norms"], maxlen=64)
        self.losses = deque(sd["losses"], maxlen=self.osc_window + 1)
        self.counts, self.reasons, self.last = dict(sd["counts"]), dict(sd["reasons"]), Level(sd["last"])
