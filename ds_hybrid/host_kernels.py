"""C++ kernels for the hybrid's work on weights in host memory (``memory.host_kernels``).

Under ZeRO-Offload (and on DeepSpeed's CPU accelerator) the masters and the Adam moments live in
host memory, and every real step folds its update into the drift velocity there. Done with torch
ops a chunk at a time that is some twenty passes over memory per value: 3.5x (fp32) to 6.5x (int8)
DeepSpeed's own CPU Adam step on the same values, and 1.1x / 1.5x here (``benchmarks/host_path.py``,
``docs/results/host-fold.json``). ``kernels/host_fold.cpp`` does the same arithmetic in one
pass on torch's intra-op threads. It is compiled on first use with torch's C++ extension builder
(as DeepSpeed builds its ``cpu_adam``), into torch's extensions folder, and loaded from there
afterwards.

The same file's ``shift`` adds a drift Predict step's ``coef x v`` to a copy of the weights in
host memory in one pass (the torch ops: a dequantised chunk, a widened 16-bit chunk, the add, the
narrowing copy back): the host path's update of the fp32 masters, the device path's update of a
16-bit partition that lives in host memory (ZeRO 3 with ``offload_param: cpu``, DeepSpeed's CPU
accelerator), and a kept run's commit into the masters. Its ``catch_up`` is the gradient Predict
run's commit: the masters caught up with the 16-bit weights the run moved, in one pass; its
``held_adam`` a gradient Predict step's update of a bf16 partition in host memory (ZeRO 3 with
``offload_param: cpu``), whose torch ops took 220x DeepSpeed's CPU Adam step on as many values.

``zero_access.fold_real_update(..., host_kernel=True)``, ``zero_access.apply_velocity_update``
and ``device_predict.DevicePredict`` (``host_kernel``) call them; the torch paths stay the
reference (``tests/test_host_kernels.py`` compares them).
"""
from __future__ import annotations

import logging
import threading

import torch

from .kernels import KERNEL_DIR

log = logging.getLogger(__name__)

SETTING = "hybrid_predict.memory.host_kernels"
NAME = "ds_hybrid_host_fold"
# -ffp-contract=off: no multiply-add fused where the torch path rounds twice (host_fold.cpp says
# which ones it fuses on purpose); -fno-math-errno and -fno-trapping-math let sqrt and floor
# vectorise (the values are the same); -march=native as DeepSpeed's cpu_adam (the build is per
# machine, in torch's extensions folder); -fopenmp: at::parallel_for is inlined here and runs on
# torch's OpenMP threads only when this file is built with OpenMP too.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
VDTYPES = {"fp32": 0, "bf16": 1, "int8": 2}
NOISE_PERIOD, NOISE_KEY = 1 << 22, 0x5EED   # host_fold.cpp's kNoisePeriod and kNoiseKey: quant's noise table

_lock = threading.Lock()
_module = None
_error: str | None = None


class HostKernelUnavailable(RuntimeError):
    """``memory.host_kernels: cpp`` was asked for and the extension cannot be built or loaded."""


