"""``PredictiveEngine``: DeepSpeed's engine with Predict steps that skip backward.

The one training step users call is ``engine.train_step(micro_batches)``: one
optimizer step, i.e. one gradient-accumulation boundary's worth of micro-batches.

* Warmup / Full / Correct: forward, ``engine.backward``, ``engine.step`` for each
  micro-batch, exactly as plain DeepSpeed; the Adam direction before and after
  the step is compared so the predictor learns its step scale.
* Predict: no backward, no gradient reduction, no optimizer gradient work. The
  predicted update (``-scale * lr * m_hat / (sqrt(v_hat) + eps)``, AdamW decay
  included) is added to the fp32 masters and propagated to the model's
  parameters, inside DeepSpeed's own ``_take_model_step`` so that
  ``global_steps``, ``global_samples`` and the LR scheduler advance as in a real
  step. Every ``verify_every`` steps a ``no_grad`` forward observes the loss; a
  loss outside the accepted band restores the snapshot taken at the last good
  point (an exact rollback) and the engine returns to Full.

With ``hybrid_predict.enabled: false`` ``train_step`` is exactly the plain
DeepSpeed loop and nothing else runs (beyond the non-finite guard below, which
changes nothing while losses and gradients are finite).

Faults: a NaN or Inf in any rank's loss or raw gradients makes every rank skip
that optimizer update (one all-reduce at the accumulation boundary decides);
see ``_take_model_step``. ``save_checkpoint`` / ``load_checkpoint`` add our
state to DeepSpeed's and write atomically (``ds_hybrid/checkpoint.py``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from . import host_kernels, kernels
from . import cpu_step_behind, step_fusion
from . import zero_access as za
from .config import ConfigError, HybridPredictConfig, parse_hybrid_config, refused_before_deepspeed
from .device_predict import DevicePredict
from .dist_env import ensure_distributed_env, release_cpu_allreduce_segment
from .ds_config import load_ds_config
from .dynamics.batchstats import BatchDifficulty
from .dynamics.encoder import Observation
from .engine_state import EngineState
from .fold_overlap import BackgroundFold
from .grad_predict import GradientPredict, batch_samples
from .grad_recompute import Recompute, checkpointing_off
from .judgement import DelayedJudgement
from .memory_paths import MemoryPaths
from .noise_scale import NoiseScale
from .phases import Phase, PhaseController
from .predictor import AdamDirectionPredictor
from .shard_fold import ShardFold
from .swap_fold import SwapFold
from .wall_clock import WallClockBreakdown

LossFn = Callable[["PredictiveEngine", Any], torch.Tensor]
logger = logging.getLogger(__name__)


def default_loss(engine: "PredictiveEngine", batch: Any) -> torch.Tensor:
    """Forward a ``transformers`` causal LM batch (a dict with ``labels``) and return its loss."""
    out = engine(**batch) if isinstance(batch, Mapping) else engine(batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("ds_hybrid: the model must return a scalar loss (or an output with .loss); "
                        "pass loss_fn=... to train_step for other models")
    return loss


@dataclass
class StepResult:
    """What one optimizer step did. ``loss`` is the data-parallel mean loss of the
    step's micro-batches (None for an unverified Predict step; a ``direction: gradient``
    Predict step's is its own forward's, before its update, as a real step's)."""

    step: int                       # engine.global_steps after this step
    phase: str                      # warmup | full | predict | correct
    loss: float | None
    predicted_loss: float | None    # the predictor's expectation for this step
    confidence: float               # the predictor's confidence after this step
    backward_ran: bool
    step_time_s: float
    step_scale: float = 0.0         # Predict: scale applied to lr * Adam direction
    verified: bool = False          # Predict: a no-grad forward checked this step
    accepted: bool | None = None    # Predict: verification outcome
    rolled_back_steps: int = 0      # Predict steps undone by this step's rollback
    lr: float = 0.0
    skipped: bool = False           # real step whose update was skipped (NaN/Inf loss or gradient on a rank)
    progress: float | None = None   # Predict: batch loss with the step skipped minus with it (measured steps)
    predicted_groups: int = 0       # partial step: lower layer groups that took the predicted update (no backward)
    checked: bool | None = None     # the first forward checked the last predicted update: accepted (True) / rolled back
    bookkeeping: bool = True        # real step: ran the predictor's work on the masters (False: lazy_bookkeeping left it out)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Stats:
    steps: dict = field(default_factory=lambda: {p.value: 0 for p in Phase})
    seconds: dict = field(default_factory=lambda: {p.value: 0.0 for p in Phase})
    backward_passes: int = 0
    steps_behind: int = 0   # memory.cpu_step_behind: real steps the GPU covered, their CPU step behind the run
    copies_skipped: int = 0   # memory.cpu_step_behind: DeepSpeed's copies of masters not yet stepped, dropped
    backward_skipped: int = 0
    predict_accepted: int = 0
    predict_rolled_back: int = 0
    verifications: int = 0
    skipped_steps: int = 0          # real steps whose optimizer update was skipped (non-finite)
    predictor_seconds: float = 0.0  # time spent in the predictor (encoding, training, decisions)
    # time in the hybrid's own work on the masters, by part (capture, fold, stash, compare,
    # predicted_update, snapshot, restore): what a real step costs beyond plain DeepSpeed's
    bookkeeping_seconds: dict = field(default_factory=dict)
    partial_backward: int = 0       # backward passes of partial steps (lower layer groups predicted)
    idle_steps: int = 0             # real steps without the predictor's work on the masters (lazy_bookkeeping)
    partial_share_sum: float = 0.0  # sum over them of the share of parameters left out of the backward
    group_checks: int = 0           # first forwards that checked a predicted update (partial or whole-model)
    group_rolled_back: int = 0      # ... and rolled it back
    progress_sum: float = 0.0       # sum of measured progress of Predict steps (loss units)
    progress_n: int = 0
    progress_positive: int = 0
    # Real steps that a "no" at a Predict decision put in front of the next decision, by reason:
    # lr_gate (predict_lr_fraction), predictor (not ready, or confidence below the threshold),
    # judge (the delayed judgement's verdict). Warmup steps are in steps_per_phase.
    held_back: dict = field(default_factory=dict)


