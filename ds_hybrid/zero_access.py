"""Per-ZeRO-stage access to the fp32 master weights and the Adam state.

This module and ``engine.py`` are the only places that touch DeepSpeed's
internals (verified against DeepSpeed 0.19.8; see docs/architecture.md).

A Predict step needs three things from the optimizer, whatever the ZeRO stage:
the rank-local fp32 masters, the Adam moments that belong to them, and a way to
push changed masters into the low-precision / partitioned model parameters.
``MasterAccess`` gives exactly that; the arithmetic (predicted update, snapshot,
direction comparison) is written once on top of it.

| optimizer wrapper                     | masters                             | propagate                         |
|---------------------------------------|-------------------------------------|-----------------------------------|
| none (ZeRO 0, fp32)                   | the parameters themselves           | nothing                           |
| FP16_Optimizer (ZeRO 0, bf16/fp16)    | ``fp32_groups_flat[i]``             | unflatten into ``fp16_groups[i]`` |
| FP16_UnfusedOptimizer                 | ``fp32_groups[g][k]``               | copy into ``fp16_groups[g][k]``   |
| BF16_Optimizer                        | ``fp32_groups_flat_partition[i]``   | ``update_lp_params()`` (collective)|
| ZeRO 1/2 (``DeepSpeedZeroOptimizer``) | ``single_partition_of_fp32_groups`` | ``update_lp_params()`` (collective)|
| ZeRO 3                                | ``fp32_partitioned_groups_flat[i]`` | reassign per sub-group + epilogue |
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch


@dataclass
class MasterPartition:
    """One rank-local fp32 master tensor with its Adam state and hyper-parameters."""

    master: torch.Tensor
    state: dict  # the optimizer state for ``master``: step, exp_avg, exp_avg_sq
    group: dict  # its param group: lr, betas, eps, weight_decay
    step: float  # real optimizer steps behind the moments (for bias correction)
    group_index: int = 0  # index of ``group`` in the optimizer's param_groups (a layer group)
    lp: torch.Tensor | None = None  # the bf16/fp16 shard the forward reads, when an update may write it


class MasterAccess(abc.ABC):
    """Iterate over this rank's master partitions and propagate them to the model.

    Subclasses only say where entry ``i`` lives (``_entry``), how to make it
    resident (NVMe) and how to propagate; the arithmetic below is shared.
    """

    kind = "base"
    partitioned = False  # whether each rank holds a different shard of the masters
    params_partitioned = False  # whether the model's parameters are too (ZeRO 3): no rank holds a whole gradient
    # Set by apply_predicted_update when it wrote the low-precision shard of every partition it
    # moved (the fused kernel's lp output): the next propagate only gathers. Cleared there.
    lp_current = False

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.base = getattr(optimizer, "optimizer", optimizer)
        # Decoupled weight decay (AdamW) is part of the update the optimizer would make;
        # L2 decay (plain Adam) lives in the gradient and cannot be predicted.
        self.decoupled_decay = _is_adamw(self.base)

    @abc.abstractmethod
    def _count(self) -> int:
        """Number of master entries on this rank."""

    @abc.abstractmethod
    def _entry(self, i: int) -> tuple[torch.Tensor, Any, int]:
        """(master tensor, optimizer-state key, param-group index) of entry ``i``."""

    def num_groups(self) -> int:
        """Number of optimizer param groups (ds_hybrid's layer groups, see models.layer_groups)."""
        return len(self.base.param_groups)

    @contextlib.contextmanager
    def _resident(self, i: int):
        """Make entry ``i`` resident in memory (NVMe swap-in) for the block."""
        yield

    # Whether the optimizer swaps its sub-groups to NVMe between uses (ZeRO-Infinity's
    # offload_optimizer: nvme): a partition's master and state tensors are then empty outside
    # ``partitions()``'s block, so whoever keeps a partition past its turn reads nothing.
    swaps = False

    def partitions(self, resident: bool = True) -> Iterator[MasterPartition]:
        """Yield every master partition of this rank, swapped in while in use. ``resident``
        False: not swapped in (under ``swaps`` the master and state tensors may be empty), for
        what the optimizer keeps beside them: the param group, the step count, the state's keys."""
        for i in range(self._count()):
            with self._resident(i) if resident else contextlib.nullcontext():
                yield self.partition(i)

    def partition(self, i: int) -> MasterPartition:
        """Entry ``i`` as it is now (not swapped in: the caller makes it resident where it swaps)."""
        master, key, gi = self._entry(i)
        group = self.base.param_groups[gi]
        state = self.base.state.get(key, {})
        return MasterPartition(master, state, group, self._step_count(state, group), gi, self._lp(i))

    def numel(self, i: int) -> int:
        """Entry ``i``'s length, without swapping it in."""
        return self._entry(i)[0].numel()

    def _lp(self, i: int) -> torch.Tensor | None:
        """Entry ``i``'s low-precision shard, when the predicted update can write it in the same
        pass (bf16/fp16, same device and length as the master); None: propagate copies."""
        return None

    def _step_count(self, state: dict, group: dict) -> float:
        # torch keeps the count in the state; FusedAdam in the param group too.
        return float(state.get("step", 0) or 0) or float(group.get("step", 0) or 0)

    def propagate(self) -> None:  # subclasses whose masters are the parameters keep this
        """Copy the masters into the parameters the forward pass reads. Collective
        on ZeRO 1-3: every rank must call it."""

    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model parameters of each optimizer param group, in the optimizer's order (what
        layer-group Predict needs to know which groups lie below which block)."""
        return [list(g["params"]) for g in self.base.param_groups]

    def trained_params(self) -> list[torch.nn.Parameter]:
        """Every parameter the optimizer trains, in the same order on every rank (the private
        backward of ``predictor.direction: gradient`` takes the gradient of each)."""
        return [p for group in self.model_param_groups() for p in group]

    def group_names(self) -> list[str]:
        return [str(g.get("name", f"group_{i}")) for i, g in enumerate(self.base.param_groups)]

    @contextlib.contextmanager
    def optimizer_skips(self, groups: "set[int] | frozenset[int]"):
        """For the block, the base optimizer's ``step`` leaves the param groups ``groups`` out:
        no Adam step, no moment decay, no weight decay, no step count for them (torch's Adam /
        AdamW, DeepSpeed's FusedAdam and CPU Adam all step only the groups in
        ``param_groups``). Works whether the wrapper steps all groups at once (ZeRO 0, the
        BF16/FP16 wrappers) or one at a time (ZeRO 1/2's ``_optimizer_step``)."""
        if not groups:
            yield
            return
        base = self.base
        skip = {id(base.param_groups[g]) for g in groups}
        original = base.step

        def step(*args, **kwargs):
            kept = base.param_groups
            base.param_groups = [g for g in kept if id(g) not in skip]
            try:
                if base.param_groups:
                    return original(*args, **kwargs)
            finally:
                base.param_groups = kept

        base.step = step
        try:
            yield
        finally:
            del base.step

    def group_indices(self) -> list[int]:
        """The param group (layer group) of each master entry, in ``partitions()`` order."""
        return [self._group_index(i) for i in range(self._count())]

    def _group_index(self, i: int) -> int:
        return self._entry(i)[2]

    def device_shard(self, i: int) -> torch.Tensor | None:
        """The low-precision (model dtype) copy of master entry ``i`` that this rank's optimizer
        writes after its step, where the forward's parameters read it (ZeRO 1-3), any dtype and
        device; None where there is none in memory. ``memory.offload_predict: device`` updates it
        in place and then calls ``gather_device_shards``."""
        return None

    def shard_swapped(self, i: int) -> bool:
        """Entry ``i``'s low-precision copy is on NVMe with DeepSpeed's parameter swapper (ZeRO 3's
        ``offload_param: nvme`` past ``offload_param.max_in_cpu``): ``device_shard`` is None and
        ``read_swapped_shard`` / ``write_swapped_shard`` move it through host memory."""
        return False

    def gather_device_shards(self) -> None:
        """After the ``device_shard`` tensors were written in place: what DeepSpeed does after its own
        step to make every rank's parameters see them (an all-gather). Collective."""
        raise NotImplementedError(f"{self.kind}: no device shards")

    def release_gathered(self) -> None:
        """After a backward outside DeepSpeed's step (``predictor.direction: gradient``'s private
        one) that no update follows: leave the parameters as DeepSpeed's step leaves them. Only
        ZeRO 3 has anything to do. Collective there."""

    def param_slices(self, i: int) -> list[tuple[torch.nn.Parameter, int, int, int]]:
        """Where master entry ``i`` lies in the model's parameters: ``(param, start in the
        param's flat values, start in the master, length)`` for each piece, so a gradient taken
        per parameter (``predictor.direction: gradient``) can be laid out like the master."""
        raise NotImplementedError(f"{self.kind}: ds_hybrid does not map this optimizer's masters to the model's "
                                  "parameters")

    def has_adam_state(self) -> bool:
        """True once a real optimizer step has created ``exp_avg`` / ``exp_avg_sq``."""
        return any(p.master.numel() and "exp_avg" in p.state and "exp_avg_sq" in p.state
                   for p in self.partitions())


def _group_of_each_param(base: torch.optim.Optimizer) -> list[tuple[torch.Tensor, int]]:
    # The group's index, not its dict: Optimizer.load_state_dict (a checkpoint load)
    # replaces the group dicts, and a cached dict would hold a stale learning rate.
    return [(p, gi) for gi, g in enumerate(base.param_groups) for p in g["params"]]


class _PlainAccess(MasterAccess):
    """ZeRO 0 fp32: DeepSpeed hands the client optimizer over unwrapped; the
    parameters are the masters and the state is keyed by the Parameter."""

    kind = "zero0-fp32"

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._params = _group_of_each_param(self.base)

    def _count(self):
        return len(self._params)

    def _entry(self, i):
        p, gi = self._params[i]
        return p.data, p, gi

    def param_slices(self, i):
        p = self._params[i][0]
        return [(p, 0, 0, p.numel())]

    def _step_count(self, state, group):
        # FusedAdam increments state["step"] of the last parameter of a group only
        # (its loop variable leaks out of the loop), so the group's count is the max.
        return max(super(_PlainAccess, self)._step_count(self.base.state.get(p, {}), group)
                   for p in group["params"])


class _FP16OptimizerAccess(MasterAccess):
    """ZeRO 0 with bf16/fp16 and a fused optimizer: one flat fp32 master per group."""

    kind = "zero0-flat"

    def model_param_groups(self):
        return [list(g) for g in self.optimizer.fp16_groups]

    def _count(self):
        return len(self.optimizer.fp32_groups_flat)

    def _entry(self, i):
        flat = self.optimizer.fp32_groups_flat[i]
        return flat, flat, i

    def _lp(self, i):
        # The parameters are views of fp16_groups_flat[i] (DeepSpeed's FP16_Optimizer steps
        # into it): writing it is the copy below, as long as no parameter was rebound.
        opt = self.optimizer
        flat, master = opt.fp16_groups_flat[i], opt.fp32_groups_flat[i]
        if flat.device != master.device or flat.numel() != master.numel():
            return None
        ptr = flat.untyped_storage().data_ptr()
        return flat if all(p.data.untyped_storage().data_ptr() == ptr for p in opt.fp16_groups[i]) else None

    def propagate(self):
        from torch._utils import _unflatten_dense_tensors
        if self.lp_current:   # the update wrote the parameters' flat buffer: nothing to gather on ZeRO 0
            self.lp_current = False
            return
        for flat, lp_group in zip(self.optimizer.fp32_groups_flat, self.optimizer.fp16_groups):
            for p, q in zip(lp_group, _unflatten_dense_tensors(flat, lp_group)):
                p.data.copy_(q)


class _FP16UnfusedAccess(MasterAccess):
    """ZeRO 0 with bf16/fp16 and an unfused optimizer: one fp32 master per parameter."""

    kind = "zero0-unfused"

    def model_param_groups(self):
        return [list(g) for g in self.optimizer.fp16_groups]

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._masters = [(m, gi) for gi, ms in enumerate(optimizer.fp32_groups) for m in ms]  # index: see above

    def _count(self):
        return len(self._masters)

    def _entry(self, i):
        m, gi = self._masters[i]
        return m, m, gi

    def propagate(self):
        for masters, lp_group in zip(self.optimizer.fp32_groups, self.optimizer.fp16_groups):
            for m, p in zip(masters, lp_group):
                p.data.copy_(m)


class _BF16OptimizerAccess(MasterAccess):
    """``BF16_Optimizer`` (bf16 with fp32 gradient accumulation): flat partitions."""

    kind = "bf16-optimizer"
    partitioned = True

    def model_param_groups(self):
        return [list(g) for g in self.optimizer.bf16_groups]

    def _count(self):
        return len(self.optimizer.fp32_groups_flat_partition)

    def _entry(self, i):
        flat = self.optimizer.fp32_groups_flat_partition[i]
        return flat, flat, i

    def _lp(self, i):
        opt = self.optimizer
        return _lp_shard(opt.bf16_partitioned_groups[i], opt.real_dp_process_group[i],
                         opt.fp32_groups_flat_partition[i])

    def propagate(self):
        _propagate_lp(self, self.optimizer.bf16_groups_flat, self.optimizer.bf16_partitioned_groups)


class _Zero12Access(MasterAccess):
    """ZeRO 1 and 2 (optimizer possibly offloaded to CPU): one padded shard per group."""

    kind = "zero1-2"
    partitioned = True

    def model_param_groups(self):
        return [list(g) for g in self.optimizer.bit16_groups]

    def _count(self):
        return len(self.optimizer.single_partition_of_fp32_groups)

    def _entry(self, i):
        flat = self.optimizer.single_partition_of_fp32_groups[i]
        return flat, flat, i

    def _lp(self, i):
        opt = self.optimizer
        return _lp_shard(opt.parallel_partitioned_bit16_groups[i], opt.real_dp_process_group[i],
                         opt.single_partition_of_fp32_groups[i])

    _stager = None   # (made at the first offloaded propagate)

    def propagate(self):
        opt = self.optimizer
        if not self.lp_current and getattr(opt, "cpu_offload", False):
            # DeepSpeed's update_lp_params copies each fp32 master straight into its 16-bit
            # partition: across PCIe that is a pageable fp32 copy, 507 ms a propagate for llama-1b
            # beside an H100 (docs/results/memory-gpu-1b.json, the host path's `propagate`), paid
            # by every rollback on the device paths. Through pinned chunks cast on the host (the
            # cast torch's, round to nearest even: the same 16-bit values), then only the gather.
            from .staging import Stager
            if self._stager is None:
                self._stager = Stager()
            for i, master in enumerate(opt.single_partition_of_fp32_groups):
                self._stager.upload(self.device_shard(i), master)
            self.lp_current = True
        _propagate_lp(self, opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups)

    def device_shard(self, i):
        import deepspeed.comm as dist
        opt = self.optimizer
        return opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]

    def gather_device_shards(self):
        self.lp_current = True   # the partitions hold the update: only the all-gather is left
        self.propagate()

    def step_copy_targets(self) -> list[torch.Tensor]:
        """What DeepSpeed's step writes from the masters on this rank: each group's 16-bit
        partition and, under ``offload_optimizer``, the pinned 16-bit buffer it is cast into on
        the host first (``memory.cpu_step_behind`` drops those copies in a deferred step)."""
        opt = self.optimizer
        out = [self.device_shard(i) for i in range(self._count())]
        return out + list(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or [])

    def param_slices(self, i):
        # The parameters are views into the group's flat 16-bit buffer (round-robin order), and
        # this rank's shard is a view into it too: their offsets there give the overlap.
        flat, shard = self.optimizer.bit16_groups_flat[i], self.device_shard(i)
        size = flat.element_size()
        start = (shard.data_ptr() - flat.data_ptr()) // size
        end = start + self.optimizer.single_partition_of_fp32_groups[i].numel()
        out = []
        for p in self.optimizer.bit16_groups[i]:
            p0 = (p.data_ptr() - flat.data_ptr()) // size
            lo, hi = max(p0, start), min(p0 + p.numel(), end)
            if lo < hi:
                out.append((p, lo - p0, lo - start, hi - lo))
        return out


