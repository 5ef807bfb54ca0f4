"""Shared set-up: one single-rank gloo process group for the in-process engine tests, and
DeepSpeed's ops built in the background while the suite runs."""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed initialises torch.distributed from these on first use; tests that spawn
# ranks set their own in the child processes.
if "RANK" not in os.environ:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def pytest_collection_modifyitems(config, items):
    # The slow tests (several ranks or bench runs at once, some of them timing their steps) go last,
    # each file's in its order: they use both cores, and on a fresh environment the suite's first
    # 20 minutes or so share the second core with the background op build below (CI at 557e289 ran
    # test_bench's slow tests there in 1.6-12x the time each takes with the ops built); the tests
    # before them are mostly one small process each.
    items.sort(key=lambda item: "slow" in item.keywords)   # (stable: the order is otherwise kept)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# DeepSpeed JIT-builds six ops the first time a process loads each, on a fresh virtual environment
# too (its sources are newer than the last build): about 22 CPU-minutes on two cores, which the
# tests that load them first used to pay on the suite's own core. The suite keeps one core busy,
# so the ops are built on another meanwhile (ds-hybrid build-ops); a test that needs one first
# waits on its build lock (torch's FileBaton) or builds it itself. The three that the engine tests
# load (the CPU accelerator's collectives, fused_adam, and cpu_adam for offload) are built first,
# side by side and at full priority: the suite's first engine tests, soon after it starts, wait
# on them (one at a time they took 89 + 217 + 169 s, side by side 263 s in all). The rest follow
# one at a time, one compiler job, niced. DS_HYBRID_TEST_PREBUILD=0 turns this off.
_prebuild = None


def pytest_sessionstart(session):
    global _prebuild
    if os.environ.get("DS_HYBRID_TEST_PREBUILD", "1") == "0" or len(os.sched_getaffinity(0)) < 2:
        return
    import torch
    if torch.cuda.is_available():   # (the suite builds CPU ops; a GPU's would be CUDA builds of their own)
        return
    from ds_hybrid.op_build import _uses_shm_comm
    first = (["deepspeed_shm_comm"] if _uses_shm_comm("cpu") else []) + ["fused_adam", "cpu_adam"]
    build = [sys.executable, "-m", "ds_hybrid.op_build"]
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    # (one shell, in a session of its own, so that pytest_sessionfinish stops both phases at once;
    # a failed first phase is left to the second, which builds or names every op)
    chain = (shlex.join(build + ["--ops", *first, "--jobs", str(len(first))]) + "; exec "
             + shlex.join(nice + build + ["--all", "--jobs", "1"]))
    with open(os.path.join(tempfile.gettempdir(), "ds-hybrid-test-build-ops.log"), "w") as log:   # (the last session's)
        _prebuild = subprocess.Popen(["sh", "-c", chain], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "MAX_JOBS": "1"})


def pytest_sessionfinish(session, exitstatus):
    """A build still running is stopped (every process of its group: each op's build releases its
    lock as it stops), so that nothing outlives the session or leaves a lock behind."""
    if _prebuild is None or _prebuild.poll() is not None:
        return
    os.killpg(_prebuild.pid, signal.SIGTERM)
    try:
        _prebuild.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(_prebuild.pid, signal.SIGKILL)
