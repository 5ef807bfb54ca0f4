"""Confidence: the calibrated probability that a Predict step passes verification.

A raw score ``u`` in (0, 1] comes from what the model knows about itself:

    u = 1 / (1 + (ensemble disagreement + recent |error|) / acceptance band)

(all in loss units): near 1 when the members agree and recent forecasts were
well inside the band. ``u`` picks one of ``bins`` equal-width bins; the
confidence is that bin's acceptance frequency under a Beta(0, 1) prior,
``accepted / (accepted + rejected + 1)``: zero evidence gives confidence 0, no
optimistic prior. Adjacent bins are pooled where they violate monotonicity (a
higher score never gets a lower confidence). Outcomes come from verified
Predict steps only.

Because the confidence is an observed frequency, it is calibrated by
construction as evidence accumulates; ``table()`` reports, per confidence bin
at decision time, the share of those Predict steps that verification
accepted, which is the calibration measurement.
"""
from __future__ import annotations

import math


class ConfidenceCalibrator:
    def __init__(self, bins: int = 5):
        self.bins = bins
        self.acc = [0.0] * bins
        self.rej = [0.0] * bins
        # (confidence at decision, accepted?) of every verified Predict step, for the table.
        self.outcomes: list[tuple[float, bool]] = []

    @staticmethod
    def raw_score(disagreement: float, recent_error: float, band: float) -> float:
        if not (math.isfinite(disagreement) and math.isfinite(recent_error)) or band <= 0:
            return 0.0
        return 1.0 / (1.0 + (max(disagreement, 0.0) + max(recent_error, 0.0)) / band)

    def bin_of(self, u: float) -> int:
        return min(int(max(u, 0.0) * self.bins), self.bins - 1)

    def _pooled(self) -> list[float]:
        """Per-bin confidence, made non-decreasing by pooling adjacent violators."""
        blocks = []  # [acc, rej, first bin, last bin]
        for i in range(self.bins):
            blocks.append([self.acc[i], self.rej[i], i, i])
            while len(blocks) > 1 and self._rate(blocks[-2]) > self._rate(blocks[-1]):
                a, b = blocks[-2], blocks.pop()
                a[0] += b[0]
                a[1] += b[1]
                a[3] = b[3]
        out = [0.0] * self.bins
        for blk in blocks:
            for i in range(blk[2], blk[3] + 1):
                out[i] = self._rate(blk)
        return out

    @staticmethod
    def _rate(blk) -> float:
        return blk[0] / (blk[0] + blk[1] + 1.0)

    def confidence(self, u: float) -> float:
        return self._pooled()[self.bin_of(u)]

    def evidence(self, u: float) -> float:
        i = self.bin_of(u)
        return self.acc[i] + self.rej[i]

    def record(self, u: float, confidence: float, accepted: bool) -> None:
        i = self.bin_of(u)
        if accepted:
            self.acc[i] += 1
        else:
            self.rej[i] += 1
        self.outcomes.append((confidence, accepted))
        del self.outcomes[:-5000]

    def table(self, edges=(0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)) -> list[dict]:
        """Calibration: per confidence interval, Predict steps and the share accepted."""
        rows = []
        for lo, hi in zip(edges, edges[1:]):
            sel = [a for c, a in self.outcomes if lo <= c < hi]
            rows.append({"confidence": f"[{lo:.1f}, {min(hi, 1.0):.1f})", "steps": len(sel),
                         "accepted_share": (sum(sel) / len(sel)) if sel else None})
        return rows

    def state_dict(self) -> dict:
        return {"acc": list(self.acc), "rej": list(self.rej), "outcomes": list(self.outcomes)}

    def load_state_dict(self, sd: dict) -> None:
        self.acc, self.rej = list(sd["acc"]), list(sd["rej"])
        self.outcomes = [tuple(o) for o in sd["outcomes"]]
