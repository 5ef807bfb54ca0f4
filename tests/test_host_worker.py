"""ds_hybrid.host_worker: the thread behind the step runs its jobs one at a time, re-raises their
errors where they are joined, and works on the caller's GPU."""
from __future__ import annotations

import threading

import pytest
import torch

from ds_hybrid.host_worker import HostWorker


def test_one_job_at_a_time_its_result_and_its_error_where_it_is_joined():
    w = HostWorker("test", "test job")
    assert w.wait() is None and not w.running
    w.start(lambda: threading.current_thread().name)
    with pytest.raises(RuntimeError, match="background test job is still running"):
        w.start(lambda: None)
    assert w.wait().startswith("ds_hybrid-test") and not w.running

    def fail():
        raise ValueError("boom")
    w.start(fail)
    with pytest.raises(RuntimeError, match="the background test job failed") as e:
        w.wait()
    assert isinstance(e.value.__cause__, ValueError)
    assert w.background_seconds > 0


def test_the_thread_takes_the_callers_gpu(monkeypatch):
    """A new thread's current CUDA device is GPU 0; with several GPUs on a node, a stream context
    on the thread that switched back there would create a context on GPU 0 in every rank. The job
    runs with the caller's device set (here faked: rank 3's GPU), and with none where CUDA is not
    initialised."""
    set_on: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_on.append((d, threading.current_thread().name)))
    w = HostWorker("gpu", "test job")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    w.start(lambda: None)
    w.wait()
    assert set_on == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    w.start(lambda: None)
    w.wait()
    assert len(set_on) == 1 and set_on[0][0] == 3 and set_on[0][1].startswith("ds_hybrid-gpu")
