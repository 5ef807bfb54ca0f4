"""What DeepSpeed 0.19.8's checkpoint load leaves out under ZeRO 3 with ``offload_optimizer: nvme``.

DeepSpeed saves such a run's swap folder into the checkpoint (``offloaded_tensors/rank<r>``: each
sub-group's fp32 masters, ``exp_avg`` and ``exp_avg_sq``, one file each, named by the sub-group's
``ds_id``) and, at the load, copies those files back into the new engine's swap folder instead of
reading its ZeRO checkpoint files. The masters then load (the new engine's swapper reads its
master files by the same names), but its swapper does not know the moments' files: measured on
the CPU accelerator in a fresh process, the loaded optimizer holds no Adam state and no step
count, so its first step starts Adam afresh, and its param groups keep the fresh engine's LR for
that step (the scheduler's state writes its own only after the step). ``restore_adam_state``
gives each swapped sub-group its two moment files back (registered with DeepSpeed's swapper as its
own first step would), its step count and the param groups' settings from the ZeRO checkpoint
file DeepSpeed skipped; the next step then swaps them in.
A sub-group too small to swap stays in host memory, and DeepSpeed's load restores nothing of it:
its masters and moments come from that file too.

The files are named by parameter ids, which DeepSpeed numbers per process: where the checkpoint
holds no master file under this engine's ids (a second engine in the same process, another model),
DeepSpeed's copy loaded nothing into it; that is refused here, naming the file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")   # (CPU Adam's state tensors, in its state's order)


class NvmeResumeError(RuntimeError):
    """The checkpoint's NVMe files do not match this engine's sub-groups."""


def _zero_file(engine: Any, tag_dir: Path) -> Path:
    """This rank's ZeRO optimizer file in ``tag_dir``, by DeepSpeed's own name for it."""
    path = Path(engine._get_zero_ckpt_name(str(tag_dir.parent), tag_dir.name))
    if not path.is_file():
        raise NvmeResumeError(f"{path}: missing (this rank's ZeRO optimizer file: its Adam step counts)")
    return path


def needs_restore(engine: Any) -> bool:
    """ZeRO 3 with its optimizer swapped to NVMe: DeepSpeed's load leaves the Adam state out."""
    return bool(getattr(engine.optimizer, "swap_optimizer", False)) and engine.zero_optimization_stage() == 3


@torch.no_grad()
def restore_adam_state(engine: Any, tag_dir: Path) -> int:
    """After DeepSpeed's ``load_checkpoint`` of ``tag_dir``: register each swapped sub-group's moment
    files with DeepSpeed's optimizer swapper and set its step count. Returns the sub-groups
    restored. Raises ``NvmeResumeError`` where a file is missing (the ids differ, or the
    checkpoint was saved before the sub-group had Adam state)."""
    opt = engine.optimizer
    base = opt.optimizer
    swapper = opt.optimizer_swapper
    folder = Path(swapper.swap_folder)
    # (where DeepSpeed's save put this rank's swap files, as its load names the folder)
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    saved_files = tag_dir / "offloaded_tensors" / f"rank{dp_index_to_str(rank)}"
    zero_file = _zero_file(engine, tag_dir)
    saved = torch.load(zero_file, map_location="cpu", weights_only=False)
    states = saved["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    groups = saved["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    if len(groups) != len(base.param_groups):
        raise NvmeResumeError(f"{zero_file}: {len(groups)} optimizer param groups, this engine's "
                              f"{len(base.param_groups)}")
    for group, saved_group in zip(base.param_groups, groups):
        # (the LR, betas, ... the saved step took: the scheduler's state alone writes them only
        # after the next step, which would take the fresh engine's first LR)
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    flats = saved["optimizer_state_dict"]["fp32_flat_groups"]
    restored, in_memory = 0, []
    for i, master in enumerate(opt.fp32_partitioned_groups_flat):
        state = states.get(i, {})
        if not opt._swappable_optimizer_subgroup(i):
            # (a sub-group below the swapper's smallest tensor stays in host memory, and its masters
            # and moments are in the ZeRO file, which DeepSpeed's load skipped: read from there)
            if flats[i].numel() != master.numel():
                raise NvmeResumeError(f"{zero_file}: sub-group {i} holds "
                                      f"{flats[i].numel()} values, this engine's {master.numel()}")
            master.copy_(flats[i])
            if "step" in state:
                base.state[master] = {"step": state["step"], **{k: state[k].clone() for k in MOMENTS}}
            in_memory.append(i)
            restored += 1
            continue
        own = saved_files / f"{master.ds_id}.tensor.swp"
        if not own.is_file():
            raise NvmeResumeError(f"{own}: missing, this engine's sub-group {i} master file; the checkpoint's NVMe "
                                  "files are named for other parameter ids (load it in a fresh process that builds "
                                  "the same model)")
        if "step" not in state:
            continue   # (saved before its first optimizer step: nothing to restore)
        tensors = []
        for key in MOMENTS:
            path = folder / f"{key}-{master.ds_id}.tensor.swp"
            if not path.is_file():
                raise NvmeResumeError(f"{path}: missing after the load (sub-group {i}'s {key}; the checkpoint's "
                                      f"offloaded_tensors should hold it)")
            t = torch.empty(0, dtype=master.dtype, device=master.device)
            t.ds_id = f"{key}-{master.ds_id}"   # (its swap file's name, as DeepSpeed's swapper names it)
            tensors.append(t)
        info = swapper.swap_params_info[master.ds_id]
        info.tensors = info.tensors[:1]   # (DeepSpeed's purge_state: the master alone)
        info.add_state_tensors(tensors)
        base.state[master] = {"step": state["step"], **dict(zip(MOMENTS, tensors))}
        restored += 1
    if in_memory:   # (their 16-bit copies from the restored masters, as DeepSpeed's step writes them)
        opt.checkpoint_event_prologue()
        for i in in_memory:
            opt._reassign_or_swap_out_partitioned_parameters(i)
        opt.checkpoint_event_epilogue()
    return restored

