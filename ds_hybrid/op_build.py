"""DeepSpeed's ops that are compiled on first use: say so before a run waits for the build, and
name a build lock that an interrupted build left behind.

DeepSpeed compiles some C++ ops the first time a process loads them
(``torch.utils.cpp_extension.load``): ``fused_adam`` for an Adam / AdamW optimizer (on the CPU
accelerator too), ``cpu_adam`` with ``offload_optimizer``, ``async_io`` for NVMe, and on
DeepSpeed's CPU accelerator ``deepspeed_shm_comm`` (its shared-memory collectives). Each build
takes a minute or two, once per machine and Python / torch build, into ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions/py311_cpu`` and the like: one folder per op). The process
that builds or loads an op holds ``<folder>/lock``; the others wait until that file is gone. A
build that was interrupted (Ctrl-C, a kill, a full disk) leaves the file behind, and every
later run waits on it forever without a word (torch's ``FileBaton``).

``check_op_builds`` runs before ``ds_hybrid.initialize`` in ``ds-hybrid train``: a line for the
ops that are not built yet, an error naming a lock that nothing has touched for
``STALE_AFTER_S`` (and the command that deletes it), a note for a younger lock (another process
may be building); ``watch_build_locks`` says so again while initialize still waits on one.

``ds-hybrid build-ops`` (``main``) builds them ahead of a run, several at a time, each in a process
of its own: before a multi-rank job, so that its ranks do not wait in turn on one another's
builds, and in the test suite's background (``tests/conftest.py``), on a core the suite leaves idle.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

# A lock whose folder nothing has written to for this long is left over: a build writes its
# build.ninja and object files as it goes, and loading a built op holds the lock for a moment.
STALE_AFTER_S = 600.0
WAIT_NOTE_AFTER_S = 60.0


def extensions_root() -> Path:
    """Where torch builds extensions (``torch.utils.cpp_extension._get_build_directory`` without
    its side effect of creating the folder): ``TORCH_EXTENSIONS_DIR``, else torch's user cache
    folder plus ``py<version>_<cpu|cuXYZ|rocmXYZ>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _uses_shm_comm(accelerator: str) -> bool:
    """Whether DeepSpeed loads its shared-memory collectives (``deepspeed_shm_comm``): the CPU
    accelerator's, built on Linux only."""
    return accelerator == "cpu" and sys.platform == "linux"


def ops_for_config(ds_config: dict, accelerator: str) -> list[str]:
    """The JIT-built ops DeepSpeed loads for this ds_config on this accelerator (``cpu``, ``cuda``):
    the optimizer's (DeepSpeed's choice in ``DeepSpeedEngine.get_optimizer_configuration``),
    NVMe's, and the CPU accelerator's shared-memory collectives."""
    from .config import offload_devices
    offload = dict(zip(("offload_optimizer", "offload_param"), offload_devices(ds_config)))
    names = []
    if _uses_shm_comm(accelerator):
        names.append("deepspeed_shm_comm")
    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw") \
            and not (optimizer.get("params") or {}).get("torch_adam", False):
        names.append("cpu_adam" if offload["offload_optimizer"] in ("cpu", "nvme") else "fused_adam")
    if "nvme" in offload.values():
        names.append("async_io")
    return names


def prebuilt_ops() -> set[str]:
    """Ops installed with DeepSpeed (``DS_BUILD_OPS=1``): never built at run time."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return set()
    return {name for name, built in installed_ops.items() if built}


def is_built(folder: Path, name: str) -> bool:
    """Whether torch left a built module for the op in its folder (``name.so``, or ``name_vN.so``
    after a rebuild with other flags)."""
    return any(folder.glob(f"{name}.so")) or any(folder.glob(f"{name}_v*.so"))


@dataclass(frozen=True)
class BuildLock:
    op: str
    path: Path
    idle_s: float          # seconds since anything in the op's folder was written
    stale: bool

    def advice(self) -> str:
        return (f"if no other process is building DeepSpeed's ops, an interrupted build left it: delete it "
                f"(rm {self.path}) and run again")


def build_locks(names: list[str], root: Path | None = None, now: float | None = None) -> list[BuildLock]:
    """The ``lock`` files in the named ops' build folders, with how long their folder has been idle."""
    root = extensions_root() if root is None else root
    now = time.time() if now is None else now
    out = []
    for name in names:
        lock = root / name / "lock"
        try:
            newest = max(p.stat().st_mtime for p in lock.parent.iterdir())
        except (OSError, ValueError):   # no folder, not a folder, or one that emptied while read
            continue
        if lock.exists():
            idle = max(now - newest, 0.0)
            out.append(BuildLock(name, lock, idle, idle >= STALE_AFTER_S))
    return out


