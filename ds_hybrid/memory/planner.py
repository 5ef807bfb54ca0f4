"""``ds-hybrid plan``: which preset fits a model on a machine, and how much memory each needs.

    ds-hybrid plan --model llama-7b --gpu-mem 24GB --cpu-mem 128GB [--nvme 500GB] [--gpus 1 --nodes 1]
    ds-hybrid plan --validate          # CPU check of the estimate against measured runs

For every preset in ``ds_configs/`` the plan estimates, for the given model, sequence length
and micro batch:

* **GPU, per device**: model states (from DeepSpeed's own estimators where they apply:
  ``estimate_zero2_model_states_mem_needs`` for ZeRO 2 and ``estimate_zero3_model_states_mem_needs``
  for ZeRO 3 with 16-bit weights and no NVMe; the same byte counting otherwise, see
  ``model_states``), DeepSpeed's gradient buckets and ZeRO-3 gathered parameters, activations
  (``activation_bytes``), ds_hybrid's rollback snapshot when it lives on the GPU, the predictor,
  and framework overhead (CUDA context, allocator fragmentation);
* **CPU, per node**: the processes' runtime, offloaded model states, pinned NVMe swap buffers,
  the snapshot when it lives in host memory, and building the model: below ZeRO 3 ``ds-hybrid
  train`` builds the full fp32 model on the CPU in every process before DeepSpeed partitions it,
  so a node needs ``4 x params x processes`` at start-up; on ZeRO 3 it builds it partitioned
  under ``deepspeed.zero.Init`` (``--no-zero-init`` plans the whole build there too);
* **NVMe, per node**: ZeRO-Infinity's swapped optimizer state, gradients and parameters.

A preset fits when all three are within ``--gpu-mem``, ``--cpu-mem`` and ``--nvme``. The pick is the
fastest preset that fits, fastest meaning least offload: nothing offloaded, then the optimizer
in CPU memory, then parameters too, then NVMe; then the lower ZeRO stage; then 16-bit before
fp32.

Estimated, not measured: there is no GPU here. The GPU constants below are assumptions. The
CPU-side arithmetic is checked by ``validate_cpu`` (``--validate``), which trains small models
on DeepSpeed's CPU accelerator, where "the device" is host memory, and compares the estimate
for that run with the measured peak RSS above the process's RSS before the model was built.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

from ..arguments import (PRESET_DIR, GiB, HelpFormatter, InputError, MiB, TiB, find_preset, parse_size,
                         resolve_config)
from ..dist_env import child_env
# (the counts live below the planner, where the engine reads them too; named here for the planner's users)
from ..pinned import QUEUE_BUFFERS, STAGE_CHUNK, STAGER_BUFFERS, pinned_block_bytes
from .counts import ModelShape, activation_bytes, host_memory_bytes, layer_activation_elements, shape_of

ENGINE_REFUSES = "the engine refuses it: "   # (a reason that is the engine's rule, not an estimate)

# ---- assumptions (GPU runs; not measured here, no GPU was available) ----------------------
CUDA_CONTEXT_BYTES = 1 * GiB          # CUDA context + cuBLAS / cuDNN workspaces + NCCL buffers per process
GPU_FRAGMENTATION = 0.10              # the caching allocator's reserved-but-unused share on top of live bytes
HOST_RUNTIME_BYTES = 3 * GiB          # host RSS of one CUDA training process before its model: CUDA libraries,
                                      # torch, DeepSpeed, transformers, the corpus
# ---- measured here ----------------------------------------------------------------------------
# RSS that a CPU run adds over its pre-model baseline besides everything counted below: DeepSpeed's
# engine and C++ ops, autograd and thread-pool arenas. Measured on gpt2-test (38K parameters, so
# almost nothing else): the mean of (measured - estimated without this term) over five runs
# (tiny-cpu; ZeRO 1 at micro batch 4 and 16, ZeRO 1 with checkpointing, ZeRO 2, ZeRO 3; seq 128;
# range 126-147 MiB). validate_cpu's rows report the same difference as "unexplained_bytes".
CPU_ENGINE_OVERHEAD_BYTES = 134 * MiB
MALLOC_RETAINED_MAX = 64 * MiB        # glibc: 2 x DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit)
# The predictor's state (the RSSM ensemble and its optimizer: a few MB); an upper bound.
PREDICTOR_BYTES = 16 * MiB
# DeepSpeed's own CPU-side safety factor in its estimators (additional_buffer_factor).
DS_BUFFER_FACTOR = 1.5
# Host bytes per parameter (of the rank's partition) that DeepSpeed 0.19.8 allocates under
# offload_optimizer: cpu with 16-bit weights, counted buffer by buffer on its CPU accelerator
# (benchmarks/offload_host_layout.py, docs/results/offload-host-layout.json): fp32 masters, their
# fp32 gradient and Adam's two moments (16), plus a 16-bit buffer: ZeRO 1/2's copy of the updated
# weights for the upload, ZeRO 3's gradient partitions (its grad_partitions_flat_buffer beside the
# masters' fp32 gradient); ZeRO 3's offload_param adds the 16-bit weights. DeepSpeed's estimators
# count 16 and 18, one 16-bit buffer fewer, and multiply by their 1.5 factor instead. (On an H100,
# plain ZeRO-Offload on 1b-16gb held 18.1 bytes a parameter above its pre-build RSS:
# docs/results/memory-gpu-1b.json.)
DS_OFFLOAD_HOST_BYTES = 18
DS_OFFLOAD_PARAM_HOST_BYTES = 2

class PlanError(InputError):
    """Bad planner input; the message names the flag."""


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= TiB:
        return f"{n / TiB:.2f} TiB"
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"


# ============================================================== the model
def model_shape(name: str, vocab_size: int | None = None, layer_groups: int = 4) -> ModelShape:
    """Counts for a named model (``ds_hybrid.models``) or a transformers config JSON, its optimizer
    param groups as ``ds-hybrid train --layer-groups`` makes them (4 by default, as there)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models import MODEL_SPECS, layer_groups as make_layer_groups, model_config
    try:
        config = model_config(name, vocab_size=vocab_size)
    except ValueError as err:
        raise PlanError(f"--model: {err}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    default_seq = MODEL_SPECS[name].seq_len if name in MODEL_SPECS else None
    groups = (tuple(tuple(int(p.numel()) for p in g["params"]) for g in make_layer_groups(model, layer_groups))
              if layer_groups > 1 else None)
    return shape_of(model, name, default_seq, groups)


# ============================================================== the preset
OFFLOAD_LEVEL = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass(frozen=True)
class PresetSpec:
    """The parts of a ds_config the estimate reads (DeepSpeed's defaults where a key is absent)."""

    name: str
    stage: int
    lp_bytes: int              # 2 with bf16 / fp16, 4 in fp32
    offload_optimizer: str     # none | cpu | nvme
    offload_param: str         # none | cpu | nvme
    activation_checkpointing: bool
    micro_batch: int
    gradient_accumulation: int
    reduce_bucket_size: int
    overlap_comm: bool
    prefetch_bucket_size: int
    max_live_parameters: int
    sub_group_size: int
    param_buffer_count: int
    param_buffer_size: int
    optimizer_buffer_count: int
    hybrid_enabled: bool
    snapshot_device: str
    path: str = ""
    velocity_bytes_per_value: float = 0.0  # direction drift: 4 / 2 / ~1 bytes per parameter of the partition
    offload_predict: str = "auto"     # hybrid_predict.memory.offload_predict
    fold_source: str = "auto"         # hybrid_predict.memory.fold_source
    gradient: bool = False            # predictor.direction: gradient
    gradient_state_dtype: str = "auto"   # hybrid_predict.memory.gradient_state_dtype
    gradient_v_updated: bool = False     # predictor.gradient_second_moment: updated (the run's own v)
    free_velocity_copy: bool = False     # hybrid_predict.memory.free_velocity_copy
    fold_during_run: bool = False        # hybrid_predict.memory.fold_during_run (true: its auto is off)
    pin_memory: bool = False             # zero_optimization.offload_optimizer.pin_memory
    param_pin_memory: bool = False       # zero_optimization.offload_param.pin_memory (ZeRO 3)
    param_max_in_cpu: int = 10 ** 9      # zero_optimization.offload_param.max_in_cpu (with it on NVMe)

    def device_predict(self, accelerator: str) -> bool:
        """Whether Predict steps take the device path (the engine's rule; it needs the drift
        velocity or the gradient direction, and ZeRO 1-3)."""
        from ..config import masters_swapped, offload_predict_on_device
        beside = self.offload_optimizer != "none" and accelerator != "cpu"
        takes = (self.stage >= 1) if self.gradient else (bool(self.velocity_bytes_per_value) and self.stage >= 1)
        return takes and offload_predict_on_device(self.offload_predict, beside,
                                                   masters_swapped(self.offload_optimizer))

    def shards_on_gpu(self, accelerator: str) -> bool:
        """Whether this rank's 16-bit partitions are in GPU memory (not with ZeRO 3's ``offload_param``)."""
        return accelerator != "cpu" and not (self.stage == 3 and self.offload_param != "none")

    def gradient_state_bytes(self, accelerator: str) -> float:
        """Bytes per value of each of the run's moment copies on the device path (the engine's rule;
        ``int8-factored`` / ``int4-factored``: the first moment's value and its block's scale, the
        second moment's row and column means left out: under 0.1% of a value at 4096 x 4096)."""
        if self.compact_gradient_state:
            return (1.0 if self.gradient_state_dtype == "int8-factored" else 0.5) + 4.0 / 256
        if self.gradient_state_dtype == "auto":
            return 2.0 if self.lp_bytes == 2 and self.shards_on_gpu(accelerator) else 4.0
        return 2.0 if self.gradient_state_dtype == "bf16" else 4.0

    @property
    def compact_gradient_state(self) -> bool:
        """``memory.gradient_state_dtype: int8-factored`` or ``int4-factored``: no gradient held, a byte or
        half a byte a parameter of state."""
        return self.gradient and self.gradient_state_dtype in ("int8-factored", "int4-factored")

    def snapshot_kept(self, accelerator: str) -> bool:
        """Whether the engine keeps an fp32 copy of the masters: not on the device path with the
        fold read back from the optimizer state."""
        from ..config import fold_from_optimizer_state
        device = self.device_predict(accelerator)
        if self.gradient:   # its device path keeps no snapshot; its host path does, for the run's rollback
            return not device
        return not (device and (fold_from_optimizer_state(self.fold_source, device) or self.fold_source == "weights16"))

    def velocity_beside_shards(self, accelerator: str) -> bool:
        """``fold_source: weights16`` on the device-side drift path: the velocity lives beside the
        16-bit shards, not the masters."""
        return self.fold_source == "weights16" and self.device_predict(accelerator)

    @property
    def speed_rank(self) -> tuple:
        """Sort key, fastest first: least offload, then lower stage, then 16-bit."""
        p, o = OFFLOAD_LEVEL[self.offload_param], OFFLOAD_LEVEL[self.offload_optimizer]
        return (max(p, o), p, o, self.stage, self.lp_bytes)

    def describe(self) -> str:
        off = []
        if self.offload_optimizer != "none":
            off.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            off.append(f"param->{self.offload_param}")
        return (f"Z{self.stage} {'bf16' if self.lp_bytes == 2 else 'fp32'}"
                f"{' ' + ','.join(off) if off else ''}{' AC' if self.activation_checkpointing else ''}")


VELOCITY_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256}  # per value, quant.CompactBuffer


