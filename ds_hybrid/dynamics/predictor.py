"""``RSSMPredictor``: the dynamics model behind the engine's predictor interface.

Per optimizer step the engine calls ``observe(Observation)``; at a decision
``decide()``; in a Predict step ``step_scales()`` and, when it verifies,
``accept()``. Everything it reads is shared by all ranks (all-reduced by the
engine), and its own randomness is seeded, so every rank computes the same
decisions.

How the parts fit:

* the **encoder** turns the observation history into 64 normalised features;
* the **loss base** is a damped linear (Holt) forecast of the loss; the RSSM's
  loss head forecasts the residual of that base k = 1..K steps ahead, in units
  of the base's innovation scale, as a Gaussian per member;
* the **corrector** regresses the remaining residual on the RSSM mean, naive
  forecasts and the batch difficulty;
* the **confidence** is the calibrated acceptance frequency of the bin of
  (disagreement + recent error) / band; the **bandit** picks the run length;
* the **divergence monitor** shortens, forces Full or rolls back;
* **how far**: per layer group, the running projection and cosine of the next
  real Adam direction on the previous one (measured on real steps), times the
  RSSM's imagined scale for the j-th step of the run, times ``kappa``, a
  multiplier raised when measured progress per predicted step is positive and
  cut when it is not.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from collections import deque

import torch

from .. import kernels
from ..config import ConfigError, DivergenceConfig, HybridPredictConfig
from .bandit import LinUCBHorizon, horizon_arms, run_reward
from .calibration import ConfidenceCalibrator
from .corrector import LOSS_INPUTS, ResidualCorrector
from .divergence import DivergenceMonitor, Level
from .encoder import Observation, StateEncoder
from .rssm import ACTION_DIM, RSSMEnsemble, RSSMShape, sequence_loss
from .window import CH_LOSS

# Encoded features the bandit sees (indices into the 64; see encoder.py's table).
BANDIT_FEATURES = (13, 35, 37, 26, 29, 32, 34, 51)
BANDIT_DIM = 2 + len(BANDIT_FEATURES)  # + bias + confidence


class LossBase:
    """Damped Holt forecast of the loss (level + k * trend), its innovation scale, and
    the naive forecasts the corrector and the evaluation compare against."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.1, ema: float = 0.1, trend_window: int = 16):
        self.alpha, self.beta, self.ema_rate, self.trend_window = alpha, beta, ema, trend_window
        self.level: float | None = None
        self.trend = 0.0
        self.scale: float | None = None
        self.ema: float | None = None
        self.last_step = 0
        self.recent: deque[tuple[int, float]] = deque(maxlen=trend_window)

    def forecast(self, k: float) -> float:
        return (self.level if self.level is not None else float("nan")) + k * self.trend

    def update(self, step: int, loss: float) -> None:
        if self.level is None:
            self.level, self.ema = loss, loss
            self.scale = max(abs(loss) * 0.01, 1e-6)
        else:
            gap = max(step - self.last_step, 1)
            innov = loss - self.forecast(gap)
            self.level = self.level + gap * self.trend + self.alpha * innov
            self.trend += self.alpha * self.beta * innov / gap
            self.scale = math.sqrt(0.95 * self.scale ** 2 + 0.05 * innov ** 2)
            self.ema += self.ema_rate * (loss - self.ema)
        self.last_step = step
        self.recent.append((step, loss))

    def ols(self, target_step: int) -> float:
        """Least-squares line through the recent losses, at ``target_step``."""
        xs = [s for s, _ in self.recent]
        ys = [v for _, v in self.recent]
        n = len(xs)
        if n < 3:
            return ys[-1] if ys else float("nan")
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        return my + slope * (target_step - mx)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("level", "trend", "scale", "ema", "last_step")} | \
            {"recent": list(self.recent)}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("level", "trend", "scale", "ema", "last_step"):
            setattr(self, k, sd[k])
        self.recent = deque((tuple(r) for r in sd["recent"]), maxlen=self.trend_window)


@contextlib.contextmanager
def single_thread():
    """Run the predictor's small tensor ops on one thread. Its matrices are tiny, and an
    intra-op thread pool that competes with the training step's threads (or another
    process) made a training round 80x slower in a measurement on 2 cores."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def predictor_device(setting: str) -> torch.device:
    """The device of ``hybrid_predict.dynamics.device`` on this rank (its current GPU for cuda)."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("hybrid_predict.dynamics.device is 'cuda' but torch sees no CUDA device here "
                          "(set it to 'cpu' or 'auto')")
    return torch.device("cuda", torch.cuda.current_device())


