"""How the bench starts each run: a plain Python process, or DeepSpeed's launcher with every
rank bound to its cores.

``python``: ``python -m ds_hybrid.train ...``, its own world of one, on whatever cores the OS
gives it. ``deepspeed``: ``deepspeed --num_gpus 1 --bind_cores_to_rank --module ds_hybrid.train
...``, as a user starts a run: the launcher wraps the rank in ``numactl -C <cores> -m <node>``
and sets ``OMP_NUM_THREADS`` to the cores it got. Under ZeRO-Offload that decides how fast
the CPU Adam step runs, so every arm of a suite starts the same way.

``--jobs N`` runs N at a time, each bound to its own share of the cores (``core_slots``):
DeepSpeed's launcher takes it as ``--bind_core_list``, a plain process under ``taskset`` with
``OMP_NUM_THREADS`` set to it, so that no two runs' threads share a core.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import threading

from . import dist_env

LAUNCHERS = ("python", "deepspeed")


def check(launcher: str, jobs: int = 1) -> None:
    """Refuse, naming the flag, a launcher that cannot start here (before any run starts)."""
    if launcher not in LAUNCHERS:
        raise SystemExit(f"--launcher: one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "deepspeed" and shutil.which("numactl") is None:
        raise SystemExit("--launcher deepspeed binds each rank to its cores (--bind_cores_to_rank), which needs "
                            "numactl: install it (Debian/Ubuntu: apt-get install numactl) or pass --launcher python")
    if launcher == "python" and jobs > 1 and shutil.which("taskset") is None:
        raise SystemExit("--jobs above 1 binds each run to its own cores, which with --launcher python needs "
                         "taskset (util-linux): install it or pass --jobs 1")


_ports_lock = threading.Lock()
_ports_given: set[int] = set()


def free_port() -> int:
    """A port for the launcher's rendezvous that no other process holds now (a test's or
    another bench's ranks may hold DeepSpeed's default 29500), and that this process has not
    handed to another run (``--jobs``: two launchers started together must not take one port)."""
    with _ports_lock:
        port = dist_env.free_port(_ports_given)
        _ports_given.add(port)
        return port


def machine_cores() -> list[int]:
    """The cores DeepSpeed's launcher binds to by default (``--bind_cores_to_rank`` with no list:
    the first of the machine's physical cores), within this process's affinity."""
    import psutil   # (a DeepSpeed dependency)
    allowed = os.sched_getaffinity(0)
    return [c for c in range(psutil.cpu_count(logical=False) or len(allowed)) if c in allowed]


def core_slots(jobs: int, cores: list[int] | None = None) -> list[list[int]]:
    """``--jobs``: the machine's cores in ``jobs`` equal contiguous sets, one for each run
    running at a time (the remainder, fewer than ``jobs`` cores, left idle). Refuses, naming
    the flag, more jobs than cores."""
    cores = machine_cores() if cores is None else cores
    if jobs < 1 or jobs > len(cores):
        raise SystemExit(f"--jobs: between 1 and the {len(cores)} cores the runs can be bound to here "
                         f"(each run takes at least one), got {jobs}")
    per = len(cores) // jobs
    return [cores[i * per:(i + 1) * per] for i in range(jobs)]


def core_list(cores: list[int]) -> str:
    """DeepSpeed's ``--bind_core_list`` (and taskset's) form: ranges joined by commas, ascending."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(c) if c == start else f"{start}-{c}")
            start = None
    return ",".join(parts)


def command(launcher: str, module: str, args: list[str], cores: list[int] | None = None) -> list[str]:
    """The command line that runs ``python -m module args`` with ``launcher``. ``cores``: the
    cores the run is bound to (default: the launcher's, every physical core, or the OS's)."""
    if launcher == "python":
        cmd = [sys.executable, "-m", module, *args]
        return ["taskset", "-c", core_list(cores), *cmd] if cores else cmd
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
           "--bind_cores_to_rank"]
    if cores:
        cmd.append(f"--bind_core_list={core_list(cores)}")
    return [*cmd, "--module", module, *args]


def threads_env(env: dict, launcher: str, cores: list[int] | None) -> dict:
    """A plain process bound to ``cores`` runs as many threads as it has cores (DeepSpeed's
    launcher sets ``OMP_NUM_THREADS`` itself)."""
    if cores and launcher == "python":
        env = dict(env, OMP_NUM_THREADS=str(len(cores)))
    return env


def host() -> str:
    """The machine a result (or a profile's rounds) was timed on: its CPU cores and GPU."""
    try:
        import torch
        gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    except Exception:
        gpu = ""
    return f"{platform.machine()} {os.cpu_count()} CPU cores{gpu}"