def _beta2(ds_config: dict) -> float:
    """The ds_config optimizer's ``betas[1]`` (DeepSpeed's Adam default 0.999 where it has none)."""
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    return float((params.get("betas") or (0.9, 0.999))[1])


def preset_spec(ds_config: dict, name: str = "config", path: str = "") -> PresetSpec:
    """Read a ds_config dict (DeepSpeed's defaults fill what it leaves out)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from ..config import ConfigError, parse_hybrid_config, second_moment_updated
    zero = DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))
    try:
        hybrid = parse_hybrid_config(ds_config)
    except ConfigError as err:
        raise PlanError(f"preset {name}: {err}") from None
    lp = 2 if (ds_config.get("bf16") or {}).get("enabled") or (ds_config.get("fp16") or {}).get("enabled") else 4
    oo = str(getattr(zero.offload_optimizer.device, "value", zero.offload_optimizer.device)) \
        if zero.offload_optimizer else "none"
    op = str(getattr(zero.offload_param.device, "value", zero.offload_param.device)) if zero.offload_param else "none"
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps", 1)
    if micro is None:  # train_batch_size and gas given: one process's share
        micro = max(1, int(ds_config.get("train_batch_size", 1)) // max(int(gas), 1))
    return PresetSpec(
        name=name, stage=int(zero.stage), lp_bytes=lp, offload_optimizer=oo, offload_param=op,
        activation_checkpointing="activation_checkpointing" in ds_config,
        micro_batch=int(micro), gradient_accumulation=int(gas),
        reduce_bucket_size=int(zero.reduce_bucket_size), overlap_comm=bool(zero.overlap_comm),
        prefetch_bucket_size=int(zero.prefetch_bucket_size), max_live_parameters=int(zero.max_live_parameters),
        sub_group_size=int(zero.sub_group_size),
        param_buffer_count=int(zero.offload_param.buffer_count) if zero.offload_param else 0,
        param_buffer_size=int(zero.offload_param.buffer_size) if zero.offload_param else 0,
        optimizer_buffer_count=int(zero.offload_optimizer.buffer_count) if zero.offload_optimizer else 0,
        hybrid_enabled=bool(hybrid.enabled), snapshot_device=str(hybrid.snapshot_device), path=path,
        velocity_bytes_per_value=(VELOCITY_BYTES[hybrid.memory.velocity_dtype]
                                  if hybrid.enabled and hybrid.predictor.direction == "drift" else 0.0),
        offload_predict=hybrid.memory.offload_predict, fold_source=hybrid.memory.fold_source,
        gradient=bool(hybrid.enabled and hybrid.predictor.direction == "gradient"),
        gradient_state_dtype=hybrid.memory.gradient_state_dtype,
        gradient_v_updated=bool(hybrid.enabled and hybrid.predictor.direction == "gradient" and second_moment_updated(
            hybrid.predictor.gradient_second_moment, _beta2(ds_config), hybrid.memory.gradient_state_dtype,
            hybrid.memory.cpu_step_behind)),
        free_velocity_copy=bool(hybrid.memory.free_velocity_copy),
        fold_during_run=hybrid.memory.fold_during_run is True,
        pin_memory=bool(zero.offload_optimizer.pin_memory) if zero.offload_optimizer else False,
        param_pin_memory=bool(zero.offload_param.pin_memory) if zero.offload_param else False,
        param_max_in_cpu=int(zero.offload_param.max_in_cpu) if zero.offload_param else 10 ** 9)


def load_presets(names: Iterable[str] | None = None, overrides: list[str] | None = None) -> list[PresetSpec]:
    """Every preset in ds_configs/ (or the named ones, by name or path); ``overrides``: ``--set
    KEY=VALUE`` items applied to each one's ``hybrid_predict`` section (its name then ends in ``+set``)."""
    from ..config import ConfigError, apply_overrides
    paths: list[Path]
    if names:
        paths = [find_preset(n, "--presets") for n in names]
    else:
        paths = sorted(PRESET_DIR.glob("*.json"))
    out = []
    for p in paths:
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PlanError(f"preset {p}: {err}") from None
        if overrides:
            try:
                apply_overrides(cfg, overrides)
            except ConfigError as err:
                raise PlanError(f"preset {p.stem}: {err}") from None
        out.append(preset_spec(cfg, p.stem + ("+set" if overrides else ""), str(p)))
    return out


# ============================================================== the arithmetic
@dataclass
class Item:
    where: str      # gpu | cpu | nvme
    what: str
    bytes: float
    source: str = "ds_hybrid"