def _lp_shard(partitions: list, group: Any, master: torch.Tensor) -> torch.Tensor | None:
    """This rank's low-precision partition (DeepSpeed's update_lp_params copies the master into
    it), when the fused update can write it instead: 16-bit, same device and length. With
    offload_optimizer the masters are on the host and it is on the GPU: propagate copies."""
    import deepspeed.comm as dist
    lp = partitions[dist.get_rank(group=group)]
    ok = lp.dtype in (torch.bfloat16, torch.float16) and lp.device == master.device and lp.numel() == master.numel()
    return lp if ok else None


def _propagate_lp(access: MasterAccess, groups_flat: list, partitioned: list) -> None:
    """DeepSpeed's ``update_lp_params`` (copy each master into its 16-bit partition, then
    all-gather the partitions), without the copy when the update already wrote them."""
    opt = access.optimizer
    if not access.lp_current:
        opt.update_lp_params()
        return
    access.lp_current = False
    from deepspeed.runtime.utils import all_gather_dp_groups
    all_gather_dp_groups(groups_flat=groups_flat, partitioned_param_groups=partitioned,
                         dp_process_group=opt.real_dp_process_group,
                         start_alignment_factor=opt.nccl_start_alignment_factor,
                         allgather_bucket_size=opt.allgather_bucket_size)


