"""The 64-feature encoding of the training state, normalised online.

One ``Observation`` per optimizer step (values every rank shares: all-reduced
losses and sums) goes into ``StateEncoder.observe``; ``encode()`` returns a
float32 tensor of 64 features, each standardised by running statistics (no raw
magnitudes reach the model). The window statistics (features 0-38) are a pure tensor
function of fixed-size histories (``dynamics.window.window_features``) so a GPU kernel can
replace it (``kernels/encoder.cu``, through ``kernels.window_features``).

Feature table (index: meaning; "loss" = observed mean loss of real and
verified steps; windows count observations, not steps):

| idx   | feature |
|-------|---------|
| 0     | last loss |
| 1-4   | mean loss over the last 4 / 8 / 16 / 32 |
| 5-8   | std of loss over the last 4 / 8 / 16 / 32 |
| 9-10  | min / max loss over the last 32 |
| 11-13 | least-squares slope of loss over the last 8 / 16 / 32 |
| 14-15 | curvature (quadratic coefficient) of loss over the last 16 / 32 |
| 16    | log gradient norm, last real step |
| 17-18 | mean log gradient norm over the last 8 / 32 real steps |
| 19    | std of log gradient norm over the last 8 |
| 20    | slope of log gradient norm over the last 16 |
| 21    | last log gradient norm minus its 32-step mean (explosion / vanishing) |
| 22    | log update norm, last step (lr x scale x Adam direction norm) |
| 23    | mean log update norm over the last 8 |
| 24    | last log update norm minus its 8-step mean |
| 25-27 | cosine between consecutive Adam directions: last, mean of 8, min of 8 |
| 28-30 | projection of the new Adam direction on the old: last, mean of 8, std of 8 |
| 31-32 | relative absolute loss-prediction error: last, mean of 8 |
| 33    | mean signed relative loss-prediction error over 8 (bias) |
| 34    | share of the last 8 verifications accepted |
| 35    | loss noise-to-signal: residual std of the 16-step line / mean loss |
| 36    | share of loss increases among the last 16 changes |
| 37    | sign-change rate of loss changes over the last 16 (oscillation) |
| 38    | z-score of the last loss against the 16-step mean and std |
| 39    | log parameter norm |
| 40    | log (update norm / parameter norm) |
| 41-42 | log mean abs Adam first moment, log mean sqrt second moment |
| 43    | log (mean abs m / mean sqrt v): the moments' signal-to-noise |
| 44-45 | change of features 41 and 42 since the previous probed step |
| 46-47 | min / max cosine over layer groups (last probe) |
| 48-49 | min / max projection over layer groups (last probe) |
| 50    | log learning rate |
| 51    | learning rate / largest learning rate seen |
| 52    | change of log learning rate since the previous step |
| 53    | schedule position: step / planned total steps (0 when unknown) |
| 54    | log(1 + step) |
| 55-58 | phase one-hot: warmup, full, predict, correct |
| 59    | steps since the last real gradient |
| 60    | index of the step in its Predict run |
| 61    | length of the current Predict run |
| 62    | step scale applied by the last Predict step |
| 63    | progress per predicted step (probe-loss decrease), running mean |
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .. import kernels
from .window import (CH_ACC, CH_COS, CH_ERR, CH_GRAD, CH_LOSS, CH_PROJ, CH_SERR, CH_UPD, NUM_CHANNELS,
                     NUM_WINDOW_FEATURES, WINDOW)

NUM_FEATURES = 64
PHASES = ("warmup", "full", "predict", "correct")


@dataclass
class Observation:
    """What the engine saw in one optimizer step (shared by all ranks)."""

    step: int
    phase: str
    loss: float | None = None            # observed mean loss; None for an unverified Predict step
    lr: float = 0.0
    grad_norm: float | None = None       # global gradient norm of a real step, when DeepSpeed computed it
    groups: list[list[float]] | None = None  # per layer group zero_access.DIRECTION_STATS sums (real steps)
    step_scale: float = 0.0              # Predict: mean scale applied
    predicted_loss: float | None = None  # the prediction this step's loss was checked against
    accepted: bool | None = None         # Predict: verification outcome
    rolled_back: int = 0                 # Predict: steps this step's rejection undid
    horizon: int = 0                     # Predict: length of the run this step belongs to
    predict_index: int = 0               # Predict: index of this step in its run
    total_steps: int = 0                 # planned optimizer steps (schedule position), 0 if unknown
    progress: float | None = None        # probe-loss decrease per predicted step, at the end of a run
    batch_difficulty: float | None = None  # optional cheap statistic of the batch (see dynamics.batchstats)

    def as_dict(self) -> dict:
        return asdict(self)


def _right_aligned(values: Sequence[float], width: int = WINDOW) -> list[float]:
    vals = list(values)[-width:]
    return [0.0] * (width - len(vals)) + vals


class RunningNorm:
    """Per-feature running mean and variance (Welford, then exponential once ``n``
    passes ``horizon`` so the statistics follow a drifting run)."""

    def __init__(self, dim: int, horizon: int = 500, clip: float = 5.0):
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64)
        self.m2 = torch.zeros(dim, dtype=torch.float64)
        self.horizon, self.clip = horizon, clip

    def update(self, x: torch.Tensor) -> None:
        x = x.double()
        self.n += 1
        rate = 1.0 / min(self.n, self.horizon)
        delta = x - self.mean
        self.mean += rate * delta
        self.m2 = (1 - rate) * self.m2 + rate * delta * (x - self.mean) if self.n > 1 else torch.zeros_like(self.m2)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        std = self.m2.clamp_min(0).sqrt()
        z = torch.where(std > 1e-12, (x.double() - self.mean) / std.clamp_min(1e-12), torch.zeros_like(self.mean))
        return z.clamp(-self.clip, self.clip).float()

    def state_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean.clone(), "m2": self.m2.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.mean, self.m2 = sd["n"], sd["mean"].clone().double(), sd["m2"].clone().double()


def _log(x: float) -> float:
    return math.log(max(x, 1e-30))


@dataclass
class _Scalars:
    param_norm: float = 0.0
    update_norm: float = 0.0
    dir_norm: float = 0.0
    m_abs: float = 0.0
    v_sqrt: float = 0.0
    d_m: float = 0.0
    d_v: float = 0.0
    cos_min: float = 0.0
    cos_max: float = 0.0
    proj_min: float = 0.0
    proj_max: float = 0.0
    lr_max: float = 0.0
    dlog_lr: float = 0.0
    last_lr: float = 0.0
    since_real: int = 0
    progress: float = 0.0
    progress_n: int = 0


class StateEncoder:
    """Keeps the histories and running statistics; ``encode()`` gives the normalised 64 features."""

    def __init__(self, norm_horizon: int = 500, backend: str = "torch", device: torch.device | str = "cpu"):
        self.backend = backend  # hybrid_predict.kernels: the window features' kernel or torch
        self.device = torch.device(device)  # where the window features are computed (dynamics.device)
        self.hist = {c: deque(maxlen=WINDOW) for c in range(NUM_CHANNELS)}
        self.s = _Scalars()
        self.last_obs: Observation | None = None
        self.norm = RunningNorm(NUM_FEATURES, norm_horizon)
        self._raw: torch.Tensor = torch.zeros(NUM_FEATURES, dtype=torch.float64)

    # ------------------------------------------------------------------ input
    def observe(self, obs: Observation) -> torch.Tensor:
        """Fold one step in, update the normaliser; returns the normalised features."""
        s, h = self.s, self.hist
        if obs.loss is not None and math.isfinite(obs.loss):
            if obs.predicted_loss is not None and math.isfinite(obs.predicted_loss):
                rel = (obs.loss - obs.predicted_loss) / max(abs(obs.predicted_loss), 1e-8)
                h[CH_ERR].append(abs(rel))
                h[CH_SERR].append(rel)
            h[CH_LOSS].append(obs.loss)
        if obs.accepted is not None:
            h[CH_ACC].append(1.0 if obs.accepted else 0.0)
        if obs.grad_norm is not None and math.isfinite(obs.grad_norm) and obs.grad_norm > 0:
            h[CH_GRAD].append(_log(obs.grad_norm))
        real = obs.phase != "predict"
        s.since_real = 0 if real else s.since_real + 1
        if obs.groups:
            self._fold_groups(obs)
        elif obs.phase == "predict" and s.dir_norm > 0 and obs.step_scale > 0:
            # A Predict step moves along the last probed direction: its norm is known.
            s.update_norm = obs.step_scale * obs.lr * s.dir_norm
            h[CH_UPD].append(_log(s.update_norm))
        if obs.lr > 0:
            s.dlog_lr = _log(obs.lr) - _log(s.last_lr) if s.last_lr > 0 else 0.0
            s.last_lr = obs.lr
            s.lr_max = max(s.lr_max, obs.lr)
        if obs.progress is not None and math.isfinite(obs.progress):
            s.progress_n += 1
            s.progress += (obs.progress - s.progress) / min(s.progress_n, 20)
        self.last_obs = obs
        self._raw = self.raw_features()
        self.norm.update(self._raw)
        return self.norm.normalise(self._raw)

    def _fold_groups(self, obs: Observation) -> None:
        s, h = self.s, self.hist
        g = torch.tensor(obs.groups, dtype=torch.float64)
        dot, old, new, msq, mabs, vsq, n = g.sum(0).tolist()
        if old > 0 and new > 0:
            h[CH_COS].append(dot / math.sqrt(old * new))
            h[CH_PROJ].append(dot / old)
            valid = (g[:, 1] > 0) & (g[:, 2] > 0)
            cos = g[valid, 0] / (g[valid, 1] * g[valid, 2]).sqrt()
            proj = g[valid, 0] / g[valid, 1]
            s.cos_min, s.cos_max = float(cos.min()), float(cos.max())
            s.proj_min, s.proj_max = float(proj.min()), float(proj.max())
            s.dir_norm = math.sqrt(new)
            s.update_norm = obs.lr * s.dir_norm
            h[CH_UPD].append(_log(max(s.update_norm, 1e-30)))
        if n > 0:
            s.param_norm = math.sqrt(msq)
            m_abs, v_sqrt = mabs / n, vsq / n
            if s.m_abs > 0 and m_abs > 0:
                s.d_m, s.d_v = _log(m_abs) - _log(s.m_abs), _log(v_sqrt) - _log(s.v_sqrt)
            s.m_abs, s.v_sqrt = m_abs, v_sqrt

    # ------------------------------------------------------------------ output
    def histories(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The right-aligned ``[NUM_CHANNELS, WINDOW]`` histories and their valid counts."""
        hist = torch.tensor([_right_aligned(self.hist[c]) for c in range(NUM_CHANNELS)], dtype=torch.float64)
        counts = torch.tensor([len(self.hist[c]) for c in range(NUM_CHANNELS)], dtype=torch.int32)
        return hist, counts

    def scalar_features(self) -> torch.Tensor:
        s, o = self.s, self.last_obs
        f = torch.zeros(NUM_FEATURES - NUM_WINDOW_FEATURES, dtype=torch.float64)
        if s.param_norm > 0:
            f[0] = _log(s.param_norm)
            f[1] = _log(s.update_norm) - _log(s.param_norm) if s.update_norm > 0 else 0.0
        if s.m_abs > 0 and s.v_sqrt > 0:
            f[2], f[3] = _log(s.m_abs), _log(s.v_sqrt)
            f[4] = f[2] - f[3]
        f[5], f[6] = s.d_m, s.d_v
        f[7], f[8], f[9], f[10] = s.cos_min, s.cos_max, s.proj_min, s.proj_max
        if o is not None:
            if o.lr > 0:
                f[11] = _log(o.lr)
                f[12] = o.lr / s.lr_max
            f[13] = s.dlog_lr
            f[14] = o.step / o.total_steps if o.total_steps > 0 else 0.0
            f[15] = math.log1p(max(o.step, 0))
            if o.phase in PHASES:
                f[16 + PHASES.index(o.phase)] = 1.0
            f[20] = s.since_real
            f[21] = o.predict_index if o.phase == "predict" else 0
            f[22] = o.horizon if o.phase == "predict" else 0
            f[23] = o.step_scale if o.phase == "predict" else 0.0
        f[24] = s.progress
        return f

    def raw_features(self) -> torch.Tensor:
        """The 64 unnormalised features (float64)."""
        hist, counts = self.histories()
        if self.device.type != "cpu":
            hist, counts = hist.to(self.device, non_blocking=True), counts.to(self.device, non_blocking=True)
        return torch.cat([kernels.window_features(hist, counts, backend=self.backend).double().cpu(),
                          self.scalar_features()])

    def encode(self) -> torch.Tensor:
        """The current normalised 64 features (float32)."""
        return self.norm.normalise(self._raw)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"hist": {c: list(v) for c, v in self.hist.items()}, "scalars": asdict(self.s),
                "last_obs": None if self.last_obs is None else self.last_obs.as_dict(),
                "norm": self.norm.state_dict(), "raw": self._raw.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.hist = {int(c): deque(v, maxlen=WINDOW) for c, v in sd["hist"].items()}
        self.s = _Scalars(**sd["scalars"])
        self.last_obs = None if sd["last_obs"] is None else Observation(**sd["last_obs"])
        self.norm.load_state_dict(sd["norm"])
        self._raw = sd["raw"].clone()