def model_states(shape: ModelShape, preset: PresetSpec, gpus: int, nodes: int,
                 zero_init: bool = False, accelerator: str = "cuda") -> list[Item]:
    """Weights, gradients, fp32 masters and Adam moments (and building the model) per GPU / node.

    DeepSpeed's estimators give the numbers where they apply (ZeRO 2 and 3, 16-bit weights, no
    NVMe); their CPU figures include DeepSpeed's 1.5x buffer factor and the build of the model
    in each process. Under ``offload_optimizer: cpu`` with 16-bit weights the host figure is
    DeepSpeed's buffers as counted instead (``_offload_host_states``): more bytes per parameter
    than its estimators count, without their 1.5x. Elsewhere the same bytes per parameter are counted here: weights
    (2 or 4), gradients (2 or 4; partitioned from ZeRO 2), an fp32 gradient partition (4),
    fp32 masters (4; the weights themselves in fp32 ZeRO 0) and Adam's two moments (8), the
    last three partitioned from ZeRO 1.
    """
    P, W, lp, st = shape.params, gpus * nodes, preset.lp_bytes, preset.stage
    oo, op = preset.offload_optimizer, preset.offload_param
    largest = shape.largest_module_params
    items: list[Item] = []
    build = 4 * P * gpus  # ds-hybrid train builds the fp32 model on the CPU in every process
    if st == 3 and op != "none" and oo == "none":
        raise PlanError(f"preset {preset.name}: offload_param needs offload_optimizer as well (DeepSpeed)")
    if st < 3 and (op != "none" or oo == "nvme"):
        raise PlanError(f"preset {preset.name}: parameter offload and NVMe need ZeRO stage 3")
    if st == 0 and oo != "none":
        raise PlanError(f"preset {preset.name}: optimizer offload needs ZeRO stage 1 or more")

    if accelerator == "cpu":  # one place for everything; the model built is the model trained
        if st == 0:
            per = (16 if lp == 4 else 20) * P
        else:
            grads = lp * P if st == 1 else lp * P / W
            per = lp * P / (W if st == 3 else 1) + grads + 16 * P / W
        items.append(Item("cpu", f"model states (ZeRO {st}, {lp}-byte weights)", per))
        return items

    if lp == 2 and st == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        cpu, gpu = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=oo == "cpu",
                                                         additional_buffer_factor=DS_BUFFER_FACTOR)
        items.append(Item("gpu", "model states", gpu, "deepspeed"))
        items.append(_offload_host_states(P, gpus, W, build, 0, cpu) if oo == "cpu" else
                     Item("cpu", "model states + model build", cpu, "deepspeed"))
        return items
    if lp == 2 and st == 3 and "nvme" not in (oo, op):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            P, largest, gpus, nodes, cpu_offload=oo == "cpu", cpu_offload_params=op == "cpu",
            zero_init=zero_init, additional_buffer_factor=DS_BUFFER_FACTOR)
        items.append(Item("gpu", "model states + largest layer", gpu, "deepspeed"))
        items.append(_offload_host_states(P, gpus, W, 0 if zero_init else build,
                                          DS_OFFLOAD_PARAM_HOST_BYTES if op == "cpu" else 0, cpu)
                     if oo == "cpu" else
                     Item("cpu", "model states + model build" if not zero_init else "model states", cpu,
                          "deepspeed"))
        return items

    # The same counting for what DeepSpeed has no estimator for.
    if st == 0:
        items.append(Item("gpu", "model states (ZeRO 0)", (16 if lp == 4 else 20) * P))
        items.append(Item("cpu", "model build", build))
        return items
    if st in (1, 2):
        grads = lp * P if st == 1 else lp * P / W
        if oo == "none":
            items.append(Item("gpu", f"model states (ZeRO {st})", lp * P + grads + 16 * P / W))
            items.append(Item("cpu", "model build", build * DS_BUFFER_FACTOR))
        else:
            items.append(Item("gpu", f"weights + gradients (ZeRO {st})", lp * P + (grads if st == 1 else 0)))
            if lp == 2:   # ZeRO 1 runs ZeRO 2's code (stage_1_and_2.py): the same buffers
                items.append(_offload_host_states(P, gpus, W, build, 0, max(build, 16 * P * gpus / W)
                                                  * DS_BUFFER_FACTOR))
            else:
                items.append(Item("cpu", "masters + Adam + fp32 gradients, or model build",
                                  max(build, 16 * P * gpus / W) * DS_BUFFER_FACTOR))
        return items
    # stage 3: fp32 weights, or NVMe (ZeRO-Infinity)
    items.append(Item("gpu", "largest layer gathered", 4 * largest, "deepspeed"))
    if op == "none":
        items.append(Item("gpu", "weight partition", lp * P / W))
    if oo == "none":
        items.append(Item("gpu", "gradients + masters + Adam (partitions)", (lp + 4 + 4 + 8) * P / W))
    if oo == "nvme":
        items += _nvme_states(shape, preset, gpus, W, nodes, 0 if zero_init else build)
        return items
    states_cpu = 0.0
    if oo == "cpu":
        states_cpu += 16 * P * gpus / W
    if op == "cpu":
        states_cpu += lp * P * gpus / W
    items.append(Item("cpu", "offloaded states, or model build", max(0 if zero_init else build, states_cpu)))
    return items


def _nvme_states(shape: ModelShape, preset: PresetSpec, gpus: int, W: int, nodes: int, build: float) -> list[Item]:
    """ZeRO-Infinity (ZeRO 3 with ``offload_optimizer: nvme``), as DeepSpeed 0.19.8 lays it out,
    counted buffer by buffer on its CPU accelerator (``benchmarks/offload_host_layout.py``,
    docs/results/offload-host-layout-nvme.json). On the drive: the fp32 masters, Adam's moments
    and their fp32 gradients (16 bytes a parameter), and with ``offload_param: nvme`` the 16-bit
    weights. In host memory: the 16-bit gradient partitions (``grad_partitions_flat_buffer``,
    ``lp`` bytes a parameter of the partition, whatever is swapped), the 16-bit weights
    (``offload_param: cpu``; on NVMe up to ``max_in_cpu`` of them stay), ``buffer_count`` pinned
    fp32 swap buffers of the largest optimizer sub-group, offload_param's swap buffers, and while
    the optimizer is set up, the largest sub-group's fp32 gradient (read from stage3.py's
    ``initialize_optimizer_states``; gone after it)."""
    P, lp = shape.params, preset.lp_bytes
    part = math.ceil(P / W)
    groups = [[math.ceil(n / W) for n in g] for g in shape.param_groups]
    largest = max(n for g in groups for n in _sub_groups(g, preset.sub_group_size))
    nvme = 16 * P / nodes + (lp * P / nodes if preset.offload_param == "nvme" else 0)
    host = lp * part                                               # 16-bit gradient partitions
    if preset.offload_param == "cpu":
        host += lp * part
    elif preset.offload_param == "nvme":
        host += lp * min(part, preset.param_max_in_cpu) + preset.param_buffer_count * preset.param_buffer_size * lp
    host += 4 * largest * (preset.optimizer_buffer_count + 1)     # swap buffers + the setup's gradient
    return [Item("nvme", "swapped optimizer state / gradients / weights", nvme),
            Item("cpu", "16-bit gradient partitions and weights + pinned swap buffers (counted), or model build",
                 max(build, gpus * host), "deepspeed 0.19.8 (counted)")]


def _offload_host_states(P: float, gpus: int, W: int, build: float, param_bytes: int,
                         deepspeed_estimate: float) -> Item:
    """What DeepSpeed keeps in a node's host memory under ``offload_optimizer: cpu`` with 16-bit
    weights: its buffers as counted (``DS_OFFLOAD_HOST_BYTES`` per parameter of each rank's
    partition, plus ``offload_param``'s 16-bit weights), or the fp32 model each process builds
    first where that is larger (it is freed before the states exist; counted as DeepSpeed's
    estimators count it, with their 1.5x). DeepSpeed's own estimate is named beside it."""
    per_param = DS_OFFLOAD_HOST_BYTES + param_bytes
    states = per_param * P * gpus / W
    build *= DS_BUFFER_FACTOR
    return Item("cpu", f"model states: DeepSpeed's offload buffers, {per_param} bytes a parameter (counted; "
                       f"its estimator says {fmt_bytes(deepspeed_estimate)} with its 1.5x factor)"
                       + (", or model build" if build > states else ""),
                max(build, states), "deepspeed 0.19.8 (counted)")


