"""A real step's fold inside ZeRO-Infinity's sub-group steps (``memory.fold_in_step`` under
``offload_optimizer: nvme``).

With the optimizer state on NVMe, DeepSpeed's ZeRO 3 step swaps each sub-group's fp32 master
and Adam moments in from the drive, steps it, copies it into the 16-bit weights and swaps it
out. The drift fold after the step (``zero_access.fold_real_update``) reads the masters and
moments the step left, so it swapped every sub-group in once more: a real step of the hybrid
read the optimizer state from the drive twice where plain DeepSpeed reads it once (1.109x a plain
step on this project's CPU, ``benchmarks/nvme_step_cost.py``). A snapshot fold (``fold_source:
snapshot``) also swapped them in before the step, for its copy of the masters, and kept that
copy (4 bytes a parameter) in host memory.

Here each sub-group's fold runs inside DeepSpeed's step while the sub-group is swapped in
(``zero_access.StepJobs``: an ``after`` job of ``_optimizer_step``), with the arithmetic of the
fold after the step on the same values: the velocity, its int8 noise and the direction
statistics are bit for bit that fold's. With ``fold_source: snapshot`` the sub-group's masters are
copied just before its Adam step (after a kept run's commit into them, which goes into the same
step first) into one buffer the size of the largest sub-group, and the fold takes the step's own
displacement from it, bit for bit the snapshot fold's. A real step then swaps what a plain one
does (``tests/test_engine.py::test_a_kept_drift_run_goes_into_deepspeeds_nvme_step``).

ZeRO 3 steps every sub-group or, on a skipped step (a non-finite gradient, an overflow), none:
a step that reached some and not others is an error here (the fold would mix two steps' updates).
Whole-model real steps only: a layer-group step keeps the snapshot, its rollback point.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from . import zero_access as za


class SwapFold:
    """The fold of one engine's real steps into the drift velocity, inside DeepSpeed's ZeRO 3
    step, a sub-group at a time (``arm`` before the step, ``finish`` after it)."""

    def __init__(self, access: za.MasterAccess, vel: za.VelocityBuffers, from_state: bool,
                 host_kernel: bool) -> None:
        self.access, self.vel = access, vel
        self.from_state = from_state    # memory.fold_source resolved (False: the step's own displacement)
        self.host_kernel = host_kernel  # memory.host_kernels resolved
        self.seconds = 0.0              # the armed step's folds' (and copies') time inside it
        self._jobs = za.StepJobs(access, late=True)
        # fold_source: snapshot: one sub-group's masters before its step (buffers[i] a view of
        # _copy while sub-group i steps), reused from sub-group to sub-group and step to step
        self._before = za.PartitionBuffers()
        self._copy: torch.Tensor | None = None
        self._out: torch.Tensor | None = None   # the armed step's direction statistics

    def copy_bytes(self) -> int:
        """Host bytes of the copy buffer (``fold_source: snapshot``; 0 from the optimizer state)."""
        return 0 if self._copy is None else self._copy.numel() * self._copy.element_size()

    def arm(self, lrs: Sequence[float], beta: float, step: int, moments: bool) -> None:
        """Fold into the velocity in DeepSpeed's coming step: ``lrs`` its LR per param group,
        ``step`` the step count it makes (the int8 noise's seed), ``moments`` as
        ``fold_real_update``'s."""
        count = self.access._count()
        self._out = torch.zeros(self.access.num_groups(), len(za.DIRECTION_STATS), dtype=torch.float64)
        self.seconds = 0.0
        self._before.buffers = [torch.empty(0)] * count
        self._before.holds = "weights"
        before = None if self.from_state else self._before

        def fold(i: int, part: za.MasterPartition) -> None:
            t0 = time.perf_counter()
            self._out += za.fold_real_update(self.access, before, self.vel, lrs, beta, step, keep=True,
                                             moments=moments, host_kernel=self.host_kernel, count=False,
                                             pairs=[(i, part)])
            self._before.buffers[i] = torch.empty(0)
            self.seconds += time.perf_counter() - t0

        copies = {} if self.from_state else {i: (lambda part, i=i: self._copy_before(i, part)) for i in range(count)}
        self._jobs.defer(copies, {i: (lambda part, i=i: fold(i, part)) for i in range(count)})

    @torch.no_grad()
    def _copy_before(self, i: int, part: za.MasterPartition) -> None:
        t0 = time.perf_counter()
        master = za._flat(part.master)
        n = master.numel()
        if self._copy is None or self._copy.numel() < n or self._copy.device != master.device:
            self._copy = torch.empty(n, dtype=torch.float32, device=master.device)
        self._before.buffers[i] = self._copy[:n].copy_(master)
        self.seconds += time.perf_counter() - t0

    def finish(self) -> torch.Tensor | None:
        """After DeepSpeed's step: the direction statistics of the fold it took (the velocity
        counts one more update where it moved), or None where it took none (a skipped step, or
        not armed)."""
        out, self._out = self._out, None
        self._before.buffers = []
        if not self._jobs.finish_after("fold_in_step") or out is None:
            return None
        self.vel.updates += int(bool(out[:, 6].sum() > 0))
        return out
