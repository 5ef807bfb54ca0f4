"""The gradient noise scale, and what a gradient Predict step from a share of the batch is worth.

A gradient Predict step from a share ``f`` of its batch (``predictor.gradient_batch_fraction``)
costs about ``f`` of a real step's forwards and backwards and none of its optimizer step; what
it is worth depends on how noisy a gradient from ``f B`` samples is. McCandlish et al., "An
Empirical Model of Large-Batch Training" (2018): the steps to a loss scale as
``S_min (1 + B_noise / B)``, ``B_noise = tr(Sigma) / |G|^2`` the gradient noise scale, so a step
from ``b`` samples is worth ``(1 + B_noise / B) / (1 + B_noise / b)`` of one from ``B``. Both
terms come from the squared norms of gradients at two batch sizes (their appendix A.1):

    E |g_b|^2 = |G|^2 + tr(Sigma) / b

which the engine has for free: the real step's gradient norm (DeepSpeed's, ``B`` samples) and
the share step's (``b``). The norms fall as training goes on and the two kinds of step come at
different rates (1 and 7 in 8, say), so each share step is paired with the real step just
before it, the pair gives the two unbiased estimates, and each estimate is averaged over the
pairs (as the paper's own estimator averages them, not the norms). Every value fed here is the
same on every rank (all-reduced norms), so the estimate is too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class _Mean:
    """An exponential mean over the values seen, debiased as Adam's moments are."""

    decay: float
    value: float = 0.0
    weight: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.value = self.decay * self.value + (1.0 - self.decay) * x
        self.weight = self.decay * self.weight + (1.0 - self.decay)
        self.n += 1

    def get(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


class NoiseScale:
    """``B_noise`` from gradient Predict steps' squared norms (``small`` samples), each paired with
    the last real step's (``big`` samples) at most ``max_age`` optimizer steps before it; the
    pairs' estimates are averaged over about the last ``1 / (1 - decay)`` pairs."""

    def __init__(self, decay: float = 0.98, max_age: int = 64):
        self.decay, self.max_age = decay, max_age
        self.big: int | None = None     # sequences in a real step's gradient
        self.small: int | None = None   # ... in a share step's
        self._last: tuple[float, int] | None = None   # the last real step's squared norm and step
        self._true_sq = _Mean(decay)   # |G|^2, over the last pairs
        self._trace = _Mean(decay)     # tr(Sigma)
        self._run = [0.0, 0.0]         # ... both summed over every pair since the start (or a restart)
        self.real_observed = 0

    def observe(self, sq_norm: float, samples: int, real: bool, step: int) -> None:
        """Optimizer step ``step``'s squared gradient norm (the gradient of the mean loss over
        ``samples`` sequences, before clipping). A change of either batch size starts over."""
        if not (0.0 <= sq_norm < float("inf")) or samples <= 0:
            return
        if real:
            if samples != self.big:
                self._restart(big=samples)
            self._last = (sq_norm, step)
            self.real_observed += 1
            return
        if samples != self.small:
            self._restart(small=samples)
        if self._last is None or step - self._last[1] > self.max_age or self.big is None or samples >= self.big:
            return
        big_sq, b, B = self._last[0], float(samples), float(self.big)
        true_sq, trace = (B * big_sq - b * sq_norm) / (B - b), (sq_norm - big_sq) / (1.0 / b - 1.0 / B)
        self._true_sq.add(true_sq)
        self._trace.add(trace)
        self._run[0] += true_sq
        self._run[1] += trace

    def _restart(self, big: int | None = None, small: int | None = None) -> None:
        if big is not None:
            self.big, self._last = big, None
        if small is not None:
            self.small = small
        self._true_sq, self._trace, self._run = _Mean(self.decay), _Mean(self.decay), [0.0, 0.0]

    @property
    def pairs(self) -> int:
        return self._trace.n

    def b_noise(self, run: bool = False) -> float | None:
        """``tr(Sigma) / |G|^2`` in sequences, over the last pairs (``run``: over every pair, the
        steadier figure; the noise scale grows as the loss falls); None before a pair, or where the
        noise swamps the signal (``|G|^2`` estimated at or below 0: a share step is then worth
        about its share)."""
        if not self.pairs:
            return None
        true_sq, trace = self._run if run else (self._true_sq.get(), self._trace.get())
        if true_sq <= 0.0:
            return None
        return max(trace, 0.0) / true_sq

    def share_worth(self, run: bool = False) -> float | None:
        """What one step from ``small`` samples is worth in steps from ``big``: ``(1 + x) / (1 + x / f)``
        with ``x = B_noise / big`` and ``f = small / big``; ``f`` where the noise swamps the signal."""
        if not self.pairs:
            return None
        f = self.small / self.big
        b_noise = self.b_noise(run)
        if b_noise is None:
            return f
        x = b_noise / self.big
        return (1.0 + x) / (1.0 + x / f)

    def expected_share_sq(self) -> float | None:
        """The squared norm a share step's gradient is expected to have now: the last real step's plus
        ``tr(Sigma) (1 / small - 1 / big)`` (the relation above, with the pairs' trace), known before
        its backward. What a clip must use where the update cannot wait for the gradient's own norm (an
        update applied as the backward produces each parameter's gradient; ``grad_step_study.py
        --predict-clip expected``). None before a pair or once the last real step is too old."""
        if not self.pairs or self._last is None:
            return None
        trace = max(self._trace.get(), 0.0)
        return self._last[0] + trace * (1.0 / self.small - 1.0 / self.big)

    def state_dict(self) -> dict:
        """Everything ``observe`` has gathered, so a resumed run's estimate goes on from the same
        pairs (it travels in the engine's ``hybrid_state_dict``)."""
        return {"decay": self.decay, "max_age": self.max_age, "big": self.big, "small": self.small,
                "last": None if self._last is None else list(self._last), "true_sq": asdict(self._true_sq),
                "trace": asdict(self._trace), "run": list(self._run), "real_observed": self.real_observed}

    def load_state_dict(self, sd: dict) -> None:
        self.decay, self.max_age, self.big, self.small = sd["decay"], sd["max_age"], sd["big"], sd["small"]
        self._last = None if sd["last"] is None else (float(sd["last"][0]), int(sd["last"][1]))
        self._true_sq, self._trace = _Mean(**sd["true_sq"]), _Mean(**sd["trace"])
        self._run, self.real_observed = [float(x) for x in sd["run"]], int(sd["real_observed"])

    def summary(self) -> dict:
        return {"b_noise_samples": self.b_noise(), "share_worth": self.share_worth(),
                "run_b_noise_samples": self.b_noise(run=True), "run_share_worth": self.share_worth(run=True),
                "batch_samples": self.big, "share_samples": self.small, "real_observed": self.real_observed,
                "pairs": self.pairs}