def _sub_groups(numels: list[int], size: int) -> list[int]:
    """ZeRO 3's optimizer sub-groups of one param group (``_create_fp16_sub_groups``): tensors in
    order, a sub-group closed once it reaches ``sub_group_size``; their sizes."""
    if sum(numels) <= size:
        return [sum(numels)]
    out, cur = [], 0
    for i, n in enumerate(numels):
        cur += n
        if cur >= size or i == len(numels) - 1:
            out.append(cur)
            cur = 0
    return out


def swapped_sub_groups(shape: ModelShape, preset: PresetSpec, W: int = 1) -> list[int]:
    """The optimizer sub-groups (their sizes, one rank's partition) whose 16-bit partitions ZeRO 3
    keeps on NVMe under ``offload_param: nvme``: DeepSpeed 0.19.8 (``stage3.py``) gives each param
    group in turn a host flat buffer of what is left of ``max_in_cpu``, and a sub-group a slice of
    it only where the sub-group ends inside it; the rest are swapped."""
    if preset.stage != 3 or preset.offload_param != "nvme":
        return []
    out, before = [], 0
    for g in ([math.ceil(n / W) for n in g] for g in shape.param_groups):
        room = sum(g) if before + sum(g) <= preset.param_max_in_cpu else max(0, preset.param_max_in_cpu - before)
        before += sum(g)
        offset = 0
        for n in _sub_groups(g, preset.sub_group_size):
            offset += n
            if offset > room:
                out.append(n)
    return out


def deepspeed_pinned_blocks(shape: ModelShape, preset: PresetSpec, W: int = 1) -> list[float]:
    """The host blocks one rank pins under ``offload_optimizer`` (DeepSpeed 0.19.8; recorded
    call by call on its CPU accelerator in ``tests/test_planner_pinned.py``):

    * ZeRO 1/2 with ``pin_memory`` (``stage_1_and_2.py``): each flat param group's fp32 masters,
      their fp32 gradient and the 16-bit copy for the upload; the largest tensor's 16-bit staging
      buffer; with ``gradient_accumulation_steps`` > 1 a 16-bit accumulation buffer per tensor
      (``accumulated_grads_in_cpu``; with several ranks counted as ``1 / W`` of the model's);
    * ZeRO 3 (``stage3.py``): with ``offload_optimizer.pin_memory`` the 16-bit gradient
      partitions (one block) and, in CPU memory, each optimizer sub-group's fp32 gradient (on NVMe
      the swapper locks its own buffers, which torch does not round); with ``offload_param``
      each param group's flat 16-bit weights, and with its ``pin_memory`` every tensor's 16-bit
      partition as ``zero.Init`` made it (DeepSpeed then points the parameter into the flat
      buffer; torch's allocator keeps the block: the H200's pinned peak holds them)."""
    lp = preset.lp_bytes
    groups = [[math.ceil(n / W) for n in g] for g in shape.param_groups]
    tensors = [n for g in groups for n in g]
    blocks: list[float] = []
    if preset.stage == 3:
        if preset.pin_memory:
            blocks.append(float(lp * sum(tensors)))
            if preset.offload_optimizer == "cpu":   # (on NVMe: the swapper's own page-locked buffers)
                blocks += [4.0 * n for g in groups for n in _sub_groups(g, preset.sub_group_size)]
        if preset.offload_param == "cpu":
            blocks += [float(lp * sum(g)) for g in groups]
            if preset.param_pin_memory:
                blocks += [float(lp * n) for n in tensors]
        return blocks
    if not preset.pin_memory:
        return blocks
    # (the staging buffer holds a whole tensor, not this rank's share of it)
    blocks = [float(b) for g in groups for b in (4 * sum(g), 4 * sum(g), lp * sum(g))]
    blocks.append(float(lp * max(shape.tensor_numels)))
    if preset.gradient_accumulation > 1:
        blocks += [lp * n / W for n in shape.tensor_numels]
    return blocks


def velocity_pinned_blocks(shape: ModelShape, preset: PresetSpec, W: int = 1) -> list[float]:
    """The host drift velocity's pinned blocks, one set per param group (the engine pins it where
    the 16-bit shards are on a GPU and ``offload_optimizer.pin_memory`` is on): int8 keeps whole
    256-value blocks and a float scale for each (``quant.CompactBuffer``)."""
    out: list[float] = []
    for n in (math.ceil(g / W) for g in shape.group_numels):
        if preset.velocity_bytes_per_value in (4.0, 2.0):
            out.append(preset.velocity_bytes_per_value * n)
        else:
            nblocks = math.ceil(n / 256)
            out += [256.0 * nblocks, 4.0 * nblocks]
    return out


def staging_pinned_blocks(preset: PresetSpec, accelerator: str, W: int = 1) -> list[float]:
    """The hybrid's own pinned chunk buffers on one rank (``staging``; pinned only where a copy
    crosses between host memory and a GPU), on the device path under ``offload_optimizer``:

    * the gradient Predict step with the 16-bit shards on the GPU: the run's moments go up and its
      first moment and the 16-bit weights (the masters' catch-up) come down through a ``Stager``'s
      two buffers per dtype they cross in (the state dtype's, the weights'): 16 MiB for bf16 state
      beside bf16 weights, what an H200 pinned on top of plain ZeRO-Offload's blocks with llama-1b;
    * the gradient Predict step on ZeRO 3 with ``offload_param`` (the shards in host memory): each
      parameter's gradient share comes down through a ``QueuedDownloads``' 8 buffers, in the
      weights' dtype on one rank and in the state dtype with several (the share is all-reduced in it);
    * the drift path with ``fold_during_run``: the commit adds the run's held velocity copy from the
      GPU through a ``Stager`` (int8: its values, and its scales in fp32 buffers, 40 MiB). Without
      it the commit reads the host velocity, and nothing crosses."""
    if (accelerator == "cpu" or not preset.hybrid_enabled or preset.offload_optimizer == "none"
            or not preset.device_predict(accelerator)):
        return []
    if not preset.gradient:
        if not (preset.fold_during_run and preset.shards_on_gpu(accelerator)):
            return []
        v = preset.velocity_bytes_per_value
        kinds = [1.0, 4.0] if v not in (2.0, 4.0) else [v]   # (int8: the values, then the fp32 scales)
        return [STAGE_CHUNK * b for b in kinds for _ in range(STAGER_BUFFERS)]
    state, lp = preset.gradient_state_bytes(accelerator), float(preset.lp_bytes)
    if preset.compact_gradient_state:   # (its moments cross unstaged; a kept run's catch-up is staged)
        return [STAGE_CHUNK * lp] * STAGER_BUFFERS
    if preset.shards_on_gpu(accelerator):
        return [STAGE_CHUNK * b for b in sorted({state, lp}) for _ in range(STAGER_BUFFERS)]
    return [STAGE_CHUNK * (lp if W == 1 else state)] * QUEUE_BUFFERS


def pinned_rounding(blocks: list[float], pinned_round_mb: int) -> float:
    """What torch's pinned allocator holds beyond ``blocks`` (``pinned.pinned_block_bytes``)."""
    return sum(pinned_block_bytes(math.ceil(b), pinned_round_mb) - b for b in blocks)


