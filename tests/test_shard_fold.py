"""memory.fold_source: weights16 — a real step's fold into the drift velocity from the 16-bit
shards DeepSpeed's step writes (``ds_hybrid/shard_fold.py``), on the device-side Predict path
under ``offload_optimizer: cpu`` (ZeRO 1, 2 and 3 on DeepSpeed's CPU accelerator)."""
from __future__ import annotations

import pytest
import torch

from engine_utils import Batches, committed, ds_config, full_params, make_engine, master_copies, resumed_in_a_run

# Predict runs of 2 drift steps after 2 real ones, checked by the next real step's forward.
NEXT = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
        "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
        "predictor": {"direction": "drift"},
        "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}

STAGES = {"z1": dict(stage=1), "z2": dict(stage=2), "z3": dict(stage=3, offload_param="cpu")}


def _hybrid(fold: str = "weights16", velocity: str = "fp32", **changes) -> dict:
    h = {**NEXT, **changes}
    h["memory"] = {"offload_predict": "device", "fold_source": fold, "velocity_dtype": velocity,
                   **changes.get("memory", {})}
    return h


def _engine(stage: str, bf16: bool = True, seed: int = 0, gas: int = 1, groups: int = 0, **hybrid):
    return make_engine(ds_config(offload_opt="cpu", bf16=bf16, gas=gas, hybrid=_hybrid(**hybrid), **STAGES[stage]),
                       seed=seed, groups=groups)


def _velocity(engine) -> list[torch.Tensor]:
    return [b.load().clone() for b in engine._velocity.buffers]


def _bf16(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(-1).to(torch.bfloat16).float() for t in ts]


@pytest.mark.parametrize("stage, gas, groups", [("z1", 1, 0), ("z2", 2, 2), ("z3", 1, 0)],
                         ids=["z1", "z2-2-micro-batches-2-groups", "z3"])
def test_the_velocity_is_the_average_of_the_rounded_masters_steps(stage, gas, groups):
    """bf16 weights: every real step that folds puts ``(R(m_after) - R(m_before)) / lr`` into the
    velocity (R: the rounding to bf16, which is what DeepSpeed's step writes into the shards),
    bit for bit the same torch arithmetic on the rounded masters; a step that commits a kept run
    leaves the velocity as it was; Predict runs are taken and kept all along. (ZeRO 2 with 2
    micro-batches a step and 2 param groups: the copy is taken at the boundary's step only.)"""
    eng = _engine(stage, gas=gas, groups=groups)
    assert eng.statistics()["fold_source"] == "weights16" and eng._velocity.beside_shards
    beta = eng.hybrid_config.predictor.drift_beta
    b, ref, phases, zero_lr = Batches(seed=3), None, [], 0
    for _ in range(16):
        before, folds = master_copies(eng), dict(eng.statistics()["shard_folds"])
        lrs = [float(g["lr"]) for g in eng._masters.base.param_groups]
        phases.append(eng.train_step(b.step(gas)).phase)
        zero_lr += phases[-1] != "predict" and lrs[0] == 0.0   # (WarmupLR's first steps: nothing to fold)
        now = eng.statistics()["shard_folds"]
        if now["folded"] > folds["folded"]:
            d = [(a - c) for a, c in zip(_bf16(master_copies(eng)), _bf16(before))]
            gi = eng._masters.group_indices()
            ref = ([x * (1.0 / lrs[g]) for x, g in zip(d, gi)] if ref is None
                   else [v.mul(beta).add(x, alpha=(1.0 - beta) / lrs[g]) for v, x, g in zip(ref, d, gi)])
        if ref is not None:   # (the first warmup steps have an LR of 0: nothing folded yet)
            for v, r in zip(_velocity(eng), ref):
                assert torch.equal(v, r)
        # the shards' copy is taken inside the step and gone after it
        assert eng._shards.before.holds is None
    st = eng.statistics()
    assert phases.count("predict") >= 4 and st["predict_accepted"] >= 4
    # every real step at an LR above 0 folds but the ones that committed a kept run
    real = sum(p != "predict" for p in phases)
    assert st["shard_folds"]["skipped"] >= 2
    assert st["shard_folds"]["folded"] + st["shard_folds"]["skipped"] == real - zero_lr
    # no copy of the masters, no velocity copy, nothing uploaded
    assert st["snapshot_bytes"] == 0 and st["device_velocity_bytes"] == 0
    assert "velocity_upload" not in st["bookkeeping_seconds"] and "shard_capture" in st["bookkeeping_seconds"]