def stale_message(stale: list[BuildLock]) -> str:
    return ("DeepSpeed's op build lock " + "; ".join(
        f"{lock.path} (op {lock.op}; nothing in its folder changed for {lock.idle_s / 60:.0f} min)"
        for lock in stale) + " would make this run wait forever: " + "; ".join(lock.advice() for lock in stale))


def stale_locks(ds_config: dict, accelerator: str, root: Path | None = None) -> list[BuildLock]:
    """The stale build locks of the ops DeepSpeed will load for this ds_config (none built in)."""
    names = [n for n in ops_for_config(ds_config, accelerator) if n not in prebuilt_ops()]
    return [lock for lock in build_locks(names, root) if lock.stale]


def check_op_builds(ds_config: dict, accelerator: str, say: Callable[[str], None] = print,
                    root: Path | None = None) -> list[BuildLock]:
    """Before DeepSpeed loads its ops: say which will be compiled now, fail on a stale build lock
    (naming it and what to delete), note a live one. Returns the locks to watch while waiting."""
    root = extensions_root() if root is None else root
    names = [n for n in ops_for_config(ds_config, accelerator) if n not in prebuilt_ops()]
    locks = build_locks(names, root)
    stale = [lock for lock in locks if lock.stale]
    if stale:
        raise SystemExit(stale_message(stale))
    missing = [n for n in names if not is_built(root / n, n)]
    if missing:
        say(f"DeepSpeed builds its {', '.join(missing)} op{'s' if len(missing) > 1 else ''} for this machine now: "
            f"a minute or two, once (kept in {root})")
    for lock in locks:
        say(f"DeepSpeed's op build lock {lock.path} exists: another process is building or loading {lock.op}, and "
            f"this run waits until it is gone; {lock.advice()}")
    return locks


