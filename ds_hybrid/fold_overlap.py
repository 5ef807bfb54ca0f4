"""A real step's velocity fold on a host thread, behind the next real step (``memory.fold_overlap``).

Under ZeRO-Offload every real step folds its update into the drift velocity in host memory,
read back from the Adam state the step left (``zero_access.fold_real_update``). Inline, that
pass sits on the step's critical path, after DeepSpeed's CPU Adam step: 1.5x that step with the
int8 velocity even as one C++ pass (``docs/results/host-fold.json``). Nothing in the next real
step's forward and backward reads what the fold writes (the velocity) or writes what it reads
(the masters and the Adam moments: the GPU works on the 16-bit parameters, the backward writes
the gradient partition). So the fold can run on a host thread while they run:

* started by the engine after a real step's optimizer step, with DeepSpeed's partitions listed
  on the main thread, on a ``host_worker.HostWorker``;
* joined (``wait``) before anything that reads or writes its inputs or its output: the next
  optimizer step, a Predict step (it reads the velocity: the real step before it joins its own
  fold before it ends, so the wait is booked to that real step), a capture, restore or commit of
  the masters, a checkpoint save or load;
* its sums (the direction statistics) reach the predictor with the next real step's
  observation (``take``), so the step scale and the confidence are one real step behind the
  inline fold's. The velocity itself is the inline fold's, bit for bit.
"""
from __future__ import annotations

from typing import Callable

import torch

from .host_worker import HostWorker, WorkerOwner


class BackgroundFold(WorkerOwner):
    """One engine's fold thread and the sums of the last fold the predictor has not seen."""

    def __init__(self) -> None:
        self._worker = HostWorker("fold", "fold of a real step's update into the drift velocity")
        self._sums: torch.Tensor | None = None

    def start(self, fold: Callable[[], torch.Tensor]) -> None:
        """Run ``fold()`` (returning the per-group sums) on the thread; returns at once."""
        self.wait()
        self._worker.start(fold)

    def wait(self) -> None:
        """Join the running fold (its sums wait for ``take``), re-raising its error."""
        if self._worker.running:
            # (Every applied real step takes the last sums before it starts a fold, so at most
            # one fold's sums are ever waiting.)
            self._sums = self._worker.wait()

    def waiter(self) -> Callable[[], None]:
        """For another host thread: a call that returns once the running fold has ended."""
        return self._worker.waiter()

    def take(self) -> torch.Tensor | None:
        """The joined fold's sums, once (None: no fold since the last take)."""
        sums, self._sums = self._sums, None
        return sums

    def state_dict(self) -> dict:
        """The sums not yet observed (call ``wait`` first): a resumed run observes them where
        the uninterrupted one would."""
        return {"sums": self._sums}

    def load_state_dict(self, sd: dict | None) -> None:
        self.wait()
        self._sums = None if sd is None else sd.get("sums")
