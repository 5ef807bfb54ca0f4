"""memory.free_velocity_copy: the device path's velocity copy beside the 16-bit shards exists only
while a Predict run lasts, and freeing it between runs changes no weight, master or upload count.

On DeepSpeed's CPU accelerator the shards share the velocity's memory, so the device path makes
no copy; these tests make it copy anyway (``DevicePredict.copy_always``), as beside a GPU."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine_utils import Batches, ds_config, full_params, make_engine, step_together
from test_device_predict import STAGES, _accept_then_reject, _hybrid, _same


def _engine(stage: str, free: bool, velocity: str = "int8", **changes):
    mem = {"velocity_dtype": velocity, "free_velocity_copy": free}
    eng = make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto", memory=mem, **changes),
                                **STAGES[stage]), seed=0)
    eng._device_predict.copy_always = True
    eng._free_velocity_copy = eng._resolve_free_velocity_copy()   # (now that there is a copy to free)
    uploads = []
    upload = eng._device_predict.upload
    eng._device_predict.upload = lambda vel: (uploads.append(eng.global_steps), upload(vel))[1]
    return eng, uploads


@pytest.mark.parametrize("stage, velocity", [("z1", "fp32"), ("z2", "int8"), ("z3", "int8")])
def test_the_copy_lives_only_during_a_run_and_changes_nothing(stage, velocity):
    """Beside an engine that keeps its copy: the same phases, losses, weights and masters at every
    step (bit for bit); the copy is there during each run and gone after the next real step
    begins; and no more uploads than keeping it (the velocity changes at every real step, so each
    run copies it anyway)."""
    keep, keep_uploads = _engine(stage, False, velocity)
    free, free_uploads = _engine(stage, True, velocity)
    assert free.statistics()["free_velocity_copy"] is True and keep.statistics()["free_velocity_copy"] is False
    assert free.statistics()["fold_during_run"] is False
    bk, bf = Batches(seed=3), Batches(seed=3)
    phases, during, after = [], [], []
    for _ in range(16):
        r = step_together(keep, free, bk, bf)
        phases.append(r.phase)
        _same(keep, free)
        (during if r.phase == "predict" else after).append(free.statistics()["device_velocity_bytes"])
        assert keep.statistics()["device_velocity_bytes"] == (0 if not keep_uploads else
                                                               keep._device_predict.device_bytes())
    runs = sum(1 for a, b in zip(phases, phases[1:]) if a != "predict" and b == "predict")
    assert runs >= 3 and free.statistics()["predict_accepted"] >= 4
    assert all(n > 0 for n in during)
    # real steps after the first run: the copy freed at their start (and not made again)
    first = phases.index("predict")
    assert all(n == 0 for n, ph in zip(after[first:], [p for p in phases if p != "predict"][first:]))
    assert len(free_uploads) == len(keep_uploads) == runs
    assert keep._device_predict.device_bytes() > 0   # (the other engine still holds its copy)


def test_a_rejected_run_is_undone_as_with_the_copy_kept():
    """check: forward, runs of 3 verified steps, the third rejected: the two kept steps go into the
    masters along the host velocity, the weights back to them, bit for bit the engine that keeps
    its copy, and the copy is freed at the next real step."""
    cfg = dict(check="forward", verify_every=1, min_predict_steps=3, max_predict_steps=3)
    keep, _ = _engine("z2", False, **cfg)
    free, _ = _engine("z2", True, **cfg)
    for e in (keep, free):
        _accept_then_reject(e, keep=2)
    bk, bf = Batches(seed=5), Batches(seed=5)
    rejected = 0
    for _ in range(16):
        r = step_together(keep, free, bk, bf)
        _same(keep, free)
        rejected += r.phase == "predict" and r.accepted is False
        if r.phase != "predict":
            assert free.statistics()["device_velocity_bytes"] == 0
    assert rejected >= 2


def test_free_velocity_copy_refuses_fold_during_run_and_is_off_where_there_is_no_copy():
    """With fold_during_run: true: an error naming both keys. Where no copy is made (the host
    path; the device path on the CPU accelerator, where the shards share the velocity's memory)
    there is nothing to free: the engine runs and says so."""
    with pytest.raises(ValueError, match="fold_during_run.*free_velocity_copy"):
        make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid(
            "device", fold="auto", memory={"fold_overlap": True, "fold_during_run": True,
                                           "free_velocity_copy": True})))
    for where in ("host", "device"):
        eng = make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid(
            where, fold="auto", memory={"free_velocity_copy": True})))
        assert eng.statistics()["free_velocity_copy"] is False
        b = Batches(seed=3)
        assert "predict" in [eng.train_step(b.step()).phase for _ in range(8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_copy_is_made_per_run_and_its_memory_released():
    """Beside a GPU (bf16 weights, masters in host memory, the `7b-24gb-z2` layout): the device path
    makes its own copy without the test hook, every run uploads it once, and after each run's next
    real step nothing holds the copy's GPU tensors any more (their memory is the allocator's)."""
    eng = make_engine(ds_config(offload_opt="cpu", bf16=True, stage=2, hybrid=_hybrid(
        "auto", fold="auto", memory={"velocity_dtype": "int8", "free_velocity_copy": True})), seed=0)
    st = eng.statistics()
    assert st["offload_predict"] == "device" and st["free_velocity_copy"] is True and st["fold_during_run"] is False
    b = Batches(seed=3, device=eng.device)
    copies, phases = [], []
    for _ in range(16):
        r = eng.train_step(b.step())
        phases.append(r.phase)
        if r.phase == "predict":
            dp = eng._device_predict   # (no local name may keep a copy alive past the step)
            made = [weakref.ref(v.data) for v, copy in zip(dp._velocity, dp._copies) if copy and v.device.type == "cuda"]
            assert made
            copies += made
        else:
            assert eng.statistics()["device_velocity_bytes"] == 0
            gc.collect()
            assert all(ref() is None for ref in copies)
    runs = sum(1 for a, c in zip(phases, phases[1:]) if a != "predict" and c == "predict")
    assert runs >= 3
    assert eng.statistics()["bookkeeping_seconds"].get("velocity_upload", 0) > 0
    assert all(torch.isfinite(p).all() for p in full_params(eng))
