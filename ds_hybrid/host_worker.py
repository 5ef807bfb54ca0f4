"""One long-lived host thread for the hybrid's work on host memory that overlaps the next step.

Under ZeRO-Offload two host passes can run while the GPU runs a real step's forward and
backward: a kept Predict run's commit into the masters (``device_predict``,
``memory.commit_overlap``) and a real step's fold into the velocity (``fold_overlap``,
``memory.fold_overlap``). Each runs on its own ``HostWorker``: one job at a time, joined by
``wait`` before anything touches what the job reads or writes, its error re-raised there. The
thread lives as long as its owner, so its ``quant.scratch`` buffers (its own, by name) are
reused from job to job instead of paying page faults every step.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from .quant import worker_scratch


class HostWorker:
    """A host thread named ``name`` running one job at a time; ``what`` names the job in errors."""

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what
        self._pool: ThreadPoolExecutor | None = None   # created on first use
        self._future: Future | None = None
        self.background_seconds = 0.0   # the jobs' time on the thread (off the critical path)

    def start(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` on the thread; returns at once. The last job must have been joined."""
        if self._future is not None:
            raise RuntimeError(f"ds_hybrid: a background {self.what} is still running; wait() for it first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ds_hybrid-{self.name}")

        # The caller's GPU for the thread: a new thread's current device is GPU 0, and a stream or
        # device context on it that switches back there would create a CUDA context on GPU 0 in
        # every rank's process (hundreds of MB each with several GPUs on a node).
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run() -> Any:
            t0 = time.perf_counter()
            if device is not None:
                torch.cuda.set_device(device)
            try:
                with torch.no_grad(), worker_scratch(self.name):   # (grad mode is per thread)
                    return job()
            finally:
                self.background_seconds += time.perf_counter() - t0

        self._future = self._pool.submit(run)

    @property
    def running(self) -> bool:
        """A job was started and not yet joined."""
        return self._future is not None

    def waiter(self) -> Callable[[], None]:
        """A call that blocks until the running job has ended (re-raising its error), for a job
        on another worker that must come after it; this thread still joins it with ``wait``."""
        future = self._future

        def wait_for_it() -> None:
            if future is not None:
                future.result()
        return wait_for_it

    def wait(self) -> Any:
        """Join the running job and return its result (None when none runs), re-raising its error."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except BaseException as e:
            raise RuntimeError(f"the background {self.what} failed") from e


class WorkerOwner:
    """Mixin for a class whose background jobs run on its ``self._worker`` (a ``HostWorker``):
    what the engine's statistics and the tests read of it."""

    _worker: HostWorker

    @property
    def background_seconds(self) -> float:
        """The jobs' time on the thread (off the critical path)."""
        return self._worker.background_seconds

    @property
    def running(self) -> bool:
        """A job was started and not yet joined."""
        return self._worker.running
