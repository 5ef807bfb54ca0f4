"""memory.fold_during_run: a drift Predict run on the device path moves along a copy of the
velocity made before the last real step's fold, and that fold runs on its thread during the run.

What must hold: the run's steps move along that copy (the velocity before the fold) while the fold
runs; the commit adds the run's steps along the same copy, bit for bit the torch ops a host path
would run on those values (also when the copy comes down through the stager's chunks); a rejected
run's verified steps go into the masters along it too; a checkpoint saved while a run holds its
copy resumes bit for bit; and the setting refuses what it cannot do, naming the key."""
from __future__ import annotations

import pytest
import torch

from engine_utils import Batches, ds_config, full_params, make_engine, master_copies, step_together
from test_device_predict import STAGES, _accept_then_reject, _hybrid, _same


def _cfg(stage: str, during=True, velocity: str = "int8", kernels: str = "auto", commit_overlap=False,
         **changes) -> dict:
    mem = {"velocity_dtype": velocity, "host_kernels": kernels, "fold_overlap": True, "fold_during_run": during,
           "commit_overlap": commit_overlap}
    return ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto", memory=mem, **changes), **STAGES[stage])


def _values(bufs) -> list[torch.Tensor]:
    return [None if b is None else b.load().cpu() for b in bufs]


def _watch(engine) -> dict:
    """Record, per run, the host velocity when the run's copy was made, the copy itself, whether
    the fold ran during the run's steps, and each commit's masters before and after with the
    steps and the buffers it added along."""
    dp, seen = engine._device_predict, {"held": [], "running": [], "commits": []}
    hold, add = dp.hold, dp._add_to_masters

    def record_hold(vel):
        before = _values(vel.buffers)
        out = hold(vel)
        seen["held"].append((before, _values(dp._velocity), [b is not h for b, h in zip(dp._velocity, vel.buffers)]))
        return out

    def record_add(parts, bufs, steps, after=None):
        start = [p.master.detach().clone().view(-1) for p in parts]
        add(parts, bufs, steps, after)
        seen["commits"].append((start, [p.master.detach().clone().view(-1) for p in parts],
                                [p.group_index for p in parts], _values(bufs), [list(c) for c in steps]))
    dp.hold, dp._add_to_masters = record_hold, record_add
    predict = engine._predict_step

    def record_predict(*args, **kwargs):
        seen["running"].append(engine._folds.running)
        return predict(*args, **kwargs)
    engine._predict_step = record_predict
    return seen


def _expected(start, groups, bufs, steps) -> list[torch.Tensor]:
    """The host path's additions: each step's coef * v in order, a chunk at a time (torch ops)."""
    from ds_hybrid.quant import CHUNK
    out = []
    for m, gi, v in zip(start, groups, bufs):
        m = m.clone()
        if v is not None:
            for a in range(0, m.numel(), CHUNK):
                b = min(a + CHUNK, m.numel())
                for coefs in steps:
                    if coefs[gi] != 0.0:
                        m[a:b].add_(v[a:b], alpha=coefs[gi])
        out.append(m)
    return out


@pytest.mark.parametrize("stage, velocity, kernels, commit_overlap",
                         [("z1", "fp32", "torch", False), ("z2", "int8", "auto", True), ("z3", "int8", "torch", True)])
def test_a_run_moves_along_the_velocity_before_the_fold_that_runs_meanwhile(stage, velocity, kernels,
                                                                           commit_overlap):
    """The real step before a run copies the velocity (a copy also on the CPU accelerator, where
    the shards share its memory) before starting its fold; the run's steps find the fold still
    running; the host velocity then moves on; the commit adds the run's steps along the copy, bit
    for bit the torch ops on those values, on the commit's thread after the fold (commit_overlap)
    or inline after joining it."""
    eng = make_engine(_cfg(stage, True, velocity, kernels, commit_overlap), seed=0)
    st = eng.statistics()
    assert st["fold_during_run"] is True and st["fold_overlap"] is True and st["commit_overlap"] is commit_overlap
    seen = _watch(eng)
    b = Batches(seed=3)
    phases = [eng.train_step(b.step()).phase for _ in range(16)]
    eng._wait_fold(), eng._wait_commit()
    runs = phases.count("predict") // 2
    assert runs >= 3 and len(seen["held"]) >= runs and len(seen["commits"]) >= runs - 1
    for before, copy, separate in seen["held"]:
        assert all(separate)   # its own memory: the fold writes the host buffer meanwhile
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(before, copy))
    assert all(seen["running"])   # every Predict step ran beside the fold of the real step before it
    # each commit added along the copy its run held (not the velocity the fold left since)
    for (start, after, groups, bufs, steps), (_, copy, _) in zip(seen["commits"], seen["held"]):
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(bufs, copy))
        for e, m in zip(_expected(start, groups, bufs, steps), after):
            assert torch.equal(e, m)
    v_now = _values(eng._velocity.buffers)
    assert any(not torch.equal(x, y) for x, y in zip(seen["held"][-1][1], v_now) if x is not None)
    st = eng.statistics()
    assert st["predict_accepted"] >= 4 and st["predict_rolled_back"] == 0
    # the copy is the real step's work, timed there; no Predict step uploads
    assert st["bookkeeping_seconds"]["velocity_hold"] > 0 and "velocity_upload" not in st["bookkeeping_seconds"]


