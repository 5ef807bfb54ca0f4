"""``predictor.direction: gradient``: a Predict step that takes its own gradient.

Under ZeRO-Offload a real step's dear part is the CPU Adam step and the PCIe copies, not the
forward and backward (docs/memory.md). This Predict step runs a forward and backward of its own
through ``engine.module`` and moves the weights by Adam's step with the new gradient in the first
moment and the second moment held at the last real step's (``predictor.gradient_second_moment:
held``) or updated by the new gradient too, as a real step's is (``updated``). The run keeps its
own first moment (and an updated second), begun from the optimizer's: a run that is kept hands
them to the optimizer (``commit``), so each Predict gradient stays in the moments as a real
step's does; a rolled-back run drops them (``discard``). Measured with
``benchmarks/grad_step_study.py`` (mode ``adam-carry``, held): 0.98-1.01 of a real step in loss at
1 real step in every 2 to 16.

The backward is private: ``torch.autograd.grad`` through ``engine.module`` accumulates into no
``.grad``, so DeepSpeed's gradient hooks, its reduction buckets, offload copies and counters never
see it (tests/test_grad_step_study.py: an engine taking such backwards trains bit for bit as one
that does not). Going through the engine's own forward would not do: DeepSpeed 0.19.8 queues its
backward epilogue on any backward of that graph. Several ranks all-reduce the gradient themselves.
On ZeRO 3 no rank holds a whole gradient, as under DeepSpeed's own backward: each parameter's is
all-reduced as the backward produces it and only this rank's share kept (``_partition_gradient``).

Where the run's state lives (``memory.offload_predict``, resolved by the engine):

* **host path** (``on_device=False``): the run's first moment is a copy of ``exp_avg`` beside the
  fp32 masters, the step moves the masters (``zero_access.apply_predicted_update``) and propagates
  them to the 16-bit weights; the engine's snapshot of the masters is the rollback point.
* **device path** (``on_device=True``, ZeRO 1-3 under ``offload_optimizer``): at a run's first
  step the first and second moments are copied next to this rank's 16-bit partition
  (``MasterAccess.device_shard``: on the GPU; in host memory with ZeRO 3's ``offload_param``), in
  ``memory.gradient_state_dtype``; each step moves that partition (``kernels.held_adam_step``; a
  bf16 partition rounded stochastically) and all-gathers it (ZeRO 3: points the parameters at it
  again). The host masters are neither read nor written during the run, and with the partition
  on the GPU nothing crosses PCIe but the losses. A kept run's masters take the 16-bit weights once (``commit``:
  ``master = weight + (master - round(master))``, the weight plus the sub-16-bit residual the
  master had, so with fp32 weights the master becomes the weight exactly); a rejected run
  re-propagates the 16-bit weights from the masters, which never left the last good point
  (``discard``: an exact rollback, no snapshot).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Iterable

import torch

from . import host_kernels, kernels
from .compact_moments import CompactMoments, _mix
from .config import ConfigError
from .host_worker import HostWorker, WorkerOwner
from .quant import worker_scratch
from .staging import QueuedDownloads, Stager, side_stream
from .zero_access import MasterAccess, MasterPartition, StepJobs, SwappedShards, _flat

Timer = Callable[[str], ContextManager]


class ModuleCaller:
    """The engine as a loss function sees it in the private forward: calling it runs
    ``engine.module``; every other attribute is the engine's."""

    def __init__(self, engine: Any):
        object.__setattr__(self, "_engine", engine)

    def __call__(self, *args, **kwargs):
        return self._engine.module(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _untimed(part: str) -> ContextManager:
    return contextlib.nullcontext()


def batch_share(batches: list, fraction: float) -> list:
    """The part of a step's micro-batches a gradient Predict step takes its gradient from
    (``predictor.gradient_batch_fraction``): the first ``round(fraction * len(batches))`` of
    them (at least one), or with a single micro-batch its first ``round(fraction * size)``
    sequences (at least one). A micro-batch is a tensor, or a dict, list or tuple of them;
    its size is the first dimension of its first tensor, and only tensors with that first
    dimension are cut (a mask shared by the sequences stays whole). The rule reads only the
    batches' shapes, so every rank cuts alike."""
    if fraction >= 1.0 or not batches:
        return batches
    if len(batches) > 1:
        return batches[:max(1, round(fraction * len(batches)))]
    size = _first_dim(batches[0])
    if size is None:
        raise ConfigError(f"hybrid_predict.predictor.gradient_batch_fraction: a micro-batch of type {type(batches[0]).__name__} "
                        "holds no tensor to cut by its first dimension; use whole micro-batches "
                        "(gradient_accumulation_steps > 1) or leave the fraction at 1")
    keep = max(1, round(fraction * size))
    return [_cut(batches[0], size, keep)] if keep < size else batches


def batch_samples(batches: list) -> int | None:
    """The sequences in a step's micro-batches (their first dimensions' sum; None where one holds
    no tensor to count by)."""
    sizes = [_first_dim(b) for b in batches]
    return sum(sizes) if sizes and None not in sizes else None


def _first_dim(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = _first_dim(v)
        if n is not None:
            return n
    return None


def _cut(batch: Any, size: int, keep: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:keep] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)({k: _cut(v, size, keep) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cut(v, size, keep) for v in batch)
    return batch


def _add_into(total: torch.Tensor, start: int) -> Callable[[torch.Tensor, int, int], None]:
    """A ``Stager.download`` take: each staged chunk ``[a, b)`` added into ``total`` at ``start + a``."""
    def take(staged: torch.Tensor, a: int, b: int) -> None:
        total[start + a:start + b].add_(staged)
    return take


def _all_covered(covered: int, calls: list) -> None:
    """The cover stepped a partition for each deferred call, or a call steps tensors it cannot cover."""
    if covered != len(calls):
        raise RuntimeError("ds_hybrid: hybrid_predict.memory.cpu_step_behind: DeepSpeed's CPU Adam stepped tensors "
                           "that are not the hybrid's master partitions; set memory.cpu_step_behind to false "
                           "and report it")


class GradientPredict(WorkerOwner):
    """One engine's gradient Predict steps: the gradient's layout on this rank's partitions and
    the run's state: its first moment ``m`` (one tensor per master partition; None outside a
    run) and, on the device path, the second moment ``v`` beside the 16-bit partition."""

    def __init__(self, access: MasterAccess, clip: float, all_reduce: Callable[[torch.Tensor], None], world: int,
                 on_device: bool = False, state_dtype: torch.dtype = torch.float32, backend: str = "auto",
                 seed: int = 0, batch_fraction: float = 1.0, lr_scale: float = 1.0, compact: str | None = None,
                 second_moment: str = "held"):
        self.access = access
        # predictor.gradient_second_moment: "updated": the run's v is a copy of the optimizer's that
        # each Predict gradient is folded into (beta2 v + (1 - beta2) g^2), handed over with m when
        # the run is kept; "held": the last real step's v (read in place where it can be)
        self.update_v = second_moment == "updated"
        # memory.gradient_state_dtype: int8-factored or int4-factored (the device path, ZeRO 1-3):
        # "int8" / "int4", the run's moments in about a byte or half a byte a parameter and the gradient
        # folded into them as the backward produces it (compact_moments.py); the run's state is then
        # ``moments``, and ``m`` stays None
        self.compact = compact
        self.moments: CompactMoments | None = None
        self._beta1: dict = {}   # each parameter's Adam beta1 (its group's), for the compact fold
        self._commit_streams: dict = {}   # a compact run's commit behind the next step: its side stream per GPU
        # Under NVMe swap: a kept run's commit by sub-group, taken inside DeepSpeed's next step
        self._in_step = StepJobs(access)
        # ... and the next run's state, made inside the real step before it (stage_in_step): what
        # is being made, then (finish_staging) kept in _next for the run's first step
        self._stage_jobs = StepJobs(access)
        self._staging: tuple | None = None
        # ZeRO 3's offload_param: nvme: the 16-bit partitions on the drive, read and written through one
        # host buffer (a step moves each in turn; a commit's catch-up and a checkpoint read them)
        self.swapped = SwappedShards(access)
        self.batch_fraction = batch_fraction   # predictor.gradient_batch_fraction: the batch's share it takes
        # predictor.gradient_lr_scale: the share of the schedule's LR (and decay) a step takes
        self.lr_scale = lr_scale
        self.clip = float(clip or 0.0)   # the ds_config's gradient_clipping, as DeepSpeed applies it
        self._all_reduce, self._world = all_reduce, world
        self.on_device = on_device
        self.state_dtype = state_dtype   # the device path's m and v (the host path keeps fp32)
        # The sum of the gradient over micro-batches and ranks: in the device path's state dtype
        # (bf16 on a GPU: 2 bytes a parameter beside the moments, as DeepSpeed sums a bf16 model's), else fp32.
        self.sum_dtype = state_dtype if on_device else torch.float32
        self.backend = backend           # hybrid_predict.kernels, for the update
        self.seed = seed                 # the stochastic rounding's draws: (seed, step, partition)
        self._slices = [access.param_slices(i) for i in range(access._count())]   # NotImplementedError: refused
        self.params = access.trained_params()
        # ZeRO 3: where each parameter's share on this rank lies in the partitions (its gradient
        # goes there as the backward produces it; see _partition_gradient)
        self._where: dict = {}
        for i, pieces in enumerate(self._slices):
            for p, ps, ms, n in pieces:
                self._where.setdefault(p, []).append((i, ps, ms, n))
        self._index = {p: k for k, p in enumerate(self.params)}
        self._offsets = [0]   # where each parameter's gradient lies in a flat buffer of them all
        for p in self.params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self.m: list[torch.Tensor | None] | None = None
        self.v: list[torch.Tensor | None] = []
        self.covered = False   # the run's moments are cover()'s (memory.cpu_step_behind), v not the optimizer's
        self.nonfinite = 0   # Predict steps whose gradient was NaN/Inf on some rank (they moved nothing)
        self._worker = HostWorker("gradient-commit", "commit of a kept gradient Predict run")
        # memory.cpu_step_behind: DeepSpeed's CPU Adam step of the real step before a run, run
        # behind the run (cpu_step_behind.py); joined (wait, behind.wait) before anything reads the
        # masters or moments
        self.behind = HostWorker("cpu-step", "CPU Adam step behind a gradient Predict run")
        # The moments' copies between host memory and a GPU: cast on the host, through pinned chunks
        self._stager = Stager()
        # ZeRO 3 with offload_param: cpu: each parameter's gradient share from a GPU into the sums
        # in host memory, queued from autograd's thread and added on a host thread of its own (its own
        # buffers: a prefetch may use the stager's then)
        self._shares = QueuedDownloads()
        self.stage_shares = False   # tests: that queued copy also where the share and the sums share a device
        # memory.host_kernels resolved (the engine sets it where the masters are in host memory):
        # the commit's catch-up in one C++ pass (host_kernels.catch_up), bit for bit the torch ops
        self.host_kernel = False
        # the engine sets it beside an accelerator: copies of moments that stay in host memory (ZeRO
        # 3's offload_param: cpu) are made behind the GPU's forward and backward too
        self.prefetch_host = False
        # prefetch(): the next run's copies being made on the worker, then (key, m, v) once joined
        self._prefetching = False
        self._next: tuple | None = None
        self.prefetched = [0, 0]   # runs that began from a prefetch's copies; prefetches dropped as stale
        self.last_loss: float | None = None   # the last private forward's loss, mean over micro-batches and ranks
        # the last taken gradient's squared norm (before clipping) and the sequences it came from, all
        # ranks together: what the gradient noise scale is estimated from (noise_scale.py)
        self.last_sq: float | None = None
        self.last_samples: int | None = None
        # predictor.gradient_checkpointing (the engine sets it): whether the private backward recomputes
        # the model's checkpointed blocks (grad_recompute.Recompute)
        self.recompute = None

    @property
    def share_wait_seconds(self) -> dict[str, float]:
        """ZeRO 3's queued shares (``_partition_gradient``): the seconds autograd's thread waited
        for a free buffer (``slot``) and for the last adds after the backward (``drain``)."""
        return self._shares.wait_seconds

    @property
    def pending(self) -> bool:
        """A run's first moment the optimizer has not taken yet."""
        return self.m is not None or self.moments is not None

    def _shard(self, i: int) -> torch.Tensor:
        """Partition ``i``'s 16-bit weights, flat; for one on NVMe a stand-in that sizes and places
        the run's tensors but holds no values (``_values``, ``_held`` read and write those)."""
        if self.swapped.swapped(i):
            return self.swapped.stand_in(i)
        return _flat(self.access.device_shard(i))

    def _any_swapped(self) -> bool:
        """Some partition is on NVMe: a pass that reads it runs on this thread (DeepSpeed's swapper)."""
        return any(map(self.swapped.swapped, range(self.access._count())))

    def _values(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` (``_shard(i)``), or for a partition on NVMe its values read into the host buffer."""
        return self.swapped.read(i) if self.swapped.swapped(i) else shard

    @contextlib.contextmanager
    def _held(self, i: int):
        """Partition ``i`` to move in place: itself, or one on NVMe read into the host buffer and
        written back after (each pass that writes calls ``swapped.release`` first)."""
        if self.swapped.swapped(i):
            with self.swapped.held(i) as flat:
                yield flat
        else:
            yield self._shard(i)

    def _parts(self) -> Iterable[MasterPartition]:
        """The partitions for a pass that reads or writes their tensors: listed here (a pass on
        a host thread reads no DeepSpeed structure), or under ZeRO-Infinity's NVMe swap
        (``access.swaps``) ``partitions()`` itself, each swapped in for its turn only: such a pass
        runs on this thread, one partition at a time."""
        return self.access.partitions() if self.access.swaps else list(self.access.partitions())

    # ------------------------------------------------------------------ a step
    def take(self, engine: Any, batches: list, loss_fn: Callable, timed: Timer = _untimed) -> bool:
        """This step's gradient (the mean over its micro-batches, or the share of them
        ``batch_fraction`` keeps, and the ranks, clipped as DeepSpeed clips) into the run's first
        moment. Collective. False (nothing changed) when it is not finite on some rank."""
        if not self._prefetching:   # (a prefetch goes on behind this gradient; _begin joins it)
            # (a commit behind the last real step reads the state this run copies; a CPU step behind
            # the run goes on: the run's state is the GPU's)
            self.wait(behind=False)
        batches = batch_share(batches, self.batch_fraction)
        if self.compact:
            return self._take_compact(engine, batches, loss_fn, timed)
        # (predictor.gradient_checkpointing; the run's moments allocated: a measured peak holds them)
        ready = self.m is not None or self._prefetching or self._next is not None
        recompute = self.recompute.scope(batches, ready) if self.recompute is not None else contextlib.nullcontext()
        with timed("gradient"), recompute:
            laid = None   # ZeRO 3: the gradient already laid like the masters, one tensor per partition
            if self.access.params_partitioned:
                laid, device = self._partition_gradient(engine, batches, loss_fn)
                grads = [t for t in laid if t is not None]
            else:
                grads = self._gradient(engine, batches, loss_fn)
                device = self._device(grads)
            sq = torch.zeros((), dtype=torch.float32, device=device)
            for g in grads:
                if g is not None:
                    sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(device) ** 2
            if laid is not None:   # (each rank holds its own share of the gradient)
                self._all_reduce(sq)
            norm = float(sq.sqrt())   # the same on every rank: the gradient was all-reduced
        samples = batch_samples(batches)
        self.last_sq, self.last_samples = norm * norm, samples * self._world if samples else None
        if not math.isfinite(norm):
            self.nonfinite += 1
            self.access.release_gathered()   # (no apply follows to do it)
            return False
        # DeepSpeed's ZeRO 1/2 clipping: divide by (norm + 1e-6) / clip where that is above 1.
        coef = (norm + 1e-6) / self.clip if self.clip > 0.0 else 1.0
        coef = max(coef, 1.0)
        if self.m is None:
            with timed("state_upload"):
                self._begin()
        with timed("moment"), torch.no_grad():
            for i, part in enumerate(self.access.partitions(resident=False)):   # (the group's betas only)
                m = self.m[i]
                if m is None:
                    continue
                beta1, beta2 = part.group.get("betas", (0.9, 0.999))
                m = m.view(-1)
                m.mul_(beta1)
                # (updated: Adam's v of the clipped gradient, g / coef; the fold in fp32, into v's dtype)
                v = self.v[i].view(-1).mul_(beta2) if self.update_v else None
                if laid is not None:
                    g = laid[i].to(m.device)
                    m.add_(g, alpha=(1.0 - beta1) / coef)
                    if v is not None:
                        v.addcmul_(g, g, value=(1.0 - beta2) / (coef * coef))
                    continue
                for p, ps, ms, n in self._slices[i]:
                    g = grads[self._index[p]]
                    if g is not None:
                        g = g.reshape(-1)[ps:ps + n].to(m.device)
                        m[ms:ms + n].add_(g, alpha=(1.0 - beta1) / coef)
                        if v is not None:
                            v[ms:ms + n].addcmul_(g, g, value=(1.0 - beta2) / (coef * coef))
        return True

    def _take_compact(self, engine: Any, batches: list, loss_fn: Callable, timed: Timer) -> bool:
        """``take`` with the compact state: the gradient folded into the run's first moment a
        parameter at a time (``_stream_gradient``)."""
        key = _round_key(self.seed, int(engine.global_steps), 0, salt=0x7F4A7C15)
        if self.moments is None:
            with timed("state_upload"):
                self._begin_compact(key)
        recompute = self.recompute.scope(batches, True) if self.recompute is not None else contextlib.nullcontext()
        with timed("gradient"), recompute:
            sq = self._stream_gradient(engine, batches, loss_fn, key)
        samples = batch_samples(batches)
        if sq is None:   # (some parameter's gradient was NaN/Inf on the ranks, and went into the moment)
            self.last_sq = self.last_samples = None
            self.nonfinite += 1
            self.moments.reset_m(self._parts(), key)
            self.access.release_gathered()   # (ZeRO 3: no apply follows to do it)
            return False
        self.moments.take_shares(sq)
        # (the whole gradient's norm: from one micro-batch's per-parameter norms; with several, none)
        one = len(batches) == 1
        self.last_sq = sum(sq.values()) if one else None
        self.last_samples = samples * self._world if one and samples else None
        return True

    def _begin_compact(self, key: int, first: bool = True) -> None:
        """The run's compact moments, built from the optimizer's (collective: the shares' sums);
        ``first`` False: the first moment left for a resume to load."""
        self.wait()
        staged = self._take_staged() if first else self.drop_staged()
        if staged is not None:
            self.moments = staged[0]
        else:
            device = self._shard(0).device
            self.moments = CompactMoments(self._slices, self.params, device, self.compact)
            self.moments.build(self._parts(), key, self._all_reduce, first=first)
        # (read at each run: a momentum schedule such as DeepSpeed's OneCycle moves a group's betas)
        self._beta1 = {}
        for i, part in enumerate(self.access.partitions(resident=False)):
            for p, _, _, _ in self._slices[i]:
                self._beta1[p] = part.group.get("betas", (0.9, 0.999))[0]

    def _stream_gradient(self, engine: Any, batches: list, loss_fn: Callable, key: int) -> dict | None:
        """The step's gradient folded into the compact first moment as the backward produces it:
        a tensor hook per parameter all-reduces the parameter's gradient (several ranks), clips
        it to its share of the threshold (``CompactMoments.fold``) and hands autograd a
        zero-stride zero, so no gradient is held past its own hook (or, the moments in host memory
        and the gradient on a GPU, past its queued copies: ``_fold_behind``). Sets ``last_loss``. Returns
        each parameter's squared gradient norm summed over the micro-batches (the same on every
        rank), or None where one was not finite (its NaN/Inf is then in the first moment, which the
        caller takes again from the optimizer's). The norms are read once, after the backward:
        a hook that waited for each would stall a GPU's backward at every parameter."""
        moments, world, n = self.moments, self._world, len(batches)
        norms: list = []   # (parameter, its gradient's norm as a 0-d tensor) per hook call
        first = [True]

        def hook(p: torch.nn.Parameter) -> Callable:
            def take(g: torch.Tensor) -> torch.Tensor:
                flat = g.detach().reshape(-1)
                if world > 1:
                    flat = flat.to(torch.float32, copy=True)
                    self._all_reduce(flat)
                # (read after the backward, once: a NaN folds NaN into the moment, which is then taken again)
                norm = torch.linalg.vector_norm(flat, dtype=torch.float32) / world
                norms.append((p, norm))
                beta1, weight = self._beta1.get(p, 0.9), 1.0 / (n * world)
                if flat.device == moments.device and not self.stage_shares:
                    moments.fold(p, flat, norm, self.clip, beta1, weight, first[0], key)
                else:   # (a GPU's gradient into moments in host memory: queued, folded behind the backward)
                    self._fold_behind(p, flat, norm, beta1, weight, first[0], key)
                return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
            return take

        caller = ModuleCaller(engine)
        trained = [p for p in self.params if p.requires_grad]
        handles = [p.register_hook(hook(p)) for p in trained]
        losses = []
        try:
            for k, batch in enumerate(batches):
                first[0] = k == 0
                with torch.enable_grad():
                    loss = loss_fn(caller, batch)
                    torch.autograd.grad(loss, trained, allow_unused=True)
                losses.append(loss.detach().float().reshape(1))
        finally:
            for h in handles:
                h.remove()
            self._shares.drain()   # the queued folds done (also after an error: nothing folds them later)
        loss_sum = torch.cat(losses).sum().reshape(1)
        self._all_reduce(loss_sum)
        self.last_loss = float(loss_sum) / (n * world)
        values = torch.stack([x for _, x in norms]).double().cpu().tolist() if norms else []
        if not all(math.isfinite(x) for x in values):
            return None
        sq: dict = {}
        for (p, _), x in zip(norms, values):
            sq[p] = sq.get(p, 0.0) + x * x
        return sq

    def _fold_behind(self, p: torch.nn.Parameter, flat: torch.Tensor, norm: torch.Tensor, beta1: float,
                     weight: float, first: bool, key: int) -> None:
        """``CompactMoments.fold`` of a gradient on a GPU into moments in host memory (ZeRO 3 with
        ``offload_param: cpu``), without the hook waiting for the GPU: each of ``p``'s slices crosses
        through the pinned buffers of ``QueuedDownloads`` and its host thread folds it chunk by chunk
        (``CompactMoments.fold_range`` of the queue's chunks, each a multiple of ``quant.CHUNK``), in
        the hooks' order. The same values, roundings and draws as the fold in the hook."""
        moments = self.moments
        slices = moments.by_param.get(p, ())
        if not slices:
            return
        # the fold's scale: copied on the backward's stream before the queue's copies, which wait for it
        scale = torch.empty(1, dtype=torch.float32, pin_memory=flat.is_cuda)
        scale.copy_(moments.fold_scale(p, norm, self.clip, beta1, weight).reshape(1), non_blocking=True)
        for s in slices:
            def take(staged: torch.Tensor, a: int, b: int, s=s) -> None:
                with worker_scratch("compact-fold"):   # (beside the main thread's scratch buffers)
                    moments.fold_range(s, staged, a, b, scale[0], beta1, first, key)
            self._shares.put(flat[s.ps:s.ps + s.n], take)

    @staticmethod
    def _device(grads: list) -> torch.device:
        return next((g.device for g in grads if g is not None), torch.device("cpu"))

    def _gradient(self, engine: Any, batches: list, loss_fn: Callable) -> list[torch.Tensor | None]:
        """Per parameter (``self.params``' order), the gradient averaged over the micro-batches
        and the ranks; sets ``last_loss``. One micro-batch on one rank: autograd's own tensors
        (nothing else allocated). Otherwise they are summed into one flat buffer (``sum_dtype``; in
        fp32 the losses' sum in its last value), which one all-reduce averages over the ranks."""
        caller = ModuleCaller(engine)
        offsets, total = self._offsets, self._offsets[-1]
        flat = None
        losses = []
        grads: list = []
        for batch in batches:
            with torch.enable_grad():
                loss = loss_fn(caller, batch)
                grads = list(torch.autograd.grad(loss, self.params, allow_unused=True))
            losses.append(loss.detach().float().reshape(1))
            if len(batches) == 1 and self._world == 1:
                break
            if flat is None:
                flat = torch.zeros(total + 1, dtype=self.sum_dtype, device=loss.device)
            for k, g in enumerate(grads):
                if g is not None:
                    flat[offsets[k]:offsets[k] + g.numel()].add_(g.reshape(-1))
                grads[k] = None   # (freed as it goes)
        loss_sum = torch.cat(losses).sum(dtype=torch.float64)
        if flat is None:
            self.last_loss = float(loss_sum)
            return grads
        share = len(batches) * self._world
        if flat.dtype == torch.float32:
            flat[-1] = loss_sum
        else:   # (a 16-bit slot would round the loss: it goes on its own)
            loss_sum = loss_sum.reshape(1).to(flat.device, torch.float32)
            self._all_reduce(loss_sum)
        self._all_reduce(flat)
        flat.div_(share)
        self.last_loss = float(flat[-1]) if flat.dtype == torch.float32 else float(loss_sum) / share
        return [flat[o:o + p.numel()] for o, p in zip(offsets, self.params)]

    def _partition_gradient(self, engine: Any, batches: list,
                            loss_fn: Callable) -> tuple[list[torch.Tensor | None], torch.device]:
        """ZeRO 3: per master partition, this rank's share of the step's gradient laid out like
        it (the mean over the micro-batches and the ranks; ``sum_dtype``, beside where the run's
        first moment lives), and the device the ranks reduce on; sets ``last_loss``.

        No rank holds a whole gradient here, as under DeepSpeed's own ZeRO 3 backward: a tensor
        hook on each parameter takes its gradient as the backward produces it, all-reduces it,
        adds this rank's share into the partitions and hands autograd a zero-stride zero in its
        place, so what ``torch.autograd.grad`` returns costs no memory. The hooks fire in the
        backward's order, the same on every rank, so their all-reduces pair up."""
        sums: list[torch.Tensor | None] = []
        # (not swapped in: the state's keys and where it lives when it is in memory)
        for i, part in enumerate(self.access.partitions(resident=False)):
            n = self.access.numel(i)
            if "exp_avg" not in part.state or n == 0:
                sums.append(None)
                continue
            device = self._shard(i).device if self.on_device else part.state["exp_avg"].device
            sums.append(torch.zeros(n, dtype=self.sum_dtype, device=device))
        where = self._where

        def hook(p: torch.nn.Parameter) -> Callable:
            def take_share(g: torch.Tensor) -> torch.Tensor:
                flat = g.detach().reshape(-1)
                if self._world > 1:
                    flat = flat.to(self.sum_dtype, copy=True)
                    self._all_reduce(flat)
                for i, ps, ms, n in where.get(p, ()):
                    if sums[i] is None:
                        continue
                    share = flat[ps:ps + n]
                    if share.device == sums[i].device and not self.stage_shares:
                        sums[i][ms:ms + n].add_(share)
                    else:   # (a GPU's share into host memory: pinned chunks, added behind the backward)
                        self._shares.put(share, _add_into(sums[i], ms))
                return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
            return take_share

        caller = ModuleCaller(engine)
        handles = [p.register_hook(hook(p)) for p in self.params if p.requires_grad]
        losses = []
        try:
            for batch in batches:
                with torch.enable_grad():
                    loss = loss_fn(caller, batch)
                    torch.autograd.grad(loss, self.params, allow_unused=True)
                losses.append(loss.detach().float().reshape(1))
        finally:
            for h in handles:
                h.remove()
            self._shares.drain()   # the queued shares added (also after an error: nothing writes the sums later)
        share = len(batches) * self._world
        loss_sum = torch.cat(losses).sum().reshape(1)
        self._all_reduce(loss_sum)
        self.last_loss = float(loss_sum) / share
        for t in sums:
            if t is not None:
                t.div_(share)
        return sums, loss_sum.device

    def _begin(self) -> None:
        """The run's first moment (and on the device path its second moment) beside what the
        steps move: copies of the optimizer's, taken once per run (or by ``prefetch`` before it,
        used when the optimizer has not stepped since)."""
        self.wait()
        shards = [self._shard(i) for i in range(self.access._count())] if self.on_device else []
        if self.access.swaps:   # (each partition swapped in for its copies only; no prefetch runs here)
            staged = self._take_staged()
            self.m, self.v = staged if staged is not None else self._state_copies(self.access.partitions(), shards)
            return
        parts = list(self.access.partitions())
        ready, self._next = self._next, None
        if ready is not None:
            if ready[0] == self._state_key(parts):
                self.m, self.v = ready[1], ready[2]
                self.prefetched[0] += 1
                return
            self.prefetched[1] += 1
            ready = None   # (the stale copies' GPU memory back before the new ones are made)
        self.m, self.v = self._state_copies(parts, shards)

    @staticmethod
    def _state_key(parts: list) -> tuple:
        """What the copies were made from: each partition's step count and moment tensors."""
        return tuple((p.step, id(p.state.get("exp_avg")), id(p.state.get("exp_avg_sq"))) for p in parts)

    def _state_copies(self, parts: "Iterable", shards: list) -> tuple[list, list]:
        """The run's moments beside the shards, copied now, a partition at a time (``parts`` may
        be ``partitions()`` itself, each swapped in for its turn only)."""
        ms: list = []
        vs: list = []
        for i, part in enumerate(parts):
            m, v = self._state_copy(part, shards[i] if shards else None)
            ms.append(m), vs.append(v)
        return ms, vs

    def _state_copy(self, part: MasterPartition, shard: torch.Tensor | None) -> tuple:
        """A partition's moments for the run, allocated and copied now."""
        m, v, f = self._state_buffer(part, shard)
        self._fill_one(part, m, v, f)
        return m, v

    def _state_buffers(self, parts: list, shards: list) -> tuple[list, list, list]:
        """``_state_buffer`` of each partition, as three lists."""
        made = [self._state_buffer(part, shards[i] if shards else None) for i, part in enumerate(parts)]
        return [b[0] for b in made], [b[1] for b in made], [b[2] for b in made]

    def _state_buffer(self, part: MasterPartition, shard: torch.Tensor | None) -> tuple:
        """A partition's first and second moment for the run (allocated; the host path's first
        moment already a copy, a second moment that can be read where it lies is the optimizer's
        own) and what is left to copy into them: 0 nothing, 1 the first moment, 2 both."""
        if "exp_avg" not in part.state or part.master.numel() == 0:
            return None, None, 0
        if not self.on_device:
            # (held: the optimizer's own exp_avg_sq is read in place, swapped in with the master)
            return (part.state["exp_avg"].detach().clone(),
                    part.state["exp_avg_sq"].detach().clone() if self.update_v else None, 0)
        m = torch.empty(shard.numel(), dtype=self.state_dtype, device=shard.device)
        v = part.state["exp_avg_sq"].view(-1)
        # (held, read-only: no copy where it can be read and stays there; updated: always the
        # run's own; under NVMe the optimizer's is swapped out after this partition's turn)
        if self.update_v or v.device != shard.device or v.dtype != self.state_dtype or self.access.swaps:
            return m, torch.empty(shard.numel(), dtype=self.state_dtype, device=shard.device), 2
        return m, v, 1

    def _fill(self, parts: list, ms: list, vs: list, fill: list, after=None, order: bool = True) -> None:
        for part, m, v, f in zip(parts, ms, vs, fill):
            self._fill_one(part, m, v, f, after, order)

    def _fill_one(self, part: MasterPartition, m, v, f: int, after=None, order: bool = True) -> None:
        if f:
            self._copy(m, part.state["exp_avg"].view(-1), after, order)
        if f == 2:
            self._copy(v, part.state["exp_avg_sq"].view(-1), after, order)

    @torch.no_grad()
    def cover(self, calls: list, step: int) -> None:
        """``memory.cpu_step_behind``: the real step's Adam step taken beside the 16-bit weights,
        from the deferred calls' clipped gradient and moments from before the step (copied there in
        ``state_dtype``; the moments' arithmetic in fp32), into the weights with ``held_adam_step``
        (a bf16 weight rounded stochastically); the stepped moments become the run's state. The
        calls' own step of the masters runs later (``step_behind``). Collective (the all-gather).
        In the compact state, ``_cover_compact``."""
        by_ptr = {call.params.data_ptr(): call for call in calls}
        if self.compact:
            self._cover_compact(calls, by_ptr, step)
            return
        parts = list(self.access.partitions())
        from .quant import CHUNK, scratch
        ms: list = []
        vs: list = []
        for i, part in enumerate(parts):
            call = by_ptr.get(part.master.data_ptr()) if part.master.numel() else None
            if call is None or call.params.numel() != part.master.numel():
                ms.append(None), vs.append(None)
                continue
            shard = self._shard(i)
            m, v, g = (torch.empty(shard.numel(), dtype=self.state_dtype, device=shard.device) for _ in range(3))
            for dst, src in ((m, call.exp_avg), (v, call.exp_avg_sq), (g, call.grads)):
                self._copy(dst, src.view(-1))
            w0, w1 = scratch(shard.device, 0, m.numel()), scratch(shard.device, 1, m.numel())
            for a in range(0, m.numel(), CHUNK):
                b = min(a + CHUNK, m.numel())
                gf = w0[:b - a].copy_(g[a:b])
                m[a:b].copy_(w1[:b - a].copy_(m[a:b]).mul_(call.beta1).add_(gf, alpha=1.0 - call.beta1))
                v[a:b].copy_(w1[:b - a].copy_(v[a:b]).mul_(call.beta2).addcmul_(gf, gf, value=1.0 - call.beta2))
            del g
            self._held_adam(shard, m, v, lr=float(call.lr), beta1=call.beta1, beta2=call.beta2, eps=call.eps,
                            step=call.step, weight_decay=float(call.weight_decay),
                            bias_correction=bool(call.bias_correction),
                            key=_round_key(self.seed, step, i, salt=0x5BD1E995))
            ms.append(m), vs.append(v)
        _all_covered(sum(m is not None for m in ms), calls)
        self.access.gather_device_shards()
        self.m, self.v, self._next = ms, vs, None
        self.covered = True

    def _cover_compact(self, calls: list, by_ptr: dict, step: int) -> None:
        """``cover`` in the compact state (``memory.gradient_state_dtype``): the run's moments built
        from the optimizer's as they stand before the step (its calls have not run), the calls'
        gradient (DeepSpeed's clip already in it) folded into both (the first moment as a Predict
        step folds its own; the second moment's row and column means by the same update as the
        whole, ``CompactMoments.fold_real_step``, one copy of each chunk), then Adam's step of the 16-bit weights from them,
        the factored second moment in it as in the run's steps. What crosses to the GPU is what a
        run's start copies (the first moment; the second's means are taken in host memory) and
        the gradient; the full-size stepped moments never exist there. Collective (the shares'
        sums, the all-gather)."""
        parts = list(self.access.partitions())
        key = _round_key(self.seed, step, 0, salt=0x2545F491)
        self._begin_compact(key)   # (the moments before the step; joins a commit still writing them)
        moments, stepped = self.moments, 0
        for i, part in enumerate(parts):
            slices = moments.parts[i]
            call = by_ptr.get(part.master.data_ptr()) if slices else None
            if call is None or call.params.numel() != part.master.numel():
                continue
            g, shard = call.grads.view(-1), self._shard(i)
            # Crossing to the GPU, in the 16-bit weights' dtype through the stager's pinned chunks, as
            # the full-size cover's copies go (half the bytes of DeepSpeed's fp32 gradient, no pageable copy)
            stage = dict(copy=self._copy, dtype=shard.dtype) if g.device != moments.device else {}
            for k, s in enumerate(slices):
                moments.fold_real_step(s, g[s.ms:s.ms + s.n], call.beta1, call.beta2, _mix(key, i, k), **stage)
            kw = dict(lr=float(call.lr), beta1=call.beta1, beta2=call.beta2, eps=call.eps, step=call.step,
                      weight_decay=float(call.weight_decay), bias_correction=bool(call.bias_correction))
            moments.step(i, shard, lambda x, m, v, key, kw=kw: self._held_adam(x, m, v, key=key, **kw),
                         key=_round_key(self.seed, step, i, salt=0x5BD1E995))
            stepped += 1
        _all_covered(stepped, calls)
        moments.refresh_shares(self._all_reduce)   # (the run's first shares: of the stepped v's norm)
        self.access.gather_device_shards()
        self.covered = True

    def step_behind(self, calls: list) -> None:
        """The deferred calls (DeepSpeed's step of the masters and host moments) on a host thread;
        ``wait`` or ``behind.wait()`` join it."""
        from .cpu_step_behind import run_all
        self.behind.start(lambda: run_all(calls))

    def prefetch(self) -> None:
        """The next step begins a run (the engine calls this after the real step before it):
        make the run's copies of the moments now, on the host thread, while that step's forward
        and backward run (its gradient needs no moment). Where they cross to another device
        (the device path beside a GPU), or stay in host memory beside one (``prefetch_host``:
        the GPU runs the forward and backward meanwhile); elsewhere (DeepSpeed's CPU accelerator,
        where the thread would take the forward's cores) ``_begin`` copies in place of it."""
        if not self.on_device or self.compact or self.m is not None or self._worker.running or self.access.swaps:
            return
        parts = list(self.access.partitions())   # (DeepSpeed's structures read here, not on the thread)
        shards = [self._shard(i) for i in range(len(parts))]
        if not (self._crosses(parts, shards) or self.prefetch_host):
            return
        key = self._state_key(parts)
        # Allocated here, and the copies wait only for the work queued so far (what freed that
        # memory), not for the next step's forward and backward queued while they run.
        ms, vs, fill = self._state_buffers(parts, shards)
        ready = Stager.mark(next(s.device for s in shards))

        def job() -> tuple:   # (wait() orders the main stream after these copies: Stager.join)
            self._fill(parts, ms, vs, fill, after=ready, order=False)
            return key, ms, vs

        self._next = None
        self._prefetching = True
        self._worker.start(job)

    # -------------------------------------- the next run's state inside the real step (NVMe swap)
    def stage_in_step(self, step: int) -> None:
        """Under ZeRO-Infinity's NVMe swap, in a real step a run may follow (the last of a Full or
        Correct phase): make the run's state inside DeepSpeed's step, each sub-group's just after
        its Adam step while DeepSpeed has it swapped in (``zero_access.StepJobs``), instead of at
        the run's first step through a swap-in and swap-out of every sub-group of its own. The same
        state as that step would make from the same moments: the copies of the moments beside the
        16-bit partitions, or the compact moments (``step``: the step count DeepSpeed's step makes,
        the first moment's rounding key, as the run's first step reads it). ``finish_staging``
        after the step keeps it for the run; the next real step drops it where no run came."""
        self.drop_staged()
        count = self.access._count()
        if self.compact:
            moments = CompactMoments(self._slices, self.params, self._shard(0).device, self.compact)
            moments.start()
            key = _round_key(self.seed, step, 0, salt=0x7F4A7C15)
            self._staging = (moments,)

            def make(i: int, part: MasterPartition) -> None:
                moments.build_one(i, part, key)
        else:
            ms: list = [None] * count
            vs: list = [None] * count
            self._staging = (ms, vs)

            def make(i: int, part: MasterPartition) -> None:
                ms[i], vs[i] = self._state_copy(part, self._shard(i))
        self._stage_jobs.defer({}, {i: (lambda part, i=i: make(i, part)) for i in range(count)})

    def finish_staging(self) -> None:
        """After the real step: the state ``stage_in_step`` made, kept for the run's first step
        (``_begin``), or nothing where DeepSpeed's step reached no sub-group (a skipped step, the
        same on every rank). Collective with the compact state (its second moment's sums)."""
        staging, self._staging = self._staging, None
        if not self._stage_jobs.finish_after("gradient_prefetch") or staging is None:
            return
        if self.compact:
            staging[0].finish(self._all_reduce)
        self._next = (self._state_key(list(self.access.partitions(resident=False))), *staging)

    def drop_staged(self) -> None:
        """Under NVMe swap: forget the state made for a run that did not come (its memory back
        before a real step's forward and backward; ``gradient_prefetch_stale`` counts it)."""
        if self.access.swaps and self._next is not None:
            self._next = None
            self.prefetched[1] += 1

    def _take_staged(self) -> tuple | None:
        """The run's state ``stage_in_step`` made (``_begin``: the copies ``(m, v)``; the compact
        path: ``(moments,)``), where the optimizer has not stepped since; else None."""
        if not self.access.swaps or self._next is None:
            return None
        ready, self._next = self._next, None
        if ready[0] != self._state_key(list(self.access.partitions(resident=False))):
            self.prefetched[1] += 1
            return None
        self.prefetched[0] += 1
        return ready[1:]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, order: bool = True) -> None:
        """``dst.copy_(src)``; between host memory and a GPU through the stager (the cast on the
        host, pinned chunks: no pageable copy, no GPU transient)."""
        if dst.device == src.device:
            dst.copy_(src)
        elif src.device.type == "cpu":
            self._stager.upload(dst, src, after, order)
        else:
            self._stager.download(dst, src, after=after)

    @torch.no_grad()
    def apply(self, step: int) -> None:
        """The step's update from the run's first moment, then what makes every rank's
        parameters see it (the host path's propagate, the device path's all-gather). Collective."""
        if not self.on_device:
            from .zero_access import apply_predicted_update
            apply_predicted_update(self.access, 1.0, backend=self.backend, first_moments=self.m,
                                   second_moments=self.v if self.update_v else None, lr_scale=self.lr_scale)
            self.access.propagate()
            return
        if self.moments is not None:
            self._apply_compact(step)
            return
        self.swapped.release(range(self.access._count()))
        for i, part in enumerate(self.access.partitions(resident=False)):   # (group and step count only)
            if self.m[i] is None:
                continue
            g = part.group
            beta1, beta2 = g.get("betas", (0.9, 0.999))
            with self._held(i) as shard:
                self._held_adam(shard, self.m[i], self.v[i], lr=float(g["lr"]) * self.lr_scale,
                                beta1=beta1, beta2=beta2, eps=g.get("eps", 1e-8), step=part.step,
                                weight_decay=float(g.get("weight_decay", 0.0)),
                                bias_correction=g.get("bias_correction", True), key=_round_key(self.seed, step, i))
        self.access.gather_device_shards()

    def _apply_compact(self, step: int) -> None:
        """``apply`` from the compact state: Adam's step a range at a time (``CompactMoments.step``)."""
        self.swapped.release(range(self.access._count()))
        for i, part in enumerate(self.access.partitions(resident=False)):   # (group and step count only)
            if not self.moments.parts[i]:
                continue
            g = part.group
            beta1, beta2 = g.get("betas", (0.9, 0.999))
            kw = dict(lr=float(g["lr"]) * self.lr_scale, beta1=beta1, beta2=beta2, eps=g.get("eps", 1e-8),
                      step=part.step, weight_decay=float(g.get("weight_decay", 0.0)),
                      bias_correction=g.get("bias_correction", True))
            with self._held(i) as shard:
                self.moments.step(i, shard, lambda x, m, v, key: self._held_adam(x, m, v, key=key, **kw),
                                  key=_round_key(self.seed, step, i))
        self.access.gather_device_shards()

    def _held_adam(self, shard: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
                   beta2: float, eps: float, step: int, weight_decay: float, bias_correction: bool, key: int) -> None:
        """Adam's step of ``shard`` from ``m`` and ``v`` (``kernels.held_adam_step``)."""
        if self._host_step(shard, m, v):
            # a bf16 partition in host memory (ZeRO 3's offload_param: cpu): one C++ pass, bit
            # for bit the torch ops (whose random bits' hash alone took seconds a step for 1B)
            bc1, bc2 = kernels._bias_corrections(beta1, beta2, step, bias_correction)
            decay = -lr * weight_decay if self.access.decoupled_decay and weight_decay else 0.0
            host_kernels.held_adam(shard, m, v, bc1=bc1, bc2=bc2, decay=decay, lr=lr, eps=eps, key=key)
            return
        kernels.held_adam_step(shard, m, v, beta1=beta1, beta2=beta2, step=step, weight_decay=weight_decay,
                               decoupled=self.access.decoupled_decay, bias_correction=bias_correction,
                               backend=self.backend, lr=lr, eps=eps, key=key)

    def _host_step(self, shard: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
        """``memory.host_kernels`` takes this step: a bf16 shard in host memory beside moments there
        (with fp32 weights the step is ``fused_update``'s, bit for bit the host path's masters)."""
        return (self.host_kernel and shard.device.type == "cpu" and shard.dtype == torch.bfloat16
                and m.device.type == v.device.type == "cpu" and m.dtype == v.dtype
                and all(t.is_contiguous() for t in (shard, m, v)))

    # --------------------------------------------------------- how a run ends
    @torch.no_grad()
    def commit(self, resync: bool = False, background: bool = False) -> None:
        """The run is kept: its first moment becomes the optimizer's and, on the device path, the
        masters take the 16-bit weights (plus their own sub-16-bit residual). ``resync``: the run
        goes on (a verified step in the middle of it), so the 16-bit weights are then written from
        the masters again, which keeps "weight = round(master)" true at the next commit (a
        collective on ZeRO 1/2). ``background`` (the device path, ``memory.commit_overlap``): on a
        host thread, returning at once; the same copies and additions, so the same masters and
        moments bit for bit. Whoever reads or writes the masters or the moments next calls
        ``wait`` first (the engine: before the optimizer step, a checkpoint; ``take`` itself)."""
        self.wait()
        if self.moments is not None:
            self._commit_compact(resync, background)
            return
        if self.m is None:
            return
        shards = [self._shard(i) for i in range(self.access._count())] if self.on_device else []
        run, second = self.m, (self.v if self.update_v else None)
        self.m, self.v = None, []
        self.covered = False
        if self.access.swaps and not resync:
            self._defer_to_step({i: (lambda part, i=i: self._hand_over_one(i, part, run, shards, None, second))
                                 for i in range(len(run)) if run[i] is not None})
            return
        parts = self._parts()   # (DeepSpeed's structures read here, not on the thread)
        if background and self.on_device and not resync and not self._any_swapped():
            # (the thread's copies wait for the run's last update, not for what this step queues after it)
            ready = Stager.mark(shards[0].device) if shards else None
            self._worker.start(lambda: self._hand_over(parts, run, shards, ready, second))
            return
        self._hand_over(parts, run, shards, second=second)
        if self.on_device and resync:
            self._repropagate()

    def _commit_compact(self, resync: bool, background: bool = False) -> None:
        """``commit`` of the compact state: each partition's first moment into the optimizer's and
        the masters caught up with the 16-bit weights; ``background`` (``memory.commit_overlap:
        true``) on the host thread, as ``_hand_over`` is."""
        moments, self.moments = self.moments, None
        self.covered = False
        shards = [self._shard(i) for i in range(self.access._count())]
        if self.access.swaps and not resync:
            self._defer_to_step({i: (lambda part, i=i: self._hand_over_compact_one(moments, i, part, shards[i]))
                                 for i in range(len(shards)) if moments.parts[i]})
            return
        parts = self._parts()   # (DeepSpeed's structures read here, not on the thread)
        if background and not resync and not self._any_swapped():
            # (the thread's work waits for the run's last update, not for what this step queues after it)
            ready = Stager.mark(shards[0].device) if shards else None
            self._worker.start(lambda: self._hand_over_compact(moments, parts, shards, ready))
            return
        self._hand_over_compact(moments, parts, shards)
        if resync:
            self._repropagate()

    def _hand_over_compact(self, moments: CompactMoments, parts: list, shards: list, after=None) -> None:
        """``_hand_over`` of the compact state. ``after``: the event the run's last update was
        queued before (``Stager.mark``); the first moment's dequantization and copy then run on a
        side stream that waits for it alone, so on a GPU they go on beside the next step's forward
        and backward (the moments are freed once the thread is joined, after the stream's work)."""
        stream = side_stream(self._commit_streams, moments.device) if after is not None else None
        if stream is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, part in enumerate(parts):
                if moments.parts[i]:
                    self._hand_over_compact_one(moments, i, part, shards[i], after)
            if stream is not None:
                stream.synchronize()

    def _hand_over_compact_one(self, moments: CompactMoments, i: int, part: MasterPartition, shard: torch.Tensor,
                               after=None) -> None:
        """Partition ``i`` of ``_hand_over_compact``."""
        moments.write_m(i, part.state["exp_avg"])   # (into host memory: waits for the current stream only)
        _catch_up(_flat(part.master), self._values(i, shard), self._stager, after, self.host_kernel)

    def _hand_over(self, parts: list, run: list, shards: list, after=None, second: list | None = None) -> None:
        """The run's first moment (and ``second``: its updated second moment) into the
        optimizer's, and (``shards``: the device path) the masters caught up with the 16-bit
        weights. ``after``: the event its copies from a GPU wait for (``Stager.mark``; None: the
        work queued so far)."""
        for i, part in enumerate(parts):
            if run[i] is not None:
                self._hand_over_one(i, part, run, shards, after, second)

    def _hand_over_one(self, i: int, part: MasterPartition, run: list, shards: list, after=None,
                       second: list | None = None) -> None:
        """Partition ``i`` of ``_hand_over``."""
        self._copy(part.state["exp_avg"].view(-1), run[i].view(-1), after)
        if second is not None and second[i] is not None:
            self._copy(part.state["exp_avg_sq"].view(-1), second[i].view(-1), after)
            second[i] = None
        # (the copy has finished: the moment's GPU memory goes back now, not after the last
        # partition's catch-up, which a background commit runs during the next real step)
        run[i] = None
        if shards:
            _catch_up(_flat(part.master), self._values(i, shards[i]), self._stager, after, self.host_kernel)

    # ------------------------------------------------- the commit inside DeepSpeed's NVMe step
    # (zero_access.StepJobs: benchmarks/nvme_step_cost.py measures the real step that keeps a run
    # at what a plain step costs)
    def _defer_to_step(self, jobs: dict) -> None:
        """Each ``jobs[i](part)`` runs inside DeepSpeed's next step, before sub-group ``i``'s Adam
        step. Called by ``commit`` after its ``wait``, which settled any earlier ones."""
        self._in_step.defer(jobs)

    def settle(self) -> None:
        """The parts of a deferred commit no step has taken, now (each sub-group swapped in): the
        engine calls it when a real step ends, so that after it the masters and moments hold the
        run whether DeepSpeed stepped or skipped (a non-finite gradient)."""
        self._in_step.settle()

    @staticmethod
    def _crosses(parts: list, shards: list) -> bool:
        """Some moment lives on another device than its 16-bit partition (a GPU beside host masters)."""
        return any("exp_avg" in p.state and p.state["exp_avg"].device != s.device for p, s in zip(parts, shards))

    def wait(self, behind: bool = True) -> None:
        """Join a commit or a prefetch running in the background, re-raising its error (a
        prefetch's copies are kept for the run they were made for), and (``behind``) a CPU step
        behind the run."""
        self.settle()   # (a commit deferred into a step that has not run it)
        prefetching, self._prefetching = self._prefetching, False
        try:
            got = self._worker.wait()
        finally:
            if prefetching:
                # The copies were queued by the thread: this thread's stream waits for them before
                # anything reads those tensors, or frees them (a stale copy) for reuse.
                self._stager.join()
        if prefetching:
            self._next = got
        if behind:
            self.behind.wait()

    @torch.no_grad()
    def discard(self) -> None:
        """The run is rolled back: the optimizer's first moment is still the last good point's.
        On the device path the masters are too: the 16-bit weights are written from them (an
        exact rollback; a collective on ZeRO 1/2). On the host path the engine restores the
        masters from its snapshot."""
        self.wait()
        self.m, self.v, self.moments = None, [], None
        self.covered = False
        if self.on_device:
            self._repropagate()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The run's first moment (in the middle of a run) and, on the device path, this rank's
        16-bit partitions, which hold the run while the masters hold the last good point."""
        self.wait()
        sd: dict = {"nonfinite": self.nonfinite, "on_device": self.on_device, "m": None, "shards": None}
        if self.moments is not None:   # (the compact state's first moments; its second is read again, but a
            # covered run's, which is its own)
            sd["compact"] = self.moments.state_dict(v=self.covered)
            sd["shards"] = [self._saved_shard(i) for i in range(len(self.moments.parts))]
            return sd
        if self.m is not None:
            sd["m"] = [None if t is None else t.detach().to("cpu", copy=True) for t in self.m]
            if self.on_device:
                sd["shards"] = [self._saved_shard(i) for i in range(len(self.m))]
            # (covered: the run's second moment is the GPU's step of it; updated: the run's own; neither
            # is the optimizer's)
            if self.covered or self.update_v:
                sd["v"] = [None if t is None else t.detach().to("cpu", copy=True) for t in self.v]
        return sd

    def _saved_shard(self, i: int) -> torch.Tensor:
        """A copy of partition ``i``'s 16-bit weights in host memory, for a checkpoint."""
        return self._values(i, self._shard(i)).detach().to("cpu", copy=True)

    def _load_shards(self, saved: list) -> None:
        """``state_dict``'s partitions back into the 16-bit weights, then the all-gather (one on
        NVMe is written whole, with no read before)."""
        swapped = self.swapped.release(range(self.access._count()))
        for i, t in enumerate(saved):
            if swapped[i]:
                self.swapped.write(i, t.view(-1))
            else:
                self._shard(i).copy_(t.view(-1))
        self.access.gather_device_shards()

    @torch.no_grad()
    def load_state_dict(self, sd: dict | None) -> str | None:
        """Restore ``state_dict()`` after DeepSpeed loaded the weights and masters. Collective on
        the device path. Returns why a saved run could not be taken up as it was (None: it was,
        or there was none); the loaded weights are then the last good point."""
        self.wait()
        self.m, self.v, self._next = None, [], None   # (a prefetch was made from the state being replaced)
        self.moments = None
        self.covered = False
        if not sd:
            return None
        self.nonfinite = int(sd.get("nonfinite", 0))
        if sd.get("compact") is not None or self.compact:
            return self._load_compact(sd)
        saved = sd.get("m")
        if saved is None:
            return None
        want = [(self.access.numel(i),) if "exp_avg" in p.state and self.access.numel(i) else None
                for i, p in enumerate(self.access.partitions(resident=False))]
        if [None if t is None else tuple(t.reshape(-1).shape) for t in saved] != want:
            if self.on_device:
                self.discard()   # (the loaded 16-bit weights from the loaded masters: the last good point)
            return self._unmatched()
        if bool(sd.get("on_device")) != self.on_device:
            # Saved on the other path. Host -> device: the masters hold the run, so it is kept now.
            # Device -> host: the masters are the last good point and the run's weights are not
            # in them, so it is dropped.
            if self.on_device:
                self._hand_over(self._parts(), saved, [], second=sd.get("v"))
                return "saved on the host path: the run is kept as it stands (it can no longer be rolled back)"
            self._repropagate()
            return "saved on the device path: the run is dropped (the masters hold its last good point)"
        self._begin()   # (allocates m and v where they belong; v read again from the optimizer)
        for m, t in zip(self.m, saved):
            if m is not None:
                m.view(-1).copy_(t.view(-1))
        if sd.get("v") is not None and self.update_v:
            # (the run's own second moment, allocated by _begin)
            for v, t in zip(self.v, sd["v"]):
                if v is not None:
                    v.view(-1).copy_(t.view(-1))
        elif sd.get("v") is not None and self.on_device:
            # memory.cpu_step_behind: the run's own v, a tensor of its own (_begin may have handed
            # it the optimizer's, where that can be read in place)
            self.v = [None if v is None else torch.empty_like(v).copy_(t.view(-1).to(v.device))
                      for v, t in zip(self.v, sd["v"])]
            self.covered = True
        if self.on_device:
            self._load_shards(sd["shards"])
        return None

    def _load_compact(self, sd: dict) -> str | None:
        """``load_state_dict`` where the saved run or this one has the compact state."""
        saved = sd.get("compact")
        meta = list(self.access.partitions(resident=False))
        if saved is None:   # (this engine is compact; the run was saved with full-size moments)
            if sd.get("m") is None:
                return None
            sizes = [None if t is None else t.numel() for t in sd["m"]]
            here = [self.access.numel(i) if "exp_avg" in p.state and self.access.numel(i) else None
                    for i, p in enumerate(meta)]
            if not sd.get("on_device") and sizes == here:
                self._hand_over(self._parts(), sd["m"], [])   # (the masters hold the run: it is kept)
                return "saved on the host path: the run is kept as it stands (it can no longer be rolled back)"
            self._repropagate()
            return ("saved on the device path with full-size moments: the run is dropped (the masters hold its "
                    "last good point)")
        if not self.compact or any(d["dtype"] != self.compact for sl in saved["m"] if sl for d in sl):
            self._repropagate()
            return ("saved with another memory.gradient_state_dtype (int8-factored or int4-factored): the run is "
                    "dropped (the masters hold its last good point)")
        # (the second moment read again from the optimizer; the first is the saved one, not built)
        self._begin_compact(0, first=False)
        if not self.moments.load_state_dict(saved) or len(sd["shards"]) != len(meta):
            self.moments = None
            self._repropagate()
            return self._unmatched()
        self._load_shards(sd["shards"])
        self.covered = saved.get("v") is not None
        return None

    def _unmatched(self) -> str:
        """Why a saved run's moments do not fit this rank's partitions."""
        if self.access.swaps and not any("exp_avg" in p.state for p in self.access.partitions(resident=False)):
            # DeepSpeed 0.19.8 loads ZeRO 3's NVMe-offloaded state from copies of its swap files and
            # leaves the optimizer with no Adam state here (docs/deepspeed-parity.md)
            return ("the optimizer holds no Adam state after DeepSpeed's load "
                    "(zero_optimization.offload_optimizer.device: nvme)")
        return "this rank's partitions have other sizes here (another world size)"

    def _repropagate(self) -> None:
        """The 16-bit weights written again from the masters (a collective on ZeRO 1/2): after a
        commit that lets the run go on, a rollback, or a saved device-path run dropped at a load."""
        self.access.lp_current = False
        self.access.propagate()


def _round_key(seed: int, step: int, i: int, salt: int = 0) -> int:
    """The stochastic rounding's key for partition ``i`` at ``step`` (its random bits are a hash of
    the key and the index): the same on a rerun and after a resume; ``salt`` sets apart the real
    step's own update (``cover``) from a Predict step's."""
    return (((seed * 1_000_003 + int(step)) * 1009 + i) ^ salt) & 0xFFFFFFFF


@torch.no_grad()
def _catch_up(master: torch.Tensor, shard: torch.Tensor, stager: Stager | None = None, after=None,
              host_kernel: bool = False) -> None:
    """``master = shard + (master - round(master))`` a chunk at a time: the master moves by the
    16-bit weight's change over the run (the weight was ``round(master)`` at its start) and keeps
    its residual below 16 bits. With an fp32 shard the master becomes the shard exactly. A shard
    on a GPU comes down a chunk at a time through ``stager``'s pinned buffers (16-bit across PCIe),
    each chunk's arithmetic on the host while the next crosses; ``host_kernel``: that arithmetic in
    one C++ pass (``host_kernels.catch_up``) where the master is in host memory."""
    if shard.dtype == torch.float32:
        if stager is not None and shard.device != master.device:
            stager.download(master, shard, after=after)
        else:
            master.copy_(shard)
        return
    from .quant import CHUNK, scratch
    work, res = scratch(master.device, 0, master.numel()), scratch(master.device, 1, master.numel())

    def take(s: torch.Tensor, a: int, b: int) -> None:
        if host_kernel and master.device.type == "cpu" and s.device.type == "cpu" and s.is_contiguous():
            host_kernels.catch_up(master[a:b], s)
            return
        w = work[:b - a].copy_(s)
        r = res[:b - a].copy_(master[a:b].to(s.dtype))
        master[a:b].sub_(r).add_(w)

    if stager is not None and shard.device != master.device:
        stager.download(master, shard, take, after=after)
        return
    for a in range(0, master.numel(), CHUNK):
        b = min(a + CHUNK, master.numel())
        take(shard[a:b], a, b)