class _Zero3Access(MasterAccess):
    """ZeRO 3: fp32 sub-group partitions, possibly swapped to NVMe between uses.

    Propagation follows DeepSpeed's own checkpoint-restore path: prologue, per
    sub-group reassign (or swap out), then the epilogue that invalidates hpZ
    secondary shards and re-gathers persistent parameters.
    """

    kind = "zero3"
    partitioned = True
    params_partitioned = True

    def model_param_groups(self):
        raise NotImplementedError("ZeRO 3 partitions parameters across ranks; layer-group Predict needs ZeRO 0-2")

    def _count(self):
        return len(self.optimizer.fp32_partitioned_groups_flat)

    @property
    def swaps(self):
        return bool(getattr(self.optimizer, "swap_optimizer", False))

    def _entry(self, i):
        opt = self.optimizer
        flat = opt.fp32_partitioned_groups_flat[i]
        return flat, flat, opt.sub_group_to_group_id[i]

    def numel(self, i):
        return int(self.optimizer.fp16_partitioned_groups_flat_numel[i])

    @contextlib.contextmanager
    def _resident(self, i):
        opt = self.optimizer
        swapped = opt._swappable_optimizer_subgroup(i)
        if swapped:
            opt._optimizer_states_and_gradient_swap_in(i)
        try:
            yield
        finally:
            if swapped:
                opt._optimizer_states_and_gradient_swap_out(i)

    def propagate(self):
        opt = self.optimizer
        opt.checkpoint_event_prologue()
        for i in range(self._count()):
            with self._resident(i):
                opt._reassign_or_swap_out_partitioned_parameters(i)
        opt.checkpoint_event_epilogue()

    def _group_index(self, i):
        return self.optimizer.sub_group_to_group_id[i]   # without swapping the master in

    def device_shard(self, i):
        return self.optimizer.fp16_partitioned_groups_flat[i]   # None: swapped out to NVMe

    def shard_swapped(self, i):
        opt = self.optimizer   # (DeepSpeed gives a sub-group no flat buffer past max_in_cpu)
        return opt.fp16_partitioned_groups_flat[i] is None and bool(getattr(opt, "params_in_nvme_and_cpu", False))

    def read_swapped_shard(self, i: int, out: torch.Tensor) -> None:
        """Sub-group ``i``'s 16-bit partition into ``out`` (flat, its length, the parameters'
        dtype): each parameter's partition swapped in from NVMe and released again, or copied
        where the swapper keeps it in memory (below its smallest tensor). DeepSpeed's own read
        of an NVMe sub-group (``_swap_in_sub_group_to_flat_buffer``)."""
        self.optimizer._swap_in_sub_group_to_flat_buffer(out, i)

    def write_swapped_shard(self, i: int, flat: torch.Tensor) -> None:
        """``flat`` (``read_swapped_shard``'s layout) back as sub-group ``i``'s 16-bit partition:
        what DeepSpeed's step does from the masters (``_partitioned_params_swap_out``), from these
        values. The partitions on NVMe are written through the swap-out buffer DeepSpeed reserves
        for the largest sub-group (synchronously); those it keeps in memory are copied."""
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
        opt = self.optimizer
        params, sources, offset = [], [], 0
        for param, part in zip(opt.fp16_groups[i], opt.fp16_partitioned_groups[i]):
            src = flat.narrow(0, offset, part.ds_numel)
            if part.status == PartitionedParamStatus.AVAILABLE:
                part.data.copy_(src)
            else:
                params.append(param)
                sources.append(src)
            offset += part.ds_numel
        if params:
            params[0].nvme_swapper.swap_out_partitioned_params(dst_fp16_params=params, src_fp32_params=sources)

    def trained_params(self):
        return [p for sub_group in self.optimizer.fp16_groups for p in sub_group]

    def step_copy_targets(self) -> list[torch.Tensor]:
        """What DeepSpeed's step writes from the masters on this rank: each sub-group's 16-bit
        partition (on the accelerator, or in host memory under ``offload_param``), with no pinned
        buffer between (``memory.cpu_step_behind`` drops those copies in a deferred step)."""
        return [t for t in self.optimizer.fp16_partitioned_groups_flat if t is not None]

    def release_gathered(self):
        # What DeepSpeed's step does around itself: a module whose inputs need no gradient (the
        # embedding) never runs its post-backward hook, so its parameters stay gathered and
        # marked in use until everything is released; then the persistent ones gather again.
        opt = self.optimizer
        opt.checkpoint_event_prologue()
        opt.checkpoint_event_epilogue()

    def param_slices(self, i):
        # Sub-group i's flat partition is its parameters' partitions end to end
        # (partition_numel() each, fp16_groups order); rank r's partition of a parameter is
        # values [r * partition_numel, (r + 1) * partition_numel) of it, zero-padded past its end.
        import deepspeed.comm as dist
        opt = self.optimizer
        rank = dist.get_rank(group=opt.sub_group_process_groups[i])
        out, start = [], 0
        for p in opt.fp16_groups[i]:
            size = p.partition_numel()
            n = min(size, p.ds_numel - rank * size)
            if n > 0:
                out.append((p, rank * size, start, n))
            start += size
        return out

    def gather_device_shards(self):
        # DeepSpeed's own path after a step, without the fp32 -> 16-bit copy: the parameters'
        # partitions point into the flat buffers again, then persistent parameters re-gather.
        opt = self.optimizer
        opt.checkpoint_event_prologue()
        for i in range(self._count()):
            if opt.fp16_partitioned_groups_flat[i] is not None:   # (else on NVMe: the next fetch reads it)
                opt._unflatten_partitioned_parameters(i)
        opt.checkpoint_event_epilogue()

    def partition_all(self) -> None:
        """Every gathered parameter back to its partition (DeepSpeed's prologue to a checkpoint or a
        step): a swapped-in partition is released first, so what ``write_swapped_shard`` writes to
        NVMe is what the next fetch reads."""
        self.optimizer.checkpoint_event_prologue()