class _NonFiniteGuard:
    """Watches one optimizer step of this rank for NaN/Inf: the micro-batch losses, and
    every raw gradient through a tensor hook. A leaf tensor's hooks run before its
    AccumulateGrad node, so before DeepSpeed's reduction hooks: this sees the rank's own
    gradients on every ZeRO stage, without knowing where a stage keeps them afterwards.

    Each hook adds the gradient's fp32 sum to a running total: one reduction, no boolean
    temporaries and no sync inside the backward. A NaN or Inf anywhere makes the total
    non-finite (Inf - Inf is NaN). It replaced a check per element (``isfinite().all()``: two
    passes and two allocations per gradient); on ``cpu-small`` both cost a real step about 1%,
    within the machine's noise (``benchmarks/guard_cost.py``). The total can also overflow,
    only for gradients summing past 3.4e38, and such a step is skipped as well."""

    def __init__(self, module: torch.nn.Module):
        self._losses: list[torch.Tensor] = []
        self._grad_sum: torch.Tensor | None = None
        self._off = False
        self._handles = [p.register_hook(self._check_grad) for p in module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def off(self):
        """Backwards in the block are not this step's (``direction: gradient``'s private one,
        which judges its own gradient): their gradients are not watched."""
        self._off = True
        try:
            yield
        finally:
            self._off = False

    def remove(self) -> None:
        """Take the hooks off (a benchmark swaps guards on one engine)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _check_grad(self, grad: torch.Tensor) -> None:
        if self._off:
            return
        s = grad.sum(dtype=torch.float32)  # stays on the device: no sync inside backward
        self._grad_sum = s if self._grad_sum is None else self._grad_sum + s.to(self._grad_sum.device)

    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float())

    def collect(self) -> tuple[float, int, bool]:
        """(sum of this step's losses, their count, whether anything was non-finite); resets."""
        losses = [float(x) for x in self._losses]
        bad = any(not math.isfinite(x) for x in losses) or bool(
            self._grad_sum is not None and not math.isfinite(float(self._grad_sum)))
        self._losses, self._grad_sum = [], None
        return sum(losses), len(losses), bad


@contextlib.contextmanager
def _instance_attrs(obj: Any, **attrs: Any):
    """Set attributes on one object for the block, then put back what was there."""
    missing = object()
    saved = {k: obj.__dict__.get(k, missing) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(obj, k)
            else:
                setattr(obj, k, v)


class PredictiveEngine(MemoryPaths, EngineState, DeepSpeedEngine):
    """A ``DeepSpeedEngine`` that cycles Warmup -> Full -> Predict -> Correct."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Attributes are set after super().__init__: DeepSpeedEngine.__getattr__ falls
        # back to the wrapped module, so nothing of ours may live in the module tree.
        self.hybrid_config: HybridPredictConfig = parse_hybrid_config(self._config._param_dict)
        self._stats = _Stats()
        # "wall_clock_breakdown": DeepSpeed's forward/backward/step timers booked per phase.
        self._wall_clock = WallClockBreakdown(self) if self.wall_clock_breakdown() else None
        self._predicted_update: Callable[[], None] | None = None
        self._guard = _NonFiniteGuard(self.module)
        self._boundary_loss: float | None = None  # mean loss over ranks of the last real step
        self._velocity: za.VelocityBuffers | None = None
        self._parking: za.MomentParking | None = None
        # Layer-group Predict (group_predict): the model's block layout, the backward cut and
        # the planner; the prefix the next Full step predicts, the groups the current step
        # predicts, and the groups whose predicted update the next step's first forward checks.
        self._layout = self._cut = self._planner = None
        self._next_groups = 0
        self._step_groups: frozenset = frozenset()
        self._check_groups: frozenset | None = None
        self._check_run = False     # the pending check is of a whole-model Predict run (check: next_step)
        self._device_predict: DevicePredict | None = None   # memory.offload_predict: device
        self._saved_device_run: dict | None = None
        self._fold_from_state = False   # memory.fold_source resolved
        self._shards: ShardFold | None = None   # ... weights16: the fold from the 16-bit shards
        self._kept_runs_at_start = 0   # DevicePredict.kept_runs when this real step began
        self._capture_shards = False   # this real step copies its shards before its optimizer step
        # memory.cpu_step_behind resolved; this real step records DeepSpeed's CPU Adam calls; those recorded
        self._cpu_step_behind = self._defer_step = False
        self._deferred: list | None = None
        self._commit_overlap = False    # memory.commit_overlap resolved
        self._host_kernel = False       # memory.host_kernels resolved: the C++ fold on host masters
        self._folds: BackgroundFold | None = None   # memory.fold_overlap: the fold behind the next step
        self._fold_during_run = False   # memory.fold_during_run resolved: a run holds the velocity before the fold
        self._fusion: step_fusion.FusedCpuAdam | None = None   # memory.fold_in_step: DeepSpeed's CPU Adam, wrapped
        self._step_commit: tuple | None = None   # ... a kept run's commit, for the coming optimizer step
        self._fold_in_step = False               # ... this step's fold goes into the optimizer step
        # ... under ZeRO-Infinity's NVMe swap: the fold inside DeepSpeed's sub-group steps instead
        self._swap_fold: SwapFold | None = None
        self._step_jobs: list | None = None      # ... the jobs the last optimizer step was armed with
        self._free_velocity_copy = False   # memory.free_velocity_copy: the velocity's GPU copy only during a run
        self._gradient: GradientPredict | None = None   # predictor.direction: gradient
        # ... the gradient noise scale from its share steps' norms and the real steps': what a step from
        # predictor.gradient_batch_fraction of the batch is worth (statistics: gradient_noise_scale)
        self._noise = NoiseScale()
        if not self.hybrid_config.enabled:
            return
        if not za.is_adam_family(self):
            base = getattr(self.optimizer, "optimizer", self.optimizer)   # inside DeepSpeed's ZeRO/bf16 wrapper
            raise ConfigError(f"hybrid_predict: optimizer {type(base).__name__} keeps no Adam moments; Predict steps "
                              "need Adam or AdamW (the ds_config's optimizer.type, or optimizer= to initialize), or "
                              "set hybrid_predict.enabled to false")
        self._masters = za.master_access(self)
        self._snapshot = za.PartitionBuffers(self.hybrid_config.snapshot_device)
        self._masters_on_cuda = any(p.master.is_cuda for p in self._masters.partitions())
        self._device_predict = self._make_device_predict()
        self._fold_from_state = self._resolve_fold_source()
        self._shards = self._resolve_shard_fold()
        if self._device_predict is not None:   # its work is on the 16-bit shards: time it there
            self._masters_on_cuda = any(s is not None and s.is_cuda   # (None: on NVMe, through host memory)
                                        for s in map(self._masters.device_shard, range(self._masters._count())))
        mem = self.hybrid_config.memory
        # direction: drift keeps the running average of the real updates (one buffer per
        # parameter of this rank's partition); adam reads the optimizer's moments instead.
        self._velocity = (za.VelocityBuffers(mem.velocity_dtype, seed=self.hybrid_config.dynamics.seed)
                          if self.hybrid_config.predictor.direction in ("drift", "none") else None)
        if self._velocity is not None and self._shards is not None:
            self._velocity.beside_shards = True   # (on the shards' device: nothing to pin or upload)
            # a velocity on a GPU comes down once per run, during it, for the commit into the masters
            self._device_predict.copy_down = any(
                self._masters.device_shard(i).device != p.master.device for i, p in enumerate(self._masters.partitions()))
            self._device_predict.pin_down = self._offload_pins_memory()
        elif self._velocity is not None and self._masters_on_cuda and self._offload_pins_memory():
            # host velocity beside GPU shards: pinned, so each run's upload is one DMA, not a pageable
            # copy (unless the user turned DeepSpeed's pinning off: torch rounds each pinned block up
            # to a power of two, 2 GiB more at 7B with an int8 velocity)
            self._velocity.pin = True
        if self._velocity is not None and any(p.master.device.type == "cpu" for p in self._masters.partitions()):
            self._host_kernel = host_kernels.resolve(mem.host_kernels)   # (built here, before the first step)
            if self._device_predict is not None:
                self._device_predict.host_kernel = self._host_kernel
        self._parking = (za.MomentParking(self, self._masters, overlap=mem.park_overlap)
                         if mem.park_optimizer_states else None)
        if self.hybrid_config.predictor.direction == "gradient":
            self._gradient = self._make_gradient_predict()
            self._gradient.recompute = Recompute(self.hybrid_config.predictor.gradient_checkpointing, self.module,
                                                 self._max_over_ranks)
            if self._gradient.on_device:   # its work is on the 16-bit shards: time it there
                self._masters_on_cuda = any(self._gradient._shard(i).is_cuda for i in range(self._masters._count()))
                if any(p.master.device.type == "cpu" for p in self._masters.partitions()):
                    self._gradient.host_kernel = host_kernels.resolve(mem.host_kernels)   # (the commit's catch-up)
                self._gradient.prefetch_host = self._host_masters_beside_an_accelerator()
        self._fusion = self._resolve_fold_in_step()
        self._swap_fold = self._resolve_swap_fold()
        # memory.cpu_step_behind: a real step that may precede a gradient run defers DeepSpeed's CPU
        # Adam calls (_deferred); a run covers them on the GPU and they run behind it
        self._cpu_step_behind = self._resolve_cpu_step_behind()
        # the steps' CUDA kernels compiled here, before the first step, not inside the first Predict
        # step that launches one (kernels.prebuild: seconds of NVRTC on a machine's first run)
        self._kernels_prebuilt = self._masters_on_cuda and kernels.prebuild(self.hybrid_config.kernels, self.device)
        overlap = mem.commit_overlap
        # (auto leaves a compact run's commit inline: its side stream behind the next step is tested on
        # the CPU only, its GPU time owed; the planner counts its state beside a real step's backward either way)
        compact = self._gradient is not None and bool(self._gradient.compact)
        self._commit_overlap = self._device_path() and self._fusion is None and (
            overlap is True or (overlap == "auto" and not compact and self._host_masters_beside_an_accelerator()))
        if self.global_rank == 0 and self._host_masters_beside_an_accelerator() and not self._device_path():
            # Measured (README, "GPU memory per phase"): with the masters in host memory every
            # Predict step and every real step's bookkeeping runs on the host copies.
            logger.warning("hybrid_predict with zero_optimization.offload_optimizer: the snapshot, the velocity "
                           "and every Predict step work on the fp32 masters in host memory; on llama-1b (H100, "
                           "16 CPU cores) this ran slower than plain ZeRO-Offload. Measure before relying on it: "
                           "ds-hybrid memory-bench --preset YOUR_CONFIG (see the README)")
        self.controller = PhaseController(self.hybrid_config)
        self.predictor = make_predictor(self.hybrid_config)
        if self.hybrid_config.group_predict.enabled:
            self._setup_group_predict()
        self._folds = BackgroundFold() if self._resolve_fold_overlap() else None
        self._free_velocity_copy = self._resolve_free_velocity_copy()
        self._fold_during_run = self._resolve_fold_during_run()
        self._pending = 0  # Predict steps applied since the last good point
        dyn = self.hybrid_config.dynamics
        self._difficulty = BatchDifficulty() if dyn.batch_difficulty else None
        jc = self.hybrid_config.judge
        self._judge = (DelayedJudgement(jc.steps, jc.window, jc.min_runs, jc.z, clean=True)
                       if jc.enabled and self.hybrid_config.whole_model else None)
        self._judge_stopped = False   # the verdict stopped Predict runs (said once in the log)
        self._told: set = set()       # reasons for not predicting already said in the log
        self._verifications = 0
        self._max_lr = 0.0  # highest LR of the run so far (predict_lr_fraction)
        # Progress of measured Predict steps: (step, lr, scale, progress), for the regime analysis.
        self.progress_log: list[tuple[int, float, float, float]] = []
        sched = getattr(self._config, "scheduler_params", None) or {}
        self._total_steps = int(sched.get("total_num_steps", 0) or 0)
        if self.global_rank == 0:
            self._warn_about_the_schedule()
        # lazy_bookkeeping: the last warmup steps that do the predictor's work on the masters,
        # enough for the older ones to weigh under 1% in the velocity and the predictor's averages.
        p = self.hybrid_config.predictor
        betas = ([p.drift_beta] if self._velocity is not None else []) + [p.scale_ema]
        self._lead = max(math.ceil(math.log(0.01) / math.log(b)) if 0.0 < b < 1.0 else 1 for b in betas)
        self._trajectory = None
        if dyn.trajectory_path and self.global_rank == 0:
            from .dynamics.trajectory import TrajectoryWriter
            self._trajectory = TrajectoryWriter(dyn.trajectory_path, meta={
                "predictor": self.hybrid_config.predictor.type, "world_size": int(self.dp_world_size)})

    def _setup_group_predict(self) -> None:
        from .group_predict import BackwardCut, GroupLayout, GroupPlanner
        gp = self.hybrid_config.group_predict
        try:
            groups = self._masters.model_param_groups()
        except NotImplementedError as err:
            raise ConfigError(f"zero_optimization.stage: {err} (hybrid_predict.group_predict.enabled)") from None
        layout = GroupLayout(self.module, groups, self._masters.group_names())
        if layout.max_prefix == 0:
            raise ConfigError(f"hybrid_predict.group_predict: the optimizer's {len(groups)} param group(s) "
                              f"({', '.join(layout.names)}) hold no input-side group that can be predicted; pass "
                              "ds_hybrid.models.layer_groups(model) as model_parameters (ds-hybrid train "
                              "--layer-groups 4)")
        if gp.pinned is not None:
            layout.check(gp.pinned, "hybrid_predict.group_predict.pinned")
        self._layout, self._cut = layout, BackwardCut(self.module, layout.blocks)
        self._planner = GroupPlanner(gp, layout)

    # ------------------------------------------------------------------ API
    @property
    def phase(self) -> Phase:
        """The phase the next ``train_step`` runs in."""
        return self.controller.phase if self.hybrid_config.enabled else Phase.FULL

    def batches_per_step(self) -> int:
        """Micro-batches per ``train_step``: ``gradient_accumulation_steps``, except under ZenFlow,
        which sets that to its ``update_interval`` (how often the CPU part of the update lands)
        while every micro-step is an optimizer step of its own (a selective update of the
        important columns, and an LR scheduler step), so one batch is one step."""
        return 1 if getattr(self, "zenflow", False) else self.gradient_accumulation_steps()

    def train_step(self, micro_batches: Any, loss_fn: LossFn | None = None) -> StepResult:
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches.

        ``micro_batches``: a list of that many batches, or one batch when the
        accumulation count is 1. ``loss_fn(engine, batch) -> scalar loss`` defaults
        to ``engine(**batch).loss``.
        """
        batches = self._as_micro_batches(micro_batches)
        loss_fn = loss_fn or default_loss
        if self._wall_clock is not None:
            self._wall_clock.before_step()
        t0 = time.perf_counter()
        if not self.hybrid_config.enabled:
            self._real_step(batches, loss_fn)
            result = StepResult(self.global_steps, Phase.FULL.value, self._boundary_loss, None, 0.0, True, 0.0,
                                lr=self._lr(), skipped=not self.was_step_applied())
        else:
            try:
                if self.controller.phase is Phase.PREDICT:
                    result = self._predict_step(batches, loss_fn)
                else:
                    result = self._full_step(batches, loss_fn, self.controller.phase)
                    self._settle_cpu_step()
                if self.controller.phase is Phase.PREDICT and not self._run_holds_velocity():
                    # memory.fold_overlap: a Predict step moves along the velocity, so it could only
                    # wait for this step's fold; the wait is booked to the real step whose work it is.
                    # (fold_during_run: the run moves along the copy it holds; the fold goes on.)
                    self._wait_fold()
            finally:
                if self._deferred is not None:   # (the step raised after DeepSpeed counted it: run it now)
                    calls, self._deferred = self._deferred, None
                    cpu_step_behind.run_all(calls)
                self._wait_commit()   # (joined before the optimizer step; here if the step raised first)
                self._commit_taken_inline()   # (memory.fold_in_step: the same, for a step that never came)
            if self.controller.phase is Phase.PREDICT and self._gradient is not None \
                    and self.hybrid_config.memory.gradient_prefetch:
                # a run begins next: its moments cross to the GPU behind its first forward and backward
                self._gradient.prefetch()
        self._sync()
        result.step_time_s = time.perf_counter() - t0
        if self._wall_clock is not None:
            self._wall_clock.after_step(result.phase, result.checked, result.step_time_s)
        if self.hybrid_config.enabled:
            self._max_lr = max(self._max_lr, result.lr)
        if self._planner is not None and result.phase in (Phase.FULL.value, Phase.PARTIAL.value) \
                and not result.skipped:
            self._planner.observe_time(result.predicted_groups, result.step_time_s)
        self._account(result)
        return result

    def statistics(self) -> dict:
        """Totals since the start: steps and seconds per phase, backward passes run and
        skipped, Predict steps accepted and rolled back, the snapshot buffer's size."""
        s = self._stats
        total_bw = s.backward_passes + s.backward_skipped
        out = {
            "steps_per_phase": dict(s.steps),
            "seconds_per_phase": {k: round(v, 6) for k, v in s.seconds.items()},
            "mean_step_seconds": {k: (s.seconds[k] / s.steps[k] if s.steps[k] else None) for k in s.steps},
            "backward_passes": s.backward_passes,
            "backward_skipped": s.backward_skipped,
            "backward_skipped_pct": 100.0 * s.backward_skipped / total_bw if total_bw else 0.0,
            "predict_steps": s.steps[Phase.PREDICT.value],
            "predict_accepted": s.predict_accepted,
            "predict_rolled_back": s.predict_rolled_back,
            "verifications": s.verifications,
            "skipped_steps": s.skipped_steps,
            "partial_backward": s.partial_backward,
            "idle_steps": s.idle_steps,
            "partial_backward_share": s.partial_share_sum / s.partial_backward if s.partial_backward else 0.0,
            # whole backward passes skipped plus, for partial ones, the share of parameters left out
            "backward_skipped_equivalent": s.backward_skipped + s.partial_share_sum,
            "predicted_update_checks": s.group_checks,
            "predicted_update_rolled_back": s.group_rolled_back,
            "held_back": dict(s.held_back),
        }
        if self._wall_clock is not None:
            out["wall_clock_breakdown"] = self._wall_clock.summary()
        if self.hybrid_config.enabled:
            out["snapshot_bytes"] = self._snapshot.nbytes()
            out["velocity_bytes"] = self._velocity.nbytes() if self._velocity is not None else 0
            out["direction"] = self.hybrid_config.predictor.direction
            out["offload_predict"] = "device" if self._device_path() else "host"
            out["fold_source"] = ("weights16" if self._shards is not None
                                  else "optimizer_state" if self._fold_from_state else "snapshot")
            if self._shards is not None:   # real steps folded from the shards, and those a kept run's commit left out
                out["shard_folds"] = {"folded": self._shards.folds, "skipped": self._shards.skipped,
                                      "host_copy_bytes": self._device_predict.host_copy_bytes()}
            out["host_kernels"] = "cpp" if self._host_kernel else "torch"
            out["fold_overlap"] = self._folds is not None
            out["fold_background_seconds"] = self._folds.background_seconds if self._folds is not None else 0.0
            out["fold_during_run"] = self._fold_during_run
            out["fold_in_step"] = self._fusion is not None or self._swap_fold is not None
            if self._swap_fold is not None:   # (fold_source: snapshot under NVMe: one sub-group's masters)
                out["fold_in_step_copy_bytes"] = self._swap_fold.copy_bytes()
            if self._fusion is not None:   # partitions stepped in one pass, and through DeepSpeed's op in chunks
                out["fold_in_step_passes"] = dict(self._fusion.passes)
            out["free_velocity_copy"] = self._free_velocity_copy
            if self._device_predict is not None:
                out["device_velocity_bytes"] = self._device_predict.device_bytes()   # copies beside a GPU's shards
            if self._device_path():
                # (offload_param: nvme: the host buffer a sub-group's 16-bit partition takes its steps in)
                out["shard_swap_buffer_bytes"] = (self._device_predict or self._gradient).swapped.buffer_bytes()
                out["commit_overlap"] = self._commit_overlap
                out["commit_background_seconds"] = (self._device_predict or self._gradient).background_seconds
            if self._parking is not None:
                out["moment_parking"] = self._parking.mode
            if self._gradient is not None:   # Predict steps whose gradient was NaN/Inf on a rank: moved nothing
                out["gradient_nonfinite_steps"] = self._gradient.nonfinite
                # predictor.gradient_second_moment: Adam's v held at the last real step's, or updated by the run
                out["gradient_second_moment"] = "updated" if self._gradient.update_v else "held"
                # memory.cpu_step_behind: real steps covered on the GPU, and their CPU steps' time behind the runs
                out["cpu_step_behind"] = self._cpu_step_behind
                out["cpu_steps_behind"] = self._stats.steps_behind
                out["cpu_step_behind_seconds"] = self._gradient.behind.background_seconds
                out["cpu_step_copies_skipped"] = self._stats.copies_skipped
                # runs whose moments were copied behind the step before them (prefetch), and such copies dropped as stale
                out["gradient_prefetched_runs"], out["gradient_prefetch_stale"] = self._gradient.prefetched
                # ZeRO 3 shares queued into host memory: seconds the backward waited for a free buffer, and
                # for the last adds after it (inside bookkeeping_seconds.gradient)
                out["gradient_share_wait_seconds"] = dict(self._gradient.share_wait_seconds)
                # predictor.gradient_checkpointing: steps whose backward recomputed the checkpointed blocks, and why
                out["gradient_recompute"] = self._gradient.recompute.statistics()
                # What a Predict step from its share of the batch is worth in real steps (noise_scale.py),
                # and what it cost: its mean time over a Full step's
                noise = self._noise.summary()
                full, pred = out["mean_step_seconds"].get(Phase.FULL.value), out["mean_step_seconds"].get(
                    Phase.PREDICT.value)
                noise["share_step_cost"] = pred / full if pred and full else None
                noise["worth_per_cost"] = (noise["share_worth"] / noise["share_step_cost"]
                                           if noise["share_worth"] is not None and noise["share_step_cost"] else None)
                out["gradient_noise_scale"] = noise
            out["confidence"] = self.predictor.confidence()
            out["step_scale"] = self.predictor.step_scale()
            out["predictor"] = self.hybrid_config.predictor.type
            out["predictor_seconds"] = s.predictor_seconds
            out["bookkeeping_seconds"] = dict(s.bookkeeping_seconds)
            real = sum(s.steps[p.value] for p in Phase if p is not Phase.PREDICT)
            real_s = sum(s.seconds[p.value] for p in Phase if p is not Phase.PREDICT)
            # Mean predictor time per step over the mean time of a real step (which includes it).
            total = sum(s.steps.values())
            out["predictor_cost_fraction"] = ((s.predictor_seconds / total) / (real_s / real)
                                              if total and real and real_s else None)
            out["progress_measured"] = s.progress_n
            out["progress_mean"] = s.progress_sum / s.progress_n if s.progress_n else None
            out["progress_positive_share"] = s.progress_positive / s.progress_n if s.progress_n else None
            out["predictor_details"] = self.predictor.statistics()
            out["predictor_device"] = str(getattr(self.predictor, "device", "cpu"))
            # CuPy kernel launches in this process (kernels/*.cu): empty when every path took torch.
            out["kernel_launches"] = dict(kernels.LAUNCHES)
            if self._planner is not None:
                out["group_predict"] = self._planner.summary()
            if self._judge is not None:
                out["judgement"] = dict(self._judge.summary(), stopped_predict=self._judge_stopped)
        return out

    # ------------------------------------------------------------ phases
    def _real_step(self, batches: list, loss_fn: LossFn, on_first_forward: Callable | None = None,
                   cut: int | None = None) -> None:
        """Plain DeepSpeed: forward, backward, step for each micro-batch. The boundary
        step (``_take_model_step``) all-reduces the losses into ``_boundary_loss`` and
        skips the update on every rank if any rank saw a NaN/Inf.

        ``on_first_forward(loss, batch)`` runs after the first micro-batch's forward, before
        any backward; when it returns True (it rolled a predicted update back) that forward
        is run again. ``cut``: the block below which autograd is off (a partial step)."""
        for i, batch in enumerate(batches):
            with self._cut_at(cut):
                loss = loss_fn(self, batch)
            if i == 0 and on_first_forward is not None and on_first_forward(loss, batch):
                with self._cut_at(cut):
                    loss = loss_fn(self, batch)
            self._guard.record_loss(loss)
            self.backward(loss)
            self.step()
        for run in (self._gradient, self._device_predict):
            if run is not None:
                run.settle()   # (a kept run's commit deferred into the step: what a skipped step left)
        if self._gradient is not None:
            self._gradient.finish_staging()   # (the next run's state made inside the step, under NVMe swap)

    def _cut_at(self, block: int | None):
        return self._cut.active(block) if (self._cut is not None and block is not None) else contextlib.nullcontext()

    def _idle(self, phase: Phase) -> bool:
        """A real step whose capture, fold and direction statistics no decision would read
        (``hybrid_predict.lazy_bookkeeping``): the same answer on every rank, since it reads
        only the config, the phase and the agreed verdict."""
        cfg = self.hybrid_config
        if not cfg.lazy_bookkeeping or self._learns_from_every_step():
            return False
        if self._judge_stopped:
            return True
        return phase is Phase.WARMUP and self.controller.remaining > self._lead

    def _learns_from_every_step(self) -> bool:
        """The layer-group planner, the RSSM and the trajectory file read every step's statistics
        (the per-group moment sums included)."""
        cfg = self.hybrid_config
        return self._planner is not None or cfg.predictor.type == "rssm" or bool(cfg.dynamics.trajectory_path)

    def _full_step(self, batches: list, loss_fn: LossFn, phase: Phase) -> StepResult:
        cfg = self.hybrid_config
        if self._gradient is not None and self._gradient.behind.running:
            # memory.cpu_step_behind: this step's backward writes the gradient the CPU step reads,
            # and its check and commit read the masters it writes
            with self._timed("cpu_step_wait"):
                self._gradient.behind.wait()
        if self._gradient is not None:
            self._gradient.drop_staged()   # (made inside the last real step for a run that did not come)
        if self._free_velocity_copy:
            # The run (if one came before) is over: its check, commit or rollback read the host
            # velocity, so its GPU copy goes before this step's forward and backward need the memory.
            self._device_predict.free_copies()
        idle = self._idle(phase)
        self._stats.idle_steps += int(idle)
        drift = self._velocity is not None and not idle
        # (direction: gradient moves by Adam's own step: no direction statistics to learn from)
        probe = not idle and self._gradient is None and (
            drift or ((phase is Phase.CORRECT or cfg.predictor.learn_from_full_steps) and self._masters.has_adam_state()))
        # Layer-group Predict: the lower k groups take the predicted update and no backward.
        k = self._next_groups if phase is Phase.FULL else 0
        self._next_groups = 0
        if k and not self._masters.has_adam_state():
            k = 0
        predicted = frozenset(range(k))
        local_difficulty = self._measure_difficulty(batches)
        lrs = [float(g["lr"]) for g in self._masters.base.param_groups]
        checked: list = []

        def before_backward(loss: torch.Tensor, batch: Any) -> bool:
            # First the check of the last predicted update (the snapshot still holds its
            # rollback point), then this step's own snapshot.
            redo = self._check_predicted_update(loss, batch, checked)
            if self._gradient is not None and self._gradient.pending:
                self._gradient.commit()   # (a run kept without a check: the optimizer takes its first moment)
            if self._device_predict is not None and self._device_predict.pending:
                self._commit_run(into_step=True)   # (a run kept without a check: its masters catch up here)
            capture = predicted or (drift and not self._fold_from_state and self._shards is None
                                    and self._swap_fold is None)
            stash = not capture and probe and not drift
            if capture or stash:
                self._wait_fold()     # (it reads the masters these overwrite)
                self._wait_commit()   # both read the masters
                if self._device_predict is not None:
                    self._device_predict.settle()   # (a commit deferred into the step: these read it now)
            if capture:
                # The masters before the step (into the snapshot buffer, free outside Predict
                # runs): the update per unit LR feeds the velocity, and for predicted groups it is
                # the rollback point the next step's check may return to. (fold_source:
                # optimizer_state reads a whole step's update back from the Adam state instead.)
                with self._timed("capture"):
                    za.capture_weights(self._masters, self._snapshot)
            elif stash:
                with self._timed("stash"):
                    za.stash_direction(self._masters, self._snapshot)
            return redo

        self._step_groups = predicted
        # (memory.cpu_step_behind: a whole step that a run may follow; Warmup never precedes one)
        self._defer_step = self._cpu_step_behind and not predicted and phase is not Phase.WARMUP
        # (fold_source: weights16 folds on the shards' device: only a kept run's commit goes into the step)
        self._fold_in_step = ((self._fusion is not None or self._swap_fold is not None) and drift and not predicted
                              and self._shards is None)
        self._capture_shards = self._shards is not None and drift
        if self._capture_shards:
            self._kept_runs_at_start = self._device_predict.kept_runs
        try:
            self._real_step(batches, loss_fn, before_backward, self._layout.cut[k] if k else None)
        finally:
            self._step_groups = frozenset()
            self._fold_in_step = self._capture_shards = self._defer_step = False
        loss = self._boundary_loss  # all-reduced at the boundary, with the skip decision
        applied = self.was_step_applied()
        fold_behind = drift and applied and self._folds is not None and not predicted
        in_step, self._step_jobs = self._step_jobs, None
        swapped = self._finish_swap_fold()
        if in_step is not None and drift and applied:
            # memory.fold_in_step: folded inside the optimizer step
            groups = self._fused_fold_sums(in_step, lrs)
        elif swapped is not None and drift and applied:
            groups = swapped   # ... inside ZeRO-Infinity's sub-group steps, each swapped in once
        elif drift and applied and self._shards is not None:
            # memory.fold_source: weights16: from the shards DeepSpeed's step just wrote, on their
            # device (none where this step committed a kept run: shard_fold.py says why)
            with self._timed("fold"):
                groups = self._shards.fold(self._velocity, lrs, cfg.predictor.drift_beta, int(self.global_steps),
                                           moments=self._learns_from_every_step())
        elif fold_behind:
            # memory.fold_overlap: this step's fold runs behind the next step's forward and
            # backward (started at the end of this step, once the next phase is known); the
            # predictor gets the last one's sums (joined before this optimizer step).
            groups = self._folds.take()
            if groups is None:
                groups = torch.zeros(self._masters.num_groups(), len(za.DIRECTION_STATS), dtype=torch.float64)
        elif drift and applied:
            real = None if not predicted else set(range(self._masters.num_groups())) - predicted
            with self._timed("fold"):
                copied = self._velocity_copied()
                if copied is not None:
                    copied.synchronize()   # (the last upload has read the host velocity)
                before = None if self._fold_from_state and not predicted else self._snapshot
                groups = za.fold_real_update(self._masters, before, self._velocity, lrs,
                                             cfg.predictor.drift_beta, int(self.global_steps), groups=real,
                                             keep=bool(predicted), moments=self._learns_from_every_step(),
                                             host_kernel=self._host_kernel)
        elif probe and not drift and not predicted:
            with self._timed("compare"):
                groups = za.compare_direction(self._masters, self._snapshot)
        else:
            groups = torch.zeros(self._masters.num_groups(), len(za.DIRECTION_STATS), dtype=torch.float64)
        if predicted and applied and cfg.group_predict.check:
            self._check_groups = predicted   # the next step's first forward checks it
        # One collective for the per-group sums, the batch difficulty and the gradient norm;
        # every rank calls it (probe can differ where a rank's partition is empty). The norm
        # is averaged because DeepSpeed's may differ in the last bits between ranks, and
        # everything the predictor sees must be identical everywhere.
        grad_norm = self._grad_norm()
        local = torch.cat([groups.flatten(), local_difficulty,
                           torch.tensor([grad_norm if grad_norm is not None else -1.0], dtype=torch.float64)])
        shared = self._all_reduce_sum(local)
        groups = shared[:-3].view(groups.shape)
        difficulty = float(shared[-3] / shared[-2]) if shared[-2] > 0 else None
        grad_norm = float(shared[-1]) / self._world() if float(shared[-1]) >= 0 else None
        if self._gradient is not None and grad_norm is not None and not predicted:
            samples = batch_samples(batches)   # (a whole step's gradient: every micro-batch, every rank)
            if samples:
                self._noise.observe(grad_norm * grad_norm, samples * self._world(), True, int(self.global_steps))
        with self._timed_predictor():
            predicted_loss = self.predictor.predict_loss(self.global_steps, difficulty)[0]
        label = Phase.PARTIAL if predicted else phase
        check = checked[0] if checked else None
        if not applied:
            # No update happened: nothing for the predictor to learn, and the phase's
            # step budget counts applied updates only, so the controller stays put.
            return StepResult(self.global_steps, label.value, loss, predicted_loss, self.predictor.confidence(),
                              True, 0.0, lr=self._lr(), skipped=True, predicted_groups=k, checked=check,
                              bookkeeping=not idle)
        if self._planner is not None:
            if probe:
                self._planner.observe_groups(groups, [g not in predicted for g in range(groups.shape[0])])
            # Measured harm: this step's loss against the forecast from whole steps, after a
            # partial step or after a whole one (the loss is already shared: no collective).
            std = self.predictor.predict_loss(self.global_steps, difficulty)[1]
            excess = within_band(loss, predicted_loss, std, None, cfg.divergence)[1]
            if loss is not None and math.isfinite(excess):
                self._planner.observe_check(self._planner.stats.last_k > 0, excess)
        if self._judge is not None and not predicted:
            self._judge.real_step(loss, difficulty)
        if phase is Phase.CORRECT and predicted_loss is not None and math.isfinite(predicted_loss):
            self.predictor.record_verification(self.global_steps, predicted_loss, loss, phase.value, None)
        if predicted:
            # The predictor's loss trend and statistics learn from whole real steps only.
            with self._timed_predictor():
                self.controller.end_step(self._decide)
        else:
            self._observe(Observation(step=self.global_steps, phase=phase.value, loss=loss, lr=self._lr(),
                                      grad_norm=grad_norm, groups=groups.tolist() if probe else None,
                                      predicted_loss=predicted_loss if math.isfinite(predicted_loss) else None,
                                      total_steps=self._total_steps, batch_difficulty=difficulty))
            with self._timed_predictor():
                self.controller.end_step(self._decide)
        if self._planner is not None:
            self._planner.stepped(k)
            self._plan_next_step()
        if fold_behind:
            self._start_fold(lrs)
        return StepResult(self.global_steps, label.value, loss, predicted_loss, self.predictor.confidence(),
                          True, 0.0, lr=self._lr(), predicted_groups=k, checked=check, bookkeeping=not idle)

    def _plan_next_step(self) -> None:
        """How many lower groups the next step predicts (the same answer on every rank)."""
        ctl = self.controller
        k = 0
        if ctl.phase is Phase.FULL and not (self.hybrid_config.whole_model and ctl.remaining <= 1):
            # (The last Full step before a possible Predict run stays whole: that run's snapshot
            # would overwrite the rollback point before the check.)
            frac = self.hybrid_config.predict_lr_fraction
            gate = frac >= 1.0 or self._lr() <= frac * max(self._max_lr, self._lr())
            with self._timed_predictor():
                k = self._planner.decide(gate)
        self._next_groups = int(self._agreed([float(k)])[0])

    def _check_predicted_update(self, loss: torch.Tensor, batch: Any, out: list) -> bool:
        """The first forward of the step after a partial step checks the predicted update
        against the divergence band; outside it, the predicted groups go back to the snapshot
        (an exact rollback, on every rank together) and the caller runs the forward again."""
        groups = self._check_groups
        if groups is None:
            return False
        self._check_groups = None
        local = torch.cat([torch.tensor([float(loss.detach().float()), 1.0], dtype=torch.float64),
                           self._measure_difficulty([batch])])
        shared = self._all_reduce_sum(local)
        observed = float(shared[0] / shared[1])
        difficulty = float(shared[2] / shared[3]) if shared[3] > 0 else None
        run, self._check_run = self._check_run, False
        div = self.hybrid_config.divergence
        with self._timed_predictor():
            if run:   # a whole-model Predict run: the predictor's own verdict (it learns from it)
                ok, expected = self.predictor.accept(observed, self.global_steps + 1, div, difficulty)
            else:
                expected, std = self.predictor.predict_loss(self.global_steps + 1, difficulty)
                ok = within_band(observed, expected, std, self._boundary_loss, div)[0]
        ok, expected = self._agreed([float(ok), expected])
        accepted = ok > 0.5
        out.append(accepted)
        if run:
            self.predictor.record_verification(self.global_steps + 1, expected, observed, Phase.PREDICT.value,
                                               accepted)
            self._verifications += 1
            self._stats.verifications += 1
            if accepted:
                self._stats.predict_accepted += self._pending
                if self._judge is not None:
                    self._judge.run_ended(self._pending)
            else:
                self._stats.predict_rolled_back += self._pending
            self._pending = 0
        else:
            self._stats.group_checks += 1
        device = self._device_predict if run else None
        gradient = self._gradient if run else None
        if accepted:
            if device is not None:
                self._commit_run(into_step=True)   # before this step's optimizer reads the masters
            if gradient is not None:   # the run's first moment (and on the device path its weights)
                with self._timed("commit"):   # (memory.commit_overlap: behind this step's forward and backward)
                    gradient.commit(background=self._commit_overlap)
            return False
        self._wait_fold()   # (a rollback writes the masters; a kept run's commit waits for it itself)
        with self._timed("restore"):
            self._undo(device, gradient, set(groups))
        if not run:
            self._stats.group_rolled_back += 1
        return True

    def _predict_step(self, batches: list, loss_fn: LossFn) -> StepResult:
        ctl, cfg = self.controller, self.hybrid_config
        next_step = cfg.check == "next_step"
        device = self._device_predict
        if not self._run_holds_velocity():   # (else the fold goes on; no snapshot on the device path)
            self._wait_fold()   # the velocity this step moves along, and the masters a snapshot copies
        if ctl.predict_index == 0:
            if self._check_groups is None:
                if not self._device_path():   # (device-side runs leave the masters at the last good point)
                    with self._timed("snapshot"):
                        za.capture_weights(self._masters, self._snapshot)
                self._pending = 0
            # (else: a run straight after a run whose check is still pending; the snapshot stays
            # the last good point and the next real step checks both runs together)
            if self._parking is not None:
                self._parking.park()  # back when the run ends, before the next real step
        gradient = self._gradient
        if gradient is not None:   # the optimizer's own step with the new gradient: no learned scale
            scales = [1.0] * self._masters.num_groups()
        else:
            with self._timed_predictor():
                scales = self._agreed(self.predictor.step_scales(self._masters.num_groups(), ctl.predict_index))
        scale = sum(scales) / len(scales) if scales else 0.0
        lr = self._lr()
        verify = ctl.verify_now() and not next_step
        every = cfg.dynamics.progress_every
        measure = verify and every > 0 and self._verifications % every == 0
        self._verifications += int(verify)
        local = torch.zeros(5, dtype=torch.float64)  # observed sum, count, skipped-step sum, difficulty sum, tokens
        if verify:
            local[3:] = self._measure_difficulty(batches)
        if measure:
            # The same run with this step skipped: the batch's loss before the update.
            with self._predict_forwards():
                local[2] = sum(float(loss_fn(self, b).detach().float()) for b in batches)

        took = False   # direction: gradient: the step's own forward and backward, outside DeepSpeed's gradient path
        if gradient is not None:
            with self._guard.off():   # (its gradient is judged here, not by the next real step's skip)
                took = gradient.take(self, batches, loss_fn, timed=self._timed)
            if took and gradient.last_samples:
                self._noise.observe(gradient.last_sq, gradient.last_samples, False, int(self.global_steps))

        @torch.no_grad()
        def predicted_update() -> None:
            if cfg.predictor.direction == "none":
                return   # the control: the step advances the schedule and moves nothing
            if gradient is not None:
                if took:   # (the same on every rank: a NaN/Inf gradient anywhere moves nothing anywhere)
                    with self._timed("predicted_update"):   # (with the propagate or the all-gather)
                        gradient.apply(self.global_steps)
                return
            if device is not None:   # into the 16-bit copies, gathered; the masters wait for the check
                if device.upload_due(self._velocity):   # once per run: host velocity -> beside the shards
                    with self._timed("velocity_upload"):
                        device.upload(self._velocity)
                with self._timed("predicted_update"):
                    device.apply(self._velocity, scales)
                return
            with self._timed("predicted_update"):
                if self._velocity is not None:
                    za.apply_velocity_update(self._masters, self._velocity, scales, host_kernel=self._host_kernel)
                else:
                    za.apply_predicted_update(self._masters, scales, backend=self.hybrid_config.kernels)
            with self._timed("propagate"):
                self._masters.propagate()

        # DeepSpeed's step() reaches _take_model_step only at an accumulation boundary:
        # account for the micro-batches this step stands for, then take the boundary.
        self.micro_steps += len(batches) - 1
        self._predicted_update = predicted_update
        try:
            self.step()
        finally:
            self._predicted_update = None
        self._pending += 1

        observed = predicted = progress = difficulty = None
        accepted, undone = None, 0
        if verify:
            with self._predict_forwards():
                losses = [float(loss_fn(self, b).detach().float()) for b in batches]
            local[0], local[1] = sum(losses), len(losses)
            shared = self._all_reduce_sum(local)
            observed = float(shared[0] / shared[1])
            difficulty = float(shared[3] / shared[4]) if shared[4] > 0 else None
            if measure:
                progress = float(shared[2] / shared[1]) - observed
                self._record_progress(progress, lr, scale)
            with self._timed_predictor():
                accepted, predicted = self.predictor.accept(observed, self.global_steps, cfg.divergence,
                                                            difficulty, progress)
            ok, predicted = self._agreed([float(accepted), predicted])
            accepted = ok > 0.5
            self.predictor.record_verification(self.global_steps, predicted, observed, Phase.PREDICT.value, accepted)
            goes_on = ctl.predict_index + 1 < ctl.horizon
            if accepted:
                self._stats.predict_accepted += self._pending
                if device is not None:
                    # Kept, but the masters take it with the rest of the run at the next real step
                    # (behind its forward and backward), or alone if a later step is rejected: inline
                    # commits here took 70 ms a Predict step with llama-1b on an H200 (2026-11-26).
                    device.verified = len(device.pending)
                if gradient is not None:   # the run's first moment (and on the device path its weights)
                    with self._timed("commit"):
                        gradient.commit(resync=goes_on)
                if goes_on and not self._device_path():
                    with self._timed("snapshot"):
                        za.capture_weights(self._masters, self._snapshot)  # the new last good point
            else:
                # The fold may still run behind a run that holds its copy, and (with weight decay)
                # it reads the masters the undo writes: wait for it, as the real step's rollback does.
                self._wait_fold()
                with self._timed("restore"):
                    self._undo(device, gradient)
                undone = self._pending
                self._stats.predict_rolled_back += undone
            self._pending = 0
        else:
            with self._timed_predictor():
                predicted = self.predictor.predict_loss(self.global_steps)[0]
        self._observe(Observation(step=self.global_steps, phase=Phase.PREDICT.value, loss=observed, lr=lr,
                                  step_scale=scale, predicted_loss=predicted, accepted=accepted,
                                  rolled_back=undone, horizon=ctl.horizon, predict_index=ctl.predict_index,
                                  total_steps=self._total_steps, progress=progress, batch_difficulty=difficulty))
        run_length = ctl.predict_index + 1
        with self._timed_predictor():
            ctl.end_step(self._decide, rolled_back=accepted is False)
        if not next_step and ctl.phase is not Phase.PREDICT and accepted and self._judge is not None:
            self._judge.run_ended(run_length)   # verified and kept: the real steps after it judge it
        if next_step and ctl.phase is not Phase.PREDICT and self._pending:
            # The run is over: the next real step's first forward checks all of it.
            self._check_groups = frozenset(range(self._masters.num_groups()))
            self._check_run = True
        if self._parking is not None and ctl.phase is not Phase.PREDICT:
            self._parking.unpark()  # the run is over: the next step is real and needs the moments
        if observed is None and gradient is not None:
            observed = gradient.last_loss   # the step's own forward (before its update), as a real step reports
        return StepResult(self.global_steps, Phase.PREDICT.value, observed, predicted, self.predictor.confidence(),
                          gradient is not None, 0.0, step_scale=scale, verified=verify, accepted=accepted,
                          rolled_back_steps=undone, lr=lr, progress=progress)

    @contextlib.contextmanager
    def _predict_forwards(self):
        """The Predict phase's forwards: no autograd (no activations or gradients kept), no
        activation checkpointing (it only pays off when a backward follows; under no_grad it
        would just run each layer through the checkpoint wrapper), and the precision of
        ``memory.predict_autocast``.

        DeepSpeed's forward turns an outer ``torch.autocast`` off unless its own
        ``torch_autocast`` section is on (``autocast_if_enabled``), so for these forwards the
        engine reports that section as on, with the Predict dtype (found on the GPU: an outer
        autocast alone left the Predict forwards in fp32)."""
        prec = self.hybrid_config.memory.predict_autocast
        dtype = torch.bfloat16 if prec == "bf16" else torch.float16
        autocast = (torch.autocast(device_type=self.device.type, dtype=dtype)
                    if prec != "none" else contextlib.nullcontext())
        if prec != "none":
            self.torch_autocast_enabled = lambda: True
            self.torch_autocast_dtype = lambda: dtype
        try:
            with torch.no_grad(), autocast, checkpointing_off(self.module):
                yield
        finally:
            if prec != "none":
                del self.torch_autocast_enabled, self.torch_autocast_dtype

    # ------------------------------------------------------------ predictor plumbing
    def _decide(self) -> tuple[bool, int]:
        if not self.hybrid_config.whole_model:
            return False, 0
        # The LR gate: the LR is the same on every rank, so this needs no agreement.
        frac = self.hybrid_config.predict_lr_fraction
        if frac < 1.0 and self._lr() > frac * self._max_lr:
            return self._held("lr_gate", f"the LR {self._lr():.3g} is above predict_lr_fraction {frac:g} x its "
                                         f"highest so far {self._max_lr:.3g}")
        if self._judge_stopped:
            return self._held("judge", "the delayed judgement found the Predict runs harmful")
        predict, horizon = self.predictor.decide()
        # The delayed judgement's verdict rides on the same agreement as the decision.
        harmful = self._judge is not None and self.hybrid_config.judge.gate and self._judge.harmful()
        predict, horizon, harmful = self._agreed([float(predict), float(horizon), float(harmful)])
        if harmful > 0.5:
            self._judge_stopped = True
            if self.global_rank == 0:
                j = self._judge.summary()
                logger.warning(f"hybrid_predict.judge: the {j['judged_runs']} judged Predict runs left the real steps "
                               f"after them {j['net_effect']:+.4f} higher against the forecast without them than "
                               f"{j['placebos']} stretches with no run (standard error {j['net_stderr']:.4f}); no "
                               "more Predict runs in this run")
            return self._held("judge", "the delayed judgement found the Predict runs harmful")
        if predict <= 0.5:
            conf = self.predictor.confidence()
            return self._held("predictor", f"the predictor's confidence {conf:.2f} is below confidence_threshold "
                                           f"{self.hybrid_config.confidence_threshold:g}" if conf > 0 else
                              "the predictor has no confidence yet (too few real steps observed)")
        return True, int(horizon)

    def _held(self, reason: str, why: str) -> tuple[bool, int]:
        """A "no" at a decision: count the Full phase it puts before the next one, and say why
        once per reason (rank 0), so a run that never predicts does not do so silently."""
        held = self._stats.held_back
        held[reason] = held.get(reason, 0) + self.hybrid_config.full_steps
        if reason not in self._told and self.global_rank == 0:
            self._told.add(reason)
            logger.warning(f"hybrid_predict: no Predict run at step {self.global_steps}: {why}. (Said once; "
                           "statistics()['held_back'] counts the steps each reason held Predict back.)")
        return False, 0

    def _warn_about_the_schedule(self) -> None:
        """Settings that keep Predict from ever running, said before the first step."""
        cfg = self.hybrid_config
        sched = getattr(self._config, "scheduler_name", None)
        constant = sched == "WarmupLR" or (sched is None and self.lr_scheduler is None)   # (a client scheduler: unknown)
        if cfg.predict_lr_fraction < 1.0 and constant:
            logger.warning(f"hybrid_predict.predict_lr_fraction is {cfg.predict_lr_fraction:g}, but the LR schedule "
                           f"({sched or 'none: a constant LR'}) never decays below its peak, so Predict will never "
                           "run; set predict_lr_fraction to 1.0 or use a decaying schedule (WarmupCosineLR, "
                           "WarmupDecayLR)")
        if self._total_steps and cfg.warmup_steps >= self._total_steps:
            logger.warning(f"hybrid_predict.warmup_steps ({cfg.warmup_steps}) is not shorter than the schedule's "
                           f"total_num_steps ({self._total_steps}): no Predict step will run")

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over the ranks (a collective)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return values
        dev = torch.device(get_accelerator().current_device_name())
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.cpu().tolist()

    def _agreed(self, values: list[float]) -> list[float]:
        """Rank 0's values on every rank. Each rank's predictor sees the same all-reduced
        inputs, but CPU math libraries may round differently per process (a least-squares
        fit differed in the 16th digit between two gloo ranks in a test), and one flipped
        comparison would split the phases and hang a collective. So rank 0's predictor
        decides; the others follow it (one small broadcast per decision)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return values
        dev = torch.device(get_accelerator().current_device_name())
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        torch.distributed.broadcast(t, src=0)
        return t.cpu().tolist()

    def _undo(self, device: DevicePredict | None, gradient: GradientPredict | None,
              groups: "set[int] | None" = None) -> None:
        """A rejected run (or predicted groups) back to the last good point, exactly: a device-side
        run by re-propagating the masters, which never moved; otherwise from the snapshot. A gradient
        run also drops its first moment. Collective."""
        if device is not None:
            device.discard(self._velocity)   # (its verified steps into the masters, the rest dropped)
            return
        if gradient is not None:
            gradient.discard()   # (its device path: the 16-bit weights from the untouched masters)
            if gradient.on_device:
                return
        za.restore_weights(self._masters, self._snapshot, groups=groups)

    def _commit_run(self, into_step: bool = False) -> None:
        """A kept device-side Predict run's displacement into the masters (``memory.commit_overlap``:
        on a host thread behind the forward and backward, joined by ``_wait_commit``).
        ``into_step`` (a real step's check, with ``memory.fold_in_step``): handed to the coming
        optimizer step where it is a whole-model one, which adds it block by block before each
        block's update (a layer-group step takes it whole before its step)."""
        if into_step and self._fusion is not None and not self._step_groups:
            self._wait_fold()
            self._step_commit = self._device_predict.take_commit(self._velocity)
            return
        if self._commit_overlap and self._folds is not None and self._folds.running:
            # The fold reads the masters: the commit's thread waits for it, not this one
            # (fold_during_run: it started at the last real step and may still run).
            self._device_predict.commit(self._velocity, background=True, first=self._folds.waiter())
            return
        self._wait_fold()   # (it reads the masters)
        if self._commit_overlap:
            self._device_predict.commit(self._velocity, background=True)
            return
        with self._timed("commit"):
            self._device_predict.commit(self._velocity)

    def _start_fold(self, lrs: list[float]) -> None:
        """This real step's fold on the host thread (``memory.fold_overlap``): from the Adam state
        and the masters its optimizer step left, which nothing writes before ``_wait_fold``.
        ``memory.fold_during_run``, before a Predict run: the run's copy of the velocity is made
        first (``DevicePredict.hold``), and the fold writes the host buffer once it has left."""
        p = self.hybrid_config.predictor
        parts = list(self._masters.partitions())   # DeepSpeed's structures read here, not on the thread
        step, host = int(self.global_steps), self._host_kernel
        left = self._velocity_copied()
        if self._fold_during_run and self.controller.phase is Phase.PREDICT:
            with self._timed("velocity_hold"):   # (a real step's work: the copy is queued here)
                left = self._device_predict.hold(self._velocity)

        def fold() -> torch.Tensor:
            if left is not None:
                left.synchronize()   # the copy beside the shards has read the host buffer
            return za.fold_real_update(self._masters, None, self._velocity, lrs, p.drift_beta, step,
                                       moments=False, host_kernel=host, parts=parts)
        self._folds.start(fold)

    def book_wall_clock_as_warmup(self) -> None:
        """The ``wall_clock_breakdown`` figures of the steps so far booked as Warmup
        (``ds-hybrid train --profile-warmup``); nothing without the breakdown."""
        if self._wall_clock is not None:
            self._wall_clock.book_so_far_as_warmup()

    def _velocity_copied(self):
        """The event after which the device path's last copies of the velocity to a GPU have read
        its host buffers (None: they have, or there were none): the fold writes them next."""
        return self._device_predict.take_copied() if self._device_predict is not None else None

    def _run_holds_velocity(self) -> bool:
        """The Predict run moves along its own copy of the velocity (``memory.fold_during_run``,
        ``DevicePredict.hold``), so the last real step's fold may go on meanwhile."""
        return self._device_predict is not None and self._device_predict.held

    def _wait_fold(self) -> None:
        """Join a fold running behind the step (what a step waits for it: ``fold_wait``)."""
        if self._folds is not None and self._folds.running:
            with self._timed("fold_wait"):
                self._folds.wait()

    def _wait_commit(self) -> None:
        """Join a commit running behind the step (what a real step waits for it: ``commit_wait``)."""
        for run in (self._device_predict, self._gradient):
            if run is not None and run.running:
                with self._timed("commit_wait"):
                    run.wait()

    @contextlib.contextmanager
    def _timed(self, part: str):
        """Time one part of the hybrid's work on the masters. Masters on a GPU: the current
        stream is synchronised at both ends, so the GPU work is what is counted."""
        sync = self._masters_on_cuda
        if sync:
            torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.current_stream().synchronize()
            b = self._stats.bookkeeping_seconds
            b[part] = b.get(part, 0.0) + time.perf_counter() - t0

    @contextlib.contextmanager
    def _timed_predictor(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stats.predictor_seconds += time.perf_counter() - t0

    def _observe(self, obs: Observation) -> None:
        """Hand one step's shared observation to the predictor (and the trajectory file)."""
        with self._timed_predictor():
            self.predictor.observe(obs)
        if self._trajectory is not None:
            self._trajectory.write(obs)

    def _measure_difficulty(self, batches: list) -> torch.Tensor:
        """This rank's (cross-entropy sum, token count) of the batch; zeros when off."""
        if self._difficulty is None:
            return torch.zeros(2, dtype=torch.float64)
        got = self._difficulty.measure(batches)
        return torch.tensor(got if got is not None else (0.0, 0.0), dtype=torch.float64)

    def _grad_norm(self) -> float | None:
        try:
            g = self.get_global_grad_norm()
        except Exception:  # not every optimizer wrapper keeps one
            return None
        if g is None:
            return None
        g = float(g)
        return g if g >= 0 else None

    def _record_progress(self, progress: float, lr: float, scale: float) -> None:
        s = self._stats
        s.progress_sum += progress
        s.progress_n += 1
        s.progress_positive += int(progress > 0)
        self.progress_log.append((int(self.global_steps), lr, scale, progress))
        del self.progress_log[:-10000]

    def _take_model_step(self, lr_kwargs):
        """DeepSpeed's boundary step. In a Predict step the optimizer's step is replaced,
        for this call only, by the predicted update; everything after it (zero_grad,
        overflow check, LR scheduler, global_steps, global_samples) runs unchanged.

        In a real step, one all-reduce shares the losses and whether any rank saw a
        NaN/Inf; if one did, every rank takes the optimizer wrapper's own overflow
        branch: gradients cleared, no update, LR scheduler not stepped,
        ``skipped_steps`` += 1, while ``global_steps`` / ``global_samples`` advance
        (DeepSpeed's fp16-overflow semantics)."""
        if self._predicted_update is None or not self._run_holds_velocity():
            # the last real step's fold reads the masters and moments this step writes (a device-side
            # drift step writes neither: with fold_during_run the fold goes on through the run)
            self._wait_fold()
        self._wait_commit()   # a kept run's displacement, added behind the forward/backward: the step reads the masters
        if self._predicted_update is None:
            if self._parking is not None:
                self._parking.wait()  # moments copied back during the forward/backward: the optimizer reads them
            if self._nonfinite_on_any_rank():
                self._commit_taken_inline()   # (no update reads the masters: they catch up all the same)
                with self._optimizer_reports_overflow():
                    return super()._take_model_step(lr_kwargs)
            groups = self._step_groups
            if not groups:
                if self._capture_shards:   # memory.fold_source: weights16: the shards before the step writes them
                    with self._timed("shard_capture"):
                        self._shards.capture(committed=self._device_predict.kept_runs != self._kept_runs_at_start)
                if self._fusion is not None:
                    return self._fused_model_step(lr_kwargs)
                if self._swap_fold is not None and self._fold_in_step:
                    self._arm_swap_fold()
                if self._stages_next_run():
                    self._gradient.stage_in_step(int(self.global_steps) + 1)
                if self._defer_step:
                    # (and without DeepSpeed's copy of the masters, not yet stepped, into the weights:
                    # the cover steps the weights as they are, _settle_cpu_step copies the stepped ones)
                    with cpu_step_behind.deferred(self._masters.base) as proxy, \
                            cpu_step_behind.skip_copies_into(self._masters.step_copy_targets()) as skip:
                        out = super()._take_model_step(lr_kwargs)
                    self._deferred = proxy.calls
                    self._stats.copies_skipped += skip.skipped
                    return out
                return super()._take_model_step(lr_kwargs)
            self._commit_taken_inline()
            # A partial step: the predicted groups take the predicted update before the
            # optimizer runs, and the optimizer leaves them out; the wrapper's own copy of the
            # masters into the 16-bit weights (and ZeRO's all-gather) then carries both.
            with self._timed("predicted_update"):
                self._apply_group_update(groups)
            try:
                with self._masters.optimizer_skips(groups):
                    return super()._take_model_step(lr_kwargs)
            finally:
                self._masters.lp_current = False
        opt, update = self.optimizer, self._predicted_update

        def predicted_step(*args, **kwargs):
            update()
            if hasattr(opt, "overflow"):
                opt.overflow = False  # fp16: the loss scaler must not count a predicted step

        # Instance attributes shadow the methods for this call only. Clipping is off:
        # there are no gradients to clip (ZeRO 0 fp32 would index an empty list).
        opt.step = predicted_step
        self.gradient_clipping = lambda: 0.0
        try:
            return super()._take_model_step(lr_kwargs)
        finally:
            del opt.step
            del self.gradient_clipping

    def _fused_model_step(self, lr_kwargs):
        """DeepSpeed's step with this step's commit and fold inside its CPU Adam step, one pass
        over each partition (``memory.fold_in_step``, ``step_fusion.py``). A partition the step
        does not reach takes its commit after the step; its fold is left to ``_full_step``."""
        vel, jobs = self._velocity, []
        taken, self._step_commit = self._step_commit, None
        steps, bufs = taken if taken is not None else ([], [])
        fold = self._fold_in_step
        if fold:
            copied = self._velocity_copied()
            if copied is not None:
                copied.synchronize()   # (the last upload has read the host velocity the fold writes)
        beta, moments = self.hybrid_config.predictor.drift_beta, self._learns_from_every_step()
        step = int(self.global_steps) + 1   # (what DeepSpeed's step makes it: the inline fold's noise seed)
        for i, part in enumerate(self._masters.partitions()):
            if part.master.numel() == 0:
                continue
            job = step_fusion.PartitionJob(i, part.group_index, za._flat(part.master))
            if i < len(bufs) and bufs[i] is not None and steps:
                job.commit = (bufs[i], [c[part.group_index] for c in steps])
            if fold:
                job.fold = step_fusion.FoldJob(functools.partial(vel.buffer, i, part.master), part.master.numel(),
                                               vel.dtype, vel.generator(part.master.device, step, i), beta,
                                               vel.updates == 0, moments, self._masters.decoupled_decay)
            if job.commit is not None or job.fold is not None:
                jobs.append(job)
        self._step_jobs = jobs if fold else None
        self._fusion.arm(jobs)
        try:
            return super()._take_model_step(lr_kwargs)
        finally:
            left = self._fusion.disarm()
            for job in left:
                job.commit_rest()
            b = self._stats.bookkeeping_seconds
            for job in jobs:
                for part, sec in job.seconds.items():
                    if sec:
                        b[f"{part}_in_step"] = b.get(f"{part}_in_step", 0.0) + sec
            if left and self._fusion.unmatched:
                raise RuntimeError("ds_hybrid: hybrid_predict.memory.fold_in_step: DeepSpeed's CPU Adam stepped "
                                   "tensors that are not the hybrid's master partitions; set memory.fold_in_step "
                                   "to false and report it")
            if fold and int(self.global_steps) != step:
                raise RuntimeError(f"ds_hybrid: memory.fold_in_step folded step {step}, but DeepSpeed's step "
                                   f"count is {int(self.global_steps)}")

    def _stages_next_run(self) -> bool:
        """``memory.gradient_prefetch`` under NVMe swap: this whole real step makes the state of a
        gradient run that may follow it inside its DeepSpeed step (``GradientPredict.stage_in_step``);
        the same answer on every rank (the config and the phase)."""
        g = self._gradient
        return (g is not None and g.on_device and self._masters.swaps and self.hybrid_config.memory.gradient_prefetch
                and self.controller.may_predict_next())

    def _arm_swap_fold(self) -> None:
        """This step's fold into DeepSpeed's ZeRO 3 step, a sub-group at a time while it is swapped
        in (``memory.fold_in_step`` under NVMe swap, ``swap_fold.py``)."""
        copied = self._velocity_copied()
        if copied is not None:
            copied.synchronize()   # (the last upload has read the host velocity the fold writes)
        lrs = [float(g["lr"]) for g in self._masters.base.param_groups]   # (the scheduler steps after it)
        self._swap_fold.arm(lrs, self.hybrid_config.predictor.drift_beta, int(self.global_steps) + 1,
                            self._learns_from_every_step())

    def _finish_swap_fold(self) -> torch.Tensor | None:
        """The direction statistics of the fold the last optimizer step took inside its sub-group
        steps (None: none), its time booked as ``fold_in_step``."""
        if self._swap_fold is None:
            return None
        out = self._swap_fold.finish()
        if out is not None:
            b = self._stats.bookkeeping_seconds
            b["fold_in_step"] = b.get("fold_in_step", 0.0) + self._swap_fold.seconds
        return out

    def _settle_cpu_step(self) -> None:
        """``memory.cpu_step_behind``, after a real step that deferred DeepSpeed's CPU Adam calls:
        a run begins next, so the GPU takes the step itself and the calls run behind the run; else
        they run now and the stepped masters go into the 16-bit weights as DeepSpeed's step would
        have put them (``cpu_step_behind.py``)."""
        calls, self._deferred = self._deferred, None
        if calls is None:
            return   # (none deferred, or a skipped step: DeepSpeed called no update; the same on every rank)
        # (a rank with no calls, an empty partition, still takes the collectives below)
        if self.controller.phase is Phase.PREDICT and not self._gradient.pending:
            with self._timed("cpu_step_cover"):
                self._gradient.cover(calls, int(self.global_steps))
            self._gradient.step_behind(calls)
            self._stats.steps_behind += 1
            return
        with self._timed("cpu_step"):
            cpu_step_behind.run_all(calls)
            self._masters.lp_current = False
            self._masters.propagate()

    def _commit_taken_inline(self) -> None:
        """A kept run's commit taken for the optimizer step (``memory.fold_in_step``) that no
        fused step will add: added now, whole."""
        taken, self._step_commit = self._step_commit, None
        if taken is None:
            return
        steps, bufs = taken
        with self._timed("commit"):
            for i, part in enumerate(self._masters.partitions()):
                if i < len(bufs) and bufs[i] is not None and part.master.numel():
                    job = step_fusion.PartitionJob(i, part.group_index, za._flat(part.master))
                    job.commit = (bufs[i], [c[part.group_index] for c in steps])
                    job.commit_rest()

    def _fused_fold_sums(self, jobs: list, lrs: list[float]) -> torch.Tensor:
        """This step's direction statistics from the fold inside its optimizer step (and the
        inline fold of any partition the step did not reach), as the inline fold returns them."""
        out = torch.zeros(self._masters.num_groups(), len(za.DIRECTION_STATS), dtype=torch.float64)
        folded = False
        for job in jobs:
            if job.reached:
                folded |= job.fold.add_to(out[job.group_index], job.master.numel())
        rest = {job.index for job in jobs if not job.reached}
        if rest:
            out += za.fold_real_update(self._masters, None, self._velocity, lrs, self.hybrid_config.predictor.drift_beta,
                                       int(self.global_steps), moments=self._learns_from_every_step(),
                                       host_kernel=self._host_kernel, only=rest, count=False)
            folded |= bool(out[:, 6].sum() > 0)
        self._velocity.updates += int(folded)
        return out

    @torch.no_grad()
    def _apply_group_update(self, groups: frozenset) -> None:
        if self.hybrid_config.predictor.direction == "none":
            return   # the control: predicted groups stay where they are
        scales = self._planner.scales(len(groups))
        if self._velocity is not None:
            za.apply_velocity_update(self._masters, self._velocity, scales, host_kernel=self._host_kernel)
        else:
            za.apply_predicted_update(self._masters, scales, backend=self.hybrid_config.kernels)

    def _nonfinite_on_any_rank(self) -> bool:
        """Collective: share this real step's losses (into ``_boundary_loss``) and the NaN/Inf flag."""
        loss_sum, count, bad = self._guard.collect()
        shared = self._all_reduce_sum(torch.tensor([loss_sum, count, float(bad)], dtype=torch.float64))
        self._boundary_loss = float(shared[0] / shared[1]) if shared[1] > 0 else None
        return bool(shared[2] > 0)

    def _optimizer_reports_overflow(self):
        """For one boundary step, make the optimizer wrapper take its own overflow branch,
        which knows where its stage keeps the accumulated gradients and clears them."""
        opt = self.optimizer
        name = type(opt).__name__
        if name == "DeepSpeedZeroOptimizer":  # ZeRO 1/2: step() asks check_overflow -> has_overflow
            return _instance_attrs(opt, check_grad_overflow=True, has_overflow=lambda partition_gradients=True: True)
        if name == "DeepSpeedZeroOptimizer_Stage3":
            def overflowed(update_scale=True):
                opt.overflow = True
                return True
            return _instance_attrs(opt, _overflow_check_and_loss_scale_update=overflowed)
        if name in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
            return _instance_attrs(opt, step=lambda closure=None: opt._skip_invalid_grad_norm())
        if name == "BF16_Optimizer":
            def skip(closure=None):
                opt.overflow = True
                opt.clear_hp_grads()
                opt.clear_lp_grads()
            return _instance_attrs(opt, step=skip)
        if isinstance(opt, torch.optim.Optimizer):  # ZeRO 0 fp32: the engine's zero_grad clears p.grad
            return _instance_attrs(opt, step=lambda *args, **kwargs: None, overflow=True)
        raise TypeError(f"ds_hybrid: cannot skip a step of optimizer wrapper {name}")

    def _snapshot_needed(self) -> bool:
        # Inside a Predict run the snapshot is the last good point a rejection returns to, and
        # after a partial step it is the predicted groups' rollback point until the next step's
        # check; at every other step boundary it is retaken (or unused) before it is read.
        # Device-side Predict runs leave the masters at the last good point: no snapshot.
        if self._device_path():
            return self._check_groups is not None and not self._check_run
        return (self.controller.phase is Phase.PREDICT and self.controller.predict_index > 0) \
            or self._check_groups is not None

    def _device_path(self) -> bool:
        """Predict runs leave the masters at the last good point (``memory.offload_predict``
        resolved to the device path, for the drift or the gradient direction)."""
        return self._device_predict is not None or (self._gradient is not None and self._gradient.on_device)

    # ------------------------------------------------------------ helpers
    def _as_micro_batches(self, micro_batches: Any) -> list:
        gas = self.batches_per_step()
        batches = list(micro_batches) if isinstance(micro_batches, (list, tuple)) else [micro_batches]
        if len(batches) != gas:
            per_step = (f"gradient_accumulation_steps is {gas}" if gas == self.gradient_accumulation_steps()
                        else "ZenFlow: every micro-step is an optimizer step")
            raise ValueError(f"train_step: got {len(batches)} micro-batches, but a step takes {gas} ({per_step}); "
                             f"pass one batch per micro-step of the optimizer step")
        if self.micro_steps % gas != 0:
            raise RuntimeError("train_step: called in the middle of an accumulation cycle "
                               "(mixing engine.step() calls with train_step is not supported)")
        return batches

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return t
        dev = torch.device(get_accelerator().current_device_name())
        buf = t.to(dev)
        torch.distributed.all_reduce(buf)
        return buf.cpu()

    def _all_reduce_in_place(self, t: torch.Tensor) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(t)

    def _world(self) -> int:
        if not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size()

    def _shared_mean_loss(self, losses: list[float]) -> float:
        t = self._all_reduce_sum(torch.tensor([sum(losses), len(losses)], dtype=torch.float64))
        return float(t[0] / t[1])

    def _lr(self) -> float:
        try:
            return float(self.get_lr()[0])
        except Exception:  # no optimizer param groups (never the case after init)
            return 0.0

    def _sync(self) -> None:
        # Wall-clock step times need the device idle; .item() above already synced the loss.
        if get_accelerator().device_name() != "cpu":
            get_accelerator().synchronize()

    def _account(self, r: StepResult) -> None:
        s = self._stats
        gas = self.batches_per_step()
        s.steps[r.phase] += 1
        s.seconds[r.phase] += r.step_time_s
        if r.backward_ran:
            s.backward_passes += gas
        else:
            s.backward_skipped += gas
        if r.predicted_groups:
            s.partial_backward += gas
            s.partial_share_sum += gas * self._layout.share_below(r.predicted_groups)
        s.verifications += int(r.verified)
        s.skipped_steps += int(r.skipped)
        if self.hybrid_config.enabled and self.hybrid_config.log_to_monitor and self.monitor.enabled \
                and self.global_rank == 0:
            events = [("Hybrid/phase", Phase(r.phase).code, self.global_samples),
                      ("Hybrid/confidence", r.confidence, self.global_samples),
                      ("Hybrid/step_time_s", r.step_time_s, self.global_samples),
                      ("Hybrid/backward_skipped_pct", self.statistics()["backward_skipped_pct"], self.global_samples)]
            if r.loss is not None:
                events.append(("Hybrid/loss", r.loss, self.global_samples))
            if r.predicted_loss is not None and math.isfinite(r.predicted_loss):
                events.append(("Hybrid/predicted_loss", r.predicted_loss, self.global_samples))
            # direction: gradient: what a share step is worth in real steps by the noise scale, once a pair
            # gave one (noise_scale.py), so a run's plot says whether its share steps pay as it goes
            for name, value in (("share_worth", self._noise.share_worth()),
                                ("gradient_noise_scale", self._noise.b_noise())):
                if value is not None:
                    events.append((f"Hybrid/{name}", value, self.global_samples))
            self.monitor.write_events(events)


def within_band(observed: float, expected: float, std: float, level: float | None, div) -> tuple[bool, float]:
    """The check of a predicted update by the next real step's first forward: is the loss
    inside the divergence band above its forecast? Returns (ok, excess over the forecast in
    units of the band). The band is the wider of ``rel_tolerance`` and ``z_threshold``
    standard deviations; above ``max_loss_ratio`` times the last real loss is always out."""
    if not math.isfinite(observed):
        return False, math.inf
    if level is not None and math.isfinite(level) and observed > div.max_loss_ratio * level:
        return False, math.inf
    if expected is None or not math.isfinite(expected):
        return True, math.nan
    band = abs(expected) * div.rel_tolerance
    if std is not None and math.isfinite(std):
        band = max(band, div.z_threshold * std)
    band = max(band, 1e-12)
    return observed <= expected + band, (observed - expected) / band


def make_predictor(cfg: HybridPredictConfig):
    """The predictor named by ``hybrid_predict.predictor.type``."""
    if cfg.predictor.type == "rssm":
        from .dynamics.predictor import RSSMPredictor
        return RSSMPredictor(cfg)
    return AdamDirectionPredictor(cfg)


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, config: Any = None, **kwargs):
    """``deepspeed.initialize`` that returns a ``PredictiveEngine``: the same 4-tuple
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The ``hybrid_predict`` section is validated before DeepSpeed builds anything,
    so a bad key fails before any training.
    """
    import deepspeed

    if not torch.distributed.is_initialized() and ensure_distributed_env():
        if "distributed_port" in kwargs:   # the port DeepSpeed's own discovery would have used
            os.environ["MASTER_PORT"] = str(kwargs["distributed_port"])
        logger.info("ds_hybrid.initialize: no launcher (no RANK / WORLD_SIZE): running as rank 0 of 1")
    # DeepSpeed's backward-compatible spellings, with its own deprecation warning.
    if config is None and kwargs.get("config_params") is not None:
        config = kwargs.pop("config_params")
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
        if getattr(args, "deepspeed_config", None) is not None:
            raise InitializeError("ds_hybrid.initialize: given both args.deepscale_config and "
                                  "args.deepspeed_config; pass one")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    # args.deepspeed_config is read here and handed to DeepSpeed as the parsed dict; the
    # caller's args keep it afterwards, as after deepspeed.initialize.
    from_args = config is None and args is not None and getattr(args, "deepspeed_config", None) is not None
    if from_args:
        config = args.deepspeed_config
    if config is None:
        raise InitializeError("ds_hybrid.initialize: no ds_config; pass config= (a dict, a path to a JSON or hjson "
                              "file, or a base64 string) or args.deepspeed_config")
    cfg_dict = load_ds_config(config)
    hybrid = parse_hybrid_config(cfg_dict)  # fail fast, naming the key
    if hybrid.enabled and optimizer is None and not cfg_dict.get("optimizer"):
        raise ConfigError("hybrid_predict.enabled: Predict steps read and move an Adam-family optimizer's state, and "
                          "this ds_config has no 'optimizer' section and initialize() got no optimizer=. Add "
                          "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": ...}} to the ds_config, pass "
                          "optimizer=torch.optim.AdamW(...) to initialize, or set hybrid_predict.enabled to false")
    refused = refused_before_deepspeed(cfg_dict, hybrid)   # (ZenFlow with the hybrid or accumulating)
    if refused:
        raise ConfigError(refused)

    # An interrupted op build leaves a lock that DeepSpeed's next build of that op waits on
    # forever, in silence: name it instead (ds-hybrid train also says what is about to be built).
    from .op_build import stale_locks, stale_message
    stale = stale_locks(cfg_dict, get_accelerator().device_name())
    if stale:
        raise RuntimeError(stale_message(stale))

    from deepspeed.pipe import PipelineModule
    if isinstance(model, PipelineModule):
        raise ValueError("ds_hybrid: pipeline-parallel models (PipelineModule) are not supported")
    if cfg_dict.get("hybrid_engine", {}).get("enabled", False):
        raise ValueError("ds_hybrid: DeepSpeed's RLHF hybrid_engine section cannot be combined with hybrid_predict")

    # deepspeed.initialize builds DeepSpeedEngine by its module-global name; rebinding it
    # for this one call gives our subclass every step of DeepSpeed's own initialize
    # (distributed init, mesh, zero.Init context, GC setup) without copying them.
    original = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = PredictiveEngine
    try:
        if from_args:
            args.deepspeed_config = None   # DeepSpeed refuses a config in both places
        result = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                      model_parameters=model_parameters, config=cfg_dict, **kwargs)
    finally:
        deepspeed.DeepSpeedEngine = original
        if from_args:
            args.deepspeed_config = config
    release_cpu_allreduce_segment()   # DeepSpeed's CPU allreduce would leave 64 MiB per rank in /dev/shm
    return result


class InitializeError(ValueError, AssertionError):
    """A bad argument to ``initialize`` that ``deepspeed.initialize`` refuses with an ``assert``
    (no config, two configs): both types, so code written for either one catches it."""
