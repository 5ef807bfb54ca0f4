"""One process without a launcher: the environment ``torch.distributed`` needs to be rank 0 of 1.

``deepspeed.initialize`` with no ``RANK`` / ``WORLD_SIZE`` falls back to MPI discovery, which
fails with ``No module named 'mpi4py'`` for a plain ``python my_script.py``. Imports nothing
heavy, so ``ds_hybrid.initialize`` and the main job can both call it first. ``child_env``: the
same from the other side, a process this one starts as a world of one of its own.
"""
from __future__ import annotations

import logging
import os
import random
import socket
from pathlib import Path

from .arguments import REPO_ROOT

logger = logging.getLogger(__name__)

# Set by MPI launchers (Open MPI, MPICH / Intel MPI, PMIx, MVAPICH) and Slurm: DeepSpeed's own
# discovery handles those, so a process started by one is left alone.
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def ensure_distributed_env() -> bool:
    """Without a launcher, make this process rank 0 of 1 on a free local port. Returns whether
    it did (False: a launcher, or an earlier call, set the environment)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    if any(v in os.environ for v in _LAUNCHER_VARS):
        return False
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return True


def free_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A local port for a rendezvous that no process holds now and that is not in ``taken``, drawn
    at random below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from that range, from which it also takes the
    local end of every outgoing connection: between that choice and rank 0's listen, the gloo ranks
    of another run on this host could take it (EADDRINUSE; seen in CI 2026-12-06 with two test
    workers). Below the range only another explicit choice can collide, and each is drawn at random.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):   # (not Linux: the IANA range's start)
        low = 49152
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    while True:   # (nothing free below the range: the kernel's choice)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def child_env() -> dict:
    """The environment of a run this process starts (a bench run, the profile, a planner
    measurement): a world of its own, whatever world this one is in, with this checkout importable."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # each child is its own world of 1
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


# DeepSpeed's CPU shared-memory allreduce names each rank's segment so (deepspeed/ops/csrc/cpu/comm/shm.cpp).
_SHM_SEGMENT = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
_shm_released = False


def release_cpu_allreduce_segment() -> bool:
    """Unlink this rank's DeepSpeed CPU allreduce segment once every rank has mapped it. Call it on
    every rank right after ``deepspeed.initialize``; returns whether it unlinked one.

    On the CPU accelerator, with every rank on this host (DeepSpeed's launcher sets ``LOCAL_SIZE``),
    DeepSpeed gives each rank a 64 MiB POSIX shared-memory segment for its low-latency allreduce and
    never unlinks it: every such run left ``/dev/shm/deepspeed_allreduce_buffer_*`` behind, memory
    that stays taken until a reboot (a 2-rank run, 128 MiB). Each rank maps every rank's segment
    while DeepSpeed sets up its communicator, so after a barrier each rank unlinks its own name:
    the mappings stay valid, and the name is gone even if the process is killed later.
    """
    global _shm_released
    if _shm_released or not torch_dist_initialized():
        return False
    from deepspeed.comm import comm as ds_comm
    if getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return False
    world = ds_comm.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):   # DeepSpeed made no segment (the same on every rank)
        return False
    _shm_released = True
    if world > 1:
        ds_comm.barrier()
    path = _SHM_SEGMENT.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                               port=os.environ.get("MASTER_PORT", ""), rank=ds_comm.get_rank())
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    logger.debug("unlinked %s (DeepSpeed's CPU allreduce segment; the mappings stay)", path)
    return True


def torch_dist_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()