class SwappedShards:
    """The 16-bit partitions ZeRO 3 keeps on NVMe (``offload_param: nvme`` past ``max_in_cpu``:
    ``MasterAccess.shard_swapped``) as a device-side Predict step reads and writes them: a
    sub-group's partition comes from the drive into one host buffer, as long as the largest such
    partition and kept from step to step, and goes back through DeepSpeed's own swap-out (2 bytes a
    parameter each way in bf16; the masters and the Adam state are not swapped for it)."""

    def __init__(self, access: MasterAccess):
        self.access = access
        self._flat: torch.Tensor | None = None

    def swapped(self, i: int) -> bool:
        return self.access.shard_swapped(i)

    def release(self, indices: Iterable[int]) -> list[bool]:
        """Before writes to partitions ``indices``: every gathered parameter back to its partition
        where one of them is on NVMe (a partition still swapped in would be released unwritten over
        what was written). Returns whether each is on NVMe."""
        swapped = [self.swapped(i) for i in indices]
        if any(swapped):
            self.access.partition_all()
        return swapped

    def read(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s partition in the host buffer (valid until the next ``read``)."""
        n, dtype = self.access.numel(i), self.access.optimizer.dtype   # (DeepSpeed's 16-bit dtype)
        if self._flat is None or self._flat.numel() < n or self._flat.dtype != dtype:
            self._flat = torch.empty(n, dtype=dtype)
        flat = self._flat[:n]
        self.access.read_swapped_shard(i, flat)
        return flat

    def write(self, i: int, flat: torch.Tensor) -> None:
        """``flat`` (the partition's length and dtype) as sub-group ``i``'s partition on NVMe
        (after ``release``)."""
        self.access.write_swapped_shard(i, flat)

    @contextlib.contextmanager
    def held(self, i: int) -> Iterator[torch.Tensor]:
        """Partition ``i`` read into the buffer to be moved in place, written back after."""
        flat = self.read(i)
        yield flat
        self.write(i, flat)

    def stand_in(self, i: int) -> torch.Tensor:
        """What a pass that only sizes or places tensors by the partition sees of a swapped one:
        its length, dtype and device (host memory) and no values (an expanded scalar: a write to it
        raises)."""
        return torch.empty((), dtype=self.access.optimizer.dtype).expand(self.access.numel(i))

    def buffer_bytes(self) -> int:
        """Bytes of the host buffer (0 before the first read)."""
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()


class StepJobs:
    """One owner's work on each sub-group inside DeepSpeed's next ZeRO 3 step under
    ZeRO-Infinity's NVMe swap (``access.swaps``), while DeepSpeed has the sub-group swapped in.

    ``jobs`` run just before a sub-group's Adam step (``_optimizer_step``): a kept run's commit
    into the masters makes there the same additions on the same values as a commit of its own,
    which would swap every sub-group in and out once more beside the step's own swap. ``after``
    jobs run just after it, before DeepSpeed copies the sub-group into the 16-bit weights and
    swaps it out: a real step's fold (``swap_fold.py``), which would otherwise swap every
    sub-group in again to read the masters and moments the step left.

    The owners of one optimizer share one wrapper of its ``_optimizer_step``: every owner's
    ``jobs`` run, ``late`` owners' last (the fold's copy of a sub-group before its step comes
    after a commit's additions, so that it folds the step's own move), then DeepSpeed's step,
    then every owner's ``after`` jobs. What a step does not reach (a skipped step: the
    non-finite guard, an overflow): ``jobs`` run at ``settle``, which the owner calls when the
    real step ends and before anything else reads the masters; ``after`` jobs are dropped by
    ``finish_after``, which says whether the step took them."""

    def __init__(self, access: MasterAccess, late: bool = False) -> None:
        self.access = access
        self.late = late
        self.jobs: dict = {}    # sub-group index -> job(part), before its Adam step
        self.after: dict = {}   # sub-group index -> job(part), after it
        self.ran: set[int] = set()   # the sub-groups whose after job the step ran
        self._hooked = False

    def defer(self, jobs: dict, after: "dict | None" = None) -> None:
        """Each ``jobs[i](part)`` runs in DeepSpeed's next step before sub-group ``i``'s Adam step,
        each ``after[i](part)`` after it (the caller has settled or dropped any earlier ones)."""
        self.jobs, self.after, self.ran = jobs, dict(after or {}), set()
        if not self._hooked:
            owners = _sub_group_owners(self.access.optimizer)
            owners.append(self)
            owners.sort(key=lambda owner: owner.late)   # (stable: the others in the order they came)
            self._hooked = True

    def settle(self) -> None:
        """The ``jobs`` no step has taken, now (each sub-group swapped in for its own)."""
        jobs, self.jobs = self.jobs, {}
        if not jobs:
            return
        for i, part in enumerate(self.access.partitions()):
            job = jobs.get(i)
            if job is not None:
                job(part)

    def finish_after(self, key: str) -> bool:
        """After the step: whether it ran this owner's ``after`` jobs (False: none, a skipped step).
        A ZeRO 3 step steps every sub-group or none: one that ran some and left others raises,
        naming ``memory.<key>``. What is left (and any ``jobs``) is dropped."""
        left, ran = self.after, self.ran
        self.jobs, self.after, self.ran = {}, {}, set()
        if not ran:
            return False
        missed = [i for i in left if self.access.numel(i)]
        if missed:
            raise RuntimeError(f"ds_hybrid: hybrid_predict.memory.{key}: DeepSpeed's ZeRO 3 step stepped sub-groups "
                               f"{sorted(ran)} and not {missed}; set memory.{key} to false and report it")
        return True


def _sub_group_owners(opt: Any) -> list:
    """The ``StepJobs`` sharing ``opt``'s wrapped ``_optimizer_step`` (wrapped on first use)."""
    owners = getattr(opt, "_ds_hybrid_step_jobs", None)
    if owners is not None:
        return owners
    owners = []
    inner = opt._optimizer_step

    def sub_group_step(sub_group_id, *args, **kwargs):
        for owner in owners:
            job = owner.jobs.pop(sub_group_id, None)
            if job is not None:
                job(owner.access.partition(sub_group_id))
        out = inner(sub_group_id, *args, **kwargs)
        for owner in owners:
            job = owner.after.pop(sub_group_id, None)
            if job is not None:
                job(owner.access.partition(sub_group_id))
                owner.ran.add(sub_group_id)
        return out
    opt._optimizer_step = sub_group_step   # (on the instance, once per optimizer)
    opt._ds_hybrid_step_jobs = owners
    return owners


def master_access(engine: Any) -> MasterAccess:
    """Pick the accessor for ``engine.optimizer`` (a DeepSpeed engine after init)."""
    opt = engine.optimizer
    name = type(opt).__name__
    if name == "DeepSpeedZeroOptimizer_Stage3":
        return _Zero3Access(opt)
    if name == "DeepSpeedZeroOptimizer":
        return _Zero12Access(opt)
    if name == "BF16_Optimizer":
        return _BF16OptimizerAccess(opt)
    if name == "FP16_Optimizer":
        return _FP16OptimizerAccess(opt)
    if name == "FP16_UnfusedOptimizer":
        return _FP16UnfusedAccess(opt)
    if isinstance(opt, torch.optim.Optimizer):
        return _PlainAccess(opt)
    raise TypeError(f"ds_hybrid: unsupported optimizer wrapper {name}; Predict steps need an Adam-family "
                    f"optimizer under ZeRO 0-3 (set hybrid_predict.enabled to false to train without them)")


def _is_adamw(opt: torch.optim.Optimizer) -> bool:
    if isinstance(opt, torch.optim.AdamW):
        return True
    for attr in ("adam_w_mode", "adamw_mode"):  # FusedAdam, DeepSpeedCPUAdam
        if hasattr(opt, attr):
            return bool(getattr(opt, attr))
    return False


def is_adam_family(engine: Any) -> bool:
    """True when the engine's base optimizer keeps Adam moments the predictor can read."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    name = type(base).__name__.lower()
    return isinstance(base, (torch.optim.Adam, torch.optim.AdamW)) or "adam" in name


# ---------------------------------------------------------------------------
# Arithmetic on top of MasterAccess: written once for every stage.
# ---------------------------------------------------------------------------

@torch.no_grad()
def adam_direction(part: MasterPartition) -> torch.Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` (a new tensor).

    This is the direction the optimizer's next step would take if the gradient
    did not change; it costs no gradient and no extra memory between steps.
    """
    out = torch.empty_like(part.state["exp_avg"])
    flat = _flat(out)
    for s, e, d in _adam_direction_chunks(part):
        flat[s:e].copy_(d)
    return out


