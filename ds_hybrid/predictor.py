"""The first predictor: the Adam direction from the optimizer state, a learned
step scale, a linear loss trend, and a confidence built from measured evidence.

Everything here is a function of scalars that every rank shares (all-reduced by
the engine before they arrive), so all ranks compute the same predictions.

What it learns, and from what:

* **Step scale** (how far a Predict step goes along the frozen Adam direction):
  on every real step the engine compares the Adam direction before the step
  ``d_old`` with the one after it ``d_new``; the projection
  ``<d_new, d_old> / |d_old|^2`` is how much of the old direction the next real
  step keeps. Its running mean, times ``predictor.step_scale``, is the scale.
* **Predicted loss**: a least-squares line through the last ``loss_window``
  real-step losses, extrapolated to the step being predicted, or the window's
  mean where the line rises (a Predict run is not expected to raise the loss);
  the spread of the residuals is the noise band used by verification.
* **Confidence**: the running cosine between consecutive real Adam directions
  (a direction that keeps turning cannot be extrapolated) times the share of
  verified Predict steps accepted so far, ``(accepted + 1) / (accepted + rejected + 1)``.
  It is 0 until real steps have been measured. (``direction: gradient``: the accepted share
  alone, once three real-step losses are in.)

With ``predictor.direction: drift`` the same sums compare each real update (per unit
LR) with the velocity, the running average of the updates before it: the projection
is how much of the velocity the next real step keeps, and it replaces the cosine in
the confidence (a single update is mostly oscillation around the drift).
"""
from __future__ import annotations

import math
from collections import deque

from .config import DivergenceConfig, HybridPredictConfig