def load():
    """The compiled extension (built on the first call in a machine's extensions folder), or
    ``HostKernelUnavailable`` naming the setting and the builder's error."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            src = KERNEL_DIR / "host_fold.cpp"
            try:
                if not src.is_file():
                    raise FileNotFoundError(f"kernel source {src} not found (set DS_HYBRID_KERNEL_DIR to the "
                                            "repository's kernels/ folder)")
                from torch.utils.cpp_extension import load as build
                from . import quant
                if (quant.CHUNK, quant.NOISE_TABLE_SEED) != (NOISE_PERIOD, NOISE_KEY):   # (host_fold.cpp's own)
                    raise ValueError(f"quant.CHUNK and NOISE_TABLE_SEED must be {NOISE_PERIOD} and {NOISE_KEY:#x}, "
                                     "the noise table host_fold.cpp computes")
                _module = build(name=NAME, sources=[str(src)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                verbose=False)
            except Exception as e:   # a missing compiler or ninja, a compile error: said once, by name
                _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if _module is None:
            raise HostKernelUnavailable(f"{SETTING}: cpp: the C++ fold could not be built ({_error}); a C++ "
                                        "compiler and ninja are needed (as for DeepSpeed's cpu_adam), or set "
                                        "it to torch")
        return _module


def resolve(setting: str) -> bool:
    """``memory.host_kernels``: whether the masters' host work uses the C++ kernels. ``cpp``
    raises when they cannot be built; ``auto`` falls back to torch, with one warning."""
    if setting == "torch":
        return False
    try:
        load()
        return True
    except HostKernelUnavailable as e:
        if setting == "cpp":
            raise
        log.warning("%s: auto falls back to the torch ops: %s", SETTING, e)
        return False


FOLD_GROUP = 64 * 256   # values per partial sum of the fold (host_fold.cpp's kGroup blocks)


def _offsets(noise: list[torch.Tensor], read: bool = False) -> list[int]:
    """Per chunk's noise, its offset in quant's noise table (the kernel computes those values
    instead of reading them) or -1 (drawn directly, or ``read``: read)."""
    from .quant import noise_offset
    return [-1 if read else noise_offset(t) for t in noise]


def fold(w: torch.Tensor, m: torch.Tensor | None, v2: torch.Tensor | None, before: torch.Tensor | None,
         vel, noise: list[torch.Tensor], chunk: int, lr: float, wd: float, beta: float, bc1: float, bc2: float,
         eps: float, first: bool, moments: bool, values: tuple[int, int] | None = None,
         acc: torch.Tensor | None = None) -> list[float]:
    """One partition's fold (see ``kernels/host_fold.cpp``): the velocity ``vel`` (a
    ``quant.CompactBuffer`` in host memory) updated in place; returns the sums
    ``[d.v_old, v_old.v_old, d.d, w.w, sum |m|, sum sqrt(v2)]`` with ``d`` = lr x the update.

    ``before``: the weights before the step (the update is ``w - before``), of the whole partition
    or of the folded values only; None: the update is read back from the moments ``m``, ``v2``.
    ``values``: fold only the values ``[start, end)`` of the partition (``start`` a multiple of
    ``FOLD_GROUP``, ``end`` too or the partition's end), adding their sums to ``acc`` (6 fp64
    values, updated in place; the return is its new values): folding a partition range by range
    in order gives the one call's velocity and sums bit for bit (``step_fusion.py``)."""
    empty = torch.empty(0, dtype=torch.float32)
    from_state = before is None
    start, end = values if values is not None else (0, w.numel())
    if start % FOLD_GROUP or (end % FOLD_GROUP and end != w.numel()):
        raise ValueError(f"host_kernels.fold: values [{start}, {end}) must start and end on a multiple of "
                         f"{FOLD_GROUP} (or the partition's end, {w.numel()})")
    if acc is None:
        acc = torch.zeros(6, dtype=torch.float64)
    b1 = -(-end // 256) if end == w.numel() else end // 256
    return load().fold(w, m if m is not None else empty, v2 if v2 is not None else empty,
                       before if before is not None else empty, vel.data,
                       vel.scale if vel.dtype == "int8" else empty, noise, _offsets(noise), VDTYPES[vel.dtype],
                       int(chunk), float(lr), float(wd), float(beta), float(bc1), float(bc2), float(eps), from_state,
                       bool(first), bool(moments), start // 256, b1, acc)


def adam_fold(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, adam: list[float], commit,
              coefs: list[float], vel, noise: list[torch.Tensor], chunk: int, lr: float, wd: float, beta: float,
              bc1: float, bc2: float, eps: float, first: bool, moments: bool, end: int, acc: torch.Tensor,
              read_noise: bool = False, displacement: bool = False) -> list[float]:
    """DeepSpeed's CPU Adam step on the values ``[0, end)`` of a flat fp32 partition (``end`` a
    multiple of ``FOLD_GROUP``) with ``adam``, DeepSpeed's nine scalars for the step
    (``step_fusion.AdamScalars``), each block first taking ``commit`` (a ``quant.CompactBuffer``,
    or None) times ``coefs`` in order and then folded into ``vel`` as ``fold`` folds it from the
    optimizer state (or its displacement), in one pass (see ``kernels/host_fold.cpp``); the fold's sums added to ``acc``.
    ``displacement``: fold the step's own update (each block's weights copied before it, in L1), as
    ``fold`` folds from a snapshot, instead of reading it back from the moments.
    ``read_noise``: read a noise-table window's values instead of computing them (the same values:
    ``benchmarks/fold_in_step.py`` times the two)."""
    if end % FOLD_GROUP or not 0 <= end <= p.numel():
        raise ValueError(f"host_kernels.adam_fold: end {end} must be a multiple of {FOLD_GROUP} within the partition")
    empty = torch.empty(0, dtype=torch.float32)
    cdata, cscale, cdtype = empty, empty, 0
    if commit is not None and coefs:
        cdata, cdtype = commit.data, VDTYPES[commit.dtype]
        cscale = commit.scale if commit.dtype == "int8" else empty
    return load().adam_fold(p, g, m, v, [float(x) for x in adam], cdata, cscale, cdtype,
                            [float(c) for c in coefs] if commit is not None else [], vel.data,
                            vel.scale if vel.dtype == "int8" else empty, noise, _offsets(noise, read_noise),
                            VDTYPES[vel.dtype], int(chunk), float(lr), float(wd), float(beta), float(bc1),
                            float(bc2), float(eps), bool(first), bool(moments), end // 256, acc, bool(displacement))


def shift(x: torch.Tensor, vel, coefs, sumsq: bool = False) -> float:
    """``x += c * v`` for each ``c`` in ``coefs`` in order (zeros skipped), ``x`` a flat contiguous
    fp32 / bf16 / fp16 tensor in host memory and ``vel`` a ``quant.CompactBuffer`` of as many
    values: bit for bit the torch ops' result, rounding a 16-bit ``x`` after every step. Returns
    ``sum v.v`` (fp64) when ``sumsq``, else 0."""
    empty = torch.empty(0, dtype=torch.float32)
    return load().shift(x, vel.data, vel.scale if vel.dtype == "int8" else empty, VDTYPES[vel.dtype],
                        [float(c) for c in coefs], bool(sumsq))


def catch_up(master: torch.Tensor, w: torch.Tensor) -> None:
    """``master = (master - round(master)) + w`` for a flat fp32 ``master`` and a flat bf16 / fp16
    ``w`` of as many values, both in host memory: bit for bit ``grad_predict._catch_up``'s torch
    ops, in one pass."""
    load().catch_up(master, w)


def held_adam(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, bc1: float, bc2: float, eps: float,
              decay: float, key: int) -> None:
    """A gradient Predict step's Adam update of a flat contiguous bf16 ``x`` in host memory from
    the run's first moment ``m`` and the held second moment ``v`` (both fp32 or both bf16, as many
    values), ``x`` written back rounded stochastically with the random bits of (``key``, index):
    bit for bit ``kernels.held_adam_step_reference``, in one pass (``decay``: -lr x the decoupled
    weight decay, or 0)."""
    load().held_adam(x, m, v, float(lr), float(bc1), float(bc2), float(eps), float(decay), int(key))