def _offload_host_extras(shape: ModelShape, preset: PresetSpec, gpus: int, W: int, accelerator: str,
                         pinned_round_mb: int) -> list[Item]:
    """What DeepSpeed holds in host memory under ``offload_optimizer: cpu`` (or ``nvme``) beyond
    the counted buffers (``DS_OFFLOAD_HOST_BYTES`` a parameter, ``_nvme_states``; counted on its
    CPU accelerator, where nothing is pinned):

    * ZeRO 1/2 with ``gradient_accumulation_steps`` > 1: the 16-bit accumulation buffers (2.0
      bytes a parameter, ``benchmarks/offload_host_layout.py --gas``) and, pinned, the largest
      tensor's staging buffer;
    * ZeRO 3 with ``offload_param`` pinned, on a GPU machine: every tensor's 16-bit partition from
      ``zero.Init``, which torch's pinned allocator keeps after DeepSpeed moves the weights into
      its flat buffer (2 bytes a parameter);
    * on a GPU machine, what torch's pinned allocator rounds the pinned blocks up to
      (``deepspeed_pinned_blocks``): for llama-1b on the H200 the blocks so rounded are the
      profiler's pinned peak to 0.01 MiB on ZeRO 2 and 3 (``tests/test_planner_pinned.py``)."""
    lp = preset.lp_bytes
    items: list[Item] = []
    gpu = accelerator != "cpu"
    if preset.stage in (1, 2):
        if preset.gradient_accumulation > 1:
            items.append(Item("cpu", "16-bit gradient accumulation buffer per parameter tensor "
                                     "(gradient_accumulation_steps > 1; DeepSpeed's accumulated_grads_in_cpu)",
                              lp * shape.params * gpus / W, "deepspeed 0.19.8 (counted)"))
        if preset.pin_memory and gpu:
            items.append(Item("cpu", "the largest tensor's 16-bit staging buffer (temp_grad_buffer_for_cpu_offload)",
                              lp * max(shape.tensor_numels) * gpus, "deepspeed 0.19.8"))
    elif preset.offload_param == "cpu" and preset.param_pin_memory and gpu:
        items.append(Item("cpu", "16-bit partition of every tensor from zero.Init, pinned and kept by torch's host "
                                 "allocator (offload_param.pin_memory)", lp * shape.params * gpus / W,
                          "deepspeed 0.19.8 + torch (H200's pinned peak)"))
    blocks = deepspeed_pinned_blocks(shape, preset, W)
    if blocks and gpu:
        how = ("powers of two" if not pinned_round_mb else
               f"powers of two up to {pinned_round_mb} MiB, its own size above (--pinned-round-mb)")
        items.append(Item("cpu", f"pinned-memory rounding of DeepSpeed's offload blocks (torch's host allocator: {how})",
                          pinned_rounding(blocks, pinned_round_mb) * gpus, "torch's CachingHostAllocator (counted)"))
    return items


@dataclass
class Estimate:
    preset: str
    description: str
    micro_batch: int
    seq_len: int
    gpu_bytes: float
    cpu_bytes: float
    nvme_bytes: float
    snapshot_bytes: float
    snapshot_where: str
    items: list[Item] = field(default_factory=list)
    fits: bool | None = None
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["items"] = [asdict(i) for i in self.items]
        return d


