"""memory.fold_overlap: a real step's fold into the drift velocity runs on a host thread behind
the next real step's forward and backward.

What must hold: the velocity is the inline fold's bit for bit (it is joined before anything reads
or writes what it works on), the predictor sees each fold's direction statistics exactly one
real step later, and a checkpoint taken with a fold's statistics still unseen resumes bit for bit."""
from __future__ import annotations

import pytest
import torch

import ds_hybrid.zero_access as za
from engine_utils import Batches, ds_config, make_engine, step_together
from test_device_predict import STAGES, _hybrid, _same


def _velocity(engine) -> torch.Tensor:
    """The velocity, flat (empty before the first fold: the first warmup step's LR is 0)."""
    bufs = [b.load() for b in engine._velocity.buffers if b is not None]
    return torch.cat(bufs) if bufs else torch.zeros(0)


def _cfg(stage: str, overlap, velocity: str = "int8", kernels: str = "auto", during=False, **changes) -> dict:
    """``during``: memory.fold_during_run (off here unless asked: these tests pin the fold behind
    the next real step; tests/test_fold_during_run.py covers the fold during a run). The inline
    fold is the pass after the step (memory.fold_in_step off: tests/test_step_fusion.py)."""
    mem = {"velocity_dtype": velocity, "host_kernels": kernels, "fold_overlap": overlap,
           "fold_during_run": during, "fold_in_step": False}
    return ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto", memory=mem, **changes), **STAGES[stage])


def _observed(engine) -> list:
    """Record the direction sums each real step hands the predictor."""
    seen = []
    observe = engine.predictor.observe_real_step

    def record(step, loss, dot, old_sq, new_sq, correct=False):
        seen.append((dot, old_sq, new_sq))
        observe(step, loss, dot, old_sq, new_sq, correct)
    engine.predictor.observe_real_step = record
    return seen


@pytest.mark.parametrize("stage, velocity, kernels", [("z1", "fp32", "torch"), ("z2", "int8", "auto"),
                                                      ("z3", "int8", "torch")])
def test_fold_behind_the_next_step_is_the_inline_fold_one_step_later(stage, velocity, kernels):
    """predictor.direction: none (Predict steps move nothing, so the weights cannot depend on the
    predictor's step scale): the same phases, losses and weights; after every fold the velocity
    equals the inline fold's bit for bit; the thread runs while the next real step's backward
    does; and the sums each real step observes are the inline run's of the real step before."""
    inline, behind = (make_engine(_cfg(stage, o, velocity, kernels, predictor={"direction": "none"}), seed=0)
                      for o in ("auto", True))
    assert inline.statistics()["fold_overlap"] is False and behind.statistics()["fold_overlap"] is True
    seen_inline, seen_behind = _observed(inline), _observed(behind)
    velocities, after_join = [], []
    folds = behind._folds
    wait = folds.wait

    def wait_and_keep():
        ran = folds.running
        wait()
        if ran:
            after_join.append(_velocity(behind))
    folds.wait = wait_and_keep
    running_at_backward = []
    backward = behind.backward
    behind.backward = lambda loss, **kw: (running_at_backward.append(folds.running), backward(loss, **kw))[1]
    bi, bb = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(16):
        ri = step_together(inline, behind, bi, bb)
        phases.append(ri.phase)
        if ri.phase != "predict":
            velocities.append(_velocity(inline))
        # This step's fold runs behind the next step if that one is real; a Predict step moves along
        # the velocity, so before one it is joined (within the real step, whose work it is).
        assert folds.running == (ri.phase != "predict" and behind.controller.phase.value != "predict")
    assert phases.count("predict") >= 4
    behind._wait_fold()
    assert len(after_join) == len(velocities) and velocities[-1].norm() > 0
    for v_inline, v_behind in zip(velocities, after_join):
        assert torch.equal(v_inline, v_behind)
    _same(inline, behind)
    # Each real step observes the last fold's sums: the inline run's, one real step later.
    assert len(seen_behind) == len(seen_inline) == len(velocities)
    assert seen_behind[0] == (0.0, 0.0, 0.0) and seen_behind[1:] == seen_inline[:-1]
    # After a real step the next real step's backward ran beside its fold.
    assert running_at_backward.count(True) >= 6
    si, sb = inline.statistics(), behind.statistics()
    assert "fold" in si["bookkeeping_seconds"] and "fold" not in sb["bookkeeping_seconds"]
    assert "fold_wait" in sb["bookkeeping_seconds"] and sb["fold_background_seconds"] > 0
    assert si["fold_background_seconds"] == 0


