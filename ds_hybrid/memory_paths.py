"""Which memory paths a ``PredictiveEngine`` takes, chosen once at set-up.

``hybrid_predict.memory`` and ``predictor`` name paths (the fold's source, the device-side
Predict run, the gradient direction's state, the fold behind the step, inside CPU Adam or inside
ZeRO-Infinity's sub-group steps, the fold during a run, the freed velocity copy, the CPU step
deferred behind a gradient run) that only some ZeRO layouts, optimizers and devices allow. Each
method here resolves one setting against what DeepSpeed built: the path to take,
``auto``'s choice with the measurement behind it, or a config error naming the key and what this
setup lacks. ``PredictiveEngine.__init__`` calls them in order, each after the paths it depends
on; the step loop only reads what they chose.
"""
from __future__ import annotations

import logging

import torch

from . import step_fusion
from .config import (ConfigError, compact_state_refusal, fold_from_optimizer_state, masters_swapped,
                     offload_devices, offload_predict_on_device, second_moment_updated)
from .device_predict import DevicePredict
from .device_predict import unsupported as device_unsupported
from .grad_predict import GradientPredict
from .shard_fold import ShardFold
from .swap_fold import SwapFold

logger = logging.getLogger(__name__)


class MemoryPaths:
    """``PredictiveEngine``'s set-up choices among the memory paths (a mixin: its methods read the
    DeepSpeed config, the optimizer's masters and the paths resolved before them on the engine)."""

    def _offload_pins_memory(self) -> bool:
        """DeepSpeed's ``offload_optimizer.pin_memory`` as it parsed it (true where nothing is
        offloaded: then the velocity is not in host memory anyway)."""
        oo = self._config.zero_config.offload_optimizer
        return True if oo is None else bool(oo.pin_memory)

    def _host_masters_beside_an_accelerator(self) -> bool:
        """offload_optimizer on a GPU (on DeepSpeed's CPU accelerator everything is host memory anyway)."""
        return offload_devices(self._config._param_dict)[0] in ("cpu", "nvme") and self.device.type != "cpu"

    def _offload_predict_on_device(self, setting: str) -> bool:
        """``memory.offload_predict`` resolved for this setup (``config.offload_predict_on_device``)."""
        return offload_predict_on_device(setting, self._host_masters_beside_an_accelerator(),
                                         masters_swapped(offload_devices(self._config._param_dict)[0]))

    def _resolve_fold_source(self) -> bool:
        """``memory.fold_source``: True where real steps read their update back from the Adam
        state instead of a pre-step copy of the masters."""
        setting = self.hybrid_config.memory.fold_source
        if not fold_from_optimizer_state(setting, self._device_predict is not None):
            return False
        amsgrad = any(g.get("amsgrad") for g in self._masters.base.param_groups)
        if amsgrad and setting == "optimizer_state":
            raise ConfigError("hybrid_predict.memory.fold_source: optimizer_state reads the update back from Adam's "
                              "moments, which amsgrad's max does not allow; set it to snapshot")
        return not amsgrad

    def _resolve_shard_fold(self) -> ShardFold | None:
        """``memory.fold_source: weights16``: the fold from the 16-bit shards, or a config error
        naming what this setup lacks."""
        cfg = self.hybrid_config
        if cfg.memory.fold_source != "weights16":
            return None
        why = None
        if cfg.predictor.direction != "drift":
            why = f"predictor.direction is {cfg.predictor.direction!r} (there is no drift velocity to fold)"
        elif self._device_predict is None:
            why = ("the Predict steps are not on the device-side drift path (memory.offload_predict: device, or auto "
                   "with zero_optimization.offload_optimizer beside a GPU): the shards would hold each run")
        elif cfg.group_predict.enabled:
            why = "group_predict is on (a layer-group step's fold keeps its snapshot: its rollback point)"
        elif any(map(self._masters.shard_swapped, range(self._masters._count()))):
            why = ("zero_optimization.offload_param.device is nvme: some 16-bit partitions are on the drive, with "
                   "no shard in memory to read the real step's update from")
        else:
            between = cfg.correction_steps if cfg.correction_steps > 0 else cfg.full_steps
            key = "correction_steps" if cfg.correction_steps > 0 else "full_steps"
            if between == 1:
                why = (f"{key} is 1: the one real step between two Predict runs commits the first and takes no "
                       "fold (shard_fold.py), so the velocity would stop at the first kept run; set it to 2 or more")
        if why is not None:
            raise ConfigError(f"hybrid_predict.memory.fold_source: weights16, but {why}")
        return ShardFold(self._masters, backend=self.hybrid_config.kernels)

    def _make_device_predict(self) -> "DevicePredict | None":
        """``memory.offload_predict``: the device-side Predict path, or None (the host path)."""
        setting = self.hybrid_config.memory.offload_predict
        if self.hybrid_config.predictor.direction == "gradient":
            return None   # (its own device path: grad_predict.GradientPredict)
        if not self._offload_predict_on_device(setting):
            return None
        why = device_unsupported(self._masters, self.hybrid_config.predictor.direction)
        if why is None:
            return DevicePredict(self._masters, backend=self.hybrid_config.kernels)
        if setting == "device":
            raise ConfigError(f"hybrid_predict.memory.offload_predict: device: {why}; set it to host or auto")
        if self.global_rank == 0:
            logger.warning(f"hybrid_predict.memory.offload_predict: auto takes the host path: {why}")
        return None

    def _make_gradient_predict(self) -> GradientPredict:
        """``predictor.direction: gradient``: where each master partition lies in the model's
        parameters and where the run's state lives (``memory.offload_predict``), or a config
        error naming what this layout lacks."""
        if not self._masters.decoupled_decay and any(g.get("weight_decay") for g in self._masters.base.param_groups):
            raise ConfigError("optimizer.params.weight_decay: hybrid_predict.predictor.direction 'gradient' takes "
                              "Adam's step with decoupled weight decay (AdamW, adam_w_mode true); this optimizer's "
                              "L2 decay would have to go into the gradient")
        # (ZeRO-Infinity's parameter swap is refused by initialize, before DeepSpeed builds its async_io op)
        mem = self.hybrid_config.memory
        on_device = self._offload_predict_on_device(mem.offload_predict)
        if on_device and self._masters.kind not in ("zero1-2", "zero3"):
            why = (f"the device path keeps the run beside ZeRO 1-3's 16-bit partitions; this optimizer is "
                   f"{self._masters.kind}")
            if mem.offload_predict == "device":
                raise ConfigError(f"hybrid_predict.memory.offload_predict: device: {why}; set it to host or auto")
            if self.global_rank == 0:
                logger.warning(f"hybrid_predict.memory.offload_predict: auto takes the host path: {why}")
            on_device = False
        dtype = torch.float32
        compact = {"int8-factored": "int8", "int4-factored": "int4"}.get(mem.gradient_state_dtype)
        refused = compact_state_refusal(mem.gradient_state_dtype, on_device)
        if refused:
            raise ConfigError(refused)
        if not compact and on_device:
            shard = self._masters.device_shard(0)   # (None: on NVMe, read into host memory for each step)
            if mem.gradient_state_dtype == "bf16" or (mem.gradient_state_dtype == "auto" and shard is not None
                                                      and shard.is_cuda and shard.dtype == torch.bfloat16):
                dtype = torch.bfloat16
        pred = self.hybrid_config.predictor
        # (the smallest betas[1] of the optimizer's groups: auto updates v where any group's is short)
        beta2 = min(float(g.get("betas", (0.9, 0.999))[1]) for g in self._masters.base.param_groups)
        updated = second_moment_updated(pred.gradient_second_moment, beta2, mem.gradient_state_dtype,
                                        mem.cpu_step_behind)
        try:
            return GradientPredict(self._masters, self.gradient_clipping(), self._all_reduce_in_place, self._world(),
                                   on_device=on_device, state_dtype=dtype, backend=self.hybrid_config.kernels,
                                   seed=self.hybrid_config.dynamics.seed,
                                   batch_fraction=pred.gradient_batch_fraction,
                                   lr_scale=pred.gradient_lr_scale, compact=compact,
                                   second_moment="updated" if updated else "held")
        except NotImplementedError as err:
            raise ConfigError(f"hybrid_predict.predictor.direction: gradient needs ZeRO 1-3 or ZeRO 0 in fp32 "
                              f"(zero_optimization.stage, bf16.enabled): {err}") from None

    def _resolve_fold_overlap(self) -> bool:
        """``memory.fold_overlap``: whether real steps fold on a host thread behind the next step."""
        setting = self.hybrid_config.memory.fold_overlap
        if self._fusion is not None:
            return False   # (memory.fold_in_step: the fold runs inside the optimizer step; true refused there)
        if setting is False or self._velocity is None:
            if setting is True:
                raise ConfigError("hybrid_predict.memory.fold_overlap: true needs predictor.direction: drift (there is "
                                  "no velocity to fold with the Adam direction)")
            return False
        why = None
        if self._shards is not None:
            why = "memory.fold_source is weights16 (the fold is a few kernels on the shards' device after the step)"
        elif not self._fold_from_state:
            why = ("memory.fold_source is snapshot: the next step's copy of the masters would overwrite what the "
                   "fold reads; set fold_source to optimizer_state")
        elif self._learns_from_every_step():
            why = ("group_predict, predictor.type: rssm and dynamics.trajectory_path read every real step's "
                   "direction statistics at that step")
        elif offload_devices(self._config._param_dict)[0] == "nvme":
            why = ("offload_optimizer.device is nvme: reading the masters would swap them in on the fold's thread, "
                   "beside DeepSpeed's own swapper")
        if setting == "auto":
            return why is None and self._host_masters_beside_an_accelerator()
        if why is not None:
            raise ConfigError(f"hybrid_predict.memory.fold_overlap: true, but {why}")
        return True

    def _resolve_fold_in_step(self) -> "step_fusion.FusedCpuAdam | None":
        """``memory.fold_in_step``: DeepSpeed's CPU Adam op wrapped so that real steps fold (and
        kept runs commit) inside its step, or None."""
        mem = self.hybrid_config.memory
        setting = mem.fold_in_step
        if setting is False or offload_devices(self._config._param_dict)[0] == "nvme":
            return None   # (under NVMe swap the fold goes into DeepSpeed's sub-group steps: _resolve_swap_fold)
        base = self._masters.base
        behind = [k for k in ("fold_overlap", "fold_during_run", "commit_overlap") if getattr(mem, k) is True]
        why = None
        if behind:
            why = (f"memory.{behind[0]} is true (that work runs behind the step on a host thread; "
                   f"set one of the two to false)")
        elif self._velocity is None:
            why = "predictor.direction is not drift (there is no velocity to fold)"
        elif type(base).__name__ != "DeepSpeedCPUAdam":
            why = (f"the optimizer is {type(base).__name__}, not DeepSpeed's CPU Adam "
                   "(zero_optimization.offload_optimizer.device: cpu)")
        elif not self._fold_from_state and self._shards is None:
            why = "memory.fold_source is snapshot (the fold reads a copy of the masters from before the step)"
        elif not self._host_kernel:
            why = "memory.host_kernels is torch (the fold by ranges is the C++ kernel's)"
        elif not getattr(base, "fp32_optimizer_states", True):
            why = "DeepSpeed's CPU Adam keeps its moments in 16 bits here (the fold reads fp32 moments)"
        if why is not None:
            if setting is True:
                raise ConfigError(f"hybrid_predict.memory.fold_in_step: true, but {why}")
            return None
        # auto takes it beside a GPU too: there it made the real steps cheaper than the fold behind
        # the step (H200, llama-1b, 2026-11-27: 1044 against 1172 ms; gpu_run.sh grad1b).
        return step_fusion.install(base)

    def _resolve_swap_fold(self) -> "SwapFold | None":
        """``memory.fold_in_step`` under ZeRO-Infinity's NVMe optimizer swap: real steps fold inside
        DeepSpeed's sub-group steps (``swap_fold.py``), or None."""
        setting = self.hybrid_config.memory.fold_in_step
        if setting is False or not self._masters.swaps:
            return None
        why = None
        if self._velocity is None:
            why = "predictor.direction is not drift (there is no velocity to fold)"
        elif self._shards is not None:
            why = "memory.fold_source is weights16 (the fold is on the shards' device, after the step)"
        if why is not None:
            if setting is True:
                raise ConfigError(f"hybrid_predict.memory.fold_in_step: true, but {why}")
            return None
        return SwapFold(self._masters, self._velocity, self._fold_from_state, self._host_kernel)

    def _resolve_fold_during_run(self) -> bool:
        """``memory.fold_during_run``: whether a drift run holds a copy of the velocity from before
        the last real step's fold, which then runs during the run."""
        setting = self.hybrid_config.memory.fold_during_run
        why = None
        if self._shards is not None:
            why = "memory.fold_source is weights16 (the fold is on the shards' device, before the run)"
        elif self._fusion is not None:
            why = "memory.fold_in_step is on (the fold runs inside the optimizer step, before the run)"
        elif self._folds is None:
            why = "memory.fold_overlap is off here (the fold runs inline)"
        elif self._device_predict is None:
            why = "the Predict steps are not on the device-side drift path (memory.offload_predict)"
        if why is None and self.hybrid_config.memory.free_velocity_copy:
            why = "memory.free_velocity_copy is on (the commit would read the run's held copy after it is freed)"
        if setting is True and why is not None:
            raise ConfigError(f"hybrid_predict.memory.fold_during_run: true, but {why}")
        if setting == "auto":
            # Off: measured on an H100 (llama-1b, 2026-11-26) the fold during the run made the real
            # steps slower than the fold behind the step (803 against 746 ms; Predict steps 20.4
            # against 18.1): a run of a few 20 ms steps is too short for the fold, which then lands
            # in the next real step's forward and backward.
            return False
        return setting is True and why is None

    def _resolve_free_velocity_copy(self) -> bool:
        """``memory.free_velocity_copy``: where there is a velocity copy to free, the device-side
        drift path's beside shards on a GPU (a preset that sets it still runs on the CPU)."""
        if not self.hybrid_config.memory.free_velocity_copy or self._device_predict is None:
            return False
        if self._shards is not None:
            raise ConfigError("hybrid_predict.memory.free_velocity_copy: true, but memory.fold_source is weights16: "
                              "the velocity itself lives beside the shards (there is no copy to free); set one of the "
                              "two otherwise")
        return self._device_predict.copy_always or all(
            s is not None and s.is_cuda for s in map(self._masters.device_shard, range(self._masters._count())))

    def _resolve_cpu_step_behind(self) -> bool:
        """``memory.cpu_step_behind``: on, or a config error naming what this setup lacks."""
        if not self.hybrid_config.memory.cpu_step_behind:
            return False
        base = self._masters.base
        why = None
        if self._gradient is None:
            why = "predictor.direction is not gradient (the GPU covers the step with the gradient run's own Adam step)"
        elif not self._gradient.on_device:
            why = "memory.offload_predict resolved to host (the run must live beside the 16-bit weights)"
        elif self._masters.kind not in ("zero1-2", "zero3"):
            why = f"the optimizer is {self._masters.kind}, not ZeRO 1, 2 or 3 (zero_optimization.stage)"
        elif self._masters.kind == "zero3" and (getattr(self.optimizer, "swap_optimizer", False)
                                                or None in self.optimizer.fp16_partitioned_groups_flat):
            # (the deferred calls would read moments swapped out, or step partitions not in memory)
            why = "ZeRO 3 keeps the optimizer state or the parameters on NVMe (offload_optimizer/offload_param.device)"
        elif self._masters.kind == "zero3" and getattr(self.optimizer, "partial_offload", 1.0) != 1.0:
            # (those sub-groups step on the accelerator at once, and their copy into the weights is dropped)
            why = "zero_optimization.offload_optimizer.ratio is below 1 (some sub-groups step on the accelerator)"
        elif type(base).__name__ != "DeepSpeedCPUAdam" or not hasattr(base, "ds_opt_adam"):
            why = (f"the optimizer is {type(base).__name__}, not DeepSpeed's CPU Adam "
                   "(zero_optimization.offload_optimizer.device: cpu)")
        elif self._fusion is not None:
            why = "memory.fold_in_step is on (its passes live inside the step this defers)"
        elif self.hybrid_config.group_predict.enabled:
            why = "group_predict is enabled (a partial step steps some groups only)"
        if why is not None:
            raise ConfigError(f"hybrid_predict.memory.cpu_step_behind: true, but {why}")
        return True