def _adam_direction_chunks(part: MasterPartition):
    """``adam_direction(part)`` a chunk at a time: yields ``(start, end, direction chunk)``, the
    chunk in a reused work buffer (valid until the next one), without two partition-sized
    temporaries (seconds of allocation and page faults on a host partition). The same
    operations per element as ``kernels.fused_update_reference``."""
    from .kernels import _bias_corrections
    from .quant import CHUNK, scratch
    st, g = part.state, part.group
    beta1, beta2 = g.get("betas", (0.9, 0.999))
    eps = g.get("eps", 1e-8)
    bc1, bc2 = _bias_corrections(beta1, beta2, part.step, g.get("bias_correction", True))
    m, v = _flat(st["exp_avg"]), _flat(st["exp_avg_sq"])
    w0, w1 = scratch(m.device, 0, m.numel()), scratch(m.device, 1, m.numel())
    for s in range(0, m.numel(), CHUNK):
        e = min(s + CHUNK, m.numel())
        denom = torch.div(v[s:e], bc2, out=w0[:e - s]).sqrt_().add_(eps)
        yield s, e, torch.div(m[s:e], bc1, out=w1[:e - s]).div_(denom)


class PartitionBuffers:
    """One fp32 buffer per master partition: the rollback snapshot, and between
    Predict runs the previous Adam direction for the predicted-vs-actual comparison.

    Memory cost: one fp32 copy of this rank's master partition (4 bytes per
    parameter / data-parallel world size on ZeRO 1-3), on ``device`` ("same" or "cpu").
    """

    def __init__(self, device: str = "same"):
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.holds: str | None = None  # "weights" | "direction" | None

    def _buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0))
        buf = self.buffers[i]
        dev = like.device if self.device == "same" else torch.device("cpu")
        if buf.numel() != like.numel() or buf.device != dev:
            buf = torch.empty(like.shape, dtype=torch.float32, device=dev,
                              pin_memory=(dev.type == "cpu" and like.device.type == "cuda"))
            self.buffers[i] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


@torch.no_grad()
def capture_weights(access: MasterAccess, bufs: PartitionBuffers, groups: "set[int] | None" = None) -> None:
    """Snapshot the master partitions (the last good point for a rollback), of every
    param group or only of ``groups``."""
    for i, part in enumerate(access.partitions()):
        if groups is None or part.group_index in groups:
            bufs._buffer(i, part.master).copy_(part.master, non_blocking=True)
    bufs.holds = "weights"


@torch.no_grad()
def capture_shards(access: MasterAccess, bufs: PartitionBuffers) -> None:
    """Copy the 16-bit shards DeepSpeed's step is about to write (``device_shard``), each in its
    own dtype and on its own device, into ``bufs`` (``memory.fold_source: weights16``: the real
    step's update is their difference after the step). A buffer is reused where it matches."""
    for i in range(access._count()):
        shard = access.device_shard(i)
        while len(bufs.buffers) <= i:
            bufs.buffers.append(torch.empty(0))
        if shard is None:
            continue
        buf = bufs.buffers[i]
        if buf.shape != shard.shape or buf.dtype != shard.dtype or buf.device != shard.device:
            buf = bufs.buffers[i] = torch.empty_like(shard)
        buf.copy_(shard)
    bufs.holds = "shards"


@torch.no_grad()
def restore_weights(access: MasterAccess, bufs: PartitionBuffers, groups: "set[int] | None" = None) -> None:
    """Copy the snapshot back into the masters (of every param group, or of ``groups``) and
    propagate: an exact rollback."""
    assert bufs.holds == "weights", "restore_weights needs a weight snapshot"
    for i, part in enumerate(access.partitions()):
        if groups is None or part.group_index in groups:
            part.master.copy_(bufs.buffers[i])
    access.lp_current = False   # the 16-bit copies hold the update: propagate must copy
    access.propagate()  # a collective on ZeRO 1-3: every rank rolls back together


def _scale_of(scale: "float | Sequence[float]", gi: int) -> float:
    return float(scale) if isinstance(scale, (int, float)) else float(scale[gi])


@torch.no_grad()
def apply_predicted_update(access: MasterAccess, scale: "float | Sequence[float]", backend: str = "torch",
                           first_moments: "Sequence[torch.Tensor] | None" = None,
                           second_moments: "Sequence[torch.Tensor | None] | None" = None,
                           lr_scale: float = 1.0) -> float:
    """Add ``-scale * lr * adam_direction`` (plus AdamW's decoupled decay) to the masters.

    ``scale`` is one number, or one per layer group (optimizer param group); a
    group with scale 0 is left untouched, decay included. ``backend`` is
    ``hybrid_predict.kernels``: the one-pass CUDA kernel (``kernels/fused_update.cu``)
    on GPU partitions, or its torch reference, which is bit-identical to
    ``adam_direction`` + add on the same device. Returns the squared norm of the
    applied update on this rank. The caller propagates to the model parameters.
    ``first_moments``: one tensor per partition that stands in for the optimizer's ``exp_avg``
    (``predictor.direction: gradient``, whose Predict run keeps its own); ``second_moments`` the
    same for ``exp_avg_sq`` (``predictor.gradient_second_moment: updated``). ``lr_scale``: the
    share of the group's LR the step takes, its decay included (``predictor.gradient_lr_scale``).
    """
    from . import kernels
    sq = []
    wrote_lp = True
    for i, part in enumerate(access.partitions()):
        if part.master.numel() == 0 or "exp_avg" not in part.state:
            continue
        s = _scale_of(scale, part.group_index)
        if s == 0.0:
            continue
        if part.step < 1:
            raise RuntimeError("ds_hybrid: the optimizer state has no step count; a Predict step needs at "
                               "least one real optimizer step first (hybrid_predict.warmup_steps >= 1)")
        g = part.group
        beta1, beta2 = g.get("betas", (0.9, 0.999))
        m = part.state["exp_avg"] if first_moments is None else first_moments[i]
        v = part.state["exp_avg_sq"] if second_moments is None else second_moments[i]
        sq.append(kernels.fused_update(
            part.master, m, v, lr=float(g["lr"]) * lr_scale, scale=s,
            beta1=beta1, beta2=beta2, eps=g.get("eps", 1e-8), step=part.step,
            weight_decay=float(g.get("weight_decay", 0.0)), decoupled=access.decoupled_decay,
            bias_correction=g.get("bias_correction", True), compute_sq=True, backend=backend,
            lp_out=part.lp))   # the model's 16-bit copy in the same pass, where it can be written
        wrote_lp = wrote_lp and part.lp is not None
    access.lp_current = wrote_lp  # propagate then only gathers
    return sum(float(x) for x in sq)  # one host sync per step, after every partition is queued


@torch.no_grad()
def stash_direction(access: MasterAccess, bufs: PartitionBuffers) -> None:
    """Keep the current Adam direction, to compare with the next real step's."""
    for i, part in enumerate(access.partitions()):
        if "exp_avg" in part.state:
            buf = _flat(bufs._buffer(i, part.master))
            for s, e, d in _adam_direction_chunks(part):
                buf[s:e].copy_(d)
    bufs.holds = "direction"


# Columns of compare_direction's per-group sums.
DIRECTION_STATS = ("dot", "old_sq", "new_sq", "master_sq", "m_abs", "v_sqrt", "numel")


@torch.no_grad()
def compare_direction(access: MasterAccess, bufs: PartitionBuffers) -> torch.Tensor:
    """Per-layer-group sums for the predicted-vs-actual comparison after a real step.

    Returns float64 ``[num_groups, 7]`` with the columns of ``DIRECTION_STATS``:
    ``<d_new, d_old>``, ``|d_old|^2``, ``|d_new|^2`` (the stashed Adam direction
    against the one after the step), ``|master|^2``, ``sum |m|``, ``sum sqrt(v)``
    and the element count, over this rank's partitions. The caller all-reduces
    them (sums, so ranks holding shards agree) and derives per group the
    projection ``<d_new, d_old> / |d_old|^2`` (how far the next real step goes
    along the stashed direction), the cosine and the moment summaries.
    """
    out = torch.zeros(access.num_groups(), len(DIRECTION_STATS), dtype=torch.float64)
    if bufs.holds != "direction":
        return out
    for i, part in enumerate(access.partitions()):
        if "exp_avg" not in part.state or i >= len(bufs.buffers) or part.master.numel() == 0:
            continue
        old_all, master = _flat(bufs.buffers[i]), _flat(part.master)
        row = out[part.group_index]
        # fp32 dots per chunk (pairwise), summed in fp64 on the device: no fp64 copies of the partition
        sums = torch.zeros(4, dtype=torch.float64, device=master.device)
        for s, e, new in _adam_direction_chunks(part):
            old = old_all[s:e].to(new.device, non_blocking=True)
            w = master[s:e]
            sums += torch.stack([torch.dot(new, old), torch.dot(old, old), torch.dot(new, new), torch.dot(w, w)])
        for col, val in enumerate(sums.tolist()):
            row[col] += val
        row[4] += _chunked_sum(part.state["exp_avg"], torch.abs)
        row[5] += _chunked_sum(part.state["exp_avg_sq"], torch.sqrt)
        row[6] += float(part.master.numel())
    bufs.holds = None
    return out