@pytest.mark.parametrize("velocity", ["int8", "fp32"])
def test_the_commit_through_staged_chunks_is_the_direct_commit(velocity):
    """A held copy on a GPU comes down to the masters a chunk at a time through the stager. Forced
    on the CPU accelerator (``stage_commit``), with chunks of 1024 values so that a partition is
    several (the int8 scales sliced per chunk, a short last one): weights and masters bit for bit
    those of the direct commit, at every step."""
    from ds_hybrid.staging import Stager
    cfg = _cfg("z2", True, velocity, "auto", True)
    direct, staged = make_engine(cfg, seed=0), make_engine(cfg, seed=0)
    staged._device_predict.stage_commit = True
    staged._device_predict._stager = Stager(chunk=1024)
    sizes = [p.master.numel() for p in staged._masters.partitions()]
    assert max(sizes) > 4 * 1024 and any(n % 1024 for n in sizes)
    calls = []
    add_staged = staged._device_predict._add_staged
    staged._device_predict._add_staged = lambda *a, **k: (calls.append(1), add_staged(*a, **k))[1]
    bd, bs = Batches(seed=3), Batches(seed=3)
    for _ in range(14):
        step_together(direct, staged, bd, bs)
        direct._wait_commit(), staged._wait_commit()
        _same(direct, staged)
    assert calls and staged.statistics()["predict_accepted"] >= 4


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_a_rejection_after_verified_steps_adds_them_along_the_held_copy(stage):
    """check: forward, runs of 3 verified steps, the third rejected: the masters take the two kept
    steps along the run's copy of the velocity (not the velocity its fold has moved on to since),
    and the 16-bit weights go back to the masters."""
    eng = make_engine(_cfg(stage, True, check="forward", verify_every=1, min_predict_steps=3, max_predict_steps=3),
                      seed=0)
    _accept_then_reject(eng, keep=2)
    seen = _watch(eng)
    b = Batches(seed=5)
    rejected = 0
    for _ in range(16):
        r = eng.train_step(b.step())
        if r.phase == "predict" and r.accepted is False:
            rejected += 1
            start, after, groups, bufs, steps = seen["commits"][-1]
            assert len(steps) == 2
            assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(bufs, seen["held"][-1][1]))
            for e, m in zip(_expected(start, groups, bufs, steps), after):
                assert torch.equal(e, m)
            assert not eng._device_predict.held and not eng._device_predict.pending
    assert rejected >= 2


def test_a_rejection_in_the_run_waits_for_a_slow_fold(monkeypatch):
    """A verified step rejected while the last real step's fold still runs (at 1B-7B parameters
    the fold takes seconds): the undo writes the masters the fold reads (AdamW's weight decay), so
    it waits for the fold first. With the fold slowed down, the velocity and masters are those of
    an engine whose fold is done in time, bit for bit."""
    import time
    from ds_hybrid import engine as engine_mod

    def run(delay: float):
        fold = engine_mod.za.fold_real_update

        def slow(*args, **kwargs):
            if kwargs.get("parts") is not None:   # (the fold behind the step, on its thread)
                time.sleep(delay)
            return fold(*args, **kwargs)
        monkeypatch.setattr(engine_mod.za, "fold_real_update", slow)
        eng = make_engine(_cfg("z2", True, check="forward", verify_every=1, min_predict_steps=3,
                               max_predict_steps=3), seed=0)
        _accept_then_reject(eng, keep=2)
        folding = []
        discard = eng._device_predict.discard
        eng._device_predict.discard = lambda vel=None: (folding.append(eng._folds.running), discard(vel))[1]
        b = Batches(seed=5)
        for _ in range(16):
            eng.train_step(b.step())
        eng._wait_fold()
        monkeypatch.setattr(engine_mod.za, "fold_real_update", fold)
        return folding, _values(eng._velocity.buffers), master_copies(eng)

    prompt, prompt_vel, prompt_masters = run(0.0)
    slow, slow_vel, slow_masters = run(0.4)
    assert len(slow) >= 2 and len(prompt) == len(slow)
    assert not any(slow)   # (each rejection found the fold joined)
    for a, b in zip(prompt_vel + prompt_masters, slow_vel + slow_masters):
        assert a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("when", ["in the run", "before the run"])
