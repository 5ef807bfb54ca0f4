"""A real step's fold into the drift velocity from the 16-bit shards (``memory.fold_source: weights16``).

Under ZeRO-Offload the masters and the Adam moments live in host memory, and the other fold
sources read them there after the optimizer step: a pass over the masters (``snapshot``) or over
the masters and both moments (``optimizer_state``). On an H200 with llama-1b that pass, inside
DeepSpeed's CPU Adam step, made the hybrid's optimizer step 106 ms slower than plain's
(2026-11-27; docs/memory.md). But DeepSpeed's step ends by writing each rank's 16-bit shard
from its master (``MasterAccess.device_shard``: the master rounded to 16 bits), on the GPU. So:

* **capture**: just before DeepSpeed's optimizer step, each shard is copied beside itself (2 bytes
  a parameter of the partition, on its device; on a GPU the copy is freed after the fold);
* **fold**: after the step, ``(after - before) / lr`` goes into the velocity, which lives beside
  the shards (``VelocityBuffers.beside_shards``), with the other sources' arithmetic
  (``zero_access.fold_real_update(shards=True)``): a few kernels on the GPU and nothing read in
  host memory. The device-side Predict run then moves along that velocity where it is (no
  upload); the velocity is copied into pinned host buffers on a side stream at the run's first
  step (``DevicePredict.copy_down``), and the commit of a kept run adds the run from that copy
  (inside DeepSpeed's CPU Adam step where ``memory.fold_in_step`` is on).

**How exact.** ``R(m + u) - R(m) = u + e' - e`` with ``R`` the rounding to 16 bits and ``|e|``,
``|e'|`` at most half a 16-bit step of the weight: the masters' update up to one rounding of
each weight. Within an exponential average the rounding errors of consecutive steps largely
cancel (they telescope), which is why a velocity folded this way stays close to the masters'
(``tests/test_shard_fold.py`` measures it).

**The real step that commits a kept run does not fold.** Its shards before the step hold the
run's 16-bit trajectory (each Predict step rounded ``shard + coef v``; a step smaller than half a
16-bit step leaves a weight where it was), while the masters take the run's exact displacement.
Their difference would put the part of the run the shards never took into the velocity, in the
velocity's own direction, at every kept run: a feedback that grows it. That step is left out of
the average instead (the predictor sees no direction statistics for it), so with Predict runs
after every n real steps the velocity averages n - 1 of them. A rejected run leaves no such
trace: its rollback writes the shards from the masters again. Because of this the engine refuses
a schedule whose every real step commits a run (one real step between runs).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import zero_access as za


class ShardFold:
    """The shards' copy before a real step's optimizer step, and the fold after it."""

    def __init__(self, access: za.MasterAccess, backend: str = "torch"):
        self.access = access
        self.backend = backend   # hybrid_predict.kernels: the fold on a GPU by kernels.shard_fold
        self.before = za.PartitionBuffers("same")   # 16-bit copies (holds "shards"), not fp32 masters
        self.folds = 0      # real steps folded
        self.skipped = 0    # real steps that committed a kept run, so took no fold

    def capture(self, committed: bool) -> None:
        """Before DeepSpeed's optimizer step. ``committed``: this step's check kept a Predict run,
        whose rounded trajectory the shards hold: no copy, and the step will not fold."""
        if committed:
            self.before.holds = None
            return
        za.capture_shards(self.access, self.before)

    def fold(self, vel: za.VelocityBuffers, lrs: Sequence[float], beta: float, step: int,
             moments: bool) -> torch.Tensor:
        """After an applied optimizer step: the per-group ``DIRECTION_STATS`` sums (zeros where
        the step committed a run or was never captured), the velocity folded."""
        if self.before.holds != "shards":
            self.skipped += 1
            return torch.zeros(self.access.num_groups(), len(za.DIRECTION_STATS), dtype=torch.float64)
        updates = vel.updates
        out = za.fold_real_update(self.access, self.before, vel, lrs, beta, step, moments=moments, shards=True,
                                  backend=self.backend)
        self.folds += vel.updates - updates   # (an LR of 0, the first warmup step's, folds nothing)
        self.release()
        return out

    def release(self) -> None:
        """A copy on a GPU goes back to the allocator between steps (the real step's activations
        and buckets need it more); one in host memory stays, to be written again."""
        self.before.holds = None
        if any(b.is_cuda for b in self.before.buffers):
            self.before.buffers = []

    def nbytes(self) -> int:
        """Bytes held by the copies now (between steps: none on a GPU)."""
        return self.before.nbytes()