# ---------------------------------------------------------------------------
# The drift direction: a running average of the real updates.
# ---------------------------------------------------------------------------

class VelocityBuffers:
    """Per master partition, the exponential average of the real steps' updates per unit
    learning rate, ``v <- beta * v + (1 - beta) * (w_after - w_before) / lr``: where the
    weights have been going, with the step-to-step oscillation averaged out. Stored as
    fp32, bf16 or int8 (``quant.CompactBuffer``); 4, 2 or ~1 bytes per parameter of the
    rank's partition, on the masters' device."""

    def __init__(self, dtype: str = "fp32", seed: int = 0):
        self.dtype, self.seed = dtype, seed
        self.buffers: list = []
        self.updates = 0  # real updates folded in so far
        # memory.fold_source: weights16: the buffers live beside the 16-bit shards (on a GPU under
        # ZeRO-Offload), not beside the masters
        self.beside_shards = False
        # host buffers in page-locked memory (the engine sets it where a GPU reads them: the device
        # path's once-per-run upload is then a DMA; measured pageable on an H200: 44 ms a Predict step)
        self.pin = False

    def buffer(self, i: int, like: torch.Tensor):
        from .quant import CompactBuffer
        while len(self.buffers) <= i:
            self.buffers.append(None)
        buf = self.buffers[i]
        if buf is None or buf.numel != like.numel() or buf.device != like.device:
            buf = CompactBuffer(like.numel(), self.dtype, like.device,
                                pin=self.pin and like.device.type == "cpu" and torch.cuda.is_available())
            self.buffers[i] = buf
        return buf

    def generator(self, device: torch.device, step: int, i: int) -> torch.Generator | None:
        """int8 stochastic rounding: a generator seeded by (seed, step, partition), the same
        on a rerun and after a resume."""
        if self.dtype != "int8":
            return None
        return torch.Generator(device=device).manual_seed(self._draw(step, i))

    def noise_key(self, step: int, i: int) -> int:
        """The same (seed, step, partition) as a uint32 key, for the shard fold's kernel, whose
        int8 noise is a hash of (key, index) (``kernels.shard_fold``)."""
        return self._draw(step, i) & 0xFFFFFFFF

    def _draw(self, step: int, i: int) -> int:
        return (self.seed * 1_000_003 + step) * 1009 + i

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.buffers if b is not None)

    def state_dict(self) -> dict:
        return {"dtype": self.dtype, "updates": self.updates,
                "buffers": [None if b is None else b.state_dict() for b in self.buffers]}

    def load_state_dict(self, sd: dict, access: "MasterAccess") -> None:
        if sd["dtype"] != self.dtype:
            raise ValueError(f"the checkpoint's drift velocity is {sd['dtype']}, this run's "
                             f"hybrid_predict.memory.velocity_dtype is {self.dtype}")
        self.updates = sd["updates"]
        saved_buffers = sd["buffers"]
        # (each partition while it is in use: under NVMe swap a listed master is empty past its turn)
        for i, part in enumerate(access.partitions()):
            if i >= len(saved_buffers) or saved_buffers[i] is None:
                continue
            like = access.device_shard(i) if self.beside_shards else part.master
            self.buffer(i, like).load_state_dict(saved_buffers[i])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)  # masters are contiguous (flat partitions, or parameters on ZeRO 0)


def _chunked_sum(t: torch.Tensor, fn) -> float:
    """sum fn(t) with one CHUNK-sized fp32 transient at a time: an fp64 copy of 1B moments is
    8 GB and seconds on a CPU. torch.sum accumulates each chunk pairwise (accurate in fp32);
    the chunks add up in an fp64 scalar on the tensor's device, read once at the end.
    (torch.linalg.vector_norm(ord=1) accumulates serially on the CPU: 5% low over 50M values;
    sum(dtype=float64) is 4-8x slower there.)"""
    from .quant import CHUNK, scratch
    flat = _flat(t)
    work = scratch(flat.device, 0, flat.numel())   # fn writes here: no 16 MiB allocation (page faults on a CPU) per chunk
    total = torch.zeros((), dtype=torch.float64, device=flat.device)   # one host sync at the end, not per chunk
    for s in range(0, flat.numel(), CHUNK):
        x, w = flat[s:s + CHUNK], work[:min(CHUNK, flat.numel() - s)]
        if x.dtype != torch.float32:   # 16-bit moments: to fp32 in the work buffer first
            x = w.copy_(x)
        total += fn(x, out=w).sum()
    return float(total)


