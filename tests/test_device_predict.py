"""memory.offload_predict: device — Predict steps under offload_optimizer that write the 16-bit
parameters and leave the host masters alone until the next real step's check keeps the run.

On DeepSpeed's CPU accelerator the math is the host path's: with fp32 parameters every weight
and master must match the host path bit for bit, at every step, through a kept run, a rejected
run, and a checkpoint taken in the middle of a run."""
from __future__ import annotations

import pytest
import torch

from engine_utils import (Batches, committed, ds_config, full_params, make_engine, master_copies, resumed_in_a_run,
                          step_together)

# Predict runs of 2 drift steps after 2 real ones, checked by the next real step's forward.
NEXT = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
        "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
        "predictor": {"direction": "drift"},
        "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}

STAGES = {"z1": dict(stage=1), "z2": dict(stage=2), "z3": dict(stage=3, offload_param="cpu")}


def _hybrid(where: str, fold: str = "snapshot", **changes) -> dict:
    """The paths compared bit for bit fold the velocity alike (from the pre-step copy)."""
    h = {**NEXT, **changes}
    h["memory"] = {**h.get("memory", {}), "offload_predict": where, "fold_source": fold}
    return h


def _pair(stage: str, bf16: bool = False, **changes):
    cfgs = [ds_config(offload_opt="cpu", bf16=bf16, hybrid=_hybrid(w, **changes), **STAGES[stage])
            for w in ("host", "device")]
    return [make_engine(c, seed=0) for c in cfgs]


