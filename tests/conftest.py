"""Shared set-up: one single-rank gloo process group for the in-process engine tests, and
DeepSpeed's ops built in the background while the suite runs."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ds_hybrid.dist_env import free_port   # (the tests that start ranks import it from here)

# tests/test_faults.py's one summary of the fault suite; under pytest-xdist the process that
# started the workers prints its line (pytest_terminal_summary), since a worker's terminal is not shown
FAULT_SUMMARY_PATH = Path(__file__).resolve().parent.parent / "runs" / "fault_summary.json"
_session_start = time.time()


# DeepSpeed initialises torch.distributed from these on first use; tests that spawn
# ranks set their own in the child processes. Each pytest-xdist worker takes a port of its own
# (a worker starts with the environment of the process that started it).
if "RANK" not in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def xdist_worker(config) -> bool:
    """Whether this process is a pytest-xdist worker (not the process that started the workers)."""
    return hasattr(config, "workerinput")


@pytest.fixture(autouse=True)
def _one_thread_per_xdist_worker(request):
    """Under pytest-xdist (the README's ``-n 2``) each worker's torch takes one thread: two workers
    with a thread per core each spend most of it waiting on each other (tests/test_engine.py and
    test_drift.py: 103 s on two workers at two threads, 39 s at one, 55-62 s in one process).
    Before every test, since some tests set their own count."""
    if xdist_worker(request.config):
        import torch
        torch.set_num_threads(1)
    yield


def pytest_collection_modifyitems(config, items):
    # The slow tests (several ranks or bench runs at once, some of them timing their steps) go last,
    # each file's in its order: they use both cores, and on a fresh environment the suite's first
    # minutes share the cores with the background op build below (CI at 557e289 ran test_bench's
    # slow tests there in 1.6-12x the time each takes with the ops built); the tests before them are
    # mostly one small process each. (Under the README's --dist loadfile this orders each file's
    # tests: a worker takes a whole file, the files with most tests first.)
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
# tests that load them first used to pay one at a time. So the ops are built in the background
# meanwhile, from the session's start (ds-hybrid build-ops; under pytest-xdist by the process that
# started the workers); a test that needs one first waits on its build lock (torch's FileBaton) or
# builds it itself. The three that the engine tests load (the CPU accelerator's collectives,
# fused_adam, and cpu_adam for offload) are built first, side by side and at full priority: the
# suite's first engine tests, soon after it starts, wait on them (one at a time they took
# 89 + 217 + 169 s, side by side 263 s in all). The rest follow one at a time, one compiler job,
# niced. DS_HYBRID_TEST_PREBUILD=0 turns this off.
_prebuild = None


def pytest_sessionstart(session):
    global _prebuild
    if xdist_worker(session.config):   # (the process that started the workers builds, once)
        return
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


def pytest_terminal_summary(terminalreporter, config):
    if xdist_worker(config) or not getattr(config.option, "numprocesses", None):
        return
    if FAULT_SUMMARY_PATH.exists() and FAULT_SUMMARY_PATH.stat().st_mtime >= _session_start:
        terminalreporter.write_line(json.loads(FAULT_SUMMARY_PATH.read_text())["line"])