@torch.no_grad()
def fold_real_update(access: MasterAccess, before: PartitionBuffers | None, vel: VelocityBuffers,
                     lrs: Sequence[float], beta: float, step: int, groups: "set[int] | None" = None,
                     keep: bool = False, moments: bool = True, host_kernel: bool = False,
                     parts: "list[MasterPartition] | None" = None, only: "set[int] | None" = None,
                     count: bool = True, shards: bool = False, backend: str = "torch",
                     pairs: "list[tuple[int, MasterPartition]] | None" = None) -> torch.Tensor:
    """After a real step: fold its update per unit LR into the velocity, and return the
    per-group sums of ``DIRECTION_STATS`` comparing it with the velocity before the fold
    (``old`` = the direction a Predict step would have taken, ``new`` = the real update
    per unit LR). ``before`` holds the masters from before the step (``capture_weights``);
    ``lrs`` the LR of each param group in that step. ``groups``: fold only these param groups
    (a layer-group Predict step's real ones); ``keep``: leave ``before`` marked as a weight
    snapshot (it is the predicted groups' rollback point). ``moments=False`` leaves the
    columns only the layer-group planner and the dynamics encoder read (``master_sq``,
    ``m_abs``, ``v_sqrt``) at 0: three passes over the masters and the Adam state saved, which
    is about half the fold's time (the whole-model predictor reads ``dot``, ``old_sq`` and
    ``new_sq`` only).

    ``before=None`` (``memory.fold_source: optimizer_state``): no pre-step copy of the masters;
    the step's update is read back from what the Adam step left, its moments and the weights
    after it: ``w_after - w_before = -lr (a + wd w_before)`` with ``a = m_hat / (sqrt(v_hat) +
    eps)`` and, with decoupled decay, ``w_before = (w_after + lr a) / (1 - lr wd)`` (with L2 decay
    the decay is in the gradient, so in ``a``). Equal to the copy's difference up to fp32
    rounding (``tests/test_device_predict.py`` measures how close).

    ``host_kernel`` (``memory.host_kernels``): partitions in host memory are folded by the C++
    kernel of ``ds_hybrid/host_kernels.py`` in one pass, with this function's arithmetic and
    int8 noise (``tests/test_host_kernels.py``).

    ``parts``: ``access.partitions()`` listed beforehand (a fold on a host thread reads
    DeepSpeed's optimizer structures on the main thread, ``fold_overlap.py``). ``only``: fold
    only these partitions (by index); ``count=False``: leave ``vel.updates`` to the caller (both
    for ``memory.fold_in_step``, which folds the others inside the optimizer step). ``pairs``:
    fold these partitions, each with its index (one sub-group inside DeepSpeed's step under NVMe
    swap, ``swap_fold.py``).

    ``shards`` (``memory.fold_source: weights16``): the update is the difference of the 16-bit
    shards (``access.device_shard``) after the step and ``before`` (``capture_shards``), taken
    in fp32 on the shards' device, where the velocity then lives too; the moment columns still
    read the optimizer's state. ``backend`` (``hybrid_predict.kernels``): a shard on a GPU is
    folded by one kernel a partition (``kernels.shard_fold``: its int8 noise a hash of
    (``VelocityBuffers.noise_key``, index) instead of the generator's draws, its sums fp64) where
    it resolves to CuPy; elsewhere by the torch ops below."""
    out = torch.zeros(access.num_groups(), len(DIRECTION_STATS), dtype=torch.float64)
    from_state = before is None
    if not from_state and before.holds != ("shards" if shards else "weights"):
        return out
    from .quant import scratch
    first, folded = vel.updates == 0, False
    for i, part in pairs if pairs is not None else enumerate(access.partitions() if parts is None else parts):
        lr = float(lrs[part.group_index])
        if part.master.numel() == 0 or lr <= 0 or (not from_state and i >= len(before.buffers)):
            continue
        if from_state and "exp_avg" not in part.state:
            continue
        if groups is not None and part.group_index not in groups:
            continue
        if only is not None and i not in only:
            continue
        folded = True
        master = _flat(access.device_shard(i) if shards else part.master)
        buf = vel.buffer(i, master)
        gen = vel.generator(master.device, step, i)
        row = out[part.group_index]
        if shards and _shard_fold_kernel(backend, master):
            from . import kernels
            sums = kernels.shard_fold(master, _flat(before.buffers[i]), buf, lr=lr, beta=beta, first=first,
                                      key=vel.noise_key(step, i), moments=moments, backend=backend)
            _add_fold_sums(row, sums, lr, access, part, moments)
            continue
        if host_kernel and not shards and master.device.type == "cpu" and master.is_contiguous():
            _fold_on_host(access, part, master, None if from_state else _flat(before.buffers[i]), buf, gen, lr,
                          beta, first, moments, row)
            continue
        # Reused work buffers (no 16 MiB allocation per chunk) and the sums kept on the
        # masters' device, read once per partition (not one sync per chunk on a GPU).
        # (_adam_direction_chunks works in slots 0 and 1.)
        slots = (2, 3) if from_state else (0, 1)
        d_work, v_work = (scratch(master.device, k, master.numel()) for k in slots)
        if from_state:
            directions = _adam_direction_chunks(part)
            wd = float(part.group.get("weight_decay", 0.0) or 0.0) if access.decoupled_decay else 0.0
        else:
            old_w = _flat(before.buffers[i])
        sums = torch.zeros(4, dtype=torch.float64, device=master.device)
        for s, e in buf.chunks():
            w = master[s:e]
            # d = lr * delta (the update itself); the 1/lr goes into the sums and the fold below,
            # which saves a pass over the chunk.
            d = d_work[:e - s]
            if from_state:
                a0, _, a = next(directions)   # the same CHUNK boundaries as buf.chunks()
                assert a0 == s
                if wd:   # (w + lr a) (-lr wd / (1 - lr wd)) - lr a = -lr (a + wd w_before)
                    torch.add(w, a, alpha=lr, out=d).mul_(-lr * wd / (1.0 - lr * wd)).sub_(a, alpha=lr)
                else:
                    torch.mul(a, -lr, out=d)
            elif shards:   # (widened first: a difference taken in 16 bits would round)
                d.copy_(w).sub_(old_w[s:e])
            else:
                torch.sub(w, old_w[s:e].to(w.device, non_blocking=True), out=d)
            # fp32 views of the stored velocity are updated in place; bf16 / int8 go through a copy.
            v_old = buf.data[s:e] if buf.dtype == "fp32" else buf.load(s, e, out=v_work)
            # Statistics in fp32 (torch's reductions accumulate pairwise): 4 passes, no fp64 copies.
            sums[:3] += torch.stack([torch.dot(d, v_old), torch.dot(v_old, v_old), torch.dot(d, d)])
            if moments:
                w32 = w if w.dtype == torch.float32 else scratch(master.device, 4, master.numel())[:e - s].copy_(w)
                sums[3] += torch.dot(w32, w32)
            if first:
                torch.mul(d, 1.0 / lr, out=v_old)
            else:
                v_old.mul_(beta).add_(d, alpha=(1.0 - beta) / lr)
            if buf.dtype != "fp32":
                buf.store(v_old, s, gen, clobber=True)
        _add_fold_sums(row, sums, lr, access, part, moments)
    vel.updates += int(folded and count)  # an LR of 0 (the first warmup step) moves nothing to learn from
    if not keep and not from_state:
        before.holds = None
    return out


def _shard_fold_kernel(backend: str, shard: torch.Tensor) -> bool:
    """The fold from the shards takes ``kernels.shard_fold``'s kernel for this shard: on a GPU,
    where ``hybrid_predict.kernels`` resolves to CuPy (``cupy`` without it raises, naming the key)."""
    if backend == "torch" or shard.device.type != "cuda":
        return False
    from . import kernels
    return kernels.resolve_backend(backend, shard) == "cupy"


def _add_fold_sums(row: torch.Tensor, sums: torch.Tensor, lr: float, access: MasterAccess, part: MasterPartition,
                   moments: bool) -> None:
    """A partition's fold sums (``d . v``, ``v . v``, ``d . d`` with ``d`` lr times the update,
    ``w . w``; on the fold's device, read once) into its group's ``DIRECTION_STATS`` row, with
    the moment columns read from the optimizer's state."""
    sums = sums * torch.tensor([1.0 / lr, 1.0, 1.0 / lr ** 2, 1.0], dtype=torch.float64, device=sums.device)
    for col, val in enumerate(sums.tolist()):
        row[col] += val
    if moments and "exp_avg" in part.state:
        row[4] += _chunked_sum(part.state["exp_avg"], torch.abs)
        row[5] += _chunked_sum(part.state["exp_avg_sq"], torch.sqrt)
    row[6] += float(part.master.numel())