def test_the_shard_fold_is_close_to_the_masters_fold():
    """How exact: against the fold read back from the Adam state (the masters' update up to fp32
    rounding), over the warmup's and the first Full phase's real steps, the same batches: the
    velocity differs by the bf16 rounding of the weights (a few percent, mostly cancelling in
    the average), in direction by much less. The numbers are printed."""
    engines = [_engine("z2", fold=f, warmup_steps=12) for f in ("optimizer_state", "weights16")]
    streams = [Batches(seed=8), Batches(seed=8)]
    for _ in range(12 + 2):
        for e, s in zip(engines, streams):
            assert e.train_step(s.step()).phase != "predict"
    state, shard = (torch.cat(_velocity(e)) for e in engines)
    rel = float((shard - state).norm() / state.norm())
    cos = float(torch.dot(shard, state) / (shard.norm() * state.norm()))
    print(f"weights16 against optimizer_state after 13 folds: relative difference {rel:.4f}, cosine {cos:.5f}")
    assert state.norm() > 0 and rel < 0.25 and cos > 0.97
    # with fp32 weights the shards are the masters: the same velocity up to the fold's fp32 rounding
    engines = [_engine("z2", bf16=False, fold=f, warmup_steps=12) for f in ("optimizer_state", "weights16")]
    streams = [Batches(seed=8), Batches(seed=8)]
    for _ in range(12 + 2):
        for e, s in zip(engines, streams):
            e.train_step(s.step())
    state, shard = (torch.cat(_velocity(e)) for e in engines)
    assert float((shard - state).norm() / state.norm()) < 1e-4