def _same(a, b) -> None:
    for x, y in zip(full_params(a), full_params(b)):
        assert torch.equal(x, y)
    for x, y in zip(master_copies(a), master_copies(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("stage", list(STAGES))
def test_device_path_matches_the_host_path_bit_for_bit(stage):
    """fp32 parameters: the device path's weights equal the host path's after every step, and
    its masters after every real step (during a run they stay at the last good point)."""
    host, dev = _pair(stage)
    assert dev.statistics()["offload_predict"] == "device" and host.statistics()["offload_predict"] == "host"
    bh, bd = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(14):
        phases.append(step_together(host, dev, bh, bd).phase)
        if phases[-1] != "predict":
            _same(host, dev)
    assert phases.count("predict") >= 4
    st = dev.statistics()
    assert st["predict_accepted"] >= 4 and st["predict_accepted"] == host.statistics()["predict_accepted"]
    # no snapshot of the masters for a run (the real steps' fold still takes its pre-step copy);
    # the masters catch up once per kept run
    assert "snapshot" not in st["bookkeeping_seconds"] and "snapshot" in host.statistics()["bookkeeping_seconds"]
    assert "commit" in st["bookkeeping_seconds"]
    # the velocity and the shards share the CPU accelerator's memory: nothing to upload
    assert "velocity_upload" not in st["bookkeeping_seconds"] and st["device_velocity_bytes"] == 0


def test_the_velocity_is_uploaded_once_per_velocity_state():
    """A shard on another device than the host velocity (here the meta device, standing in for a
    GPU) is due a copy when the velocity changed since the last one, and only then: a Predict
    run uploads once, the first step after a real step's fold uploads again."""
    import ds_hybrid.zero_access as za
    from ds_hybrid.device_predict import DevicePredict

    class Access:
        def device_shard(self, i):
            return torch.empty(1000, dtype=torch.bfloat16, device="meta")

    vel = za.VelocityBuffers("int8")
    vel.buffer(0, torch.zeros(1000))
    dp = DevicePredict(Access())
    for updates in (1, 2):
        vel.updates = updates
        assert dp.upload_due(vel)
        dp.upload(vel)
        assert not dp.upload_due(vel) and dp.device_bytes() == vel.nbytes()
    dp.load_state_dict({"pending": []})   # a checkpoint load brings a velocity: copy it again
    assert dp.upload_due(vel)


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_device_run_leaves_the_masters_and_rolls_back_exactly(stage):
    """During a device-side run the host masters do not move; a rejected run puts the weights
    back exactly where they were before it (the masters, re-propagated)."""
    _, dev = _pair(stage, divergence={"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0})
    b = Batches(seed=5)
    while dev.controller.phase.value != "predict":
        dev.train_step(b.step())
    masters, weights = master_copies(dev), full_params(dev)
    dev.train_step(b.step())
    assert all(torch.equal(x, y) for x, y in zip(masters, master_copies(dev)))     # masters untouched
    assert any(not torch.equal(x, y) for x, y in zip(weights, full_params(dev)))   # weights moved
    assert dev._device_predict.pending
    dev._device_predict.discard()
    assert not dev._device_predict.pending
    for x, y in zip(weights, full_params(dev)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("stage, check", [("z1", "next_step"), ("z2", "next_step"), ("z2", "forward")])
def test_device_path_rejected_run_matches_the_host_path(stage, check):
    """Every run rejected (by the next step's check, or by a verification forward inside the
    run): both paths roll back and go on bit for bit alike."""
    host, dev = _pair(stage, check=check, verify_every=1)
    for eng in (host, dev):
        eng.predictor.accept = lambda observed, step, div, *more: (False, observed)
    bh, bd = Batches(seed=4), Batches(seed=4)
    for _ in range(14):
        rh, rd = host.train_step(bh.step()), dev.train_step(bd.step())
        assert (rh.phase, rh.loss) == (rd.phase, rd.loss)
        for x, y in zip(full_params(host), full_params(dev)):
            assert torch.equal(x, y)
        if rd.phase != "predict":   # (inside a run the device path's masters wait at the last good point)
            _same(host, dev)
    st = dev.statistics()
    assert st["predict_rolled_back"] >= 2 and st["predict_rolled_back"] == host.statistics()["predict_rolled_back"]
    assert st["predict_accepted"] == 0


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_device_path_verified_inside_the_run_matches_the_host_path(stage):
    """check: forward, every Predict step verified and kept: the weights are the host path's after
    every step; the masters take the kept steps with the rest of the run at the next real step
    (not one commit per verified step), and then equal the host path's bit for bit."""
    host, dev = _pair(stage, check="forward", verify_every=1)
    bh, bd = Batches(seed=2), Batches(seed=2)
    start = None
    for _ in range(12):
        rh, rd = host.train_step(bh.step()), dev.train_step(bd.step())
        assert (rh.phase, rh.loss, rh.accepted) == (rd.phase, rd.loss, rd.accepted)
        for x, y in zip(full_params(host), full_params(dev)):
            assert torch.equal(x, y)
        if rd.phase == "predict":
            start = start or master_copies(dev)
            assert rd.accepted and dev._device_predict.verified == len(dev._device_predict.pending)
            assert all(torch.equal(x, y) for x, y in zip(start, master_copies(dev)))   # not yet committed
        else:
            start = None
            _same(host, dev)
    assert dev.statistics()["predict_accepted"] >= 2


def _accept_then_reject(engine, keep: int) -> None:
    """The engine's verifications keep ``keep`` Predict steps, reject the next, and so on."""
    seen = [0]

    def accept(observed, step, div, *more):
        seen[0] += 1
        return seen[0] % (keep + 1) != 0, observed
    engine.predictor.accept = accept


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_a_rejection_after_verified_steps_keeps_them_as_the_host_path_does(stage):
    """Runs of 3 verified Predict steps, the third rejected: the device path's masters take the two
    kept steps at the rejection and its weights go back to them; bit for bit the host path, which
    snapshots after each kept step and restores the last snapshot."""
    host, dev = _pair(stage, check="forward", verify_every=1, min_predict_steps=3, max_predict_steps=3)
    for eng in (host, dev):
        _accept_then_reject(eng, keep=2)
    bh, bd = Batches(seed=5), Batches(seed=5)
    rejected = 0
    for _ in range(16):
        rh, rd = host.train_step(bh.step()), dev.train_step(bd.step())
        assert (rh.phase, rh.loss, rh.accepted) == (rd.phase, rd.loss, rd.accepted)
        for x, y in zip(full_params(host), full_params(dev)):
            assert torch.equal(x, y)
        if rd.phase != "predict" or rd.accepted is False:
            _same(host, dev)
            rejected += rd.accepted is False
            assert not dev._device_predict.pending and dev._device_predict.verified == 0
    st = dev.statistics()
    assert rejected >= 2 and st["predict_accepted"] >= 4 and st["predict_rolled_back"] == rejected


@pytest.mark.parametrize("where", ["device", "host"])
def test_a_run_saved_after_verified_steps_resumes_keeping_them(where, tmp_path):
    """Saved after a run's first verified Predict step; the next is rejected. Resumed on the device
    path (the verified count comes back with the run) or on the host path (the masters take the
    verified step as the rollback snapshot, then the rest): every later step as the uninterrupted run's."""
    hyb = dict(check="forward", verify_every=1, min_predict_steps=3, max_predict_steps=3)
    cfg = ds_config(offload_opt="cpu", hybrid=_hybrid("device", **hyb), stage=2)
    ref, b = make_engine(cfg, seed=0), Batches(seed=6)
    while ref.controller.phase.value != "predict":
        ref.train_step(b.step())
    ref.train_step(b.step())
    assert ref._device_predict.verified == 1 and len(ref._device_predict.pending) == 1
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    resumed = make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid(where, **hyb), stage=2), seed=1)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    for eng in (ref, resumed):
        eng.predictor.accept = lambda observed, step, div, *more: (False, observed)
    b2 = Batches(seed=6)
    b2.gen.set_state(state)
    for _ in range(4):
        r1, r2 = ref.train_step(b.step()), resumed.train_step(b2.step())
        assert (r1.phase, r1.loss, r1.accepted) == (r2.phase, r2.loss, r2.accepted)
        for x, y in zip(full_params(ref), full_params(resumed)):
            assert torch.equal(x, y)
        if r1.phase != "predict" or r1.accepted is False:
            _same(ref, resumed)
    assert ref.statistics()["predict_rolled_back"] >= 1


def test_device_path_bf16_within_rounding_and_masters_exact():
    """bf16 parameters: during a run each step rounds the 16-bit weights (the host path rounds
    the fp32 master), so they differ by at most a bf16 rounding per step; the run's commit
    leaves the masters bit for bit where the host path's are."""
    host, dev = _pair("z2", bf16=True)
    bh, bd = Batches(seed=3), Batches(seed=3)
    while dev.controller.phase.value != "predict":
        rh, rd = host.train_step(bh.step()), dev.train_step(bd.step())
        assert (rh.phase, rh.loss) == (rd.phase, rd.loss)
    _same(host, dev)
    before, steps = [w.float() for w in full_params(dev)], 0
    eps = torch.finfo(torch.bfloat16).eps   # 2^-7: a bf16 ulp is at most eps |x|
    while dev.controller.phase.value == "predict":
        host.train_step(bh.step()), dev.train_step(bd.step())
        steps += 1
        for x, y, w in zip(full_params(host), full_params(dev), before):
            x, y = x.float(), y.float()
            # the master's own rounding at the start, then one rounding per step on either side
            tol = eps * (w.abs() + steps * torch.maximum(x.abs(), y.abs()))
            assert bool(((x - y).abs() <= tol).all())
    assert steps == 2 and dev._device_predict.pending
    dev._device_predict.commit(dev._velocity)    # what the next real step does once its check keeps the run
    for x, y in zip(master_copies(host), master_copies(dev)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_checkpoint_in_the_middle_of_a_device_run_resumes_bit_for_bit(stage, tmp_path):
    """Saved after the first Predict step of a run: the resumed engine's weights, masters and
    every later step equal an uninterrupted run's."""
    cfg = ds_config(offload_opt="cpu", hybrid=_hybrid("device"), **STAGES[stage])
    ref, b = make_engine(cfg, seed=0), Batches(seed=6)
    # (other initial weights: everything must come from the checkpoint)
    resumed, b2 = resumed_in_a_run(ref, b, tmp_path, lambda: make_engine(cfg, seed=1))
    assert resumed._device_predict.pending == ref._device_predict.pending
    _same(ref, resumed)
    for _ in range(5):
        r1, r2 = ref.train_step(b.step()), resumed.train_step(b2.step())
        assert (r1.phase, r1.loss) == (r2.phase, r2.loss)
        _same(ref, resumed)


def test_device_run_saved_resumes_on_the_host_path(tmp_path):
    """A checkpoint from a device-side run loaded with offload_predict: host: the masters take
    the run and the loaded masters become its rollback snapshot, as the host path holds them."""
    dev_cfg = ds_config(offload_opt="cpu", hybrid=_hybrid("device"), stage=2)
    host_cfg = ds_config(offload_opt="cpu", hybrid=_hybrid("host"), stage=2)
    ref, b = make_engine(host_cfg, seed=0), Batches(seed=6)
    dev, bd = make_engine(dev_cfg, seed=0), Batches(seed=6)
    while dev.controller.phase.value != "predict":
        ref.train_step(b.step()), dev.train_step(bd.step())
    ref.train_step(b.step()), dev.train_step(bd.step())
    dev.save_checkpoint(str(tmp_path), tag="mid")
    resumed = make_engine(host_cfg, seed=1)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    _same(ref, resumed)
    for x, y in zip(ref._snapshot.buffers, resumed._snapshot.buffers):
        assert torch.equal(x, y)


def test_offload_predict_device_refuses_what_it_cannot_do():
    """offload_predict: device with the Adam direction, or without ZeRO: an error naming the key."""
    with pytest.raises(ValueError, match="offload_predict: device.*direction"):
        make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid("device", predictor={"direction": "adam"})))
    with pytest.raises(ValueError, match="offload_predict: device.*ZeRO"):
        make_engine(ds_config(stage=0, hybrid=_hybrid("device")))
    # auto on DeepSpeed's CPU accelerator: everything is host memory, the host path
    eng = make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid("auto")))
    assert eng.statistics()["offload_predict"] == "host"


