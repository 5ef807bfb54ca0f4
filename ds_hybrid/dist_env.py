"""One process without a launcher: the environment ``torch.distributed`` needs to be rank 0 of 1.

``deepspeed.initialize`` with no ``RANK`` / ``WORLD_SIZE`` falls back to MPI discovery, which
fails with ``No module named 'mpi4py'`` for a plain ``python my_script.py``. Imports nothing
heavy, so ``ds_hybrid.initialize`` and the main job can both call it first.
"""
from __future__ import annotations

import logging
import os
import socket

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True
