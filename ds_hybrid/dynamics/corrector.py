"""Online residual correctors: recursive least squares with forgetting.

The RSSM's forecast of the loss k steps ahead (and of the next step scale) is
corrected by a linear model of its recent residuals, refit every time a target
arrives. Inputs per horizon (all in the forecast's noise units):
``[1, rssm mean, EMA - base, last - base, linear-trend - base, batch difficulty]``.
The weights start at "trust the RSSM" (1 on its mean, 0 elsewhere), so with no
data the corrector changes nothing; forgetting (``lam``) lets it follow a run
whose regime drifts.
"""
from __future__ import annotations

import torch


class RLS:
    """Recursive least squares ``y ~ w . phi`` with exponential forgetting."""

    def __init__(self, dim: int, prior: list[float] | None = None, lam: float = 0.98, delta: float = 1.0):
        self.w = torch.tensor(prior if prior is not None else [0.0] * dim, dtype=torch.float64)
        self.P = torch.eye(dim, dtype=torch.float64) * delta
        self.lam, self.n = lam, 0

    def predict(self, phi: torch.Tensor) -> float:
        return float(self.w @ phi.double())

    def update(self, phi: torch.Tensor, y: float) -> None:
        phi = phi.double()
        Pphi = self.P @ phi
        gain = Pphi / (self.lam + phi @ Pphi)
        self.w = self.w + gain * (y - self.w @ phi)
        self.P = (self.P - torch.outer(gain, Pphi)) / self.lam
        self.P = 0.5 * (self.P + self.P.T)  # keep it symmetric against round-off
        self.n += 1

    def state_dict(self) -> dict:
        return {"w": self.w.clone(), "P": self.P.clone(), "n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.w, self.P, self.n = sd["w"].clone(), sd["P"].clone(), sd["n"]


LOSS_INPUTS = ("bias", "rssm", "ema", "last", "trend", "difficulty")


class ResidualCorrector:
    """One RLS per horizon for the loss, one for the step scale."""

    def __init__(self, horizon: int, lam: float = 0.98, enabled: bool = True):
        self.enabled = enabled
        prior = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        self.loss = [RLS(len(LOSS_INPUTS), prior, lam, delta=0.1) for _ in range(horizon)]
        self.scale = RLS(2, [0.0, 1.0], lam, delta=0.1)
        # Measured effect: |error| of the RSSM alone and after correction, per horizon.
        self.abs_err_raw = [0.0] * horizon
        self.abs_err_corr = [0.0] * horizon
        self.count = [0] * horizon

    def correct_loss(self, k: int, phi: torch.Tensor) -> float:
        return self.loss[k - 1].predict(phi) if self.enabled else float(phi[1])

    def learn_loss(self, k: int, phi: torch.Tensor, y: float) -> None:
        i = k - 1
        self.abs_err_raw[i] += abs(y - float(phi[1]))
        self.abs_err_corr[i] += abs(y - self.correct_loss(k, phi))
        self.count[i] += 1
        self.loss[i].update(phi, y)

    def correct_scale(self, raw: float) -> float:
        return self.scale.predict(torch.tensor([1.0, raw])) if self.enabled else raw

    def learn_scale(self, raw: float, y: float) -> None:
        self.scale.update(torch.tensor([1.0, raw]), y)

    def effect(self) -> list[dict]:
        """Per horizon: mean |error| (noise units) without and with the correction."""
        return [{"k": i + 1, "n": n, "mae_rssm": r / n if n else None, "mae_corrected": c / n if n else None}
                for i, (r, c, n) in enumerate(zip(self.abs_err_raw, self.abs_err_corr, self.count))]

    def state_dict(self) -> dict:
        return {"loss": [r.state_dict() for r in self.loss], "scale": self.scale.state_dict(),
                "abs_err_raw": list(self.abs_err_raw), "abs_err_corr": list(self.abs_err_corr),
                "count": list(self.count)}

    def load_state_dict(self, sd: dict) -> None:
        for r, s in zip(self.loss, sd["loss"]):
            r.load_state_dict(s)
        self.scale.load_state_dict(sd["scale"])
        self.abs_err_raw, self.abs_err_corr, self.count = list(sd["abs_err_raw"]), list(sd["abs_err_corr"]), list(sd["count"])