def _velocity(engine) -> torch.Tensor:
    return torch.cat([b.load() for b in engine._velocity.buffers if b is not None])


@pytest.mark.parametrize("setup", [dict(stage=2, offload_opt="cpu"), dict(stage=3, offload_opt="cpu"),
                                   dict(stage=0)], ids=["z2-cpu-adam", "z3-cpu-adam", "z0-torch-adamw"])
def test_fold_from_the_optimizer_state_matches_the_copy(setup):
    """fold_source: optimizer_state reads a real step's update back from the Adam state: the
    velocity it builds equals the one from the pre-step copy up to fp32 rounding (DeepSpeed's
    CPU Adam and torch's AdamW, with decoupled weight decay)."""
    engines = [make_engine(ds_config(hybrid=_hybrid("host", fold=f), **setup)) for f in ("snapshot", "optimizer_state")]
    assert [e.statistics()["fold_source"] for e in engines] == ["snapshot", "optimizer_state"]
    streams = [Batches(seed=8), Batches(seed=8)]
    for _ in range(3 + 2):   # warmup and the first Full phase: real steps only
        for e, b in zip(engines, streams):
            assert e.train_step(b.step()).phase != "predict"
    snap, state = (_velocity(e) for e in engines)
    assert snap.norm() > 0
    assert float((snap - state).norm() / snap.norm()) < 1e-4
    assert engines[1].statistics()["snapshot_bytes"] == 0 < engines[0].statistics()["snapshot_bytes"]