def _fold_on_host(access: MasterAccess, part: MasterPartition, master: torch.Tensor, before: torch.Tensor | None,
                  buf, gen, lr: float, beta: float, first: bool, moments: bool, row: torch.Tensor) -> None:
    """``fold_real_update`` for one partition in host memory, by the C++ kernel: the same
    velocity (the int8 noise drawn here, chunk by chunk as the torch path draws it) and sums."""
    from . import host_kernels
    from .kernels import _bias_corrections
    from .quant import BLOCK, CHUNK, _cpu_noise
    st, g = part.state, part.group
    has_moments = "exp_avg" in st
    m = _flat(st["exp_avg"]) if has_moments and (before is None or moments) else None
    v2 = _flat(st["exp_avg_sq"]) if m is not None else None
    bc1 = bc2 = 1.0
    if before is None:
        beta1, beta2 = g.get("betas", (0.9, 0.999))
        bc1, bc2 = _bias_corrections(beta1, beta2, part.step, g.get("bias_correction", True))
    wd = float(g.get("weight_decay", 0.0) or 0.0) if access.decoupled_decay else 0.0
    noise = [_cpu_noise(-(-(e - s) // BLOCK) * BLOCK, gen) for s, e in buf.chunks()] if buf.dtype == "int8" else []
    dv, vv, dd, ww, m_abs, v_sqrt = host_kernels.fold(master, m, v2, before, buf, noise, CHUNK, lr, wd, beta, bc1,
                                                      bc2, g.get("eps", 1e-8), first, moments)
    row[0] += dv / lr
    row[1] += vv
    row[2] += dd / lr ** 2
    if moments:
        row[3] += ww
        if has_moments:
            row[4] += m_abs
            row[5] += v_sqrt
    row[6] += float(part.master.numel())


@torch.no_grad()
def apply_velocity_update(access: MasterAccess, vel: VelocityBuffers, scale: "float | Sequence[float]",
                          host_kernel: bool = False) -> float:
    """Add ``scale * lr * velocity`` to the masters (per layer group; the velocity already
    holds the weight decay and clipping of the real steps it averages). Returns the
    squared norm of the update on this rank. The caller propagates.

    ``host_kernel`` (``memory.host_kernels``): masters in host memory take the update in one
    C++ pass (``host_kernels.shift``), bit for bit the torch ops' masters; the returned norm then
    sums in another order (within fp32 rounding)."""
    from .quant import scratch
    access.lp_current = False
    sq = []
    for i, part in enumerate(access.partitions()):
        s = _scale_of(scale, part.group_index)
        if part.master.numel() == 0 or s == 0.0 or i >= len(vel.buffers) or vel.buffers[i] is None:
            continue
        coef = s * float(part.group["lr"])
        master, buf = _flat(part.master), vel.buffers[i]
        if host_kernel and master.device.type == "cpu" and master.is_contiguous():
            from . import host_kernels
            sq.append(host_kernels.shift(master, buf, [coef], sumsq=True) * coef * coef)
            continue
        work = scratch(master.device, 0, master.numel())
        vv = torch.zeros((), dtype=torch.float64, device=master.device)
        for a, b in buf.chunks():
            v = buf.data[a:b] if buf.dtype == "fp32" else buf.load(a, b, out=work)
            vv += torch.dot(v, v)                 # |coef v|^2 = coef^2 |v|^2: no scaled copy
            master[a:b].add_(v, alpha=coef)       # one pass over the master chunk
        sq.append(vv * coef * coef)
    return sum(float(x) for x in sq)


# ---------------------------------------------------------------------------
# Phase-aware memory: the Adam moments leave the accelerator during Predict runs.
# ---------------------------------------------------------------------------

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class MomentParking:
    """Moves the Adam moments to host memory for a Predict run and back before the next
    real step (a drift Predict step does not read them). Modes:

    * ``stream`` (a CUDA device, ``memory.park_overlap``): ds_hybrid's own copies on a side
      CUDA stream. The copy out is queued after the last real step's work and runs under the
      Predict run's forwards; its device memory returns to the allocator when the copy is
      done (``record_stream``). The copy back is queued when the run ends and only the next
      optimizer step waits for it (``wait``): it overlaps the next real step's forward and
      backward, and no Predict step holds the moments while they come back. (Queuing it
      during the run's last verification was measured too: the same speed, but that step's
      peak held the moments again.)
    * ``deepspeed`` (``park_overlap: false``; ZeRO 1/2, and ZeRO 3 with FusedAdam): DeepSpeed's
      own ``engine.offload_states(include=[optim_states])`` / ``reload_states()``, which keep
      a pinned host copy and know their optimizer's buffers. Synchronous; it also empties the
      CUDA cache (so the device's reserved memory drops too).
    * ``own`` (elsewhere: ZeRO 0 wrappers, ZeRO 3 with another Adam): ds_hybrid moves the
      state tensors itself on the current stream (``tensor.data`` swapped to a pinned host
      copy kept here, so ``optimizer.state`` and checkpoints never see it).
    * ``host``: the moments are already in CPU memory (``offload_optimizer``, or a CPU
      accelerator): nothing moves.
    """

    def __init__(self, engine: Any, access: MasterAccess, mode: str | None = None, overlap: bool = True):
        self.engine, self.access, self.overlap = engine, access, overlap
        self.parked = False
        self._host: dict[int, torch.Tensor] = {}     # own/stream: pinned host copy per moment tensor
        self._devices: dict[int, torch.device] = {}  # ... and the device it came from
        self.mode = mode  # chosen at the first park: the moments exist only after a real step
        self._side: Any = None                        # stream mode: the side CUDA stream
        self._incoming: dict[int, torch.Tensor] = {}  # stream mode: device copies being filled
        self._back: Any = None                        # ... the event that marks them complete
        self._pending: Any = None                     # the event the next optimizer step waits for

    def _choose_mode(self) -> str:
        devices = {part.state[k].device.type for part in self.access.partitions() for k in MOMENT_KEYS
                   if k in part.state}
        if getattr(self.engine, "zero_cpu_offload", lambda: False)() or devices <= {"cpu"}:
            return "host"  # already in CPU memory (or no accelerator): moving them would only cost
        if self.overlap and devices == {"cuda"}:
            return "stream"
        opt = self.engine.optimizer
        name = type(opt).__name__
        offload = self.engine.zero_offload_param()
        param_offloaded = offload is not None and getattr(offload.device, "value", offload.device) != "none"
        if name == "DeepSpeedZeroOptimizer" and not param_offloaded:
            return "deepspeed"
        if name == "DeepSpeedZeroOptimizer_Stage3" and not param_offloaded:
            from deepspeed.ops.adam import FusedAdam
            if type(self.access.base) is FusedAdam:
                return "deepspeed"
        return "own"

    def _moments(self) -> Iterator[torch.Tensor]:
        for part in self.access.partitions():
            for k in MOMENT_KEYS:
                t = part.state.get(k)
                if t is not None:
                    yield t

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        host = self._host.get(id(t))
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self._host[id(t)] = host
        return host

    def park(self) -> None:
        if self.parked:
            # A new Predict run straight after the last one: device copies fetched for its end
            # are not needed yet (the host copies still hold the moments).
            self._incoming.clear()
            self._back = None
            return
        if self.mode is None:
            self.mode = self._choose_mode()
        if self.mode == "deepspeed":
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
            self.engine.offload_states(include=[OffloadStateTypeEnum.optim_states], pin_memory=True,
                                       non_blocking=True)
        elif self.mode == "stream":
            self.wait()   # (a reload still in flight is ordered before the copy out)
            if self._side is None:
                self._side = torch.cuda.Stream()
            self._side.wait_stream(torch.cuda.current_stream())   # the moments are final
            with torch.cuda.stream(self._side):
                self._copy_out(self._side)
        elif self.mode == "own":
            self._copy_out()
        self.parked = True

    def _copy_out(self, side: Any = None) -> None:
        """Each moment on a device into its pinned host copy (on the current stream), then
        ``t.data`` points at the host copy."""
        for t in self._moments():
            if t.device.type == "cpu":
                continue
            host = self._pinned(t)
            host.copy_(t, non_blocking=True)
            if side is not None:
                # Freed when t.data moves below, the device memory must not be reused before
                # the copy on the side stream has read it.
                t.data.record_stream(side)
            self._devices[id(t)] = t.device
            t.data = host

    def prefetch(self) -> None:
        """Stream mode: queue the copies back on the side stream (``unpark`` calls it; then it
        only swaps the tensors in). A no-op in the other modes."""
        if not self.parked or self.mode != "stream" or self._incoming:
            return
        with torch.cuda.stream(self._side):
            for t in self._moments():
                if id(t) in self._devices:
                    dev = torch.empty(t.shape, dtype=t.dtype, device=self._devices[id(t)])
                    dev.copy_(t.data, non_blocking=True)
                    self._incoming[id(t)] = dev
            self._back = self._side.record_event()

    def unpark(self, wait: bool = False) -> None:
        """Moments back on their device. In stream mode the next optimizer step waits for the
        copies (``wait``); ``wait=True`` makes the current stream wait now (a checkpoint)."""
        if not self.parked:
            return
        if self.mode == "deepspeed":
            self.engine.reload_states(non_blocking=False)
        elif self.mode == "stream":
            self.prefetch()
            for t in self._moments():
                dev = self._incoming.pop(id(t), None)
                if dev is not None:
                    self._devices.pop(id(t))
                    dev.record_stream(torch.cuda.current_stream())  # used on the main stream from now
                    t.data = dev
            self._pending, self._back = self._back, None
            if wait:
                self.wait()
        elif self.mode == "own":
            for t in self._moments():
                if id(t) in self._devices:
                    t.data = t.data.to(self._devices.pop(id(t)), non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        self.parked = False

    def wait(self) -> None:
        """Make the current stream wait for the copies back (before the optimizer reads the
        moments). A GPU-side wait: the host does not block."""
        if self._pending is not None:
            torch.cuda.current_stream().wait_event(self._pending)
            self._pending = None

    def device_bytes(self) -> int:
        """Bytes of Adam moments on an accelerator right now (0 while parked or on the host)."""
        return sum(part.state[k].numel() * part.state[k].element_size() for part in self.access.partitions()
                   for k in MOMENT_KEYS if k in part.state and part.state[k].device.type != "cpu")