@pytest.mark.parametrize("stage", ["z1", "z3"])
def test_a_rejected_run_rolls_back_exactly_and_the_next_step_folds(stage):
    """Every run rejected by the next step's check: the weights go back to the masters (the
    rollback re-propagates them), so the shards are the masters' rounding again and the checking
    step folds (nothing is skipped)."""
    eng = _engine(stage, velocity="int8")
    eng.predictor.accept = lambda observed, step, div, *more: (False, observed)
    b = Batches(seed=4)
    while eng.controller.phase.value != "predict":
        eng.train_step(b.step())
    weights = full_params(eng)
    while eng.controller.phase.value == "predict":
        eng.train_step(b.step())
    assert any(not torch.equal(a, w) for a, w in zip(weights, full_params(eng)))
    eng.train_step(b.step())   # the check rolls the run back, then takes its own step
    for _ in range(8):
        eng.train_step(b.step())
    st = eng.statistics()
    assert st["predict_rolled_back"] >= 2 and st["predict_accepted"] == 0
    assert st["shard_folds"]["skipped"] == 0 and st["shard_folds"]["folded"] >= 8


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_checkpoint_in_the_middle_of_a_run_resumes_bit_for_bit(stage, tmp_path):
    """Saved after the first Predict step of a run (the velocity beside the shards, int8): the
    resumed engine's weights, masters and velocity, and every later step, equal an
    uninterrupted run's, the commit step's skipped fold included."""
    ref, b = _engine(stage, velocity="int8"), Batches(seed=6)
    resumed, b2 = resumed_in_a_run(ref, b, tmp_path, lambda: _engine(stage, velocity="int8", seed=1))
    skipped = ref.statistics()["shard_folds"]["skipped"]
    for _ in range(6):
        r1, r2 = ref.train_step(b.step()), resumed.train_step(b2.step())
        assert (r1.phase, r1.loss) == (r2.phase, r2.loss)
        for x, y in zip(full_params(ref) + master_copies(ref), full_params(resumed) + master_copies(resumed)):
            assert torch.equal(x, y)
        for x, y in zip(_velocity(ref), _velocity(resumed)):
            assert torch.equal(x, y)
    assert ref.statistics()["shard_folds"]["skipped"] > skipped


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_the_commit_inside_the_step_and_from_a_host_copy_is_the_inline_commit(stage):
    """A kept run's commit with weights16: inside DeepSpeed's CPU Adam step (``fold_in_step``, what
    ``auto`` takes: only the commit goes into the step), inline, and from a host copy of the velocity
    made at the run's first step (``copy_down``, what a velocity on a GPU takes; forced here): the
    same weights, masters and velocity at every step, bit for bit."""
    arms = {"in-step": _engine(stage, velocity="int8"),
            "inline": _engine(stage, velocity="int8", memory={"fold_in_step": False}),
            "copied-down": _engine(stage, velocity="int8")}
    arms["copied-down"]._device_predict.copy_down = True
    assert [e.statistics()["fold_in_step"] for e in arms.values()] == [True, False, True]
    streams = {k: Batches(seed=9) for k in arms}
    for _ in range(14):
        steps = {k: e.train_step(streams[k].step()) for k, e in arms.items()}
        assert len({(r.phase, r.loss) for r in steps.values()}) == 1
        ref = arms["inline"]
        for k, e in arms.items():
            for x, y in zip(full_params(ref) + master_copies(ref) + _velocity(ref),
                            full_params(e) + master_copies(e) + _velocity(e)):
                assert torch.equal(x, y), k
    for k, e in arms.items():
        st = e.statistics()
        assert st["predict_accepted"] >= 4 and st["shard_folds"]["skipped"] >= 2, k
    assert arms["in-step"].statistics()["bookkeeping_seconds"].get("commit_in_step", 0) > 0
    assert "commit_in_step" not in arms["inline"].statistics()["bookkeeping_seconds"]
    down = arms["copied-down"]._device_predict
    assert down._down and all(b.device.type == "cpu" for b in down._down if b is not None)


@pytest.mark.parametrize("changes, match", [
    (dict(predictor={"direction": "adam"}, memory={"offload_predict": "auto"}), "fold_source: weights16.*direction"),
    (dict(memory={"offload_predict": "host"}), "fold_source: weights16.*device-side drift path"),
    (dict(full_steps=1), "fold_source: weights16.*full_steps is 1"),
    (dict(correction_steps=1), "fold_source: weights16.*correction_steps is 1"),
    (dict(memory={"fold_overlap": True}), "fold_overlap: true.*weights16"),
    (dict(memory={"fold_during_run": True}), "fold_during_run: true.*weights16"),
    (dict(memory={"free_velocity_copy": True}), "free_velocity_copy: true.*weights16"),
], ids=["adam", "host-path", "one-full-step", "one-correction-step", "fold-overlap",
        "fold-during-run", "free-velocity-copy"])
def test_what_weights16_cannot_take_is_refused_naming_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        _engine("z2", **changes)