class AdamDirectionPredictor:
    """Scale, loss and confidence for Predict steps along the Adam direction."""

    def __init__(self, cfg: HybridPredictConfig):
        self.cfg = cfg
        self.pcfg = cfg.predictor
        self.losses: deque[tuple[int, float]] = deque(maxlen=self.pcfg.loss_window)
        self.proj_ema: float | None = None
        self.cos_ema: float | None = None
        self.accepted = 0
        self.rejected = 0
        # (step, predicted loss, observed loss, phase) of Predict and Correct steps.
        self.loss_log: list[tuple[int, float, float, str]] = []
        # (step, projection, cosine) measured on Correct steps: predicted vs actual update.
        self.update_log: list[tuple[int, float, float]] = []

    # -- learning from real steps -------------------------------------------
    def observe_real_step(self, step: int, loss: float, dot: float, old_sq: float, new_sq: float,
                          correct: bool = False) -> None:
        """Record a real step's shared loss and the direction comparison sums."""
        if math.isfinite(loss):
            self.losses.append((step, loss))
        if old_sq > 0 and new_sq > 0 and math.isfinite(dot):
            proj = dot / old_sq
            cos = dot / math.sqrt(old_sq * new_sq)
            a = self.pcfg.scale_ema
            self.proj_ema = proj if self.proj_ema is None else a * self.proj_ema + (1 - a) * proj
            self.cos_ema = cos if self.cos_ema is None else a * self.cos_ema + (1 - a) * cos
            if correct:
                self.update_log.append((step, proj, cos))

    def record_verification(self, step: int, predicted: float, observed: float, phase: str,
                            accepted: bool | None) -> None:
        """A Predict step's verified loss (accepted / rejected) or a Correct step's loss."""
        self.loss_log.append((step, predicted, observed, phase))
        if accepted is True:
            self.accepted += 1
        elif accepted is False:
            self.rejected += 1

    # -- predictions -----------------------------------------------------------
    def ready(self) -> bool:
        if self.pcfg.direction == "gradient":   # Adam's own step: no direction statistics to wait for
            return len(self.losses) >= 3
        return self.proj_ema is not None and len(self.losses) >= 3

    def step_scale(self) -> float:
        """How far along the Adam direction a Predict step goes (times the LR)."""
        if self.proj_ema is None:
            return 0.0
        return min(max(self.pcfg.step_scale * self.proj_ema, 0.0), self.pcfg.max_step_scale)

    def _trend(self) -> tuple[float, float, float, int]:
        """Least-squares line through recent real-step losses: (slope, intercept, residual std, last step)."""
        xs = [s for s, _ in self.losses]
        ys = [v for _, v in self.losses]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
        intercept = my - slope * mx
        resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
        std = math.sqrt(sum(r * r for r in resid) / max(n - 2, 1))
        return slope, intercept, std, xs[-1]

    def predict_loss(self, step: int, difficulty: float | None = None) -> tuple[float, float]:
        """Expected loss at ``step`` and its noise std. The trend is not allowed to
        rise: a Predict step is meant to make progress."""
        if not self.losses:
            return float("nan"), float("nan")
        if len(self.losses) < 3:
            return self.losses[-1][1], float("nan")
        slope, intercept, std, _ = self._trend()
        if slope >= 0.0:
            # Held flat, the least-squares line is the window's mean. (Clamping the slope alone
            # left the fitted intercept, the line's value at step 0: on a rising window that sat
            # far below every recent loss and rejected whatever came next.)
            return sum(v for _, v in self.losses) / len(self.losses), std
        return intercept + slope * step, std

    def accept(self, observed: float, step: int, div: DivergenceConfig, difficulty: float | None = None,
               progress: float | None = None) -> tuple[bool, float]:
        """Verification: is the observed loss inside the accepted band? Returns (ok, predicted).
        (This predictor ignores the batch difficulty and the measured progress.)"""
        predicted, std = self.predict_loss(step)
        if not math.isfinite(observed):
            return False, predicted
        level = self.losses[-1][1] if self.losses else observed
        if observed > div.max_loss_ratio * level:
            return False, predicted
        band = abs(predicted) * div.rel_tolerance
        if math.isfinite(std):
            band = max(band, div.z_threshold * std)
        return observed <= predicted + band, predicted

    def confidence(self) -> float:
        if not self.ready():
            return 0.0
        evidence = (self.accepted + 1) / (self.accepted + self.rejected + 1)
        if self.pcfg.direction == "gradient":
            # The step is Adam's with its own gradient: whether it can be trusted is what the
            # checks of its runs say, not how far one real step's direction carries into the next.
            return evidence
        if self.pcfg.direction in ("drift", "none"):
            # A single real update is mostly oscillation around the drift (a low cosine with
            # it by nature); what matters is whether the next step keeps going that way: the
            # running projection of each real update on the velocity (1: all of it).
            return min(max(self.proj_ema, 0.0), 1.0) * evidence
        return max(self.cos_ema, 0.0) * evidence

    def horizon(self, confidence: float) -> int:
        """Predict-run length: from min to max as confidence goes from threshold to 1."""
        c = self.cfg
        thr = c.confidence_threshold
        frac = 1.0 if thr >= 1.0 else min(max((confidence - thr) / (1.0 - thr), 0.0), 1.0)
        return c.min_predict_steps + int(round(frac * (c.max_predict_steps - c.min_predict_steps)))

    # -- the engine's predictor interface (shared with dynamics.RSSMPredictor) ----
    def observe(self, obs) -> None:
        """One step's ``dynamics.encoder.Observation``: real steps teach the scale and trend."""
        if obs.phase == "predict" or obs.loss is None:
            return
        dot = old_sq = new_sq = 0.0
        for row in obs.groups or []:
            dot, old_sq, new_sq = dot + row[0], old_sq + row[1], new_sq + row[2]
        self.observe_real_step(obs.step, obs.loss, dot, old_sq, new_sq, correct=obs.phase == "correct")

    def step_scales(self, num_groups: int, index: int) -> list[float]:
        """One scale for every layer group."""
        return [self.step_scale()] * num_groups

    def decide(self) -> tuple[bool, int]:
        """Predict when ready and confident, for a run that grows with the confidence."""
        conf = self.confidence()
        if self.ready() and conf >= self.cfg.confidence_threshold and conf > 0:
            return True, self.horizon(conf)
        return False, 0

    def statistics(self) -> dict:
        return {}

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"type": "adam_direction", "losses": list(self.losses), "proj_ema": self.proj_ema, "cos_ema": self.cos_ema,
                "accepted": self.accepted, "rejected": self.rejected,
                "loss_log": list(self.loss_log), "update_log": list(self.update_log)}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("type", "adam_direction") != "adam_direction":
            raise ValueError("predictor state is not an adam_direction predictor's "
                             "(hybrid_predict.predictor.type changed?)")
        self.losses = deque((tuple(x) for x in sd["losses"]), maxlen=self.pcfg.loss_window)
        self.proj_ema, self.cos_ema = sd["proj_ema"], sd["cos_ema"]
        self.accepted, self.rejected = sd["accepted"], sd["rejected"]
        self.loss_log = [tuple(x) for x in sd["loss_log"]]
        self.update_log = [tuple(x) for x in sd["update_log"]]