class RSSMPredictor:
    """Predict decisions, loss forecasts and step scales from the dynamics model."""

    def __init__(self, cfg: HybridPredictConfig):
        self.cfg, self.d = cfg, cfg.dynamics
        d = self.d
        self.shape = RSSMShape(deter=d.deter, stoch=d.stoch, members=d.ensemble_size, horizon=d.horizon)
        self.device = predictor_device(d.device)
        # Initialised on the CPU (the same numbers on every device), then moved.
        self.model = RSSMEnsemble(self.shape, seed=d.seed).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=d.lr)
        # Window sampling and the training noise draw from this CPU generator on any device,
        # so a GPU predictor sees the same windows and noise as a CPU one.
        self.gen = torch.Generator().manual_seed(d.seed + 17)
        # On the CPU the kernels cannot apply, and 'cupy' means "where they can", i.e. auto;
        # on a GPU (dynamics.device) 'cupy' insists on them.
        self._backend = cfg.kernels if self.device.type == "cuda" else (
            "torch" if cfg.kernels == "torch" else "auto")
        self.encoder = StateEncoder(backend=self._backend, device=self.device)
        self.base = LossBase()
        self.corrector = ResidualCorrector(d.horizon, enabled=d.corrector)
        self.calib = ConfidenceCalibrator(d.calibration_bins)
        self.bandit = LinUCBHorizon(horizon_arms(cfg.max_predict_steps, cfg.min_predict_steps), BANDIT_DIM,
                                    alpha=d.bandit_alpha)
        dv = cfg.divergence
        self.monitor = DivergenceMonitor(z_warn=dv.z_threshold, z_rollback=2 * dv.z_threshold)
        # Replay rows: features, action, loss (nan if unobserved), base level/trend/scale, projection, step.
        self.replay: deque[dict] = deque(maxlen=d.replay)
        self.h, self.z = self.model.initial(1)
        self.heads: dict | None = None          # the model's heads at the filtered state
        self.pending: deque[tuple[int, int, list]] = deque()  # (target step, k, phi) awaiting a loss
        self.errors: deque[float] = deque(maxlen=8)           # |loss - 1-step forecast| (loss units)
        self.group_proj: list[float] | None = None
        self.group_cos: list[float] | None = None
        self.kappa = 1.0
        self.progress: deque[float] = deque(maxlen=256)
        self.real_seen = 0
        self.trained_rounds = 0
        self.last_train_loss: dict = {}
        self.seconds = {"observe": 0.0, "train": 0.0, "decide": 0.0}
        self.calls = 0
        # Decision and run bookkeeping.
        self.decisions = 0
        self.since_explore = 0
        self.run: dict | None = None
        self.run_scales: list[float] = []
        self.accepted = self.rejected = 0
        self.explored = 0
        self.loss_log: list[tuple[int, float, float, str]] = []
        self.update_log: list[tuple[int, float, float]] = []
        self.difficulty_norm = [0, 0.0, 0.0]  # Welford of the batch difficulty (n, mean, m2)
        self.last_difficulty: float | None = None
        if d.init_from:
            self.load_pretrained(d.init_from)

    # ================================================================ observation
    def observe(self, obs: Observation) -> None:
        with single_thread():
            self._observe(obs)

    def _observe(self, obs: Observation) -> None:
        t0 = time.perf_counter()
        self.calls += 1
        x = self.encoder.observe(obs)
        lr_rel = obs.lr / self.encoder.s.lr_max if self.encoder.s.lr_max > 0 else 0.0
        a = torch.tensor([float(obs.phase == "predict"), obs.step_scale if obs.phase == "predict" else 0.0, lr_rel])
        dev = self.device
        has_loss = obs.loss is not None and math.isfinite(obs.loss)
        if obs.batch_difficulty is not None:
            self._fold_difficulty(obs.batch_difficulty)
        if has_loss:
            self._resolve_pending(obs)
        real = obs.phase != "predict"
        proj = float("nan")
        if obs.groups:
            proj = self._fold_groups(obs)
        if real and has_loss:
            std = self._forecast_std(1) if self.heads is not None else None
            pred = obs.predicted_loss
            self.monitor.check(obs.loss, pred, std, obs.grad_norm, real=True)
        elif real and obs.grad_norm is not None:
            self.monitor.check(None, None, None, obs.grad_norm, real=True)
        if has_loss:
            self.base.update(obs.step, obs.loss)
        self.replay.append({"x": x, "a": a, "loss": obs.loss if has_loss else float("nan"),
                            "level": self.base.level if self.base.level is not None else float("nan"),
                            "trend": self.base.trend, "scale": self.base.scale or float("nan"),
                            "proj": proj, "step": obs.step, "difficulty": obs.batch_difficulty})
        with torch.no_grad():
            E = self.shape.members
            # kernels.rssm_step: one launch for every member on a GPU (its prior is unused here).
            self.h = kernels.rssm_step(self.model, self.h, self.z, a.to(dev).view(1, 1, -1).expand(E, 1, -1),
                                       backend=self._backend)[0]
            qm, _ = self.model.posterior(self.h, self.model.embed(x.to(dev).view(1, 1, -1).expand(E, 1, -1)))
            self.z = qm
        if real and has_loss:
            self.real_seen += 1
        if obs.phase == "predict":
            self._track_run(obs)
        self.seconds["observe"] += time.perf_counter() - t0
        if real and has_loss and self.d.train_iters > 0 and self.real_seen % self.d.train_every == 0 \
                and len(self.replay) > self.d.window + 2:
            t1 = time.perf_counter()
            self.train(self.d.train_iters)
            self._refilter()
            self.seconds["train"] += time.perf_counter() - t1
        self._forecast(obs.step)

    def _fold_difficulty(self, v: float) -> None:
        n, mean, m2 = self.difficulty_norm
        n += 1
        delta = v - mean
        mean += delta / n
        m2 += delta * (v - mean)
        self.difficulty_norm = [n, mean, m2]

    def _difficulty_z(self, v: float | None) -> float:
        n, mean, m2 = self.difficulty_norm
        if v is None or n < 2 or m2 <= 0:
            return 0.0
        return max(min((v - mean) / math.sqrt(m2 / (n - 1)), 5.0), -5.0)

    def _fold_groups(self, obs: Observation) -> float:
        g = torch.tensor(obs.groups, dtype=torch.float64)
        valid = (g[:, 1] > 0) & (g[:, 2] > 0)
        tot = g.sum(0)
        if tot[1] <= 0 or tot[2] <= 0:
            return float("nan")
        proj_all = float(tot[0] / tot[1])
        a = self.cfg.predictor.scale_ema
        proj = torch.where(valid, g[:, 0] / g[:, 1].clamp_min(1e-30), torch.zeros(len(g), dtype=torch.float64))
        cos = torch.where(valid, g[:, 0] / (g[:, 1] * g[:, 2]).sqrt().clamp_min(1e-30),
                          torch.zeros(len(g), dtype=torch.float64))
        if self.group_proj is None:
            self.group_proj, self.group_cos = proj.tolist(), cos.tolist()
        else:
            self.group_proj = [a * o + (1 - a) * n for o, n in zip(self.group_proj, proj.tolist())]
            self.group_cos = [a * o + (1 - a) * n for o, n in zip(self.group_cos, cos.tolist())]
        if self.heads is not None:  # the scale head forecast this projection one step ago
            raw = float(self.heads["scale_mean"].mean())
            self.corrector.learn_scale(raw, proj_all)
        if obs.phase == "correct":
            self.update_log.append((obs.step, proj_all, float(tot[0] / (tot[1] * tot[2]).sqrt())))
        return proj_all

    # ================================================================ forecasts
    def _forecast(self, step: int) -> None:
        """Heads at the filtered state; queue the forecasts for the corrector to learn from."""
        with torch.no_grad():
            # [E, ...], on the CPU: read one number at a time below (one transfer, not many syncs)
            self.heads = {k: v[:, 0].cpu() for k, v in self.model.heads(self.h, self.z).items()}
        if self.base.level is None:
            return
        for k in range(1, self.shape.horizon + 1):
            self.pending.append((step + k, k, self._phi(step, k)))
        while len(self.pending) > 4 * self.shape.horizon * self.shape.horizon:
            self.pending.popleft()

    def _phi(self, step: int, k: int) -> list:
        """The corrector's inputs for the forecast made at ``step`` of the loss at ``step + k``
        (the difficulty entry is filled when that batch is known)."""
        b = self.base
        s = b.scale or 1.0
        base_k = b.forecast(k)
        mu = float(self.heads["loss_mean"][:, k - 1].mean())
        last = b.recent[-1][1] if b.recent else base_k
        return [1.0, mu, (b.ema - base_k) / s, (last - base_k) / s, (b.ols(step + k) - base_k) / s, 0.0,
                base_k, s]

    def _resolve_pending(self, obs: Observation) -> None:
        keep = deque()
        dz = self._difficulty_z(obs.batch_difficulty)
        for target, k, phi in self.pending:
            if target == obs.step:
                vec = torch.tensor(phi[:len(LOSS_INPUTS)], dtype=torch.float64)
                vec[5] = dz
                y = (obs.loss - phi[6]) / phi[7]
                self.corrector.learn_loss(k, vec, y)
                if k == 1:
                    self.errors.append(abs(obs.loss - (phi[6] + phi[7] * self.corrector.correct_loss(1, vec))))
            elif target > obs.step:
                keep.append((target, k, phi))
        self.pending = keep

    def _k_for(self, step: int) -> int:
        return min(max(step - self.base.last_step, 1), self.shape.horizon)

    def predict_loss(self, step: int, difficulty: float | None = None) -> tuple[float, float]:
        """Forecast of the loss at ``step`` (at most ``horizon`` steps after the last
        observed loss) and its std (aleatoric and ensemble spread), in loss units."""
        if self.base.level is None or self.heads is None:
            return float("nan"), float("nan")
        k = self._k_for(step)
        phi = self._phi(self.base.last_step, k)
        vec = torch.tensor(phi[:len(LOSS_INPUTS)], dtype=torch.float64)
        vec[5] = self._difficulty_z(difficulty)
        mean = phi[6] + phi[7] * self.corrector.correct_loss(k, vec)
        return mean, self._forecast_std(k)

    def _forecast_std(self, k: int) -> float:
        if self.heads is None or self.base.scale is None:
            return float("nan")
        mu = self.heads["loss_mean"][:, k - 1]
        sd = self.heads["loss_std"][:, k - 1]
        var = float((sd ** 2).mean()) + (float(mu.var(unbiased=False)) if mu.numel() > 1 else 0.0)
        return self.base.scale * math.sqrt(var)

    def disagreement(self, k: int = 1) -> float:
        if self.heads is None or self.base.scale is None or self.shape.members < 2:
            return 0.0
        return self.base.scale * float(self.heads["loss_mean"][:, k - 1].std(unbiased=False))

    # ================================================================ verification
    def _band(self, predicted: float, std: float, div: DivergenceConfig) -> float:
        band = abs(predicted) * div.rel_tolerance
        if math.isfinite(std):
            band = max(band, div.z_threshold * std)
        return band

    def accept(self, observed: float, step: int, div: DivergenceConfig, difficulty: float | None = None,
               progress: float | None = None) -> tuple[bool, float]:
        predicted, std = self.predict_loss(step, difficulty)
        level = self.monitor.check(observed, predicted, std, None, real=False)
        if not math.isfinite(observed) or level is Level.ROLLBACK:
            ok = False
        elif self.base.recent and observed > div.max_loss_ratio * self.base.recent[-1][1]:
            ok = False
        elif progress is not None and self.d.reject_negative_progress and progress < 0:
            ok = False
        else:
            ok = not math.isfinite(predicted) or observed <= predicted + self._band(predicted, std, div)
        if self.run is not None:
            # Exploratory runs teach the calibrator but stay out of the calibration table (-1).
            self.calib.record(self.run["u"], -1.0 if self.run["explore"] else self.run["confidence"], ok)
            if math.isfinite(predicted) and std > 0:
                self.run["excess"] = max(self.run["excess"], (observed - predicted) / std)
        if progress is not None and math.isfinite(progress):
            self.progress.append(progress)
            # How far to go: grow while predicted steps help on fresh data, cut when they hurt.
            self.kappa = min(self.kappa * 1.1, 2.0) if progress > 0 else max(self.kappa * 0.7, 0.05)
            if self.run is not None:
                self.run["progress"].append(progress)
        if ok:
            self.accepted += 1
        else:
            self.rejected += 1
        return ok, predicted

    def record_verification(self, step: int, predicted: float, observed: float, phase: str,
                            accepted: bool | None) -> None:
        self.loss_log.append((step, predicted, observed, phase))

    # ================================================================ decisions
    def ready(self) -> bool:
        return self.real_seen >= self.d.min_observations and self.trained_rounds > 0 and self.heads is not None

    def _raw_score(self) -> float:
        pred, std = self.predict_loss(self.base.last_step + 1)
        if not math.isfinite(pred):
            return 0.0
        band = self._band(pred, std, self.cfg.divergence)
        err = sum(self.errors) / len(self.errors) if self.errors else float("inf")
        return self.calib.raw_score(self.disagreement(1), err, band)

    def confidence(self) -> float:
        if not self.ready():
            return 0.0
        return self.calib.confidence(self._raw_score())

    def _context(self, conf: float) -> torch.Tensor:
        x = self.encoder.encode()
        return torch.cat([torch.tensor([1.0, conf]), x[list(BANDIT_FEATURES)].double()])

    def decide(self) -> tuple[bool, int]:
        """Predict now, and for how many steps? Shared inputs only."""
        t0 = time.perf_counter()
        try:
            with single_thread():
                return self._decide()
        finally:
            self.seconds["decide"] += time.perf_counter() - t0

    def _decide(self) -> tuple[bool, int]:
        if not self.ready():
            return False, 0
        self.decisions += 1
        self.since_explore += 1
        if self.monitor.last >= Level.FORCE_FULL:
            self.monitor.last = Level.OK
            return False, 0
        u = self._raw_score()
        conf = self.calib.confidence(u)
        explore = False
        if conf >= self.cfg.confidence_threshold and conf > 0:
            ctx = self._context(conf)
            horizon = self.bandit.choose(ctx)
            if self.monitor.last is Level.SHORTEN:
                horizon = max(self.cfg.min_predict_steps, horizon // 2)
        elif (self.d.explore_every and self.calib.evidence(u) < self.d.explore_evidence
              and self.since_explore >= self.d.explore_every):
            explore, horizon, ctx = True, self.cfg.min_predict_steps, None
            self.explored += 1
        else:
            return False, 0
        self.since_explore = 0
        self.monitor.last = Level.OK
        self.run = {"u": u, "confidence": conf, "explore": explore, "ctx": ctx, "horizon": horizon,
                    "steps": 0, "rolled_back": 0, "excess": 0.0, "progress": []}
        self.run_scales = self._imagined_scales(horizon)
        return True, horizon

    def _imagined_scales(self, horizon: int) -> list[float]:
        """The scale head along an imagined Predict run (prior rollout), corrected."""
        s = self.encoder.s
        lr_rel = s.last_lr / s.lr_max if s.lr_max > 0 else 0.0
        base = self.cfg.predictor.step_scale
        acts = torch.tensor([1.0, base, lr_rel], device=self.device).view(1, 1, 1, ACTION_DIM)
        acts = acts.expand(self.shape.members, 1, horizon, -1)
        out = kernels.rssm_rollout(self.model, self.h, self.z, acts.contiguous(), backend=self._backend)
        raw = out["scale_mean"][:, 0].mean(0).cpu()  # [horizon]
        return [self.corrector.correct_scale(float(r)) for r in raw]

    def step_scales(self, num_groups: int, index: int) -> list[float]:
        """Per layer group scale for the ``index``-th step of the current Predict run."""
        pc = self.cfg.predictor
        imagined = self.run_scales[min(index, len(self.run_scales) - 1)] if self.run_scales else 0.0
        glob = min(max(imagined, 0.0), 1.0)
        if self.group_proj is None:
            return [0.0] * num_groups
        total = [p for p in self.group_proj]
        mean_proj = sum(total) / len(total) if total else 0.0
        out = []
        for g in range(num_groups):
            p = self.group_proj[g] if g < len(self.group_proj) else 0.0
            c = self.group_cos[g] if g < len(self.group_cos) else 0.0
            if c < self.d.min_group_cosine or p <= 0:
                out.append(0.0)
                continue
            rel = p / mean_proj if mean_proj > 0 else 1.0
            out.append(min(pc.step_scale * self.kappa * glob * rel, pc.max_step_scale))
        return out

    def step_scale(self) -> float:
        """Mean of the per-group scales of the next Predict step (for reports)."""
        n = len(self.group_proj) if self.group_proj else 1
        s = self.step_scales(n, 0)
        return sum(s) / len(s) if s else 0.0

    def _track_run(self, obs: Observation) -> None:
        run = self.run
        if run is None:
            return
        run["steps"] += 1
        run["rolled_back"] += obs.rolled_back
        ended = obs.accepted is False or obs.predict_index + 1 >= obs.horizon
        if not ended:
            return
        if not run["explore"] and run["ctx"] is not None:
            accepted = run["steps"] - run["rolled_back"]
            prog = (sum(run["progress"]) / len(run["progress"])) if run["progress"] else None
            rho = self.predict_cost_ratio
            reward = run_reward(accepted, run["rolled_back"], rho, run["excess"], self.cfg.max_predict_steps,
                                progress=prog)
            self.bandit.update(run["horizon"], run["ctx"], reward, obs.step)
        self.run = None

    @property
    def predict_cost_ratio(self) -> float:
        """Cost of a Predict step over a Full step, from a fixed cost model (a Full step is
        about three forward passes; a Predict step runs its verification and progress
        forwards). Measured times would differ between ranks, and the bandit's choices
        must not."""
        ve, pe = self.cfg.verify_every, self.d.progress_every
        forwards = 1.0 / ve + (1.0 / (ve * pe) if pe else 0.0)
        return forwards / 3.0

    # ================================================================ training
    def _sequences(self, starts: torch.Tensor, rows: list[dict]) -> tuple:
        T, K = self.d.window, self.shape.horizon
        x = torch.stack([r["x"] for r in rows])
        a = torch.stack([r["a"] for r in rows])
        loss = torch.tensor([r["loss"] for r in rows], dtype=torch.float64)
        level = torch.tensor([r["level"] for r in rows], dtype=torch.float64)
        trend = torch.tensor([r["trend"] for r in rows], dtype=torch.float64)
        scale = torch.tensor([r["scale"] for r in rows], dtype=torch.float64)
        proj = torch.tensor([r["proj"] for r in rows], dtype=torch.float64)
        steps = torch.tensor([r["step"] for r in rows], dtype=torch.float64)
        n = len(rows)
        idx = starts.view(-1, 1) + torch.arange(T).view(1, -1)       # [N, T]
        # Loss targets: the loss observed exactly k steps later, in units of the base's scale.
        ks = torch.arange(1, K + 1, dtype=torch.float64)
        s0 = int(steps.min())
        by_step = torch.full((int(steps.max()) - s0 + K + 2,), float("nan"), dtype=torch.float64)
        by_step[(steps - s0).long()] = loss
        tgt_pos = (steps[idx] - s0).long().unsqueeze(-1) + ks.long()          # [N, T, K]
        target = by_step[tgt_pos.clamp_max(by_step.numel() - 1)]
        fc = level[idx].unsqueeze(-1) + ks * trend[idx].unsqueeze(-1)
        y = (target - fc) / scale[idx].unsqueeze(-1)
        m = torch.isfinite(y).double()
        y = torch.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)
        nxt = (idx + 1).clamp_max(n - 1)
        ys = proj[nxt]
        ms = (torch.isfinite(ys) & (idx + 1 < n)).double()
        ys = torch.nan_to_num(ys)
        dev = self.device
        return (x[idx].to(dev), a[idx].to(dev), y.float().to(dev), m.float().to(dev), ys.float().to(dev),
                ms.float().to(dev), ks)

    def train(self, iters: int) -> dict:
        """Gradient steps on random windows of the replay; each member draws its own."""
        rows = list(self.replay)
        T, E, B = self.d.window, self.shape.members, self.d.batch_windows
        if len(rows) <= T + 1:
            return {}
        info = {}
        for _ in range(iters):
            starts = torch.randint(0, len(rows) - T, (E * B,), generator=self.gen)
            x, a, y, m, ys, ms, _ = self._sequences(starts, rows)
            shape = lambda t: t.view(E, B, *t.shape[1:])  # noqa: E731
            total, info = sequence_loss(self.model, shape(x), shape(a), shape(y), shape(m), shape(ys), shape(ms),
                                        gen=self.gen)
            self.opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
            self.opt.step()
        self.trained_rounds += 1
        self.last_train_loss = info
        return info

    @torch.no_grad()
    def _refilter(self) -> None:
        """Recompute the filtered state over the last window with the new weights."""
        rows = list(self.replay)[-self.d.window:]
        x = torch.stack([r["x"] for r in rows]).view(1, 1, len(rows), -1).expand(self.shape.members, 1, -1, -1)
        a = torch.stack([r["a"] for r in rows]).view(1, 1, len(rows), -1).expand(self.shape.members, 1, -1, -1)
        out = self.model.filter(x.contiguous().to(self.device), a.contiguous().to(self.device))
        self.h, self.z = out["h_last"], out["z_last"]

    # ================================================================ reporting, state
    def statistics(self) -> dict:
        return {"calls": self.calls, "seconds": dict(self.seconds), "trained_rounds": self.trained_rounds,
                "kappa": self.kappa, "explored_runs": self.explored,
                "progress_mean": (sum(self.progress) / len(self.progress)) if self.progress else None,
                "progress_n": len(self.progress), "calibration": self.calib.table(),
                "corrector": self.corrector.effect(), "monitor": dict(self.monitor.counts),
                "monitor_reasons": dict(self.monitor.reasons), "bandit_pulls": dict(zip(self.bandit.arms, self.bandit.pulls)),
                "last_train_loss": self.last_train_loss}

    def state_dict(self) -> dict:
        return {"type": "rssm", "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "gen": self.gen.get_state(), "encoder": self.encoder.state_dict(), "base": self.base.state_dict(),
                "corrector": self.corrector.state_dict(), "calib": self.calib.state_dict(),
                "bandit": self.bandit.state_dict(), "monitor": self.monitor.state_dict(),
                "replay": list(self.replay), "h": self.h.cpu().clone(), "z": self.z.cpu().clone(),
                "heads": self.heads, "pending": list(self.pending), "errors": list(self.errors),
                "group_proj": self.group_proj, "group_cos": self.group_cos, "kappa": self.kappa,
                "progress": list(self.progress),
                "counters": {k: getattr(self, k) for k in ("real_seen", "trained_rounds", "calls", "decisions",
                                                           "since_explore", "accepted", "rejected", "explored")},
                "seconds": dict(self.seconds), "run": self.run, "run_scales": list(self.run_scales),
                "loss_log": list(self.loss_log), "update_log": list(self.update_log),
                "difficulty_norm": list(self.difficulty_norm)}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("type") != "rssm":
            raise ValueError("predictor state is not an RSSM predictor's (hybrid_predict.predictor.type changed?)")
        self.model.load_state_dict(sd["model"])
        # Optimizer.load_state_dict keeps tensors that already match (no copy): an in-process
        # restore would share Adam's moments with the source and step them twice.
        self.opt.load_state_dict(copy.deepcopy(sd["opt"]))
        self.gen.set_state(sd["gen"])
        self.encoder.load_state_dict(sd["encoder"])
        self.base.load_state_dict(sd["base"])
        self.corrector.load_state_dict(sd["corrector"])
        self.calib.load_state_dict(sd["calib"])
        self.bandit.load_state_dict(sd["bandit"])
        self.monitor.load_state_dict(sd["monitor"])
        self.replay = deque(sd["replay"], maxlen=self.d.replay)
        self.h, self.z = sd["h"].to(self.device).clone(), sd["z"].to(self.device).clone()
        self.heads = None if sd["heads"] is None else {k: v.cpu() for k, v in sd["heads"].items()}
        self.pending = deque(tuple(p) for p in sd["pending"])
        self.errors = deque(sd["errors"], maxlen=8)
        self.group_proj, self.group_cos, self.kappa = sd["group_proj"], sd["group_cos"], sd["kappa"]
        self.progress = deque(sd["progress"], maxlen=256)
        for k, v in sd["counters"].items():
            setattr(self, k, v)
        self.seconds, self.run, self.run_scales = dict(sd["seconds"]), sd["run"], list(sd["run_scales"])
        self.loss_log = [tuple(x) for x in sd["loss_log"]]
        self.update_log = [tuple(x) for x in sd["update_log"]]
        self.difficulty_norm = list(sd["difficulty_norm"])

    def load_pretrained(self, path: str) -> None:
        """Model weights (and corrector) from ``ds-hybrid dynamics-eval --save-predictor``."""
        from pathlib import Path
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"hybrid_predict.dynamics.init_from: file not found: {p}")
        sd = torch.load(p, map_location="cpu", weights_only=False)
        try:
            self.model.load_state_dict(sd["model"])
        except RuntimeError as err:
            raise ConfigError(f"hybrid_predict.dynamics.init_from: {p} does not fit this RSSM shape "
                              f"(ensemble_size/deter/stoch/horizon): {err}") from None
        if "corrector" in sd:
            self.corrector.load_state_dict(sd["corrector"])
        self.trained_rounds = max(self.trained_rounds, 1)