def test_the_planner_puts_the_velocity_beside_the_shards():
    """ds-hybrid plan with fold_source weights16 on a GPU machine: the velocity in GPU memory, its
    host copy for the commit (and that copy's pinned rounding) in host memory instead of the host
    velocity, no GPU copy of it, no snapshot, and the shards' copy at the optimizer step counted
    beyond what the activations leave."""
    from ds_hybrid.memory.planner import estimate, model_shape, preset_spec
    shape = model_shape("llama-1b")
    cfg = ds_config(stage=2, bf16=True, offload_opt="cpu", hybrid=_hybrid(velocity="int8"))
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    plain = dict(cfg, hybrid_predict=_hybrid(fold="optimizer_state", velocity="int8"))
    ours, theirs = (estimate(shape, preset_spec(c), seq_len=1024, micro_batch=4, accelerator="cuda")
                    for c in (cfg, plain))
    items = {(i.where, i.what): i.bytes for i in ours.items}
    assert any(w == "gpu" and t.startswith("drift velocity (") for w, t in items)
    host = {t: b for (w, t), b in items.items() if w == "cpu" and "velocity" in t}
    assert sorted(t.split(" (")[0] for t in host) == ["host copy of the drift velocity for a kept run's commit",
                                                      "pinned-memory rounding of the velocity's host copy"]
    assert not any("velocity copy" in t or "snapshot" in t for _, t in items)
    assert any(w == "gpu" and t.startswith("16-bit shards' copy") for w, t in items)
    assert ours.gpu_bytes >= theirs.gpu_bytes and ours.cpu_bytes == pytest.approx(theirs.cpu_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_fold_and_the_velocity_stay_on_it():
    """ZeRO 2 with offload_optimizer: cpu and bf16 weights on a GPU: the velocity lives on the GPU
    beside the shards (nothing uploaded, no copy), each folding real step puts the rounded
    masters' step into it (by ``kernels.shard_fold``'s kernel where CuPy imports: its fused
    multiply-add may round an fp32 ulp from torch's ops at each fold, so to 1e-5; the torch ops
    otherwise, bit for bit), and a kept run's commit, brought down from it, adds each step's
    ``coef * v`` to the masters in order."""
    from ds_hybrid import kernels
    launches = kernels.LAUNCHES["shard_fold"]
    cfg = ds_config(offload_opt="cpu", bf16=True, hybrid=_hybrid(velocity="fp32"), stage=2)
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    eng = make_engine(cfg, seed=0)
    assert eng.statistics()["offload_predict"] == "device"
    b = Batches(seed=3, device=eng.device)
    beta, ref = eng.hybrid_config.predictor.drift_beta, None
    while eng.controller.phase.value != "predict" or ref is None:
        before, folds = master_copies(eng), eng.statistics()["shard_folds"]["folded"]
        lrs = [float(g["lr"]) for g in eng._masters.base.param_groups]
        eng.train_step(b.step())
        if eng.statistics()["shard_folds"]["folded"] > folds:
            d = [(a - c).cuda() for a, c in zip(_bf16(master_copies(eng)), _bf16(before))]
            gi = eng._masters.group_indices()
            ref = ([x * (1.0 / lrs[g]) for x, g in zip(d, gi)] if ref is None
                   else [v.mul(beta).add(x, alpha=(1.0 - beta) / lrs[g]) for v, x, g in zip(ref, d, gi)])
    assert eng._velocity.buffers and all(b.device.type == "cuda" for b in eng._velocity.buffers if b is not None)
    kernel = kernels.cupy_available()
    assert (kernels.LAUNCHES["shard_fold"] > launches) == kernel
    for v, r in zip(_velocity(eng), ref):
        if kernel:
            torch.testing.assert_close(v, r, rtol=1e-5, atol=1e-6 * float(r.abs().max()))
        else:
            assert torch.equal(v, r)
    masters = master_copies(eng)
    while eng.controller.phase.value == "predict":
        eng.train_step(b.step())
    assert all(torch.equal(a, m) for a, m in zip(masters, master_copies(eng)))   # untouched by the run
    # the run's velocity came down into pinned host buffers for the commit, on a side stream
    assert eng._device_predict.copy_down and eng._device_predict.host_copy_bytes() == eng._velocity.nbytes()
    assert all(b.data.is_pinned() for b in eng._device_predict._down if b is not None)
    expected = committed(masters, eng._masters.group_indices(), list(eng._velocity.buffers),
                         eng._device_predict.pending)
    eng._device_predict.commit(eng._velocity)
    for e, m in zip(expected, master_copies(eng)):
        assert torch.equal(e, m.view(-1))
    st = eng.statistics()
    assert st["device_velocity_bytes"] == 0 and "velocity_upload" not in st["bookkeeping_seconds"]