def estimate(shape: ModelShape, preset: PresetSpec, gpus: int = 1, nodes: int = 1,
             seq_len: int | None = None, micro_batch: int | None = None, zero_init: bool = False,
             accelerator: str = "cuda", pinned_round_mb: int = 0) -> Estimate:
    """Per-device GPU, per-node CPU and per-node NVMe bytes for training ``shape`` with ``preset``.

    ``pinned_round_mb``: 0 where torch rounds every pinned host block up to a power of two (a
    torch that cannot limit it: 2.11 on the lent GPU machine), N where blocks above N MiB are
    pinned at their own size (``ds-hybrid train --pinned-round-mb N`` on a torch that can).

    ``accelerator="cpu"`` estimates a run on DeepSpeed's CPU accelerator instead: everything
    lands in host memory, and ``cpu_bytes`` is what the run adds to its process's RSS over
    the RSS before the model was built (what ``validate_cpu`` measures); ``gpu_bytes`` is 0.
    """
    seq = seq_len or shape.default_seq_len
    mb = micro_batch or preset.micro_batch
    W = gpus * nodes
    dev = "cpu" if accelerator == "cpu" else "gpu"
    items = model_states(shape, preset, gpus, nodes, zero_init, accelerator)
    P, lp = shape.params, preset.lp_bytes
    if preset.stage >= 1 and preset.offload_optimizer != "none":
        items += _offload_host_extras(shape, preset, gpus, W, accelerator, pinned_round_mb)

    # DeepSpeed's gradient buckets and ZeRO-3's gathered weights.
    if preset.stage in (1, 2, 3):
        bucket_dtype = 4 if preset.stage == 1 else lp   # ZeRO 1 stages the fp32 accumulator
        n = preset.reduce_bucket_size * (2 if preset.overlap_comm else 1)
        if accelerator == "cpu":  # pages of an empty CPU tensor are resident only once written
            n = min(n, P)
        items.append(Item(dev, "gradient reduction bucket", n * bucket_dtype, "deepspeed config"))
    if preset.stage == 3:
        # ZeRO 3 keeps gathered weights that are used again within stage3_max_reuse_distance (1e9 by
        # default: every weight, since backward reuses them all), up to stage3_max_live_parameters.
        gathered = min(max(preset.max_live_parameters, shape.block_params), P)
        items.append(Item(dev, "gathered weights (<= stage3_max_live_parameters)", gathered * lp,
                          "deepspeed config"))

    act = activation_bytes(shape, seq, mb, lp, preset.activation_checkpointing)
    items.append(Item(dev, "activations: blocks" + (" (checkpointed)" if preset.activation_checkpointing else ""),
                      act["layers"]))
    items.append(Item(dev, "activations: final norm + loss", act["head"]))
    items.append(Item(dev, "backward working set", act["working"]))

    # ds_hybrid's own buffers: one fp32 copy of the rank's master partition.
    snap, snap_where = 0.0, "-"
    if preset.hybrid_enabled:
        part = 4 * P / (W if preset.stage >= 1 else 1)
        masters_on_cpu = preset.offload_optimizer != "none"
        snap_where = "cpu" if (accelerator == "cpu" or preset.snapshot_device == "cpu" or masters_on_cpu) else "gpu"
        if preset.snapshot_kept(accelerator):
            snap = part * (gpus if snap_where == "cpu" and accelerator != "cpu" else 1)
            items.append(Item(snap_where, "rollback snapshot (fp32 master partition)", snap))
        else:
            snap_where = "-"   # device-side Predict, fold from the optimizer state: no copy of the masters
        if preset.velocity_bytes_per_value:
            # The drift velocity lives beside the masters (host memory under offload_optimizer), or
            # with fold_source weights16 beside the 16-bit shards.
            if preset.velocity_beside_shards(accelerator):
                vel_where = "gpu" if preset.shards_on_gpu(accelerator) else "cpu"
            else:
                vel_where = "cpu" if (accelerator == "cpu" or masters_on_cpu) else "gpu"
            vel = preset.velocity_bytes_per_value * part / 4 * (gpus if vel_where == "cpu" and accelerator != "cpu" else 1)
            items.append(Item(vel_where, "drift velocity (hybrid_predict.memory.velocity_dtype)", vel))
            if vel_where == "cpu" and preset.pin_memory and preset.shards_on_gpu(accelerator):
                # (pinned as DeepSpeed's offload buffers are, where the shards it feeds are on a GPU)
                items.append(Item("cpu", "pinned-memory rounding of the host drift velocity (per param group)",
                                  pinned_rounding(velocity_pinned_blocks(shape, preset, W), pinned_round_mb) * gpus,
                                  "torch's CachingHostAllocator (counted)"))
            if preset.device_predict(accelerator) and vel_where == "cpu" and preset.shards_on_gpu(accelerator):
                copy = preset.velocity_bytes_per_value * part / 4
                if preset.free_velocity_copy:
                    # Only during a Predict run (no backward, no activations kept): a real step's
                    # buckets, activations and backward working set have that memory then.
                    real_only = sum(i.bytes for i in items if i.where == "gpu" and
                                    i.what.startswith(("gradient reduction bucket", "activations:",
                                                       "backward working set")))
                    items.append(Item("gpu", "drift velocity copy beside the 16-bit shards during a Predict run, "
                                             "beyond what a real step's buckets and activations free "
                                             "(memory.free_velocity_copy)", max(0.0, copy - real_only)))
                else:
                    items.append(Item("gpu", "drift velocity copy beside the 16-bit shards (memory.offload_predict)",
                                      copy))
            if preset.velocity_beside_shards(accelerator) and vel_where == "gpu":
                # copied down once per run for the commit into the masters (DevicePredict.copy_down)
                items.append(Item("cpu", "host copy of the drift velocity for a kept run's commit "
                                         "(memory.fold_source: weights16)", preset.velocity_bytes_per_value * part / 4 * gpus))
                if preset.pin_memory:
                    items.append(Item("cpu", "pinned-memory rounding of the velocity's host copy (per param group)",
                                      pinned_rounding(velocity_pinned_blocks(shape, preset, W), pinned_round_mb) * gpus,
                                      "torch's CachingHostAllocator (counted)"))
            if preset.velocity_beside_shards(accelerator):
                # The shards' copy exists from the optimizer step to the fold, after the backward:
                # counted beyond what the activations and the backward's working set leave.
                after_backward = sum(i.bytes for i in items if i.where == dev and
                                     i.what.startswith(("activations:", "backward working set")))
                shards = preset.lp_bytes * part / 4 * (gpus if vel_where == "cpu" and accelerator != "cpu" else 1)
                items.append(Item(vel_where, "16-bit shards' copy at the optimizer step, beyond what the activations "
                                             "leave (memory.fold_source: weights16)", max(0.0, shards - after_backward)))
        if preset.gradient:
            # A gradient Predict step's private gradient on the device (autograd's 16-bit tensors; a
            # flat sum beside them with accumulation or several ranks, in the device path's state dtype,
            # fp32 on the host path), and the run's moments: copies beside the 16-bit shards on the
            # device path, its first moment beside the masters otherwise.
            device_path = preset.device_predict(accelerator)
            state = preset.gradient_state_bytes(accelerator) if device_path else 4.0
            m_where = "cpu" if (accelerator == "cpu" or masters_on_cpu) else "gpu"
            state_where = ("gpu" if preset.shards_on_gpu(accelerator) else "cpu") if device_path else m_where
            per_node = gpus if state_where == "cpu" and accelerator != "cpu" else 1
            if preset.compact_gradient_state and device_path:
                # The gradient folded into the first moment a parameter at a time (its fp32
                # all-reduce copy with several ranks); both moments in about a byte a parameter.
                items.append(Item(dev, "gradient Predict step's own gradient, a parameter at a time "
                                       "(memory.gradient_state_dtype: int8/int4-factored)",
                                  shape.largest_module_params * (lp + (4.0 if W > 1 else 0))))
                items.append(Item(state_where, "gradient Predict run's compact first moment and factored second "
                                               "(memory.gradient_state_dtype)",
                                  state * P / W * per_node))
            elif preset.stage == 3:
                # No whole gradient: each parameter's as the backward produces it (and its all-reduce
                # copy with several ranks), this rank's share summed beside the run's first moment.
                items.append(Item(dev, "gradient Predict step's own gradient, a parameter at a time "
                                       "(predictor.direction: gradient)",
                                  shape.largest_module_params * (lp + (state if W > 1 else 0))))
                items.append(Item(state_where, "gradient Predict step's gradient share (partition)",
                                  state * P / W * per_node))
            else:
                items.append(Item(dev, "gradient Predict step's own gradient (predictor.direction: gradient)",
                                  lp * P + (state * P if preset.gradient_accumulation > 1 or W > 1 else 0)))
            if device_path and not preset.compact_gradient_state:   # (the compact state's counted above)
                # (the second moment is read where it lies when that is beside the shards in the state dtype)
                v_in_place = state == 4.0 and m_where == state_where and not preset.gradient_v_updated
                items.append(Item(state_where, "gradient Predict run's Adam moments beside the 16-bit shards "
                                               "(memory.gradient_state_dtype)",
                                  (1 if v_in_place else 2) * state * P / W * per_node))
            elif not device_path:
                items.append(Item(m_where, "gradient Predict run's first moment (fp32, beside the masters)",
                                  part * per_node))
                if preset.gradient_v_updated:
                    items.append(Item(m_where, "gradient Predict run's second moment (fp32, beside the masters; "
                                               "predictor.gradient_second_moment: updated)", part * per_node))
        swapped = swapped_sub_groups(shape, preset, W)
        if swapped and preset.device_predict(accelerator):
            # (zero_access.SwappedShards: each swapped sub-group's 16-bit partition read into one
            # host buffer, stepped and written back; kept from step to step; either direction)
            items.append(Item("cpu", "host buffer a Predict step passes each 16-bit partition on NVMe "
                                     "through (offload_param: nvme)", float(lp * max(swapped) * gpus)))
        staging = staging_pinned_blocks(preset, accelerator, W)
        if staging:
            items.append(Item("cpu", "the Predict run's pinned staging chunks (ds_hybrid/staging.py)",
                              sum(pinned_block_bytes(int(b), pinned_round_mb) for b in staging) * gpus))
        items.append(Item(dev, "predictor", PREDICTOR_BYTES))

    if accelerator == "cpu":
        # glibc's malloc raises its mmap threshold to the size of a freed mmapped block (up to 32 MiB)
        # and keeps up to twice that of freed heap memory before trimming: a step's freed
        # activations stay resident up to that bound.
        transient = act["layers"] + act["working"]
        items.append(Item("cpu", "freed memory malloc keeps (glibc, <= 64 MiB)", min(MALLOC_RETAINED_MAX, transient),
                          "glibc defaults"))
        items.append(Item("cpu", "engine overhead (measured, gpt2-test)", CPU_ENGINE_OVERHEAD_BYTES, "measured"))
    else:
        live = sum(i.bytes for i in items if i.where == "gpu")
        items.append(Item("gpu", "allocator fragmentation (assumed 10%)", GPU_FRAGMENTATION * live, "assumed"))
        items.append(Item("gpu", "CUDA context + workspaces (assumed)", CUDA_CONTEXT_BYTES, "assumed"))
        items.append(Item("cpu", f"process runtime x {gpus} (assumed)", HOST_RUNTIME_BYTES * gpus, "assumed"))

    total = {w: sum(i.bytes for i in items if i.where == w) for w in ("gpu", "cpu", "nvme")}
    # (a setup the engine refuses at its start fits nothing, whatever its bytes)
    from ..config import compact_state_refusal
    refused = preset.gradient and compact_state_refusal(preset.gradient_state_dtype, preset.device_predict(accelerator))
    return Estimate(preset=preset.name, description=preset.describe(), micro_batch=mb, seq_len=seq,
                    gpu_bytes=total["gpu"], cpu_bytes=total["cpu"], nvme_bytes=total["nvme"],
                    snapshot_bytes=snap, snapshot_where=snap_where, items=items,
                    reasons=[f"{ENGINE_REFUSES}{refused}"] if refused else [])


# ============================================================== the plan
@dataclass
class Plan:
    model: ModelShape
    gpu_mem: int
    cpu_mem: int
    nvme: int
    gpus: int
    nodes: int
    estimates: list[Estimate]
    picked: str | None
    pinned_round_mb: int = 0   # 0: torch rounds every pinned block to a power of two; N: not above N MiB

    def as_dict(self) -> dict:
        return {"model": asdict(self.model),
                "hardware": {"gpu_mem_bytes": self.gpu_mem, "cpu_mem_bytes": self.cpu_mem, "nvme_bytes": self.nvme,
                             "gpus_per_node": self.gpus, "nodes": self.nodes},
                "estimates": [e.as_dict() for e in self.estimates], "picked": self.picked,
                "assumptions": {"cuda_context_bytes": CUDA_CONTEXT_BYTES, "gpu_fragmentation": GPU_FRAGMENTATION,
                                "host_runtime_bytes_per_process": HOST_RUNTIME_BYTES,
                                "predictor_bytes": PREDICTOR_BYTES, "ds_buffer_factor": DS_BUFFER_FACTOR,
                                "pinned_round_mb": self.pinned_round_mb},
                "note": "estimated, not measured: GPU figures are not validated on a GPU"}


