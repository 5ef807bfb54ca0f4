"""A real step's host passes inside DeepSpeed's CPU Adam step, one pass (``memory.fold_in_step``).

Under ZeRO-Offload the hybrid adds two passes over host memory to a real step: a kept Predict
run's commit into the fp32 masters (``device_predict.py``) and the fold of the step's update
into the drift velocity, read back from the moments the step left
(``zero_access.fold_real_update``). On host threads (``memory.commit_overlap``,
``memory.fold_overlap``) they overlap the next forward and backward on the GPU, but under
ZeRO-Offload that backward is itself host work (the gradients' copies down and their fp32
accumulation), and the threads compete with it for the host's cores and memory: on an H100 with llama-1b
(2026-11-26) the hybrid's real steps took 1.24-1.36x plain's, most of it a slower backward
(``docs/memory.md``).

Here they run inside DeepSpeed's step on each master partition, one pass over it: each block of
256 values takes the commit's additions, then Adam's update, then the fold, while it is in L1
(``host_kernels.adam_fold``). The fold then costs its arithmetic and the velocity's bytes, not a
second read of the masters and moments, and nothing runs beside the forward and backward. Its
update is the step's own displacement: each block's weights are copied (in L1) before the update,
so the fold is the snapshot fold's (``fold_source: snapshot``) with no snapshot, and it does not
rebuild the update from the moments the step left (three divisions and a square root a value,
which made the pass 2.4x DeepSpeed's step alone instead of 1.9x with the int8 velocity on this
project's 2-core CPU; ``benchmarks/fold_in_step.py``).
DeepSpeed's ``DeepSpeedCPUAdam.step`` is unchanged: only its C++ op (``optimizer.ds_opt_adam``) is
wrapped, and calls for partitions with no work pass straight through.

Bit for bit DeepSpeed's step and the inline passes:

* Adam's update is DeepSpeed's SIMD step value by value (the same IEEE operations in the same
  order, ``kernels/host_fold.cpp``), with DeepSpeed's scalars for the step: its C++ optimizer
  keeps ``beta**t`` from call to call (``Adam_Optimizer::IncrementStep``), and ``AdamScalars``
  mirrors that state in fp32 from every call that passes through here. A partition's last
  ``< FOLD_GROUP`` values (DeepSpeed's scalar tail among them) go to DeepSpeed's own op, which
  also moves its state on exactly as one call would.
* Where the one pass cannot serve (a job with no fold, an LR of 0, the mirror not known), the
  step runs in chunks of ``CHUNK`` values through DeepSpeed's op with the passes around each:
  its update is elementwise, a second call with the same step keeps its bias corrections, and
  its SIMD loop covers a chunk whole when the chunk is a multiple of its block.
* The commit is elementwise; the fold's sums add up in fixed groups of values
  (``host_kernels.fold``); a chunk's fold reads the chunk's weights as they were before its call
  (``PartitionJob.before`` copies them).

So masters, moments, velocity and direction statistics are those of DeepSpeed's step followed by
the inline fold from a snapshot of the masters taken just before it (``tests/test_step_fusion.py``).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from . import host_kernels
from .quant import CHUNK as NOISE_CHUNK, CompactBuffer

CHUNK = 1 << 20
"""Values per call of DeepSpeed's op where the one pass cannot serve: a multiple of its SIMD block
and of ``host_kernels.FOLD_GROUP`` (16 MiB of the step's four fp32 streams)."""


class PartitionJob:
    """The hybrid's work on one master partition inside the step: the commit's additions before
    the Adam update of each block or chunk (``commit``: the velocity the run moved along and the
    run's coefficients in order), the fold after it (``fold``)."""

    def __init__(self, index: int, group_index: int, master: torch.Tensor):
        self.index, self.group_index, self.master = index, group_index, master
        self.commit: tuple[CompactBuffer, list[float]] | None = None
        self.fold: FoldJob | None = None
        self.reached = False   # DeepSpeed's step called adam_update on this partition
        self.seconds = {"commit": 0.0, "fold": 0.0}
        self._before: torch.Tensor | None = None   # a chunk's weights before its update (the fold's displacement)

    def before(self, a: int, b: int) -> None:
        if self.commit is not None:
            t0 = time.perf_counter()
            buf, coefs = self.commit
            host_kernels.shift(self.master[a:b], buf.window(a, b), coefs)
            self.seconds["commit"] += time.perf_counter() - t0
        if self.fold is not None and self.fold.displacement:
            t0 = time.perf_counter()
            if self._before is None or self._before.numel() < b - a:
                self._before = torch.empty(b - a, dtype=self.master.dtype)
            self._before[:b - a].copy_(self.master[a:b])   # (after the commit: the step's own move is folded)
            self.seconds["fold"] += time.perf_counter() - t0

    def after(self, m: torch.Tensor, v2: torch.Tensor, a: int, b: int, hyper: dict) -> None:
        if self.fold is not None:
            t0 = time.perf_counter()
            self.fold.run(self.master, m, v2, a, b, hyper,
                          before=self._before[:b - a] if self.fold.displacement else None)
            self.seconds["fold"] += time.perf_counter() - t0

    def one_pass(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, adam: list[float],
                 end: int, hyper: dict) -> None:
        """Values ``[0, end)``: the commit, DeepSpeed's update and the fold in one pass."""
        t0 = time.perf_counter()
        buf, coefs = self.commit if self.commit is not None else (None, [])
        self.fold.one_pass(p, g, m, v, adam, buf, coefs, end, hyper)
        self.seconds["fold"] += time.perf_counter() - t0   # (the commit's share is not told apart here)

    def commit_rest(self) -> None:
        """The commit of a partition the step did not reach (no gradient, or no step: an
        overflow), whole: the step did not read its masters, so the order does not matter."""
        if self.commit is not None:
            self.before(0, self.master.numel())
            self.commit = None


class FoldJob:
    """One partition's fold of the step's update (its displacement, or read back from the moments
    the step leaves) with the C++ kernel, range by range, its sums kept as
    ``zero_access._fold_on_host`` adds them."""

    def __init__(self, buffer: Callable[[], CompactBuffer], numel: int, dtype: str,
                 generator: torch.Generator | None, beta: float, first: bool, moments: bool, decoupled: bool):
        from .quant import BLOCK, _cpu_noise
        # ``buffer`` makes the partition's velocity buffer on first use, as the inline fold does
        # (a step with an LR of 0 folds nothing and leaves none).
        self.buffer, self.buf = buffer, None
        self.beta, self.first, self.moments, self.decoupled = beta, first, moments, decoupled
        # The int8 noise of the whole partition, drawn chunk by chunk in order as the inline fold draws it.
        self.noise = ([_cpu_noise(-(-(min(s + NOISE_CHUNK, numel) - s) // BLOCK) * BLOCK, generator)
                       for s in range(0, numel, NOISE_CHUNK)] if dtype == "int8" else [])
        self.acc = torch.zeros(6, dtype=torch.float64)
        self.lr: float | None = None   # set by the first range folded (an LR of 0 folds nothing)
        self.read_noise = False        # (benchmarks/fold_in_step.py: the int8 noise read, not computed)
        # The step's own displacement, each block's weights copied before its update: the snapshot
        # fold's update, with no snapshot (False: rebuilt from the moments the step left, as the
        # fold after the step reads it: three divisions and a square root more a value; the benchmark's arm)
        self.displacement = True

    def run(self, w: torch.Tensor, m: torch.Tensor, v2: torch.Tensor, a: int, b: int, hyper: dict,
            before: torch.Tensor | None = None) -> None:
        """The values ``[a, b)``: from ``before`` (those values' weights before the step) where
        given, else from the moments."""
        from .kernels import _bias_corrections
        lr = hyper["lr"]
        if lr <= 0:
            return
        if m.dtype != torch.float32 or v2.dtype != torch.float32:
            raise RuntimeError("ds_hybrid: hybrid_predict.memory.fold_in_step needs fp32 Adam moments "
                               "(DeepSpeedCPUAdam's fp32_optimizer_states); set memory.fold_in_step: false")
        if self.buf is None:
            self.buf = self.buffer()
        bc1, bc2 = _bias_corrections(hyper["beta1"], hyper["beta2"], hyper["step"], hyper["bias_correction"])
        wd = float(hyper["weight_decay"] or 0.0) if self.decoupled else 0.0
        host_kernels.fold(w, m, v2, before, self.buf, self.noise, NOISE_CHUNK, lr, wd, self.beta, bc1, bc2,
                          hyper["eps"], self.first, self.moments, values=(a, b), acc=self.acc)
        self.lr = lr

    def one_pass(self, p, g, m, v, adam: list[float], commit: CompactBuffer | None, coefs: list[float], end: int,
                 hyper: dict) -> None:
        from .kernels import _bias_corrections
        if self.buf is None:
            self.buf = self.buffer()
        bc1, bc2 = _bias_corrections(hyper["beta1"], hyper["beta2"], hyper["step"], hyper["bias_correction"])
        wd = float(hyper["weight_decay"] or 0.0) if self.decoupled else 0.0
        host_kernels.adam_fold(p, g, m, v, adam, commit, coefs, self.buf, self.noise, NOISE_CHUNK, hyper["lr"], wd,
                               self.beta, bc1, bc2, hyper["eps"], self.first, self.moments, end, self.acc,
                               read_noise=self.read_noise, displacement=self.displacement)
        self.lr = hyper["lr"]

    def add_to(self, row: torch.Tensor, numel: int) -> bool:
        """The partition's sums into its group's row of ``DIRECTION_STATS`` (as
        ``zero_access._fold_on_host``); False where nothing was folded."""
        if self.lr is None:
            return False
        dv, vv, dd, ww, m_abs, v_sqrt = self.acc.tolist()
        lr = self.lr
        row[0] += dv / lr
        row[1] += vv
        row[2] += dd / lr ** 2
        if self.moments:
            row[3] += ww
            row[4] += m_abs
            row[5] += v_sqrt
        row[6] += float(numel)
        return True


class AdamScalars:
    """DeepSpeed's C++ ``Adam_Optimizer`` state for one optimizer (``csrc/includes/cpu_adam.h``,
    0.19.8), mirrored in fp32 from every ``adam_update`` call: ``IncrementStep`` (``beta**t`` kept
    and multiplied on, recomputed with ``pow`` when the step jumps or the betas change) and
    ``update_state``, and the scalars ``Step_AVX`` derives from them for a step."""

    def __init__(self, beta1: float, beta2: float):
        f = np.float32
        self.b1, self.b2, self.b1t, self.b2t, self.step = f(beta1), f(beta2), f(1.0), f(1.0), 0
        self.known = True   # False after a call this mirror cannot follow

    def call(self, step: int, beta1: float, beta2: float, lr: float, eps: float, weight_decay: float,
             bias_correction: bool, adamw: bool) -> list[float]:
        """One ``adam_update`` call's state change; returns ``host_kernels.adam_fold``'s scalars."""
        f = np.float32
        b1, b2, step = f(beta1), f(beta2), int(step)
        if b1 != self.b1 or b2 != self.b2:
            self.step, self.b1, self.b2 = step, b1, b2
            self.b1t, self.b2t = f(float(b1) ** step), f(float(b2) ** step)   # std::pow(float, size_t): in double
        elif step == self.step + 1:
            self.step += 1
            self.b1t, self.b2t = f(self.b1t * self.b1), f(self.b2t * self.b2)
        elif step != self.step:
            self.b1t, self.b2t = f(float(self.b1) ** step), f(float(self.b2) ** step)
            self.step = step
        alpha, e, wd = f(lr), f(eps), f(weight_decay)
        bc1 = bc2 = f(1.0)
        if bias_correction:
            bc1 = f(1.0) - self.b1t
            bc2 = f(1.0) / np.sqrt(f(1.0) - self.b2t)
        step_size = f(-alpha) / bc1
        w_decay = f(-alpha) * wd
        decay = wd > 0
        return [float(x) for x in (self.b1, self.b2, f(1.0) - self.b1, f(1.0) - self.b2, bc2, e, step_size,
                                   w_decay if decay and adamw else 0.0, wd if decay and not adamw else 0.0)]


class FusedCpuAdam:
    """Stands in for a ``DeepSpeedCPUAdam``'s C++ op module (``optimizer.ds_opt_adam``): an
    ``adam_update`` on a partition with an armed job runs it with the job's passes, in one pass
    (``host_kernels.adam_fold``) or in chunks through the op; every other call and attribute is
    the op's own, and every ``adam_update`` goes through ``scalars``."""

    def __init__(self, op: Any, scalars: AdamScalars, adamw: bool, chunk: int = CHUNK):
        self._op, self.scalars, self.adamw, self.chunk = op, scalars, bool(adamw), int(chunk)
        self._jobs: dict[int, PartitionJob] = {}
        self.unmatched = 0   # calls while armed on tensors that are no job's partition
        self.one_pass = True   # tests: False runs every job through the chunked calls
        self.passes = {"one_pass": 0, "chunked": 0}   # partitions stepped each way

    def __getattr__(self, name: str) -> Any:
        if name != "adam_update" and name.startswith("adam"):   # (adam_rollback: a state change not mirrored)
            self.__dict__["scalars"].known = False
        return getattr(self._op, name)

    def arm(self, jobs: list[PartitionJob]) -> None:
        self._jobs = {j.master.data_ptr(): j for j in jobs}
        self.unmatched = 0

    def disarm(self) -> list[PartitionJob]:
        """The armed jobs the step did not reach (the caller finishes them)."""
        left, self._jobs = list(self._jobs.values()), {}
        return left

    def adam_update(self, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params, grads,
                    exp_avg, exp_avg_sq):
        adam = self.scalars.call(step, beta1, beta2, lr, eps, weight_decay, bias_correction, self.adamw)
        job = self._jobs.get(params.data_ptr()) if self._jobs else None
        if job is None or params.numel() != job.master.numel():
            self.unmatched += int(bool(self._jobs))
            return self._op.adam_update(opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params,
                                        grads, exp_avg, exp_avg_sq)
        del self._jobs[params.data_ptr()]
        p, g, m, v = (t.view(-1) for t in (params, grads, exp_avg, exp_avg_sq))
        hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction)
        n = p.numel()
        start = 0
        if (self.one_pass and self.scalars.known and job.fold is not None and lr > 0
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in (p, g, m, v))):
            start = n // host_kernels.FOLD_GROUP * host_kernels.FOLD_GROUP
            if start:
                job.one_pass(p, g, m, v, adam, start, hyper)
            # the rest (fewer than FOLD_GROUP values, DeepSpeed's scalar tail among them) through its own op
            # below, in one call, which also moves its state on as one call over the partition would
            self.passes["one_pass"] += 1
        else:
            self.passes["chunked"] += 1
        if start == n:
            self._op.adam_update(opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, p[n:], g[n:],
                                 m[n:], v[n:])
        for a in range(start, n, self.chunk):
            b = min(n, a + self.chunk)
            job.before(a, b)
            self._op.adam_update(opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, p[a:b], g[a:b],
                                 m[a:b], v[a:b])
            job.after(m, v, a, b, hyper)
        job.commit = None
        job.reached = True
        return 0


def install(optimizer: Any) -> FusedCpuAdam | None:
    """Wrap ``optimizer``'s C++ op where it is DeepSpeed's CPU Adam (None elsewhere)."""
    if type(optimizer).__name__ != "DeepSpeedCPUAdam" or not hasattr(optimizer, "ds_opt_adam"):
        return None
    if not isinstance(optimizer.ds_opt_adam, FusedCpuAdam):
        beta1, beta2 = optimizer.defaults.get("betas", (0.9, 0.999))
        scalars = AdamScalars(beta1, beta2)   # (as DeepSpeedCPUAdam's create_adam made the C++ state)
        # A step before this wrap changed that state unseen: the chunked calls serve then.
        scalars.known = not any(st.get("step") for st in optimizer.state.values())
        optimizer.ds_opt_adam = FusedCpuAdam(optimizer.ds_opt_adam, scalars, getattr(optimizer, "adam_w_mode", True))
    return optimizer.ds_opt_adam