def test_fold_behind_keeps_drift_runs_and_resumes_bit_for_bit(tmp_path):
    """The shipped direction (drift): runs are taken and kept; a checkpoint saved after a real
    step, with that step's fold still to be observed, resumes bit for bit: the same phases,
    losses, weights, masters and velocity as the uninterrupted run, step after step."""
    cfg = _cfg("z2", True)
    ref, b = make_engine(cfg, seed=0), Batches(seed=6)
    seen_ref = _observed(ref)
    r = ref.train_step(b.step())
    while ref.statistics()["predict_accepted"] < 2 or r.phase == "predict":
        r = ref.train_step(b.step())
    assert ref._folds.running   # the last real step's fold
    ref.save_checkpoint(str(tmp_path), tag="mid")
    assert ref._folds._sums is not None   # joined by the save, not yet observed
    state = b.gen.get_state()
    resumed = make_engine(cfg, seed=1)   # other initial weights: everything must come from the checkpoint
    seen_resumed = _observed(resumed)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert torch.equal(resumed._folds._sums, ref._folds._sums)
    _same(ref, resumed)
    b2 = Batches(seed=6)
    b2.gen.set_state(state)
    before = len(seen_ref)
    phases = []
    for _ in range(8):
        phases.append(step_together(ref, resumed, b, b2).phase)
    assert "predict" in phases and phases[-1] != "predict"
    ref._wait_fold(), resumed._wait_fold()
    _same(ref, resumed)
    assert torch.equal(_velocity(ref), _velocity(resumed))
    assert seen_resumed == seen_ref[before:] and seen_resumed[0] != (0.0, 0.0, 0.0)


def test_a_failed_background_fold_stops_the_next_step(monkeypatch):
    """An error on the fold's thread is raised by the step that waits for it, chained."""
    eng = make_engine(_cfg("z2", True))
    b = Batches(seed=3)
    eng.train_step(b.step())
    eng._wait_fold()

    def broken(*args, **kwargs):
        raise OSError("host memory went away")
    monkeypatch.setattr(za, "fold_real_update", broken)
    eng.train_step(b.step())   # its fold fails on the thread
    with pytest.raises(RuntimeError, match="background fold") as e:
        eng.train_step(b.step())
    assert isinstance(e.value.__cause__, OSError)
    assert not eng._folds.running


def test_fold_overlap_refuses_what_it_cannot_do():
    """true where the fold cannot move: an error naming the key and the reason; auto on the CPU
    accelerator keeps the fold inline."""
    with pytest.raises(ValueError, match="fold_overlap.*fold_source"):
        make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid(
            "device", fold="snapshot", memory={"fold_overlap": True})))
    with pytest.raises(ValueError, match="fold_overlap.*rssm"):
        make_engine(_cfg("z2", True, predictor={"type": "rssm", "direction": "drift"}))
    with pytest.raises(ValueError, match="fold_overlap.*drift"):
        make_engine(ds_config(stage=2, hybrid={**_hybrid("host"), "predictor": {"direction": "adam"},
                                               "memory": {"fold_overlap": True}}))
    assert make_engine(_cfg("z2", "auto")).statistics()["fold_overlap"] is False


def test_worker_scratch_buffers_are_the_workers_own():
    """A host worker's chunk buffers are not the main thread's (both run at once)."""
    from ds_hybrid.quant import scratch, worker_scratch
    main = scratch("cpu", 0, 1024)
    with worker_scratch("fold"):
        mine = scratch("cpu", 0, 1024)
        assert mine.data_ptr() != main.data_ptr() and scratch("cpu", 0, 1024).data_ptr() == mine.data_ptr()
    assert scratch("cpu", 0, 1024).data_ptr() == main.data_ptr()
