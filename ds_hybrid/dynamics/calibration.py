"""Confidence: the calibrated probability that a Predict step passes verification.

A raw score ``u`` in (0, 1] comes from what the model knows about itself:

    u = 1 / (1 + (ensemble disagreement + recent |error|) / acceptance band)

(all in loss units): near 1 when the members agree and recent forecasts were
well inside the band. ``u`` picks one of ``bins`` equal-width bins; the
confidence is a lower confidence bound (Wilson, ``z``) on that bin's acceptance
frequency, counted with an extra rejection (a Beta(0, 1) prior): zero evidence
gives confidence 0, no optimistic prior. Counts decay by ``decay`` per new
outcome, because what verification accepts drifts as training moves on and as the
step-scale multiplier changes; a bound on a recent frequency keeps "accepted share
>= confidence" true where the plain mean ran a few points under it (three seeds of
the unit tests' easy regime, ``benchmarks/calibration_easy.py``). Adjacent bins are pooled
where they violate monotonicity (a higher score never gets a lower confidence).
Outcomes come from verified Predict steps only.

``table()`` reports, per confidence interval at decision time, the share of those
Predict steps that verification accepted: the calibration measurement.
"""
from __future__ import annotations

import math


class ConfidenceCalibrator:
    def __init__(self, bins: int = 5, z: float = 0.5, decay: float = 0.995):
        self.bins, self.z, self.decay = bins, z, decay
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

    def _rate(self, blk) -> float:
        n = blk[0] + blk[1] + 1.0  # the prior's one rejection
        p, z2 = blk[0] / n, self.z * self.z
        centre = p + z2 / (2 * n)
        spread = self.z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
        return max((centre - spread) / (1 + z2 / n), 0.0)

    def confidence(self, u: float) -> float:
        return self._pooled()[self.bin_of(u)]

    def evidence(self, u: float) -> float:
        i = self.bin_of(u)
        return self.acc[i] + self.rej[i]

    def record(self, u: float, confidence: float, accepted: bool) -> None:
        i = self.bin_of(u)
        self.acc = [a * self.decay for a in self.acc]
        self.rej = [r * self.decay for r in self.rej]
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
