"""The ``hybrid_predict`` section of a DeepSpeed JSON config.

It is typed and validated like DeepSpeed's own sections (a pydantic
``DeepSpeedConfigModel`` with ``extra="forbid"``), so a misspelt key or a bad
value fails before any training, with a message that names the key, for
example ``hybrid_predict.divergence.z_threshold: Input should be greater than 0``.

Every field carries a docstring; ``reference_markdown()`` renders them into the
configuration table of the README, and a test keeps the two in step.
"""
from __future__ import annotations

import difflib
import json
import logging
from typing import Any, Literal, Mapping

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

SECTION = "hybrid_predict"


class ConfigError(ValueError):
    """A bad ``hybrid_predict`` section or an incompatible DeepSpeed config."""


class _Section(DeepSpeedConfigModel):
    # Field docstrings become pydantic descriptions: one source for code and README.
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", strict=True,
                              validate_default=True, validate_assignment=True)


class DivergenceConfig(_Section):
    """When a verified Predict step is rejected and rolled back."""

    rel_tolerance: float = Field(0.02, ge=0.0)
    """Accepted band above the predicted loss, as a fraction of it: a verified loss above
    ``predicted * (1 + rel_tolerance)`` (and above the noise band) is rejected."""

    z_threshold: float = Field(3.0, gt=0.0)
    """Noise band in standard deviations of the per-step loss residual seen in real
    steps; the band is the wider of this and ``rel_tolerance``."""

    max_loss_ratio: float = Field(1.5, gt=1.0)
    """Hard ceiling: a verified loss above this multiple of the last real-step loss
    level is rejected whatever the bands say."""


class PredictorConfig(_Section):
    """The predictor that builds a Predict step's weight update."""

    type: Literal["adam_direction", "rssm"] = "adam_direction"
    """Both move the weights along the bias-corrected Adam direction
    ``m_hat / (sqrt(v_hat) + eps)`` read from the optimizer state, times the learning
    rate and a step scale (needs Adam, AdamW, FusedAdam or CPU Adam). ``adam_direction``:
    one learned scale, a linear loss trend, confidence from the direction cosine.
    ``rssm``: the dynamics model of the ``dynamics`` section (64-feature encoder, RSSM
    ensemble, residual corrector, calibrated confidence, bandit horizon, per-layer-group
    scales learned from measured progress)."""

    step_scale: float = Field(0.5, gt=0.0)
    """Multiplier on the learned step scale. The learned scale is the running projection
    of each real Adam direction on the previous one (how much of a step's direction
    the next step keeps); this factor damps or boosts it."""

    max_step_scale: float = Field(1.0, gt=0.0)
    """Upper clamp on the step scale applied in a Predict step."""

    scale_ema: float = Field(0.9, ge=0.0, lt=1.0)
    """Smoothing of the learned step scale and direction cosine across real steps."""

    loss_window: int = Field(16, ge=3)
    """Real-step losses used for the linear loss trend that gives the predicted loss."""

    learn_from_full_steps: bool = True
    """Compare predicted and actual Adam directions on every real step (Warmup, Full and
    Correct), not only on Correct steps. Costs two passes over the master weights per
    real step and uses the snapshot buffer. (``direction: drift`` compares on every real
    step whatever this says: its velocity is updated there.)"""

    direction: Literal["adam", "drift", "gradient", "none"] = "adam"
    """What a Predict step moves the weights along. ``adam``: the bias-corrected Adam
    direction of the optimizer state plus AdamW's decay (the optimizer's next step if the
    gradient did not change). ``drift``: the running average of the real steps' updates
    per unit LR (``drift_beta``), which averages out their step-to-step oscillation; it
    keeps one more buffer per parameter (``memory.velocity_dtype``), reads no optimizer
    state in Predict steps, and its step scale is the running projection of each real
    update on that average. ``none``: the control that measures what predicted updates are
    worth: everything as ``drift`` (the velocity, its statistics and the decisions they feed),
    but Predict steps move nothing (they still advance the LR schedule and the step counters).
    ``gradient``: each Predict step takes its own gradient (a forward and backward of its own
    through the module, outside DeepSpeed's gradient path: no reduction buckets, no offload
    copies, no optimizer step) into a first moment the run keeps, and moves by Adam's step with
    the second moment held at the last real step's; a kept run hands its first moment to the
    optimizer, a rolled-back one drops it. Worth about a real step in loss
    (``benchmarks/grad_step_study.py``); its step costs a forward and a backward, so it pays
    where the optimizer step is dear (ZeRO-Offload: ``memory.offload_predict`` keeps the run on
    the GPU). Real steps keep no direction statistics for it: the confidence is the share of
    checked runs kept. ZeRO 0 fp32 and ZeRO 1-3, bf16 or fp32; on ZeRO 3 no rank holds a whole
    gradient (each parameter's share is taken as the backward produces it). With ZeRO-Infinity
    the masters and Adam state may be on NVMe (``offload_optimizer.device: nvme``): a run swaps
    each sub-group in once where it begins, a kept run's commit goes into DeepSpeed's own step
    (before each sub-group's Adam step), and on the device path its steps read none of them.
    With the 16-bit parameters on NVMe too (``offload_param.device: nvme``) a device-path step
    reads each sub-group's partition from the drive into one host buffer, steps it there and
    writes it back."""

    drift_beta: float = Field(0.95, gt=0.0, lt=1.0)
    """``direction: drift``: decay of the running average of real updates (0.95 averages
    over about 20 real steps)."""

    gradient_batch_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """``direction: gradient``: the share of the step's batch a Predict step takes its gradient
    from: the first ``round(fraction * gradient_accumulation_steps)`` micro-batches (at least
    one), or with one micro-batch a step the first ``round(fraction * micro batch)`` sequences
    of it (at least one). The step still stands for its whole batch (the data stream, the
    schedule and the counters move as a real step's), so below 1 a Predict step costs about
    that share of a real step's forward and backward for a noisier gradient: what pays where
    a real step's forward and backward are dear too (gradient accumulation under
    ZeRO-Offload, or any run on a CPU). What such a step is worth depends on the gradient
    noise scale against the batch; the run measures it from norms it already has and reports
    the worth it projects beside the step's cost (``statistics()["gradient_noise_scale"]``,
    ``noise_scale.py``)."""

    gradient_lr_scale: float = Field(1.0, gt=0.0)
    """``direction: gradient``: the share of the schedule's learning rate (and of AdamW's decay,
    which scales with it) a Predict step takes; real steps take the whole. A gradient from a
    small share of the batch (``gradient_batch_fraction``) is noisy, and a lower rate can pay:
    measured in ``benchmarks/grad_step_study.py`` (3 seeds a setting, 7 Predict steps a real
    one), 0.7 took an eighth of a 64-sequence batch from 0.26 to 0.31 of a real step's worth,
    a quarter of 16 from 0.42 to 0.45, but a quarter of 64 and a half of 16 lost 0.02-0.05,
    and Adam's square-root rule (the fraction's square root) gained nothing beyond the seeds'
    spread (docs/memory.md, "A share step's learning rate"). So the default is the schedule's
    rate."""

    gradient_second_moment: Literal["auto", "held", "updated"] = "auto"
    """``direction: gradient``: Adam's second moment in a Predict run. ``held``: the last real
    step's, read in place (no copy beside the run's first moment). ``updated``: Adam's own, each
    Predict gradient folded into a copy of it as into the first moment (``v = beta2 v +
    (1 - beta2) g^2``), the copy handed to the optimizer with the first moment when the run is
    kept and dropped when it is rolled back: one more copy of this rank's partition, fp32 on the
    host path, in ``memory.gradient_state_dtype`` on the device path (none more where the device
    path copies the optimizer's already: beside a GPU under ``offload_optimizer``). With a held
    ``v`` a coordinate whose Predict gradients outgrow its last real ones steps by ``m / sqrt(v)``
    without Adam's bound; at ``betas[1]`` 0.95 (the 1B and 7B presets', GPT-2's) a half of a
    32-sequence batch at 15 Predict steps a real one stalled near 2.9 on a 2x schedule (ended
    2.74) and reached plain ZeRO-Offload's final loss with ``updated`` (3 of 3 seeds; docs/offload.md,
    "At the 1b-16gb preset's batch"). At 0.999 a held ``v`` moves little between real steps, and
    ``updated`` reached plain's final loss no sooner (``offload-b64``'s arm, 3 seeds: later on
    two, on neither within its schedule on the third). ``auto`` (the default): ``updated`` where
    the optimizer's ``betas[1]`` is below 0.99 (``v`` remembers under 100 steps, a few Predict
    runs), else ``held``; ``held`` too where the run's state cannot update it (below). The choice
    is in ``statistics()["gradient_second_moment"]``.
    Not ``updated`` with ``memory.gradient_state_dtype`` int8/int4-factored or
    ``memory.cpu_step_behind``, whose second moment is factored or the cover's."""

    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """``direction: gradient`` with a model under activation checkpointing (transformers'
    ``gradient_checkpointing``): whether a Predict step's own backward recomputes each
    checkpointed block's forward, as a real step's does. ``true``: it does. ``false``: the
    step's forward keeps the blocks' activations and its backward recomputes nothing (about one
    forward less a step, for the activations' memory while it runs); the gradient is the same
    bit for bit. ``auto``: ``false`` where that memory fits, decided once per micro-batch size
    (in tokens; the largest on any rank) and agreed by every rank: the first Predict step of a
    size runs checkpointed and the activations the blocks would keep are counted as the planner
    counts them (``ds-hybrid plan``). On a GPU they go on what the allocator held at the end of
    that step's forward (the step's peak where higher), against the process's limit
    (``torch.cuda.set_per_process_memory_fraction`` included) less 10% for fragmentation; on a
    CPU against half the host's available memory, shared by the node's ranks. A model without a
    transformers config to count from keeps recomputing. ``statistics()["gradient_recompute"]``
    says what was decided and from what (``ds_hybrid/grad_recompute.py``)."""


