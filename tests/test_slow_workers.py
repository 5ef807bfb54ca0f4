"""The hybrid's host threads (the fold behind a step, a kept run's commit) may take any time: at
1B-7B parameters a fold takes seconds. Every job delayed on its thread, a run must give the
same phases, weights, masters, moments and velocity as with the jobs done at once, bit for bit.
A missing join shows here as a race on a CPU (it found a rejected verified step writing the
masters while the fold still read them)."""
from __future__ import annotations

import time

import pytest
import torch

import ds_hybrid.host_worker as host_worker
from engine_utils import Batches, ds_config, full_params, make_engine, master_copies
from test_device_predict import STAGES, _accept_then_reject, _hybrid

OVERLAP = {"velocity_dtype": "int8", "fold_overlap": True, "fold_during_run": True, "commit_overlap": True}
GRADIENT = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 3, "max_predict_steps": 3,
            "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
            "predictor": {"direction": "gradient"},
            "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0},
            "memory": {"offload_predict": "device", "commit_overlap": True}}

# name: (stage, hybrid_predict, keep) -- the verifications keep `keep` Predict steps, reject the next
CASES = {
    "drift, device path, verified steps, the third rejected": (
        "z2", _hybrid("device", fold="auto", memory=dict(OVERLAP), check="forward", verify_every=1,
                      min_predict_steps=3, max_predict_steps=3), 2),
    "drift, device path, runs checked by the next real step, every other rejected": (
        "z3", _hybrid("device", fold="auto", memory=dict(OVERLAP)), 1),
    "drift, host path, fold behind the step, every other run rejected": (
        "z2", _hybrid("host", fold="optimizer_state", memory={"fold_overlap": True}), 1),
    "gradient, device path, commit behind the step, every other run rejected": ("z3", GRADIENT, 1),
}


def _run(stage: str, hybrid: dict, keep: int, delay: float, monkeypatch) -> tuple[list, list, dict]:
    start = host_worker.HostWorker.start

    def slow_start(self, job):
        def slow():
            time.sleep(delay)
            return job()
        return start(self, slow)
    monkeypatch.setattr(host_worker.HostWorker, "start", slow_start if delay else start)
    eng = make_engine(ds_config(offload_opt="cpu", hybrid=hybrid, **STAGES[stage]), seed=0)
    _accept_then_reject(eng, keep=keep)
    b = Batches(seed=5)
    results = [eng.train_step(b.step()) for _ in range(18)]
    eng._wait_fold()
    eng._wait_commit()
    tensors = [*full_params(eng), *master_copies(eng)]
    for part in eng._masters.partitions():
        tensors += [part.state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in part.state]
    if eng._velocity is not None:
        tensors += [buf.load().clone() for buf in eng._velocity.buffers if buf is not None]
    monkeypatch.setattr(host_worker.HostWorker, "start", start)
    return [(r.phase, r.accepted, r.loss) for r in results], tensors, eng.statistics()


@pytest.mark.parametrize("case", list(CASES))
def test_slow_host_threads_change_nothing(case, monkeypatch):
    stage, hybrid, keep = CASES[case]
    prompt, prompt_tensors, _ = _run(stage, hybrid, keep, 0.0, monkeypatch)
    slow, slow_tensors, st = _run(stage, hybrid, keep, 0.25, monkeypatch)
    assert st["predict_rolled_back"] >= 2 and st["predict_accepted"] >= 2
    assert sum(st.get(k, 0.0) for k in ("fold_background_seconds", "commit_background_seconds")) >= 0.25   # (delayed)
    assert slow == prompt
    assert len(slow_tensors) == len(prompt_tensors)
    for a, b in zip(prompt_tensors, slow_tensors):
        assert torch.equal(a, b)