@pytest.mark.parametrize("stage", list(STAGES))
def test_device_path_keeps_no_fp32_copy_of_the_masters(stage):
    """offload_predict: device with fold_source: auto (optimizer_state): Predict runs are taken
    and kept, and at no step does the engine hold a copy of the masters."""
    eng = make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto"), **STAGES[stage]))
    b, phases = Batches(seed=3), []
    for _ in range(14):
        phases.append(eng.train_step(b.step()).phase)
        assert eng.statistics()["snapshot_bytes"] == 0
    st = eng.statistics()
    assert st["fold_source"] == "optimizer_state" and phases.count("predict") >= 4 and st["predict_accepted"] >= 4
    assert st["velocity_bytes"] > 0
    assert st["device_velocity_bytes"] == 0   # on the CPU accelerator the shards sit beside the host velocity


@pytest.mark.parametrize("stage, velocity", [("z1", "fp32"), ("z2", "int8"), ("z3", "int8")])
def test_commit_behind_the_backward_matches_the_inline_commit_bit_for_bit(stage, velocity):
    """memory.commit_overlap: a kept run's displacement goes into the masters on a host thread
    started by the next real step's check, still running when that step's backward starts and
    joined before its optimizer step: weights and masters bit for bit the inline commit's at
    every step (``auto`` is inline on the CPU accelerator)."""
    mem = {"velocity_dtype": velocity}
    # (fold_in_step off: on the CPU accelerator its auto would add the commit inside the optimizer step)
    cfgs = [ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto", memory={
        **mem, "commit_overlap": o, "fold_in_step": False}), **STAGES[stage]) for o in ("auto", True)]
    inline, behind = (make_engine(c, seed=0) for c in cfgs)
    assert inline.statistics()["commit_overlap"] is False and behind.statistics()["commit_overlap"] is True
    running_at_backward = []
    backward = behind.backward
    behind.backward = lambda loss, **kw: (running_at_backward.append(behind._device_predict.running),
                                          backward(loss, **kw))[1]
    bi, bb = Batches(seed=3), Batches(seed=3)
    for _ in range(14):
        ri, rb = inline.train_step(bi.step()), behind.train_step(bb.step())
        assert (ri.phase, ri.loss) == (rb.phase, rb.loss)
        assert not behind._device_predict.running   # joined within the step
        _same(inline, behind)
    si, sb = inline.statistics(), behind.statistics()
    assert sb["predict_accepted"] >= 4 and sb["predict_accepted"] == si["predict_accepted"]
    assert running_at_backward.count(True) >= 2   # a commit per kept run, each overlapping a backward
    assert "commit" in si["bookkeeping_seconds"] and "commit" not in sb["bookkeeping_seconds"]
    assert "commit_wait" in sb["bookkeeping_seconds"] and sb["commit_background_seconds"] > 0
    assert si["commit_background_seconds"] == 0