@contextlib.contextmanager
def watch_build_locks(locks: list[BuildLock], say: Callable[[str], None] = print,
                      after_s: float = WAIT_NOTE_AFTER_S) -> Iterator[None]:
    """While the body runs (``ds_hybrid.initialize``), say once per lock that it is still there
    after ``after_s`` seconds: the run is waiting on it, not hung somewhere unknown."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(after_s):
            return
        for lock in locks:
            if lock.path.exists():
                say(f"still waiting on DeepSpeed's op build lock {lock.path} after {after_s:.0f} s; {lock.advice()}")

    thread = threading.Thread(target=watch, name="ds-hybrid-build-lock-watch", daemon=True)
    if locks:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if locks:
            thread.join()


# ---------------------------------------------------------------------------- building ahead
# Every op a ds_hybrid run can load, in the order a run (and the test suite) first needs them, with
# the DeepSpeed accelerator's builder class that builds it (``create_op_builder``); ``None``:
# ds_hybrid's own (``host_kernels``: the host-memory fold, built from kernels/host_fold.cpp).
BUILDERS = {
    "deepspeed_shm_comm": "ShareMemCommBuilder",   # the CPU accelerator's collectives
    "fused_adam": "FusedAdamBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "ds_hybrid_host_fold": None,
    "pin_memory": "PinMemoryBuilder",               # the CPU accelerator's pinned buffers (NVMe swap)
    "async_io": "AsyncIOBuilder",                   # NVMe (libaio)
}


def buildable_ops(accelerator: str) -> list[str]:
    """The ops of ``BUILDERS`` that this accelerator has a builder for (``deepspeed_shm_comm`` and
    ``pin_memory`` are the CPU accelerator's) and whose needs this machine meets (libaio for
    ``async_io``: DeepSpeed's ``is_compatible``)."""
    from deepspeed.accelerator import get_accelerator
    names = []
    for name, cls in BUILDERS.items():
        if name == "deepspeed_shm_comm" and not _uses_shm_comm(accelerator):
            continue
        if cls is not None:
            builder = get_accelerator().create_op_builder(cls)
            if builder is None or not builder.is_compatible(verbose=False):
                continue
        names.append(name)
    return names


def _build_one(name: str) -> None:
    """Build (or load, when built) one op in this process; a SIGTERM ends the build with torch's
    lock released (its ``finally``), so that no later run waits on a lock left behind."""
    def stop(signum, frame):
        # ninja, signalled with its process group, stops its compilers (each in a group of its own)
        # when it gets the signal; torch kills ninja outright once this raises, so give it a moment
        time.sleep(1.0)
        raise KeyboardInterrupt(f"op build of {name} stopped by signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    if BUILDERS[name] is None:
        from . import host_kernels
        host_kernels.load()
    else:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().create_op_builder(BUILDERS[name]).load(verbose=False)


def build_ops(names: list[str], jobs: int = 2, say: Callable[[str], None] = print,
              env: dict | None = None) -> dict[str, float]:
    """Build ``names`` (the ones not built yet; built ones only load), at most ``jobs`` at a time,
    each in a process of its own (``python -m ds_hybrid.op_build --one NAME``). Returns each op's
    seconds; raises ``SystemExit`` naming the ops whose build failed, each with the last line of its
    output (the last 8 lines go to ``say``)."""
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        raise SystemExit(f"build-ops: unknown op {', '.join(unknown)} (ops: {', '.join(BUILDERS)})")
    if jobs < 1:
        raise SystemExit(f"build-ops: --jobs must be at least 1, got {jobs}")
    pending, running, took, failed = list(names), {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="ds-hybrid-build-ops-") as logs:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                log = open(os.path.join(logs, name), "w+")   # (a file, not a pipe: no build blocks on its output)
                proc = subprocess.Popen([sys.executable, "-m", "ds_hybrid.op_build", "--one", name],
                                        stdout=log, stderr=subprocess.STDOUT, env=env)
                running[name] = (proc, time.time(), log)
            for name, (proc, start, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                took[name] = time.time() - start
                say(f"{name}: {'failed' if proc.returncode else 'ready'} in {took[name]:.0f} s")
                if proc.returncode:
                    log.seek(0)
                    tail = [line for line in log.read().splitlines() if line.strip()][-8:]
                    say("\n".join(f"  {line}" for line in tail))
                    failed[name] = tail[-1].strip() if tail else f"exit status {proc.returncode}"
                log.close()
            time.sleep(0.2)
    if failed:
        raise SystemExit("build-ops: the build of " + "; ".join(f"{n} failed ({why})" for n, why in failed.items()))
    return took


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="ds-hybrid build-ops",
        description="Build DeepSpeed's JIT-compiled ops (and ds_hybrid's host fold) ahead of a run, several at a "
                    f"time, into TORCH_EXTENSIONS_DIR (here: {extensions_root()}). Ops already built only load.")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--config", metavar="PRESET_OR_JSON",
                      help="a ds_config (a file or a preset's name): build the ops a run with it loads")
    what.add_argument("--ops", nargs="+", metavar="OP", help=f"these ops ({', '.join(BUILDERS)})")
    what.add_argument("--all", action="store_true",
                      help="every op this accelerator and machine can build (the default)")
    what.add_argument("--one", help=argparse.SUPPRESS)   # (one op in this process: build_ops' workers)
    ap.add_argument("--jobs", type=int, default=max(1, min(len(os.sched_getaffinity(0)), len(BUILDERS))),
                    help="ops built at once (default: the cores this process may use)")
    args = ap.parse_args(argv)
    if args.one:
        try:
            _build_one(args.one)
        except Exception as e:   # (one line for build_ops to quote: the error, not its traceback)
            raise SystemExit(f"{type(e).__name__}: {' '.join(str(e).split())}")
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator().device_name()
    if args.config:
        from .arguments import resolve_config
        ds_config, _ = resolve_config(args.config)   # (as train reads it: a preset's name too)
        names = [n for n in ops_for_config(ds_config, accelerator) if n not in prebuilt_ops()]
    else:
        names = args.ops or [n for n in buildable_ops(accelerator) if n not in prebuilt_ops()]
    stale = [lock for lock in build_locks(names) if lock.stale]
    if stale:
        raise SystemExit(stale_message(stale))
    build_ops(names, args.jobs)


if __name__ == "__main__":
    main()