class DynamicsConfig(_Section):
    """The dynamics model used by ``predictor.type: rssm`` (ds_hybrid/dynamics/)."""

    ensemble_size: int = Field(3, ge=1, le=16)
    """RSSM ensemble members; they differ in initialisation and in the windows they train
    on, and their disagreement is part of the confidence."""

    deter: int = Field(256, ge=8)
    """Size of each member's deterministic GRU state."""

    stoch: int = Field(32, ge=1)
    """Size of each member's stochastic Gaussian latent."""

    horizon: int = Field(8, ge=1, le=64)
    """Steps ahead the loss head forecasts (k = 1..horizon); at least ``max_predict_steps``."""

    train_every: int = Field(4, ge=1)
    """Train the RSSM after every this many real observations."""

    train_iters: int = Field(1, ge=0)
    """Gradient steps per training round (0 freezes the model, e.g. after ``init_from``)."""

    window: int = Field(16, ge=2)
    """Length of the observation windows the RSSM trains and filters on."""

    batch_windows: int = Field(8, ge=1)
    """Windows per member per gradient step."""

    lr: float = Field(1e-3, gt=0.0)
    """Learning rate of the RSSM's own Adam optimizer."""

    replay: int = Field(2048, ge=32)
    """Observations kept for training (the oldest are dropped)."""

    min_observations: int = Field(24, ge=4)
    """Observed losses needed before the predictor may predict at all."""

    corrector: bool = True
    """Correct the RSSM's loss and step-scale forecasts with the online residual
    regression of ``dynamics/corrector.py``."""

    calibration_bins: int = Field(5, ge=1)
    """Bins of the raw score (ensemble disagreement and recent error against the acceptance
    band) in which the acceptance frequency, the confidence, is counted."""

    explore_every: int = Field(3, ge=0)
    """While the current bin has fewer than ``explore_evidence`` verified outcomes, take a
    1-step exploratory Predict run at every n-th decision (0: never). Exploratory steps
    are counted apart in the calibration table."""

    explore_evidence: int = Field(8, ge=0)
    """Verified outcomes a bin needs before exploration stops there."""

    bandit_alpha: float = Field(0.5, ge=0.0)
    """LinUCB exploration weight of the horizon bandit."""

    progress_every: int = Field(1, ge=0)
    """Measure the progress of every n-th verified Predict step: the no-grad loss of its
    batch before the predicted update (the same run with the step skipped) minus the loss
    after it. It teaches how far to go; 0 turns it off. Costs one forward per measurement."""

    reject_negative_progress: bool = True
    """Roll back a measured Predict step whose batch loss is higher than without it."""

    min_group_cosine: float = Field(0.0, ge=-1.0, le=1.0)
    """A layer group whose running cosine between consecutive Adam directions is below this
    is not moved in Predict steps (its direction does not persist)."""

    batch_difficulty: bool = True
    """Condition loss forecasts on a cheap statistic of the batch, known before its forward:
    its tokens' cross-entropy under running bigram counts (unigram above 1024 tokens of
    vocabulary). Needs ``input_ids`` batches; it explains much of the batch-to-batch loss noise."""

    trajectory_path: str | None = None
    """Write one JSON line per optimizer step (the observation the predictor saw) to this
    file on rank 0, for offline evaluation (``ds-hybrid dynamics-eval``). Any predictor type."""

    init_from: str | None = None
    """Start the predictor from a state saved by ``ds-hybrid dynamics-eval --save-predictor``
    (a predictor trained offline on recorded trajectories)."""

    seed: int = 0
    """Seed of the ensemble's initialisation and window sampling."""

    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where the dynamics model (RSSM, its training, the encoder's window features) runs:
    ``cpu`` (its own thread, off the accelerator), ``cuda`` (the rank's current GPU, where the
    ``kernels/rssm.cu`` and ``kernels/encoder.cu`` kernels apply under ``kernels`` auto or cupy),
    ``auto`` (``cuda`` when a GPU is present). Decisions are broadcast from rank 0 either way."""


def offload_predict_on_device(setting: str, host_masters_beside_accelerator: bool,
                              masters_swapped: bool = False) -> bool:
    """``memory.offload_predict``: ``device`` and ``host`` as said; ``auto`` is the device path
    where the masters live in host memory beside an accelerator (ZeRO-Offload on a GPU), or on
    NVMe (``masters_swapped``: ZeRO-Infinity's ``offload_optimizer: nvme``, on any accelerator,
    the 16-bit parameters in memory or on NVMe too), where the host path would swap every
    sub-group in and out at every Predict step. (The engine then checks the setup can take it;
    the planner estimates with the same rule.)"""
    return setting == "device" or (setting == "auto" and (host_masters_beside_accelerator or masters_swapped))


def masters_swapped(offload_optimizer_device: str) -> bool:
    """``offload_predict_on_device``'s ``masters_swapped`` from a ds_config's optimizer offload device
    (with ``offload_param: nvme`` too, the device path reads and writes the 16-bit partitions on
    NVMe: ``device_predict.py``)."""
    return offload_optimizer_device == "nvme"


def compact_state_refusal(gradient_state_dtype: str, device_path: bool) -> str | None:
    """Why ``predictor.direction: gradient`` cannot take ``memory.gradient_state_dtype``
    ``int8-factored`` / ``int4-factored`` in this setup (None: it can, or the dtype is not one of
    them). The engine refuses the run with it; the planner marks the preset as not fitting."""
    if gradient_state_dtype not in ("int8-factored", "int4-factored"):
        return None
    if device_path:
        return None
    return (f"hybrid_predict.memory.gradient_state_dtype: {gradient_state_dtype}, but memory.offload_predict "
            "resolved to host (the compact state lives beside the 16-bit weights)")


# predictor.gradient_second_moment "auto": a gradient Predict run updates Adam's v where the
# optimizer's betas[1] is below this. v remembers about 1 / (1 - beta2) steps: 20 at 0.95, about a
# 15-step run, so a held v is stale within one (measured to stall there); 1000 at 0.999, where a
# run hardly moves it (measured: updating gained nothing).
UPDATE_V_BELOW_BETA2 = 0.99


def second_moment_updated(setting: str, beta2: float, gradient_state_dtype: str, cpu_step_behind: bool) -> bool:
    """``predictor.gradient_second_moment`` resolved: whether a gradient Predict run folds its
    gradients into a copy of Adam's second moment. ``held`` / ``updated`` as set (the config
    refuses ``updated`` where the state cannot keep it); ``auto``: where ``beta2``, the
    optimizer's smallest ``betas[1]``, is below UPDATE_V_BELOW_BETA2 and the run keeps a whole
    ``v`` (not the factored one of ``memory.gradient_state_dtype`` int8/int4-factored nor
    ``memory.cpu_step_behind``'s cover)."""
    if setting != "auto":
        return setting == "updated"
    if gradient_state_dtype in ("int8-factored", "int4-factored") or cpu_step_behind:
        return False
    return beta2 < UPDATE_V_BELOW_BETA2


def offload_devices(ds_config: Mapping[str, Any]) -> tuple[str, str]:
    """``zero_optimization.offload_optimizer.device`` and ``offload_param.device`` of a ds_config
    dict, ``none`` where absent (DeepSpeed's default)."""
    zo = ds_config.get("zero_optimization") or {}
    devices = []
    for key in ("offload_optimizer", "offload_param"):
        section = zo.get(key) if isinstance(zo, Mapping) else None
        devices.append(str(section.get("device", "none")) if isinstance(section, Mapping) else "none")
    return devices[0], devices[1]


def refused_before_deepspeed(ds_config: Mapping[str, Any], hybrid: HybridPredictConfig) -> str | None:
    """What the engine cannot run that the ds_config alone shows, outside the ``hybrid_predict``
    section (``parse_hybrid_config`` checks that one): ``initialize`` raises it before DeepSpeed
    builds anything, and ``ds-hybrid train`` exits with it among its input checks (ZenFlow with
    gradient accumulation also with the hybrid off: DeepSpeed would shrink the batch). Not part of
    ``parse_hybrid_config``: ``ds-hybrid plan --set`` parses every preset with the change and
    estimates it instead of stopping."""
    zo = ds_config.get("zero_optimization") or {}
    gas = ds_config.get("gradient_accumulation_steps")
    if isinstance(zo, Mapping) and zo.get("zenflow") and isinstance(gas, int) and gas > 1:
        # DeepSpeed's ZenFlow sets gradient_accumulation_steps to its update_interval and makes every
        # micro-batch an optimizer step: a config that accumulates would train, in silence, on a
        # batch gradient_accumulation_steps times smaller than it says.
        micro = ds_config.get("train_micro_batch_size_per_gpu")
        fold = (f" (here train_micro_batch_size_per_gpu {micro * gas})" if isinstance(micro, int) else "")
        return (f"gradient_accumulation_steps: {gas} under zero_optimization.zenflow: DeepSpeed's ZenFlow makes "
                "every micro-batch an optimizer step (its update_interval takes gradient_accumulation_steps' "
                f"place), so each step would see 1/{gas} of the batch; set "
                "gradient_accumulation_steps to 1 and train_micro_batch_size_per_gpu to the whole batch per rank"
                f"{fold}")
    if not hybrid.enabled:
        return None
    if isinstance(zo, Mapping) and zo.get("zenflow"):
        # ZenFlow replaces the optimizer step (a selective update on the device every micro-step,
        # the rest on the CPU every update_interval): the masters and Adam state the Predict
        # steps read are not where the hybrid's accessors look.
        return ("zero_optimization.zenflow: ZenFlow runs its own selective and asynchronous updates and cannot be "
                f"combined with {SECTION}; set {SECTION}.enabled to false to train with ZenFlow "
                "(ds-hybrid train --baseline), or drop the zenflow section")
    return None


def fold_from_optimizer_state(setting: str, device_path: bool) -> bool:
    """``memory.fold_source``: whether real steps read their update back from the Adam state
    (``auto``: with the device-side Predict path). The engine also refuses it under amsgrad."""
    return setting == "optimizer_state" or (setting == "auto" and device_path)


class MemoryConfig(_Section):
    """Phase-aware memory: what the Predict phase keeps, where and in which precision."""

    velocity_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """Storage of the ``direction: drift`` velocity (one value per parameter of the rank's
    partition): ``fp32`` 4 bytes, ``bf16`` 2, ``int8`` 1 (+ one fp32 scale per 256 values,
    stochastic rounding; see ``ds_hybrid/quant.py``). Under ZeRO-Offload a real step folds its
    update into it in host memory, and int8's rounding is that fold's dearest part: inside
    DeepSpeed's CPU Adam step (``fold_in_step``) the pass took 2.12x DeepSpeed's step alone with
    int8, 1.45x with bf16 and 1.46x with fp32 (a 2-core CPU, 2026-11-29, ``benchmarks/fold_in_step.py
    --velocity``; beside a GPU owed)."""

    park_optimizer_states: bool = False
    """Move the Adam moments (``exp_avg``, ``exp_avg_sq``: 8 bytes per parameter of the
    rank's partition) off the accelerator at the start of each Predict run and back when it
    ends, before the next real step: on a CUDA device by ds_hybrid's overlapped copies
    (``park_overlap``), else DeepSpeed's ``offload_states`` on ZeRO 1-2 (and ZeRO 3 with
    FusedAdam) and ds_hybrid's own move elsewhere; nothing to do when they already live in
    CPU memory (``offload_optimizer``). Needs ``predictor.direction: drift``, whose Predict
    steps do not read them."""

    park_overlap: bool = True
    """With ``park_optimizer_states`` on a CUDA device: move the moments with ds_hybrid's own
    copies on a side CUDA stream, overlapped with the Predict run's forwards (out) and with
    the next real step's forward/backward (back; only its optimizer step waits for them). ``false``: DeepSpeed's ``offload_states`` / ``reload_states`` where
    they apply: synchronous, and they empty the CUDA cache, which also lowers the device's
    reserved memory during the run."""

    offload_predict: Literal["auto", "host", "device"] = "auto"
    """Where a Predict step's update goes when the fp32 masters live in host memory
    (``zero_optimization.offload_optimizer``). ``host``: into the masters, then propagated to
    the 16-bit parameters (a host pass and a parameter copy per step, a host snapshot per
    run). ``device``: into the 16-bit parameters, with no host-master read or write and no
    snapshot; the masters catch up once, when the next real step's check keeps the run, and a
    rejected run is undone by re-propagating the untouched masters. ``predictor.direction:
    drift`` (ZeRO 1-3, ``ds_hybrid/device_predict.py``): from a copy of the velocity beside
    the 16-bit parameters, the masters taking the run's displacement bit for bit as the host
    path's. ``gradient`` (ZeRO 1-3, ``ds_hybrid/grad_predict.py``): from copies of the Adam
    moments beside them (``gradient_state_dtype``), made once per run; the masters take the
    16-bit weights plus their own sub-16-bit residual (with fp32 weights bit for bit the host
    path's). With ZeRO 3's ``offload_param: cpu`` the 16-bit partitions, and so the run's
    state, are in host memory; with ``offload_param: nvme`` (drift only) each Predict step reads
    a sub-group's 16-bit partitions from the drive into one host buffer, adds the step there and
    writes them back (2 bytes a parameter each way in bf16). ``auto``: ``device`` where the
    masters are in host memory beside a GPU, or on NVMe (``offload_optimizer.device: nvme``, on
    any accelerator: the host path would swap every sub-group in and out at every Predict step
    and keep a 4-byte-a-parameter snapshot; the device path swaps none for drift and each once
    where a gradient run begins, and a kept run's commit goes into DeepSpeed's step)."""

    gradient_state_dtype: Literal["auto", "fp32", "bf16", "int8-factored", "int4-factored"] = "auto"
    """``predictor.direction: gradient`` on the device path (``offload_predict``): the dtype
    of the run's copies of Adam's first and second moments beside the 16-bit parameters
    (8 bytes per parameter of the rank's partition in fp32, 4 in bf16; the first moment goes
    back to the optimizer when the run is kept), and of the step's gradient summed over
    micro-batches and ranks (with gradient accumulation or several ranks: 4 or 2 bytes a
    parameter). ``auto``: bf16 where the parameters are bf16 on a GPU, else fp32. (Measured with bf16 state and stochastically rounded bf16 weights:
    0.97-1.00 of a real step, ``benchmarks/grad_step_study.py``.) ``int8-factored`` (ZeRO 1-3,
    for 7B under 24 GB): about a byte a parameter in all and no gradient held: the first moment in
    int8 blocks, the second a matrix's row and column means, each parameter's gradient clipped by
    its own norm to its share of ``gradient_clipping`` and folded into the first moment as the
    backward produces it (``ds_hybrid/compact_moments.py``; 0.94-0.95 of a real step at 1 : 3 and
    1 : 7 on the study's model, against 0.95-0.96 with the whole gradient's clip).
    ``int4-factored``: the first moment in 4 bits (1.00 and 1.06 there): what fits 7B under 24 GB
    (docs/memory.md). With ``cpu_step_behind`` the real step's cover builds the run's compact
    moments from the optimizer's before the step and folds the step's gradient into both, the
    second moment's row and column means by the same update, so only the gradient crosses
    besides what a run's start copies (the factored second moment in the real step's update too:
    a step from the last run's kind of state, its loss priced in docs/memory.md). Otherwise their moments are made at the run's first
    step (no prefetch), and a kept run's commit is inline unless ``commit_overlap`` is true; with ZeRO 3's ``offload_param: cpu`` they are in host memory, beside the
    16-bit partitions, and each gradient slice crosses to them in its hook."""

    gradient_prefetch: bool = True
    """``predictor.direction: gradient`` on the device path (``offload_predict``) beside a GPU:
    make the next run's copies of the moments on a host thread while the real step before the
    run does its forward and backward (the cast to ``gradient_state_dtype`` on the host, through
    pinned chunks), so the run's first step finds them made. ``false``: that step makes them
    itself (``bookkeeping_seconds.state_upload``), and no host thread reads 8 bytes a parameter
    beside the real step's backward, whose gradient copies and fp32 accumulation are host work
    under ZeRO-Offload. The same copies either way, so the same run bit for bit. Where nothing
    crosses to another device (DeepSpeed's CPU accelerator) no copy is made ahead either way.
    Under ZeRO-Infinity's NVMe swap (``offload_optimizer: nvme``) the run's state (the copies,
    or the compact moments of ``gradient_state_dtype``) is made inside the DeepSpeed step of
    every real step that ends a Full or Correct phase (a run may follow it), each sub-group's
    just after its Adam step while it is swapped in, on every accelerator: the run's first step
    then swaps nothing, where it swapped every sub-group in and out for its moments (dropped at
    the next real step where no run came: ``gradient_prefetch_stale``).
    (On an H200 with llama-1b the gradient arm's real steps took 410 ms in their backward, with
    these copies and a kept run's commit on host threads beside it, against plain ZeRO-Offload's
    349: memory-bench's ``grad-device-noprefetch`` and ``grad-device-inline`` say how much of
    that the threads are; a GPU number, owed.)"""

    cpu_step_behind: bool = False
    """``predictor.direction: gradient`` on the device path (``offload_predict``) under ZeRO 1, 2
    or 3 with ``offload_optimizer: cpu``: the real step before a Predict run does not wait for
    DeepSpeed's CPU Adam step. The GPU takes the same Adam step itself, from the step's clipped
    gradient and the moments from before it (copied beside the 16-bit weights, the moments'
    arithmetic in fp32, the weights rounded stochastically in bf16), the run goes on from those
    weights and moments, and DeepSpeed's step of the fp32 masters and host moments runs on a host
    thread behind the run (joined at the next real step, a checkpoint or a rollback). Nothing is
    stale: the masters and moments are DeepSpeed's, and the run's weights differ from
    ``round(masters)`` by the GPU step's rounding only, which the run's commit carries into the
    masters. A real step that no run follows runs the step at once. ``statistics()``:
    ``cpu_steps_behind``, ``cpu_step_behind_seconds`` (the thread's time),
    ``bookkeeping_seconds.cpu_step_cover`` (the GPU's step and its copies), ``cpu_step_wait`` (a
    real step's wait for the thread) and ``cpu_step`` (the steps run at once). ``true`` refuses,
    naming the key, other setups (ZeRO 0, ZeRO 3 with NVMe or an ``offload_optimizer.ratio`` below
    1, the host path, another optimizer, ``fold_in_step``, ``group_predict``). Under ZeRO 3 with
    ``offload_param: cpu`` the 16-bit partitions, and so the cover's step, are in host memory:
    there the cover takes on the host the step it moves off the real step. Why (docs/memory.md, "The CPU window"): a step left behind cost 25-67% in
    loss on the CPU preset, a guessed cover more; this cover is exact. What it saves is a GPU
    number, owed: up to the CPU Adam step, 441 of the gradient arm's 869 ms real step for
    llama-1b beside an H200, less the copies of the gradient and moments to the GPU. With
    ``gradient_state_dtype`` ``int8-factored`` / ``int4-factored`` (the 7B route) the cover
    builds the run's compact moments from the optimizer's before the step, as a run's start
    does, and folds the step's gradient into both (the second moment's row and column means by
    the same update): the gradient is the one extra copy, and the full-size moments are never
    on the GPU. Its step then takes the factored second moment, as the run's steps do (not
    exact: the run's commit carries its difference from DeepSpeed's step into the masters;
    priced in loss by ``benchmarks/grad_step_study.py --real-cover compact``, docs/memory.md)."""

    commit_overlap: bool | Literal["auto"] = "auto"
    """With the device-side Predict path (``offload_predict``): the masters take a kept run's
    displacement (``direction: gradient``: the 16-bit weights, and the optimizer the run's first
    moment) on a host thread, started when the next real step's check keeps the run and
    overlapped with that step's forward and backward on the GPU (neither reads the masters);
    the optimizer step waits for it. The same additions in the same order, so the same masters
    bit for bit as ``false``, which adds them inline before the backward. ``statistics()``:
    ``commit_background_seconds`` (the thread's time) and ``bookkeeping_seconds.commit_wait``
    (the real steps' wait for it). ``auto``: on where the masters are in host memory beside a
    GPU (on DeepSpeed's CPU accelerator the thread would take the forward's own cores), except
    with a compact ``gradient_state_dtype``, whose commit behind the step is measured on the CPU
    only: ``true`` there dequantizes its first moment on a side stream beside the next backward."""

    fold_overlap: bool | Literal["auto"] = "auto"
    """With ``fold_source: optimizer_state``: a real step's fold of its update into the drift
    velocity runs on a host thread, started after its optimizer step and overlapped with the next
    real step's forward and backward (neither reads the masters and moments it reads, nor the
    velocity it writes); the next optimizer step, a capture or commit of the masters and a
    checkpoint wait for it, and a real step after which a Predict step comes (it moves along the
    velocity) waits for its own before it ends. The velocity is the inline fold's bit for bit; the
    predictor sees the fold's direction statistics with the next real step, so its step scale
    and confidence lag the inline fold's by one real step (``ds_hybrid/fold_overlap.py``).
    ``statistics()``: ``fold_background_seconds`` and ``bookkeeping_seconds.fold_wait``.
    ``true`` refuses, naming the key, setups whose every-step statistics are read at that step
    (``group_predict``, ``predictor.type: rssm``, ``dynamics.trajectory_path``), the ``snapshot``
    fold source, and NVMe optimizer offload (the fold would swap on its thread beside
    DeepSpeed's swapper; ``fold_in_step`` folds inside its step there). ``auto``: on where it
    can be, the masters are in host memory beside a GPU (on DeepSpeed's CPU accelerator the
    thread would take the forward's cores) and
    ``fold_in_step`` is off (its one pass inside the step is cheaper there: 1044 against 1172 ms
    a real step with llama-1b on an H200)."""

    fold_during_run: bool | Literal["auto"] = "auto"
    """With ``fold_overlap`` and the device-side drift path (``offload_predict``): a Predict run
    moves along the velocity as it was before the last real step's fold, so that fold runs on its
    host thread during the run instead of before it. Without it, the real step before a run waits
    for its own fold (``bookkeeping_seconds.fold_wait``; 129 ms of a 862 ms real step with
    llama-1b on an H200, 2026-11-26). At the end of that real step the velocity is copied beside
    the 16-bit shards for the run (a copy the run holds until it ends: the host buffer is the
    fold's again once the copy has left it); the commit adds the run's steps along that copy
    (from a GPU a chunk at a time through pinned buffers) on the commit's thread after the
    fold, so the masters are bit for bit those of a host path moving along the same velocity. A
    checkpoint in the middle of a run saves the held copy too. The velocity each run moves along
    misses the last real step's update (one fold of ``drift_beta``'s average): what that costs in
    loss is ``benchmarks/fold_overlap_ab.py --arms behind during``. ``true`` refuses, naming the
    key, setups without ``fold_overlap`` or the device-side drift path. ``auto``: off. Measured on
    an H100 with llama-1b (2026-11-26) it made the real steps slower than the fold behind the step
    (803 against 746 ms, Predict steps 20.4 against 18.1 ms): a run of a few 20 ms steps is too
    short for the fold, which then lands in the next real step's forward and backward."""

    fold_in_step: bool | Literal["auto"] = "auto"
    """Under ``offload_optimizer: cpu`` with DeepSpeed's CPU Adam and the drift velocity folded from
    the optimizer state by the C++ kernel (``fold_source: optimizer_state``, ``host_kernels``): a
    real step's fold, and a kept device-side run's commit into the masters, run inside
    DeepSpeed's CPU Adam step, in one pass over each master partition (each block of 256 values
    takes the commit, DeepSpeed's update, then the fold, while it is in L1;
    ``ds_hybrid/step_fusion.py``). The fold then reads no second copy of the masters and moments
    from memory, and no host thread runs beside the next forward and backward, whose gradient
    copies and fp32 accumulation are host work under ZeRO-Offload (the fold behind the step took
    the hybrid's real steps to 1.24x plain's on an H100 with llama-1b, 2026-11-26). The fold takes
    the step's own displacement (each block's weights copied in L1 before its update), not the
    update rebuilt from the moments: masters, moments, velocity and direction statistics are those
    of DeepSpeed's step followed by the inline fold from a snapshot of the masters before it
    (``fold_source: snapshot``), bit for bit, with no snapshot; the predictor sees the statistics
    at the step. Whole-model steps
    only (a layer-group step folds as before). With ``fold_source: weights16`` only the commit
    goes into the step (the fold is the GPU's). ``statistics()``: ``fold_in_step`` and
    ``bookkeeping_seconds.fold_in_step`` (the passes' time inside the step; in one pass it
    holds DeepSpeed's update of those values too) and ``commit_in_step`` (the commit's, where it
    ran apart). Under ``offload_optimizer: nvme`` (ZeRO-Infinity; ``ds_hybrid/swap_fold.py``) the
    fold runs inside DeepSpeed's ZeRO 3 step instead, each sub-group's just after its Adam step
    while it is swapped in (from the moments with ``fold_source: optimizer_state``, from a copy of
    the sub-group taken just before its step with ``snapshot``: the largest sub-group's fp32 size
    in host memory), bit for bit the fold after the step, which swaps every sub-group in once
    more to read them: a real step then swaps what a plain one does (a kept run's commit goes
    into the step either way). ``true`` refuses, naming the key, setups
    without DeepSpeed's CPU Adam, the drift velocity, the
    optimizer-state fold source or the C++ kernels (under NVMe: without the drift velocity, or
    with ``fold_source: weights16``), and with ``fold_overlap``,
    ``fold_during_run`` or ``commit_overlap`` set true. ``auto``: on where it can be and none of
    those is set true (then ``fold_overlap``'s ``auto`` is off). Measured: on DeepSpeed's CPU
    accelerator the one pass takes 2.21x DeepSpeed's step alone where the step and the fold after
    it take 3.30x, and the one pass rebuilding the update from the moments (its way until
    2026-11-29) 2.95x (2^26 values, ``benchmarks/fold_in_step.py``); beside an H200 with
    llama-1b (2026-11-27, ``gpu_run.sh grad1b``, the update rebuilt) the hybrid's real steps took
    1044 ms against 1172 ms with the fold behind the step (plain ZeRO-Offload 847 ms)."""

    free_velocity_copy: bool = False
    """With the device-side drift path (``offload_predict``) and the 16-bit shards on a GPU: free
    the velocity's copy beside them when a Predict run ends (at the start of the next real step,
    before its forward), so that step's activations, gradient buckets and backward have that
    memory back (1 byte a parameter with the int8 velocity), and copy it again at the next run's
    first step (``bookkeeping_seconds.velocity_upload``, once per run, as after every fold
    anyway). For a model whose 16-bit weights and velocity copy leave a real step too little GPU
    memory: the ``7b-24gb-z2`` preset (llama-7b's 12.6 GiB of bf16 weights and 6.4 GiB of
    int8 velocity on a 24 GB GPU). The updates, the commit and a rollback are the same bit for
    bit (they read the host velocity, which the copy equals). Where there is no such copy (the
    host path, shards in host memory, DeepSpeed's CPU accelerator) there is nothing to free and
    ``statistics()["free_velocity_copy"]`` says false. ``true`` with ``fold_during_run: true``
    refuses, naming both keys (the commit reads that run's held copy during the next real step);
    ``fold_during_run: auto`` is off where this is on."""

    host_kernels: Literal["auto", "cpp", "torch"] = "auto"
    """How the hybrid's drift work runs where the masters are in host memory
    (``offload_optimizer``, DeepSpeed's CPU accelerator): a real step's fold into the velocity,
    a drift Predict step's update of the masters (host path) or of a 16-bit partition in host
    memory (device path with ZeRO 3's ``offload_param: cpu``), and a kept run's commit into the
    masters (a drift run's, and a gradient run's catch-up with the 16-bit weights), and a gradient
    Predict step's update of a bf16 partition in host memory. ``cpp`` = one pass each of ``kernels/host_fold.cpp`` on torch's threads, built on
    first use with torch's C++ extension builder (a compiler and ninja, as DeepSpeed's
    ``cpu_adam``; fails naming this key when it cannot be built); ``torch`` = torch ops a chunk at
    a time (the reference: about twenty passes over memory for the fold, four for an update);
    ``auto`` = ``cpp`` when it builds, else ``torch``. The same results: the velocity bit for bit
    from a snapshot and within one fp32 rounding from the Adam state, the updated weights and
    masters bit for bit, except the gradient step's: IEEE fp32 operations as the CUDA kernel's,
    where torch's CPU square root is not correctly rounded, so a few values in a million differ by
    one bf16 step (``tests/test_host_kernels.py``)."""

    fold_source: Literal["auto", "snapshot", "optimizer_state", "weights16"] = "auto"
    """Where a real step's update for the drift velocity comes from. ``snapshot``: a copy of
    the masters taken before the step (4 bytes per parameter of the rank's partition, in the
    masters' memory: host memory under ``offload_optimizer``). ``optimizer_state``: read back
    after the step from the Adam moments and the new weights (no copy; equal up to fp32
    rounding; Adam/AdamW without ``amsgrad``); with ``fold_in_step`` the step's own displacement
    instead, block by block inside it (the snapshot's update, with no snapshot). ``weights16`` (the device-side drift path only):
    the difference of the 16-bit shards DeepSpeed's step writes, copied just before the step
    (2 bytes per parameter of the partition, on the shards' device, freed after the fold), with
    the velocity kept beside the shards: under ZeRO-Offload the fold is then one GPU kernel a
    partition (``kernels.shard_fold``, where ``kernels`` resolves to CuPy; else a few torch ops
    a chunk) and reads nothing in host memory, and a Predict run uploads no velocity (it comes down once
    per run, during the run, for the commit, which ``fold_in_step`` still puts inside DeepSpeed's
    CPU Adam step). Equal to the masters' update up to one 16-bit rounding of each weight; the
    real step that commits a kept run does not fold (``ds_hybrid/shard_fold.py``). Steps of layer-group Predict keep the
    snapshot (it is their rollback point). ``auto``: ``optimizer_state`` with the device-side
    Predict path (``offload_predict``), which then keeps no fp32 copy of the masters at all."""

    predict_autocast: Literal["none", "bf16", "fp16"] = "none"
    """Precision of the Predict phase's no-grad forwards (verification and progress):
    ``none`` runs them as the model is, ``bf16`` / ``fp16`` under ``torch.autocast``
    (fp16 on GPUs only). Real steps are not affected."""


class GroupPredictConfig(_Section):
    """Layer-group Predict: Full steps in which the lower layer groups take the predicted
    update and are left out of the backward pass (``ds_hybrid/group_predict.py``)."""

    enabled: bool = False
    """Take layer-group Predict steps. Needs the optimizer's param groups in input order
    (``ds_hybrid.models.layer_groups``, ``ds-hybrid train --layer-groups``), ZeRO 0-2 and
    ``zero_optimization.ignore_unused_parameters`` (DeepSpeed's default)."""

    pinned: int | None = Field(None, ge=1)
    """Predict this many lower layer groups in every Full step that is not a refresh step
    (None: the planner chooses the number per step from its measurements)."""

    max_groups: int | None = Field(None, ge=1)
    """Most lower groups the planner may predict (None: every group below the last one that
    holds a transformer block)."""

    step_scale: float = Field(1.0, ge=0.0)
    """Multiplier on a predicted group's update, ``scale * lr * direction`` with the group's
    measured projection as ``scale`` (``predictor.direction``: the drift velocity or the Adam
    direction). 0 freezes the predicted groups: the control that measures what the predicted
    update is worth."""

    refresh_every: int = Field(4, ge=1)
    """Every n-th Full step is a whole step, so the predicted groups keep taking real updates
    that their velocity and statistics learn from (1: never predict)."""

    min_gain: float = Field(0.05, ge=0.0)
    """The planner predicts ``k`` groups only when a partial step's estimated progress per
    unit time (worth over measured cost) beats a whole step's by this fraction."""

    check: bool = True
    """The next step's first forward checks the predicted update against the divergence band
    (``divergence``); outside it, the predicted groups are rolled back exactly and that forward
    runs again. false: no check (the predicted update is never undone)."""


class JudgeConfig(_Section):
    """Delayed-effect judgement of whole-model Predict runs (``ds_hybrid/judgement.py``): the
    losses of the real steps after a kept run against a forecast of the same real steps without
    it, averaged over all judged runs."""

    enabled: bool = True
    """Judge every kept run and report the verdict in ``statistics()["judgement"]``."""

    steps: int = Field(8, ge=1)
    """Real steps after a run over which its effect is averaged (fewer when the next run comes
    sooner)."""

    window: int = Field(16, ge=4)
    """Real-step losses before a run that the forecast line is fitted to. A run is judged only
    when no earlier run lies in its window (``full_steps`` at least this), so that an earlier
    run's own effect is not in the line."""

    min_runs: int = Field(6, ge=2)
    """Judged runs, and placebo judgements (the same measurement over real steps with no run
    before them), before the verdict may stop Predict."""

    z: float = Field(2.0, gt=0.0)
    """Predict stops for the rest of the run once the runs' mean effect exceeds the placebos'
    (the runs, together, left the loss higher than the real steps alone were heading) by this
    many standard errors."""

    gate: bool = True
    """Let a harmful verdict stop Predict runs. false: judge and report only."""


class HybridPredictConfig(_Section):
    """The ``hybrid_predict`` ds_config section: Warmup -> Full -> Predict -> Correct."""

    enabled: bool = True
    """Run the phase cycle. ``false`` makes the engine plain DeepSpeed: same losses,
    bit for bit, as ``deepspeed.initialize``. A config with no section is disabled."""

    warmup_steps: int = Field(20, ge=1)
    """Real optimizer steps before the first decision; the optimizer state the
    predictor reads exists only after a real step."""

    full_steps: int = Field(8, ge=1)
    """Real steps in each Full phase; the Predict decision is taken at its end."""

    lazy_bookkeeping: bool = True
    """Leave out the predictor's per-step work on the masters (the pre-step capture, the
    velocity fold and the direction statistics) in real steps whose result no decision can
    read: warmup steps more than a lead before warmup ends (the lead: the steps after which
    the older ones weigh under 1% in ``predictor.drift_beta``'s and ``predictor.scale_ema``'s
    running averages, 90 at the defaults), and every step once Predict is off for good (the
    delayed judgement's verdict). Such steps cost what plain DeepSpeed's do. Off when
    ``group_predict`` or the ``rssm`` predictor, which learn from every step, is on."""

    min_predict_steps: int = Field(1, ge=1)
    """Shortest Predict run when the engine predicts at all."""

    max_predict_steps: int = Field(8, ge=1)
    """Longest Predict run; the horizon grows with confidence above the threshold."""

    confidence_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """Predict only when the predictor's confidence is at least this."""

    predict_lr_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Predict only while the learning rate is at most this fraction of the highest LR of
    the run so far (1.0: at any LR). Predicted steps act much like a larger LR: against a
    tuned LR they were measured to help only once the schedule had decayed it (README,
    "What a predicted step is worth"). The predictor is not consulted above it."""

    whole_model: bool = True
    """Take whole-model Predict runs (the Predict phase: no backward at all). false: predict
    only in layer-group Predict steps (``group_predict``), and never enter the Predict phase."""

    correction_steps: int = Field(2, ge=0)
    """Real steps after a completed Predict run that record predicted against observed
    loss and predicted against actual update, for the predictor to learn from."""

    check: Literal["forward", "next_step"] = "forward"
    """How a whole-model Predict run is checked. ``forward``: a no-grad forward on every
    ``verify_every``-th Predict step (and the last of a run), which costs about a third of a
    real step each. ``next_step``: no forward in the run at all; the first forward of the next
    real step, which it runs anyway, checks the run against the divergence band, and outside it
    the whole run is undone exactly and that forward runs again (the delayed judgement of the
    ``judge`` section then weighs what the kept runs did to the real steps after them)."""

    verify_every: int = Field(1, ge=1)
    """Observe the loss with a no-grad forward on every n-th Predict step (the last step
    of a run is always verified). A rejected verification rolls back every Predict step
    since the last accepted one."""

    snapshot_device: Literal["same", "cpu"] = "same"
    """Where the rollback snapshot (one fp32 copy of this rank's master partition) lives:
    ``same`` as the masters, or ``cpu`` to keep it off the accelerator."""

    log_to_monitor: bool = True
    """Write the per-step scalars through DeepSpeed's monitor (TensorBoard / CSV / W&B
    sections of the ds_config) when it is enabled: ``Hybrid/phase``, ``confidence``,
    ``step_time_s``, ``backward_skipped_pct``, ``loss``, ``predicted_loss``, and with
    ``predictor.direction: gradient`` ``share_worth`` and ``gradient_noise_scale`` (the
    noise-scale estimate of what a share step is worth, and ``B_noise`` in sequences)."""

    kernels: Literal["auto", "cupy", "torch"] = "auto"
    """Where the predictor's hot paths run (fused predicted update, the device path's drift step
    into a GPU shard under ``offload_optimizer``, RSSM step and rollout, state encoding): ``cupy`` = the CUDA kernels of ``kernels/*.cu`` through CuPy (fails,
    naming what is missing, without CuPy or a CUDA device), ``torch`` = their torch
    references, ``auto`` = the kernels when CuPy imports and the tensors are on a CUDA
    device, else torch. ``ds-hybrid report`` shows what ``auto`` picks here."""

    divergence: DivergenceConfig = Field(default_factory=DivergenceConfig)
    """Rejection bands for verified Predict steps."""

    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    """Settings of the update predictor."""

    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """Phase-aware memory settings."""

    dynamics: DynamicsConfig = Field(default_factory=DynamicsConfig)
    """The dynamics model (``predictor.type: rssm``) and trajectory recording."""

    group_predict: GroupPredictConfig = Field(default_factory=GroupPredictConfig)
    """Layer-group Predict steps (partial real steps)."""

    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """Delayed-effect judgement of whole-model Predict runs, and the gate it drives."""

    @model_validator(mode="after")
    def _horizon_order(self) -> "HybridPredictConfig":
        if self.min_predict_steps > self.max_predict_steps:
            raise ValueError(f"min_predict_steps ({self.min_predict_steps}) must not exceed "
                             f"max_predict_steps ({self.max_predict_steps})")
        if self.predictor.type == "rssm" and self.dynamics.horizon < self.max_predict_steps:
            raise ValueError(f"dynamics.horizon ({self.dynamics.horizon}) must be at least "
                             f"max_predict_steps ({self.max_predict_steps})")
        if self.predictor.direction == "gradient":
            if self.predictor.type == "rssm":
                raise ValueError("predictor.type: rssm learns its step scales from the direction statistics of real "
                                 "steps; predictor.direction 'gradient' takes Adam's own step and needs type "
                                 "'adam_direction'")
            if self.group_predict.enabled:
                raise ValueError("group_predict.enabled: layer-group Predict moves the lower groups along a "
                                 "predicted direction with no gradient; predictor.direction 'gradient' takes one")
        elif self.predictor.gradient_batch_fraction != 1.0:
            raise ValueError(f"predictor.gradient_batch_fraction ({self.predictor.gradient_batch_fraction}) is the "
                             "share of a batch a gradient Predict step takes its gradient from; predictor.direction "
                             f"{self.predictor.direction!r} takes none (set direction 'gradient' or leave it at 1)")
        elif self.predictor.gradient_lr_scale != 1.0:
            raise ValueError(f"predictor.gradient_lr_scale ({self.predictor.gradient_lr_scale}) is the share of the "
                             "learning rate a gradient Predict step takes; predictor.direction "
                             f"{self.predictor.direction!r} takes no gradient (set direction 'gradient' or leave it "
                             "at 1)")
        if self.predictor.gradient_second_moment == "updated" and self.predictor.direction != "gradient":
            raise ValueError(f"predictor.gradient_second_moment ({self.predictor.gradient_second_moment!r}) is how a "
                             "gradient Predict run keeps Adam's second moment; predictor.direction "
                             f"{self.predictor.direction!r} takes no gradient (set direction 'gradient' or leave it "
                             "'auto')")
        if self.predictor.gradient_second_moment == "updated":
            if self.memory.gradient_state_dtype in ("int8-factored", "int4-factored"):
                raise ValueError(f"predictor.gradient_second_moment 'updated' keeps a whole second moment; "
                                 f"memory.gradient_state_dtype {self.memory.gradient_state_dtype!r} keeps it factored "
                                 "(use 'auto', 'fp32' or 'bf16', or leave the second moment 'held')")
            if self.memory.cpu_step_behind:
                raise ValueError("predictor.gradient_second_moment 'updated': memory.cpu_step_behind builds the "
                                 "run's second moment from the real step's cover; set one of them back")
        if self.memory.park_optimizer_states and self.predictor.direction in ("adam", "gradient"):
            raise ValueError(f"memory.park_optimizer_states needs predictor.direction 'drift': Predict steps "
                             f"with direction {self.predictor.direction!r} read the moments it would move off "
                             "the accelerator")
        return self


_ADAM_TYPES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"}


def parse_hybrid_config(ds_config: Mapping[str, Any]) -> HybridPredictConfig:
    """Read and validate the ``hybrid_predict`` section of a ds_config dict.

    A config with no section gives a disabled engine. Errors name the key path.
    """
    raw = ds_config.get(SECTION)
    if raw is None:
        near = difflib.get_close_matches(SECTION, [k for k in ds_config if isinstance(k, str)], n=1, cutoff=0.75)
        if near:
            logger.warning(f"ds_config has no '{SECTION}' section but has '{near[0]}': did you mean '{SECTION}'? "
                           "Without it this run trains as plain DeepSpeed")
        return HybridPredictConfig(enabled=False)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SECTION}: expected an object, got {type(raw).__name__}")
    try:
        cfg = HybridPredictConfig(strict=True, **raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    if cfg.enabled and cfg.group_predict.enabled:
        zo = ds_config.get("zero_optimization") or {}
        if isinstance(zo, Mapping) and int(zo.get("stage", 0) or 0) == 3:
            raise ConfigError("zero_optimization.stage: 3 partitions every parameter across ranks; layer-group "
                              f"Predict ({SECTION}.group_predict.enabled) needs ZeRO 0, 1 or 2")
        if isinstance(zo, Mapping) and zo.get("ignore_unused_parameters", True) is False:
            raise ConfigError("zero_optimization.ignore_unused_parameters: must be true for layer-group Predict "
                              f"({SECTION}.group_predict.enabled): its predicted groups get no gradient")
    if cfg.enabled and cfg.predictor.direction == "gradient":
        fp16 = ds_config.get("fp16") or {}
        if isinstance(fp16, Mapping) and fp16.get("enabled"):
            raise ConfigError(f"fp16.enabled: {SECTION}.predictor.direction 'gradient' takes its gradient without "
                              "DeepSpeed's loss scaling (fp16 gradients would underflow); use bf16")
    if cfg.enabled:
        opt = ds_config.get("optimizer")
        # A client optimizer passed to initialize() is checked by the engine instead.
        if isinstance(opt, Mapping):
            name = str(opt.get("type", "")).lower().replace("_", "")
            if name not in _ADAM_TYPES:
                raise ConfigError(f"optimizer.type: '{opt.get('type')}' is not an Adam-family optimizer; "
                                  f"{SECTION}.predictor.type 'adam_direction' reads Adam's moments "
                                  f"(use Adam or AdamW, or set {SECTION}.enabled to false)")
    return cfg


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p != "__root__")
        key = f"{SECTION}.{loc}" if loc else SECTION
        got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        lines.append(f"{key}: {e['msg']}{got}")
    return "; ".join(lines)


def reference_markdown() -> str:
    """The README's configuration reference, rendered from the field docstrings."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(model: type[_Section], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, _Section):
                walk(ann, f"{prefix}{name}.")
                continue
            typ = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
            desc = " ".join((field.description or "").split())
            rows.append(f"| `{prefix}{name}` | {typ} | `{field.default!r}` | {desc} |")

    walk(HybridPredictConfig, f"{SECTION}.")
    return "\n".join(rows)


def parse_override(item: str) -> tuple[str, Any]:
    """One ``--set KEY=VALUE``: the dotted key inside ``hybrid_predict`` and the value, JSON
    (``true``, ``4``, ``0.5``, ``"int8"``) or else the plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set: expected KEY=VALUE (a hybrid_predict key), got {item!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def apply_overrides(ds_config: dict, overrides: list[str]) -> None:
    """``--set KEY=VALUE`` (``ds-hybrid train``, ``ds-hybrid plan``, ``benchmarks/lr_check.py``):
    each item as ``parse_override`` reads it. The whole section is validated afterwards, so a bad
    key or value fails here (``ConfigError``), naming both."""
    section = ds_config.setdefault("hybrid_predict", {})
    for item in overrides:
        key, value = parse_override(item)
        node = section
        *parents, leaf = key.split(".")
        for name in parents:
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item}: hybrid_predict.{name} is not a section")
            node = child
        node[leaf] = value
    try:
        parse_hybrid_config(ds_config)
    except ConfigError as err:
        raise ConfigError(f"--set: {err}") from None