def test_a_checkpoint_while_a_run_holds_its_copy_resumes_bit_for_bit(when, tmp_path):
    """Saved in the middle of a run (a step taken along the held copy) or at the end of the real
    step before it (the copy made, the fold still running): the resumed engine holds the same copy
    and goes on bit for bit, through the commit along it and the next runs."""
    cfg = _cfg("z2", True)
    ref, b = make_engine(cfg, seed=0), Batches(seed=6)
    while ref.statistics()["predict_accepted"] < 2 or ref.controller.phase.value != "predict":
        ref.train_step(b.step())
    if when == "in the run":
        assert ref.train_step(b.step()).phase == "predict" and ref.controller.phase.value == "predict"
    assert ref._device_predict.held and ref._folds.running
    held = _values(ref._device_predict._velocity)
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    resumed = make_engine(cfg, seed=1)   # other initial weights: everything must come from the checkpoint
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed._device_predict.held
    copy = _values(resumed._device_predict._velocity)
    assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(held, copy))
    for x, y in zip(full_params(ref), full_params(resumed)):
        assert torch.equal(x, y)
    b2 = Batches(seed=6)
    b2.gen.set_state(state)
    phases = []
    while len(phases) < 12 and (phases.count("predict") < 3 or phases[-1] == "predict"):
        phases.append(step_together(ref, resumed, b, b2).phase)
        if phases[-1] != "predict":
            _same(ref, resumed)
    assert phases.count("predict") >= 3 and phases[-1] != "predict"


def test_fold_during_run_refuses_what_it_cannot_do():
    """true without the fold behind the step or without the device-side drift path: an error
    naming the key and the reason; auto is off on the CPU accelerator (fold_overlap is, and the
    shards are in host memory, where the held copy would be new memory)."""
    with pytest.raises(ValueError, match="fold_during_run.*fold_overlap"):
        make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid(
            "device", fold="auto", memory={"fold_overlap": False, "fold_during_run": True})))
    with pytest.raises(ValueError, match="fold_during_run.*offload_predict"):
        make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid(
            "host", fold="optimizer_state", memory={"fold_overlap": True, "fold_during_run": True})))
    auto = make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid("device", fold="auto")))
    assert auto.statistics()["fold_during_run"] is False
    assert make_engine(_cfg("z2", "auto")).statistics()["fold_during_run"] is False   # (fold_overlap forced on)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_the_run_holds_a_gpu_copy_and_the_commit_brings_it_down():
    """Beside a GPU (asked for: auto is off since the H100 measured it slower): the run's copy is
    on the GPU, the fold writes the pinned host buffer meanwhile, and the commit's additions along
    the copy (down through pinned chunks on a side stream) are the torch ops' on those values, bit
    for bit."""
    eng = make_engine(ds_config(offload_opt="cpu", bf16=True, stage=2, hybrid=_hybrid(
        "auto", fold="auto", memory={"velocity_dtype": "int8", "fold_overlap": True, "fold_during_run": True})),
        seed=0)
    st = eng.statistics()
    assert st["fold_during_run"] is True and st["offload_predict"] == "device"
    seen = _watch(eng)
    b = Batches(seed=3, device=eng.device)
    for _ in range(14):
        eng.train_step(b.step())
    eng._wait_fold(), eng._wait_commit()
    assert seen["commits"] and all(seen["running"])
    assert all(buf.device.type == "cuda" for buf in eng._device_predict._velocity if buf is not None)
    for start, after, groups, bufs, steps in seen["commits"]:
        for e, m in zip(_expected(start, groups, bufs, steps), after):
            assert torch.equal(e, m)