def make_plan(shape: ModelShape, presets: list[PresetSpec], gpu_mem: int, cpu_mem: int, nvme: int = 0,
              gpus: int = 1, nodes: int = 1, seq_len: int | None = None, micro_batch: int | None = None,
              zero_init: bool = False, pinned_round_mb: int = 0) -> Plan:
    """Estimate every preset, mark which fit, pick the fastest that fits (``None`` if none does)."""
    ests = []
    for p in sorted(presets, key=lambda q: (q.speed_rank, q.name)):
        e = estimate(shape, p, gpus, nodes, seq_len, micro_batch, zero_init, pinned_round_mb=pinned_round_mb)
        if e.gpu_bytes > gpu_mem:
            e.reasons.append(f"GPU {fmt_bytes(e.gpu_bytes)} > {fmt_bytes(gpu_mem)}")
        if e.cpu_bytes > cpu_mem:
            e.reasons.append(f"CPU {fmt_bytes(e.cpu_bytes)} > {fmt_bytes(cpu_mem)}")
            if p.pin_memory and pinned_round_mb == 0:
                # (torch rounding every pinned block can be what puts it over: say what avoids it)
                unpinned = estimate(shape, replace(p, pin_memory=False), gpus, nodes, seq_len, micro_batch, zero_init)
                if unpinned.cpu_bytes <= cpu_mem:
                    e.reasons.append(f"{fmt_bytes(unpinned.cpu_bytes)} with "
                                     "zero_optimization.offload_optimizer.pin_memory: false (no pinned rounding)")
        if e.nvme_bytes > nvme:
            e.reasons.append("needs --nvme" if not nvme else f"NVMe {fmt_bytes(e.nvme_bytes)} > {fmt_bytes(nvme)}")
        e.fits = not e.reasons
        ests.append(e)
    picked = next((e.preset for e in ests if e.fits), None)
    return Plan(shape, gpu_mem, cpu_mem, nvme, gpus, nodes, ests, picked, pinned_round_mb)


def plan_for_run(ds_config: dict, model: str, seq_len: int, zero_init: bool, accelerator: str,
                 gpu_mem: int | None, cpu_mem: int | None, gpus: int = 1, nodes: int = 1,
                 vocab_size: int | None = 256, layer_groups: int = 4, pinned_round_mb: int = 0) -> Estimate:
    """The estimate for the run ``ds-hybrid train`` is about to start (its config, model, sequence
    length and machine), marked as fitting or not: checked before anything is built, so that a
    run the estimate puts over the machine's memory says so first, and recorded beside what
    the run measures. ``gpu_mem`` / ``cpu_mem`` None: that side is not checked. On DeepSpeed's
    CPU accelerator the host figure is per process (``estimate``), so it is checked times
    ``gpus`` (the processes on this node). ``layer_groups`` and ``pinned_round_mb``: the run's
    ``--layer-groups`` and the pinned rounding it got (``estimate``)."""
    shape = model_shape(model, vocab_size=vocab_size, layer_groups=layer_groups)
    e = estimate(shape, preset_spec(ds_config, "this run"), gpus, nodes, seq_len, None, zero_init, accelerator,
                 pinned_round_mb)
    host = e.cpu_bytes * (gpus if accelerator == "cpu" else 1)
    if gpu_mem is not None and e.gpu_bytes > gpu_mem:
        e.reasons.append(f"GPU {fmt_bytes(e.gpu_bytes)} > {fmt_bytes(gpu_mem)}")
    if cpu_mem is not None and host > cpu_mem:
        e.reasons.append(f"CPU {fmt_bytes(host)} > {fmt_bytes(cpu_mem)}")
    e.fits = not e.reasons
    return e


