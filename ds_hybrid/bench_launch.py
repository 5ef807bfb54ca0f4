"""How the bench starts each run: a plain Python process, or DeepSpeed's launcher with every
rank bound to its cores.

``python``: ``python -m ds_hybrid.train ...``, its own world of one, on whatever cores the OS
gives it. ``deepspeed``: ``deepspeed --num_gpus 1 --bind_cores_to_rank --module ds_hybrid.train
...``, as a user starts a run: the launcher wraps the rank in ``numactl -C <cores> -m <node>``
and sets ``OMP_NUM_THREADS`` to the cores it got. Under ZeRO-Offload that decides how fast
the CPU Adam step runs, so every arm of a suite starts the same way.
"""
from __future__ import annotations

import shutil
import socket
import sys

LAUNCHERS = ("python", "deepspeed")


def check(launcher: str) -> None:
    """Refuse, naming the flag, a launcher that cannot start here (before any run starts)."""
    if launcher not in LAUNCHERS:
        raise SystemExit(f"--launcher: one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "deepspeed" and shutil.which("numactl") is None:
        raise SystemExit("--launcher deepspeed binds each rank to its cores (--bind_cores_to_rank), which needs "
                            "numactl: install it (Debian/Ubuntu: apt-get install numactl) or pass --launcher python")


def free_port() -> int:
    """A port for the launcher's rendezvous that no other process holds now (a test's or
    another bench's ranks may hold DeepSpeed's default 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(launcher: str, module: str, args: list[str], cores: str | None = None) -> list[str]:
    """The command line that runs ``python -m module args`` with ``launcher``. ``cores``: the
    launcher's ``--bind_core_list`` (default: every physical core)."""
    if launcher == "python":
        return [sys.executable, "-m", module, *args]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
           "--bind_cores_to_rank"]
    if cores:
        cmd.append(f"--bind_core_list={cores}")
    return [*cmd, "--module", module, *args]
