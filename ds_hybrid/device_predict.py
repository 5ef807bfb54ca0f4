"""Predict steps under ``offload_optimizer`` that stay on the device (``memory.offload_predict``).

With ZeRO-Offload the fp32 masters and the Adam state live in host memory. The host path
(``zero_access.apply_velocity_update`` + ``propagate``) adds each predicted update to the host
masters and copies them to the GPU's 16-bit parameters: a host pass and a PCIe transfer of the
parameters per Predict step, plus a host snapshot per run. Here instead:

* **Predict step**: the drift update ``coef * v`` is added to the 16-bit shard each rank's
  optimizer owns on the device (``MasterAccess.device_shard``: ZeRO 1/2's partition of the
  flat 16-bit group, ZeRO 3's flat 16-bit sub-group partition), from a copy of the velocity
  on that device (int8 at 1 byte per parameter of the partition, uploaded once per run, not
  per step), then gathered as DeepSpeed gathers after its own step. On a GPU the addition is one
  kernel per step and partition (``kernels.drift_shift``, ``hybrid_predict.kernels``: the shard
  read and written once, the velocity read once). The host masters are neither read nor
  written; only the coefficients (one per layer group per step) are kept.
* **Accepted run**: the masters take the run's displacement once, before the next real
  step's optimizer step, in one pass over each master chunk that adds the steps'
  ``coef * v`` in order (``commit``): the same additions as the host path, so the masters end
  bit for bit where the host path leaves them. With ``memory.commit_overlap`` that pass runs on
  a host thread while the real step's forward and backward go on on the GPU (neither reads the
  masters); the optimizer step waits for it (``wait``).
* **Rejected run**: the masters never moved, so they are the rollback point: the 16-bit
  copies are re-propagated from them (``discard``). No snapshot of the masters is taken for a
  Predict run; the rollback is exact (the same as the host path's restore).
* **Verified steps** (``check: forward``): a step the verification keeps is only counted
  (``verified``); the masters take it with the rest of the run at the next real step, or, when
  a later step of the run is rejected, alone before the re-propagation: the additions an inline
  commit after each kept step would make, so the host path's snapshot-and-restore bit for bit.
* **Fold during the run** (``memory.fold_during_run``): the real step before a run copies the
  velocity beside the shards and the run holds that copy (``hold``) until it ends, so the host
  buffer is free for that real step's fold on its thread while the run goes on. The commit (and a
  rejection's verified steps) add the steps along the held copy: from a GPU one chunk at a time
  through pinned buffers (``staging.Stager``), with the same additions in the same order.
* **Velocity beside the shards** (``memory.fold_source: weights16``, ``shard_fold.py``): the run
  moves along the velocity where it lives, on the GPU, with no copy. For the commit it comes down
  once per run into pinned host buffers (``copy_down``: at the run's first step, on a side stream
  while the run's Predict steps keep the GPU busy), so the masters take the run from host memory,
  inside DeepSpeed's CPU Adam step with ``memory.fold_in_step`` (``take_commit``).
* **16-bit parameters on NVMe** (ZeRO-Infinity's ``offload_param: nvme``, past ``max_in_cpu``):
  a sub-group with no 16-bit partition in memory is read from the drive into one host buffer at
  each Predict step, takes the step there (``host_kernels.shift``, the same additions) and is
  written back as DeepSpeed's own step writes it (``MasterAccess.read_swapped_shard`` /
  ``write_swapped_shard``): 2 bytes a parameter each way for bf16, where the host path would swap
  each sub-group's masters and Adam state (16 bytes a parameter) in and out twice and keep a
  4-byte-a-parameter snapshot in host memory for the rollback.
* **Checkpoint in the middle of a run**: the masters (the last good point), the
  coefficients and a held velocity copy are saved; on load the 16-bit copies are propagated
  from the masters and the run's updates re-applied (``replay``), bit for bit.

Where a 16-bit shard is in host memory (ZeRO 3 with ``offload_param: cpu``; DeepSpeed's CPU
accelerator) and for the commit into the masters, ``memory.host_kernels`` does the additions in one
C++ pass (``host_kernels.shift``, ``host_kernel`` here), bit for bit the torch ops below.

What the 16-bit copies hold during a run: with fp32 parameters (ZeRO with no bf16/fp16) the
device update is the host path's arithmetic on the same values, so the weights are bit for bit
the host path's. With bf16/fp16 parameters each step rounds ``param + coef * v`` to 16 bits,
where the host path rounds the fp32 master; the two differ within that rounding until the next
real step's optimizer writes the 16-bit copies from the (committed, identical) masters.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from . import host_kernels, kernels
from .host_worker import HostWorker, WorkerOwner
from .quant import BLOCK, CompactBuffer, scratch
from .staging import Stager, side_stream
from .zero_access import MasterAccess, StepJobs, SwappedShards, VelocityBuffers, _flat, _scale_of


def unsupported(access: MasterAccess, direction: str) -> str | None:
    """Why this setup cannot take device-side Predict steps (None: it can)."""
    if direction not in ("drift", "none"):
        return (f"predictor.direction is {direction!r}; device-side Predict steps move the weights along the drift "
                "velocity (the Adam direction lives with the moments in host memory)")
    if access.kind not in ("zero1-2", "zero3"):
        return f"the optimizer is not a ZeRO 1-3 one ({access.kind}); there are no host masters to keep off"
    for i in range(access._count()):
        shard = access.device_shard(i)
        if shard is None:
            if access.shard_swapped(i):
                continue   # (on NVMe: each step reads it into host memory and writes it back)
            return (f"master {i} has no 16-bit partition in memory nor on NVMe (a DeepSpeed layout ds_hybrid does "
                    "not know)")
        if shard.numel() != access.numel(i):
            return (f"the 16-bit partition of master {i} has {shard.numel()} values, the master {access.numel(i)}"
                    " (a DeepSpeed layout ds_hybrid does not know)")
    return None


class DevicePredict(WorkerOwner):
    """The device-side Predict path of one engine: the velocity's device copy, the pending
    run's coefficients, and the three ways a run ends (commit, discard, replay)."""

    def __init__(self, access: MasterAccess, backend: str = "auto"):
        self.access = access
        self.backend = backend   # hybrid_predict.kernels: a GPU shard's step by kernels.drift_shift
        # Per Predict step of the pending run: scale x LR of each layer group.
        self.pending: list[list[float]] = []
        # How many of them a verification forward kept (check: forward): the masters take them with
        # the rest at the next real step, or alone when a later step of the run is rejected.
        self.verified = 0
        # kept runs handed to the masters so far (commit, take_commit): the shard fold
        # (memory.fold_source: weights16) leaves out the real step that commits one
        self.kept_runs = 0
        # memory.fold_source: weights16 with the velocity on a GPU: a host copy of it for the commit,
        # made at each run's first step (copy_down), from the velocity state vel.updates was then
        self.copy_down = False
        self.pin_down = True   # ... in page-locked memory (the engine follows DeepSpeed's offload pin_memory)
        self._down: list[CompactBuffer | None] = []
        self._down_updates = -1
        self._down_ready = None   # the event after which the host copy is complete (None: it is)
        self._down_streams: dict = {}
        self._velocity: list[CompactBuffer | None] = []   # per partition, on its shard's device
        self._copies: list[bool] = []   # which of those are copies (not the host buffer itself)
        self._uploaded = -1   # vel.updates when the device copy was made (-1: none is current)
        # memory.fold_during_run: the device copy is the pending run's (made by hold), kept until
        # the run ends whatever the host velocity does meanwhile
        self._held = False
        self._held_ready = None   # the event after which a held copy on a GPU is complete
        # the event after which the last copies to a GPU have read the host velocity (their copies
        # are asynchronous from page-locked memory, so the fold must not write it before)
        self._copied = None
        self._stager = Stager()   # a held copy on a GPU comes down through it at the commit
        self.stage_commit = False   # tests: that staged path also where the copy shares the masters' device
        self.copy_always = False    # tests: a velocity copy also where the shards share its device
        # memory.host_kernels resolved: shards and masters in host memory take the steps in one C++
        # pass (host_kernels.shift), bit for bit the torch ops below
        self.host_kernel = False
        self._worker = HostWorker("commit", "commit of a kept Predict run into the masters")
        # Under ZeRO-Infinity's NVMe swap: a kept run's commit by sub-group, inside DeepSpeed's next step
        self._in_step = StepJobs(access)
        # Under offload_param: nvme, the 16-bit partitions on the drive, through one host buffer
        self.swapped = SwappedShards(access)

    def _device_velocity(self, vel: VelocityBuffers, always_copy: bool = False) -> list[CompactBuffer | None]:
        """The velocity next to each 16-bit shard: the host buffer itself where they share a
        device (DeepSpeed's CPU accelerator), else a copy made once per velocity state (the
        velocity only changes at real steps, so a Predict run uploads it at most once). A held
        copy (``hold``) while the run lasts. ``always_copy``: a copy on a shared device too."""
        if self._held or (self._current(vel) and not always_copy):
            return self._velocity
        self.wait()   # (a commit in the background may still read the last copies)
        out: list[CompactBuffer | None] = []
        copies: list[bool] = []
        for i, buf in enumerate(vel.buffers):
            shard = self.access.device_shard(i) if buf is not None else None
            copies.append(not (buf is None or shard is None
                               or (shard.device == buf.device and not (always_copy or self.copy_always))))
            if not copies[-1]:
                out.append(buf)
                continue
            out.append(self._copy_buffer(i, buf.numel, buf.dtype, shard.device))
            out[-1].data.copy_(buf.data, non_blocking=True)
            if buf.dtype == "int8":
                out[-1].scale.copy_(buf.scale, non_blocking=True)
        self._velocity, self._copies, self._uploaded = out, copies, vel.updates
        self._copied = self._mark_copies()
        return out

    def _mark_copies(self):
        """An event after the work queued so far on the GPU the copies live on (None: none there)."""
        devices = [b.device for b, copy in zip(self._velocity, self._copies) if copy and b.device.type == "cuda"]
        return Stager.mark(devices[0]) if devices else None

    def take_copied(self):
        """The event after which the last copies have read the host velocity (None: they have),
        for whoever writes the host velocity next (the fold): it calls ``synchronize()`` on it."""
        ev, self._copied = self._copied, None
        return ev

    def _copy_buffer(self, i: int, numel: int, dtype: str, device: torch.device) -> CompactBuffer:
        """The last copy of partition ``i``'s velocity where it fits (the GPU memory is reused
        from run to run), else a new one."""
        old = self._velocity[i] if i < len(self._velocity) else None
        copy = i < len(self._copies) and self._copies[i]   # (never the host buffer itself)
        if old is not None and copy and old.device == device and old.numel == numel and old.dtype == dtype:
            return old
        return CompactBuffer(numel, dtype, device)

    def hold(self, vel: VelocityBuffers):
        """``memory.fold_during_run``: copy the velocity beside the shards now, for the Predict
        run that comes next, and keep that copy until the run ends (a copy also where they share
        a device). Returns the event after which the host buffer may be written (None: it may
        be now); the engine's fold waits for it on its thread."""
        self.wait()   # (a commit reading the last held copy)
        self._held = False
        self._device_velocity(vel, always_copy=True)
        self._held = True
        self._held_ready = self.take_copied()
        return self._held_ready

    @property
    def held(self) -> bool:
        """A run's velocity copy is held (``hold``) until the run ends."""
        return self._held

    def _release(self) -> None:
        """The run ended: the held copy is no longer its velocity (the buffers stay for the next)."""
        self._settle_down()   # (the next fold writes the velocity a copy down may still read)
        if self._held:
            self._held, self._uploaded, self._held_ready = False, -1, None

    def _current(self, vel: VelocityBuffers) -> bool:
        """The velocity list beside the shards was made from this velocity state."""
        return self._uploaded == vel.updates and len(self._velocity) == len(vel.buffers)

    def upload_due(self, vel: VelocityBuffers) -> bool:
        """The next Predict step copies the velocity to the device first: it changed since the
        last copy, and some shard is on another device than its velocity (a GPU beside host
        masters). The engine times that copy on its own (``bookkeeping_seconds.velocity_upload``)."""
        if self._held or self._current(vel):
            return False
        return any(buf is not None and (shard := self.access.device_shard(i)) is not None
                   and (shard.device != buf.device or self.copy_always) for i, buf in enumerate(vel.buffers))

    def upload(self, vel: VelocityBuffers) -> None:
        """Make the device copy of the velocity current now (``apply`` would at its start)."""
        self._device_velocity(vel)

    def free_copies(self) -> None:
        """``memory.free_velocity_copy``: drop the velocity's copies beside the shards (their
        memory goes back to the allocator for the real step's activations and gradients); the
        next ``apply`` or ``upload`` copies the velocity again. Not while a run holds its copy
        (``hold``): a pending commit reads that one. A commit that reads the host velocity may
        still be running: it never reads these copies."""
        if self._held:
            raise RuntimeError("DevicePredict.free_copies: the run's held velocity copy is still to be committed")
        if any(self._copies):
            self._velocity = [None if copy else buf for buf, copy in zip(self._velocity, self._copies)]
            self._copies = [False] * len(self._copies)
            self._uploaded = -1

    def host_copy_bytes(self) -> int:
        """Bytes of the velocity's host copy for the commit (``copy_down``)."""
        return sum(b.nbytes() for b in self._down if b is not None)

    def device_bytes(self) -> int:
        """Bytes of velocity copies this path keeps beside the 16-bit shards."""
        return sum(b.nbytes() for b, copy in zip(self._velocity, self._copies) if copy)

    def coefficients(self, scales: "float | Sequence[float]") -> list[float]:
        return [_scale_of(scales, gi) * float(g["lr"]) for gi, g in enumerate(self.access.base.param_groups)]

    @torch.no_grad()
    def apply(self, vel: VelocityBuffers, scales: "float | Sequence[float]") -> None:
        """One Predict step: ``coef * v`` into every 16-bit shard, then the gather. Collective."""
        coefs = self.coefficients(scales)
        if self.copy_down and not self.pending:   # the run's first step: its velocity starts down now
            self._copy_down(vel)
        self._add_to_shards(vel, [coefs])
        self.pending.append(coefs)
        self.access.gather_device_shards()

    def _add_to_shards(self, vel: VelocityBuffers, steps: list[list[float]]) -> None:
        dev_v = self._device_velocity(vel)
        swapped = self.swapped.release(range(len(dev_v)))
        for i, gi in enumerate(self.access.group_indices()):
            if i >= len(dev_v) or dev_v[i] is None:
                continue
            coefs = [step[gi] for step in steps]
            if swapped[i]:
                # (the velocity of a sub-group with no shard stays in host memory)
                with self.swapped.held(i) as flat:
                    self._shift(flat, dev_v[i], coefs)
                continue
            shard, buf = _flat(self.access.device_shard(i)), dev_v[i]
            if shard.numel() == 0:
                continue
            self._shift(shard, buf, coefs)

    def _shift(self, shard: torch.Tensor, buf: CompactBuffer, coefs: list[float]) -> None:
        # the host path's additions in its order; a 16-bit shard rounded after every step, as
        # the weights were (host_kernels.shift / kernels.drift_shift, or their torch ops)
        if self._on_host(shard):   # ZeRO 3's offload_param: cpu, or DeepSpeed's CPU accelerator
            host_kernels.shift(shard, buf, coefs)
        else:
            kernels.drift_shift(shard, buf, coefs, backend=self.backend)

    def _on_host(self, t: torch.Tensor) -> bool:
        return self.host_kernel and t.device.type == "cpu" and t.is_contiguous()

    def commit(self, vel: VelocityBuffers, background: bool = False, first=None) -> None:
        """The run was kept: the masters take its displacement, each chunk once with every
        step's ``coef * v`` added in order (bit for bit the host path's masters). The 16-bit
        copies already hold the run; the next optimizer step writes them from the masters.

        ``background``: on a host thread, returning at once; whoever reads or writes the masters
        or the velocity next calls ``wait`` first (the engine: before the optimizer step, and
        before a capture of the masters). ``first``: called before the additions, on that thread
        (the engine joins the fold there, which reads the masters: ``fold_during_run``). Local: no
        collective, so ranks need not agree on it."""
        self.wait()
        self.verified = 0
        if not self.pending:
            self._release()
            return
        steps, self.pending = self.pending, []
        self.kept_runs += 1
        bufs = self._run_velocity(vel)
        after = self._ready(bufs)
        self._release()   # (the copies stay untouched until the next hold, which waits for this commit)
        if self.access.swaps:
            # ZeRO-Infinity: each sub-group's additions just before its Adam step, in this real
            # step's DeepSpeed step (swapped in there anyway), not through a swap of their own
            if first is not None:
                first()
            self._in_step.defer({i: (lambda part, i=i: self._add_one(i, part, bufs, steps, after))
                                 for i in range(len(bufs)) if bufs[i] is not None})
            return
        parts = self._parts()   # read DeepSpeed's optimizer here, not on the thread
        if background:   # (the worker has its own work buffers)
            def job() -> None:
                if first is not None:
                    first()
                self._add_to_masters(parts, bufs, steps, after)
            self._worker.start(job)
        else:
            if first is not None:
                first()
            self._add_to_masters(parts, bufs, steps, after)

    def _parts(self):
        """The partitions for the masters' additions: listed here (a commit on a host thread reads
        no DeepSpeed structure), or under ZeRO-Infinity's NVMe swap (``access.swaps``: a rejected
        run's verified steps) ``partitions()`` itself, each swapped in for its additions only, on
        this thread."""
        return self.access.partitions() if self.access.swaps else list(self.access.partitions())

    def take_commit(self, vel: VelocityBuffers) -> tuple[list[list[float]], list] | None:
        """``commit`` handed to the caller (``memory.fold_in_step``: DeepSpeed's CPU Adam step adds
        it a chunk at a time, before each chunk's update, ``step_fusion.py``): the run's steps'
        coefficients per param group, in order, and the velocity they moved along (one buffer per
        partition). None where nothing is pending, or where the run moved along a held copy on the
        device or the C++ kernel is off: then the commit is made here, inline."""
        self.wait()
        if not self.pending or self._held or not self.host_kernel:
            self.commit(vel)
            return None
        self.verified = 0
        steps, self.pending = self.pending, []
        self.kept_runs += 1
        bufs = self._run_velocity(vel)
        self._release()
        return steps, bufs

    def wait(self) -> None:
        """Join a commit running in the background, re-raising its error, and add what a commit
        deferred into DeepSpeed's step has not added yet (``settle``)."""
        self.settle()
        self._worker.wait()

    def settle(self) -> None:
        """The parts of a commit deferred into DeepSpeed's step (under NVMe swap) that no step has
        taken, now, each sub-group swapped in for its own: the engine calls it when a real step
        ends, so that after it the masters hold the run whether DeepSpeed stepped or skipped (a
        non-finite gradient), and ``wait`` calls it before anything reads them."""
        self._in_step.settle()

    def _run_velocity(self, vel: VelocityBuffers) -> list:
        """What the pending run moved along: the held copy, else the velocity itself (``copy_down``:
        its host copy, complete)."""
        if self._held:
            return list(self._velocity)
        if self.copy_down:
            self._copy_down(vel)   # (made at the run's first step already, unless a checkpoint came between)
            self._settle_down()
            return list(self._down)
        return list(vel.buffers)

    @torch.no_grad()
    def _copy_down(self, vel: VelocityBuffers) -> None:
        """``copy_down``: the velocity into host buffers (pinned where it is on a GPU), on a side
        stream after the work queued so far; nothing to do where the copy is of this state."""
        if self._down_updates == vel.updates and len(self._down) == len(vel.buffers):
            return
        self.wait()   # (a background commit may read the last copy)
        self._settle_down()
        gpu = next((b.device for b in vel.buffers if b is not None and b.device.type == "cuda"), None)
        stream = side_stream(self._down_streams, gpu) if gpu is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(gpu))
        out: list[CompactBuffer | None] = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, buf in enumerate(vel.buffers):
                old = self._down[i] if i < len(self._down) else None
                if buf is None:
                    out.append(None)
                    continue
                if old is None or old.numel != buf.numel or old.dtype != buf.dtype:
                    old = CompactBuffer(buf.numel, buf.dtype, "cpu", pin=self.pin_down and buf.device.type == "cuda")
                old.data.copy_(buf.data, non_blocking=True)
                if buf.dtype == "int8":
                    old.scale.copy_(buf.scale, non_blocking=True)
                out.append(old)
        self._down, self._down_updates = out, vel.updates
        if stream is not None:
            self._down_ready = torch.cuda.Event()
            self._down_ready.record(stream)

    def _settle_down(self) -> None:
        """Wait for the host copy's transfers (``copy_down``)."""
        if self._down_ready is not None:
            self._down_ready.synchronize()
            self._down_ready = None

    def _ready(self, bufs: list):
        """The event after which ``bufs`` are complete on their GPU (None: none is on one): a held
        copy's, made when it was copied (nothing writes it after), so the copies down need not
        wait for the work queued since (the real step's forward)."""
        if self._held and self._held_ready is not None:
            return self._held_ready
        devices = [b.device for b in bufs if b is not None and b.device.type == "cuda"]
        return Stager.mark(devices[0]) if devices else None

    @torch.no_grad()
    def _add_to_masters(self, parts: list, bufs: list, steps: list[list[float]], after=None) -> None:
        """Each master takes ``coef * v`` for every step in order, ``v`` from ``bufs`` (one per
        partition); a buffer on another device comes down a chunk at a time (``after``: the
        event its copies wait for)."""
        for part_i, part in enumerate(parts):
            self._add_one(part_i, part, bufs, steps, after)

    def _add_one(self, part_i: int, part, bufs: list, steps: list[list[float]], after=None) -> None:
        """``_add_to_masters`` for one partition (``part_i``: its index in ``bufs``)."""
        if part_i >= len(bufs) or bufs[part_i] is None or part.master.numel() == 0:
            return
        master, buf = _flat(part.master), bufs[part_i]
        coefs = [c[part.group_index] for c in steps]
        if buf.device != master.device or self.stage_commit:
            self._add_staged(master, buf, coefs, after)
        else:
            self._add(master, buf, coefs)

    def _add(self, master: torch.Tensor, buf: CompactBuffer, coefs: list[float]) -> None:
        """``master += c * v`` for each ``c`` in order, ``buf`` on the master's device."""
        if self._on_host(master):
            host_kernels.shift(master, buf, coefs)
            return
        work = scratch(master.device, 0, master.numel())
        for a, b in buf.chunks():
            v = buf.data[a:b] if buf.dtype == "fp32" else buf.load(a, b, out=work)
            for c in coefs:
                if c != 0.0:
                    master[a:b].add_(v, alpha=c)

    def _add_staged(self, master: torch.Tensor, buf: CompactBuffer, coefs: list[float], after=None) -> None:
        """``_add`` with ``buf`` on another device: its values come down through the stager's
        pinned chunks (int8: 1 byte a value, the scales first), each chunk added on the host
        while the next crosses. The chunks start on block boundaries (``STAGE_CHUNK`` is
        ``quant.CHUNK``), so the additions are ``_add``'s on the same values."""
        scale = None
        if buf.dtype == "int8":
            scale = torch.empty(buf.scale.numel(), dtype=torch.float32)
            self._stager.download(scale, buf.scale, after=after)
        n = buf.numel

        def take(staged: torch.Tensor, a: int, b: int) -> None:
            if a >= n:
                return
            e = min(b, n)
            chunk = CompactBuffer.wrap(staged, None if scale is None else scale[a // BLOCK:], buf.dtype, e - a)
            self._add(master[a:e], chunk, coefs)

        self._stager.download(None, buf.data, take, after=after)

    @torch.no_grad()
    def discard(self, vel: VelocityBuffers | None = None) -> None:
        """The run was rejected: its verified steps (``verified``, kept by a verification
        forward) go into the masters, the rest is forgotten, and the 16-bit copies are written
        from the masters, which are then the last good point (an exact rollback: the masters'
        additions are the ones an inline commit of each verified step would have made).
        Collective."""
        self.wait()
        good, self.pending, self.verified = self.pending[:self.verified], [], 0
        if good:
            if vel is None:
                raise ValueError("DevicePredict.discard: the run has verified steps; pass the velocity they moved along")
            bufs = self._run_velocity(vel)
            self._add_to_masters(self._parts(), bufs, good, self._ready(bufs))
        self._release()
        self.access.lp_current = False
        self.access.propagate()

    @torch.no_grad()
    def replay(self, vel: VelocityBuffers) -> None:
        """After a checkpoint load in the middle of a run: the 16-bit copies from the loaded
        masters, then the run's updates again, as they were made. Collective."""
        self.wait()
        self.access.lp_current = False
        self.access.propagate()
        if self.pending:
            self._add_to_shards(vel, self.pending)   # element-wise: step by step or all at once is the same
            self.access.gather_device_shards()

    def state_dict(self) -> dict:
        """The pending run's coefficients (the same on every rank)."""
        return {"pending": [list(c) for c in self.pending], "verified": self.verified}

    def held_state_dict(self) -> list | None:
        """This rank's held velocity copy (``hold``) in host memory; None when none is held."""
        self.wait()
        return [None if b is None else b.state_dict() for b in self._velocity] if self._held else None

    def load_state_dict(self, sd: dict | None, held: list | None = None, vel: VelocityBuffers | None = None) -> None:
        """Restore ``state_dict()`` and this rank's ``held_state_dict()``; a held copy is made
        again beside the shards (``vel``: the loaded velocity, whose dtype and sizes it has)."""
        self.wait()
        sd = sd or {}
        self.pending = [list(map(float, c)) for c in sd.get("pending", [])]
        self.verified = int(sd.get("verified", 0))
        self._held, self._uploaded = False, -1   # the velocity was loaded too: upload it again before the next use
        self._settle_down()
        self._down_updates = -1   # (and copy it down again: a loaded state may have the same count)
        if held is None:
            return
        if vel is None or len(held) != len(vel.buffers):
            have = None if vel is None else len(vel.buffers)
            raise ValueError("DevicePredict.load_state_dict: the checkpoint's held velocity copy has "
                             f"{len(held)} partitions, this rank's velocity {have}")
        self._device_velocity(vel, always_copy=True)   # (allocates the copies where they belong)
        for buf, saved in zip(self._velocity, held):
            if buf is not None and saved is not None:
                buf.load_state_dict(saved)
        self._held = True
        self._held_ready = self._copied = self._mark_copies()   # (after the loaded values too)