def format_plan(plan: Plan) -> str:
    m = plan.model
    lines = [f"model {m.name}: {m.params / 1e6:,.1f}M parameters ({m.layers} layers x {m.hidden}, "
             f"vocabulary {m.vocab}); {plan.gpus} GPU(s) x {plan.nodes} node(s); per GPU {fmt_bytes(plan.gpu_mem)}, "
             f"per node CPU {fmt_bytes(plan.cpu_mem)}, NVMe {fmt_bytes(plan.nvme) if plan.nvme else 'none'}",
             "",
             "| preset | setup | micro batch x seq | GPU / device | CPU / node | NVMe / node | snapshot | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for e in plan.estimates:
        snap = "-" if not e.snapshot_bytes else f"{fmt_bytes(e.snapshot_bytes)} {e.snapshot_where}"
        fits = "yes" if e.fits else "no: " + "; ".join(e.reasons)
        lines.append(f"| {e.preset} | {e.description} | {e.micro_batch} x {e.seq_len} | {fmt_bytes(e.gpu_bytes)} | "
                     f"{fmt_bytes(e.cpu_bytes)} | {fmt_bytes(e.nvme_bytes) if e.nvme_bytes else '-'} | {snap} | {fits} |")
    lines.append("")
    if plan.picked:
        lines.append(f"picked: {plan.picked} (the fastest that fits: least offload, then lowest ZeRO stage)")
    else:
        lines.append("picked: none fits; see the reasons above (more --cpu-mem, --nvme, more --gpus, a smaller "
                     "--micro-batch or --seq-len)")
    lines.append("Estimates, not measurements. GPU: model states (DeepSpeed's estimators where they apply) + buckets "
                 "+ activations + ds_hybrid's snapshot and predictor + CUDA context (1 GiB, assumed) + 10% "
                 "fragmentation (assumed). CPU: per node, including building the fp32 model in each process; "
                 "under offload_optimizer cpu or nvme, DeepSpeed's buffers as counted on its CPU accelerator "
                 "(benchmarks/offload_host_layout.py), not its estimator's 1.5x; also ZeRO 1/2's 16-bit accumulation "
                 "buffers (more than one micro-batch a step), ZeRO 3's pinned 16-bit partitions from zero.Init, and "
                 "torch's rounding of pinned blocks to powers of two" + (f" up to {plan.pinned_round_mb} MiB (--pinned-round-mb)" if plan.pinned_round_mb
                                    else " (all of them: --pinned-round-mb 0)") + ".")
    return "\n".join(lines)


# ============================================================== validation on CPU
def validate_cpu(models: Iterable[str] = ("gpt2-tiny", "gpt2-124m"), steps: int = 8, seq_len: int = 128,
                 micro_batch: int = 4, stage: int = 1, checkpointing: bool = False, hybrid: bool = True,
                 out_dir: str | Path | None = None, quiet: bool = True) -> list[dict]:
    """Train each model a few steps on DeepSpeed's CPU accelerator (``python -m ds_hybrid.train``,
    one subprocess per model, the ``tiny-cpu`` preset at the given ZeRO stage, micro batch and
    sequence length) and compare the planner's estimate for that run with what was measured.

    On the CPU accelerator "the device" is host memory. **Measured**: the highest per-step
    peak RSS of the training loop (or of set-up, if higher) minus the RSS just before the
    model was built (``summary.json``'s ``memory``; everything the process had already
    loaded: interpreter, torch, DeepSpeed, transformers, the corpus). **Estimated**:
    ``estimate(..., accelerator="cpu")``: model states, the gradient bucket, activations,
    the rollback snapshot, the predictor and the engine overhead measured once on gpt2-test.
    """
    base, _ = resolve_config("tiny-cpu")
    base["zero_optimization"] = {"stage": stage}
    base["train_micro_batch_size_per_gpu"] = micro_batch
    base["gradient_accumulation_steps"] = 1
    hp = base.setdefault("hybrid_predict", {})
    hp.update({"enabled": hybrid, "warmup_steps": 2, "full_steps": 2, "confidence_threshold": 0.0,
               "min_predict_steps": 2, "max_predict_steps": 3, "predict_lr_fraction": 1.0})
    if checkpointing:
        base["activation_checkpointing"] = {}
    else:
        base.pop("activation_checkpointing", None)
    tmp = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="ds-hybrid-plan-validate-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results = []
    for name in models:
        run = tmp / name
        run.mkdir(parents=True, exist_ok=True)
        cfg_path = run / "ds_config.json"
        cfg_path.write_text(json.dumps(base, indent=2))
        cmd = [sys.executable, "-m", "ds_hybrid.train", "--config", str(cfg_path), "--model", name,
               "--steps", str(steps), "--seq-len", str(seq_len), "--eval-every", str(steps), "--val-batches", "1",
               "--out", str(run), "--no-plot", "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        if proc.returncode != 0:
            raise RuntimeError(f"validation run {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"\n{proc.stderr[-2000:]}")
        summary = json.loads((run / "summary.json").read_text())
        mem = summary["memory"]
        loop_peak = max((p["rss_peak_mb"] for p in mem["phases"].values()), default=0.0)
        measured = (max(loop_peak, mem["setup_peak_rss_mb"] or 0.0) - mem["baseline_rss_mb"]) * MiB
        shape = model_shape(name, vocab_size=256)
        est = estimate(shape, preset_spec(base, f"tiny-cpu (ZeRO {stage})"), 1, 1, seq_len, micro_batch,
                       accelerator="cpu")
        row = {"model": name, "params": shape.params, "stage": stage, "seq_len": seq_len, "micro_batch": micro_batch,
               "checkpointing": checkpointing, "hybrid": hybrid, "steps": steps,
               "estimated_bytes": est.cpu_bytes, "measured_bytes": measured,
               "ratio": est.cpu_bytes / measured if measured > 0 else None,
               "unexplained_bytes": measured - (est.cpu_bytes - CPU_ENGINE_OVERHEAD_BYTES),
               "baseline_rss_mb": mem["baseline_rss_mb"], "setup_peak_rss_mb": mem["setup_peak_rss_mb"],
               "loop_peak_rss_mb": loop_peak, "per_phase_peak_rss_mb":
                   {k: v["rss_peak_mb"] for k, v in mem["phases"].items()},
               "items": [asdict(i) for i in est.items]}
        results.append(row)
        if not quiet:
            print(_validation_line(row), flush=True)
    return results


def _validation_line(r: dict) -> str:
    return (f"{r['model']:<10} {r['params'] / 1e6:7.2f}M  ZeRO {r['stage']}  {r['micro_batch']}x{r['seq_len']}"
            f"{' AC' if r['checkpointing'] else '   '}  estimated {r['estimated_bytes'] / MiB:8.1f} MiB  "
            f"measured {r['measured_bytes'] / MiB:8.1f} MiB  ratio {r['ratio']:.3f}")


# ============================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-hybrid plan", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="a named model (ds_hybrid.models, e.g. llama-7b) or a "
                                                 "transformers config JSON")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU: 24GB (10^9), 24GiB or 24G (2^30), or bytes")
    p.add_argument("--cpu-mem", default=None, help="host memory per node, same units")
    p.add_argument("--nvme", default="0", help="NVMe space per node for ZeRO-Infinity, same units (0: none)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batch", type=int, default=None, help="micro batch per GPU (default: each preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary (default: the model's)")
    p.add_argument("--presets", nargs="+", default=None, help="presets to consider (default: all in ds_configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set a hybrid_predict key in every preset planned, as ds-hybrid train --set does "
                        "(e.g. --set predictor.direction=gradient --set memory.gradient_state_dtype=int4-factored)")
    p.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=True,
                   help="plan ZeRO-3 presets with the model built under deepspeed.zero.Init, as ds-hybrid train "
                        "builds it there (its --zero-init); --no-zero-init: the full fp32 model built in every "
                        "process first")
    p.add_argument("--layer-groups", type=int, default=4,
                   help="optimizer param groups, as ds-hybrid train --layer-groups makes them (default 4, as there): "
                        "ZeRO 1/2 pin each group's flat buffers as one block")
    p.add_argument("--pinned-round-mb", default="auto",
                   help="pinned host blocks torch rounds up to a power of two: 0 = every block (a torch that cannot "
                        "limit it, such as 2.11), N = only those up to N MiB (ds-hybrid train --pinned-round-mb N); "
                        "auto (default) = 64 where this torch can limit it, as ds-hybrid train does, else 0")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    p.add_argument("--validate", action="store_true",
                   help="instead of planning: train small models on the CPU and compare the estimate with the "
                        "measured memory (see validate_cpu)")
    p.add_argument("--validate-models", nargs="+", default=["gpt2-tiny", "gpt2-124m"], help="--validate: models")
    p.add_argument("--validate-steps", type=int, default=8, help="--validate: steps per run")
    p.add_argument("--validate-stage", type=int, nargs="+", default=[1], help="--validate: ZeRO stages to run")
    p.add_argument("--validate-checkpointing", action="store_true", help="--validate: with activation checkpointing")
    return p


def pinned_round_setting(value: str | int) -> int:
    """``--pinned-round-mb`` as a number of MiB (0: torch rounds every pinned block)."""
    from ..pinned import can_limit_pinned_rounding
    if str(value) == "auto":
        return 64 if can_limit_pinned_rounding() else 0
    try:
        n = int(value)
    except ValueError:
        raise PlanError(f"--pinned-round-mb: 'auto' or a whole number of MiB (got {value!r})") from None
    if n < 0:
        raise PlanError(f"--pinned-round-mb: must be 0 or more (got {n})")
    return n


def main(argv: list[str] | None = None) -> Plan | list[dict]:
    args = build_parser().parse_args(argv)
    try:
        for flag in ("gpus", "nodes", "seq_len", "micro_batch", "vocab_size", "layer_groups"):
            v = getattr(args, flag)
            if v is not None and v < 1:
                raise PlanError(f"--{flag.replace('_', '-')}: must be at least 1 (got {v})")
        if args.validate:
            return _run_validation(args)
        if args.model is None:
            raise PlanError("--model: required (a named model such as llama-7b, or a config JSON)")
        if args.gpu_mem is None:
            raise PlanError("--gpu-mem: required (memory per GPU, e.g. 24GB)")
        if args.cpu_mem is None:
            raise PlanError("--cpu-mem: required (host memory per node, e.g. 128GB)")
        gpu_mem = parse_size(args.gpu_mem, "--gpu-mem")
        cpu_mem = parse_size(args.cpu_mem, "--cpu-mem")
        nvme = parse_size(args.nvme, "--nvme")
        presets = load_presets(args.presets, args.overrides)
        shape = model_shape(args.model, args.vocab_size, args.layer_groups)
        round_mb = pinned_round_setting(args.pinned_round_mb)
        if args.seq_len and args.seq_len > shape.max_positions:
            raise PlanError(f"--seq-len: {args.seq_len} is more than {args.model}'s {shape.max_positions} positions")
        plan = make_plan(shape, presets, gpu_mem, cpu_mem, nvme, args.gpus, args.nodes, args.seq_len,
                         args.micro_batch, args.zero_init, round_mb)
    except InputError as err:   # PlanError, or a size or preset that cannot be read
        raise SystemExit(f"ds-hybrid plan: {err}") from None
    print(format_plan(plan))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(plan.as_dict(), indent=2))
        print(f"wrote {args.json}")
    return plan


def _run_validation(args: argparse.Namespace) -> list[dict]:
    seq = args.seq_len or 128
    mb = args.micro_batch or 4
    print(f"CPU validation: estimate for the run vs measured peak RSS above the pre-model baseline "
          f"({args.validate_steps} steps, micro batch {mb}, seq {seq})", flush=True)
    rows = []
    for stage in args.validate_stage:
        rows += validate_cpu(args.validate_models, args.validate_steps, seq, mb, stage,
                             args.validate_checkpointing, quiet=False)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