def test_a_failed_background_commit_stops_the_step():
    """An error on the commit thread is raised by the step that waits for it, not lost."""
    eng = make_engine(ds_config(offload_opt="cpu", stage=2,
                                hybrid=_hybrid("device", fold="auto", memory={"commit_overlap": True})))
    b = Batches(seed=3)
    while eng.controller.phase.value != "predict":
        eng.train_step(b.step())
    while eng.controller.phase.value == "predict":
        eng.train_step(b.step())

    def broken(*args, **kwargs):
        raise OSError("host memory went away")
    eng._device_predict._add_to_masters = broken
    with pytest.raises(RuntimeError, match="background commit") as e:
        eng.train_step(b.step())
    assert isinstance(e.value.__cause__, OSError)
    assert not eng._device_predict.running


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_device_path_on_gpu_moves_the_shards_and_commits_the_masters(stage):
    """On a GPU with offload_optimizer: cpu and bf16 weights: offload_predict auto takes the device
    path, the velocity is copied beside the GPU shards, the GPU weights move while the host
    masters do not, and the commit adds each step's coef * v to them in order (the host path's
    arithmetic). (Compared with a replay, not with a second engine: CUDA backwards need not be
    bit-reproducible between two engines.)"""
    from ds_hybrid import kernels
    dev = make_engine(ds_config(offload_opt="cpu", bf16=True, hybrid=_hybrid("auto"), **STAGES[stage]), seed=0)
    assert dev.statistics()["offload_predict"] == "device"
    # the step's kernels compiled at set-up (kernels.prebuild), not in the first Predict step
    assert dev._kernels_prebuilt == (kernels.cupy_available() and stage != "z3")
    b = Batches(seed=3, device=dev.device)
    while dev.controller.phase.value != "predict":
        dev.train_step(b.step())
    masters, weights = master_copies(dev), full_params(dev)
    launches = kernels.LAUNCHES["drift_shift"]
    while dev.controller.phase.value == "predict":
        dev.train_step(b.step())
    # ZeRO 3 with offload_param: cpu keeps the 16-bit partition in host memory, beside the host
    # velocity: host_kernels moves it there, with no copy of the velocity and no upload
    on_gpu = stage != "z3"
    if kernels.cupy_available() and on_gpu:   # hybrid_predict.kernels: auto takes the kernel for GPU shards
        assert kernels.LAUNCHES["drift_shift"] > launches
    assert all(torch.equal(a, m) for a, m in zip(masters, master_copies(dev)))
    assert any(not torch.equal(a, w) for a, w in zip(weights, full_params(dev)))
    assert (dev.statistics()["device_velocity_bytes"] > 0) == on_gpu
    book = dev.statistics()["bookkeeping_seconds"]   # the copy timed on its own
    assert (book.get("velocity_upload", 0) + book.get("velocity_hold", 0) > 0) == on_gpu
    run = dev._device_predict.pending
    dev._wait_fold()   # (fold_source: snapshot here, so no fold runs behind the step; a no-op)
    bufs = dev._device_predict._run_velocity(dev._velocity)   # the velocity the run moved along
    expected = committed(masters, dev._masters.group_indices(), bufs, run)
    dev._device_predict.commit(dev._velocity)
    for e, m in zip(expected, master_copies(dev)):
        assert torch.equal(e, m.view(-1))
