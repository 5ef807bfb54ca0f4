"""The drift direction and the Predict phase's memory: the velocity is the running
average of the real updates per unit LR, a Predict step adds exactly scale * lr *
velocity, its storage can be bf16 or int8, the Adam moments can leave the device for
a Predict run without changing a single result, and the Predict forwards run without
autograd or activation checkpointing, in the configured precision."""
import pytest
import torch

import ds_hybrid.zero_access as za
from ds_hybrid import Phase
from ds_hybrid.config import ConfigError, parse_hybrid_config
from ds_hybrid.quant import BLOCK, CompactBuffer
from engine_utils import EAGER, BackwardCounter, Batches, ds_config, full_params, make_engine, master_copies

DRIFT = dict(EAGER, predictor={"direction": "drift", "drift_beta": 0.8})
SETUPS = {"z0-fp32": dict(stage=0), "z1-fp32": dict(stage=1), "z2-bf16": dict(stage=2, bf16=True),
          "z2-offload-cpu": dict(stage=2, offload_opt="cpu"), "z3-fp32": dict(stage=3)}


# ------------------------------------------------------------------ compact storage
def test_compact_buffer_fp32_is_exact_and_bf16_rounds():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    f = CompactBuffer(1000, "fp32", "cpu")
    f.store(x)
    assert torch.equal(f.load(), x) and f.nbytes() == 4000
    loaded = f.load()
    loaded.mul_(2)  # load returns a copy: the stored values must not change
    assert torch.equal(f.load(), x)
    b = CompactBuffer(1000, "bf16", "cpu")
    b.store(x)
    assert b.nbytes() == 2000 and torch.equal(b.load(), x.bfloat16().float())


def test_int8_is_blockwise_unbiased_and_does_not_get_stuck():
    g = torch.Generator().manual_seed(0)
    n = 3 * BLOCK + 17  # a partial last block
    x = torch.randn(n, generator=g) * torch.logspace(-3, 0, n)
    q = CompactBuffer(n, "int8", "cpu")
    q.store(x, generator=g)
    scale = x[:3 * BLOCK].view(3, BLOCK).abs().amax(1) / 127
    err = (q.load() - x)[:3 * BLOCK].view(3, BLOCK).abs()
    assert bool((err <= scale.unsqueeze(1) * 1.0001).all()), "stochastic rounding moves at most one step"
    assert q.nbytes() == 4 * BLOCK + 4 * 4
    # Unbiased: the mean over many roundings is the value.
    mean = torch.stack([(q.store(x, generator=g), q.load())[1] for _ in range(400)]).mean(0)
    assert (mean - x).abs().max() < 0.2 * scale.max()
    # An exponential average stored in int8 decays like the fp32 one (round-to-nearest
    # would freeze every element at one quantization step).
    ema = CompactBuffer(BLOCK, "int8", "cpu")
    big = torch.zeros(BLOCK)
    big[0] = 1.0          # keeps the block's scale at 1/127
    big[1:] = 2.0 / 127   # two steps
    ema.store(big, generator=g)
    for _ in range(60):
        v = ema.load()
        v[1:] *= 0.9
        ema.store(v, generator=g)
    assert ema.load()[1:].abs().mean() < 0.1 * (2.0 / 127)
    with pytest.raises(ValueError, match="multiple of"):
        q.store(x[:10], start=5, generator=g)


# ------------------------------------------------------------------ velocity
def _lrs(engine):
    return [float(g["lr"]) for g in engine._masters.base.param_groups]


@pytest.mark.parametrize("name", list(SETUPS))
def test_velocity_averages_real_updates_and_predict_adds_it(name, monkeypatch):
    engine = make_engine(ds_config(hybrid=DRIFT, **SETUPS[name]))
    batches = Batches()
    beta = 0.8
    expected = None
    while engine.phase is not Phase.PREDICT:
        before, lrs = master_copies(engine), _lrs(engine)
        groups = [p.group_index for p in engine._masters.partitions()]
        engine.train_step(batches.step())
        after = master_copies(engine)
        if lrs[0] == 0:  # the first warmup step: nothing moves, nothing is folded in
            continue
        deltas = [(a - b) / lrs[gi] for a, b, gi in zip(after, before, groups)]
        expected = deltas if expected is None else [beta * e + (1 - beta) * d for e, d in zip(expected, deltas)]
    for i, exp in enumerate(expected):
        if exp.numel():
            torch.testing.assert_close(engine._velocity.buffers[i].load().view_as(exp), exp, rtol=1e-4, atol=1e-6)
    assert engine.statistics()["velocity_bytes"] == 4 * sum(e.numel() for e in expected)

    before = master_copies(engine)
    scale = engine.predictor.step_scale()
    lrs = _lrs(engine)
    counter = BackwardCounter(monkeypatch)
    result = engine.train_step(batches.step())
    assert result.phase == "predict" and not result.backward_ran and counter.calls == 0
    assert scale > 0 and result.accepted
    for i, (b, a, part) in enumerate(zip(before, master_copies(engine), engine._masters.partitions())):
        if b.numel():
            want = b + scale * lrs[part.group_index] * engine._velocity.buffers[i].load().view_as(b)
            torch.testing.assert_close(a, want, rtol=1e-6, atol=1e-7)


def test_drift_rollback_is_exact():
    engine = make_engine(ds_config(stage=1, hybrid=DRIFT))
    batches = Batches()
    while engine.phase is not Phase.PREDICT:
        engine.train_step(batches.step())
    start = master_copies(engine)
    engine.predictor.accept = lambda observed, step, div, *more: (False, observed)
    result = engine.train_step(batches.step())
    assert result.accepted is False and result.rolled_back_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(start, master_copies(engine)))


@pytest.mark.parametrize("dtype, per_value", [("bf16", 2.0), ("int8", 1.0 + 4.0 / BLOCK)])
def test_low_precision_velocity_trains_and_costs_less(dtype, per_value):
    cfg = ds_config(stage=1, hybrid=dict(DRIFT, memory={"velocity_dtype": dtype}))
    engine = make_engine(cfg)
    batches = Batches()
    results = [engine.train_step(batches.step()) for _ in range(14)]
    assert any(r.phase == "predict" and r.accepted for r in results)
    numel = sum(p.master.numel() for p in engine._masters.partitions())
    assert engine.statistics()["velocity_bytes"] <= per_value * numel + 4 * 4 + BLOCK


# ------------------------------------------------------------------ parking the moments
def _run(engine, batches, steps):
    return [(r.phase, r.loss, r.accepted) for r in (engine.train_step(batches.step()) for _ in range(steps))]


@pytest.mark.parametrize("stage, mode", [(1, "deepspeed"), (2, "deepspeed"), (0, "own")])
def test_parking_changes_nothing_but_where_the_moments_are(stage, mode):
    hybrid = dict(DRIFT, memory={"park_optimizer_states": True})
    plain = make_engine(ds_config(stage=stage, hybrid=DRIFT))
    rows_plain = _run(plain, Batches(), 16)

    parked = make_engine(ds_config(stage=stage, hybrid=hybrid))
    parked._parking.mode = mode  # on a CPU-only machine 'auto' picks 'host' (nothing to move)
    batches = Batches()
    rows, seen_parked = [], False
    for _ in range(16):
        if parked.phase is Phase.PREDICT and parked.controller.predict_index > 0:
            seen_parked = True
            assert parked._parking.parked
            if mode == "deepspeed":
                from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
                assert OffloadStateTypeEnum.optim_states in parked.optimizer.offloaded_states
        r = parked.train_step(batches.step())
        rows.append((r.phase, r.loss, r.accepted))
        if parked.phase is not Phase.PREDICT:
            assert not parked._parking.parked, "the moments must be back before a real step"
    assert seen_parked
    assert rows == rows_plain
    assert all(torch.equal(a, b) for a, b in zip(master_copies(plain), master_copies(parked)))
    assert parked.statistics()["moment_parking"] == mode


def test_parking_needs_the_drift_direction():
    with pytest.raises(ConfigError, match="memory.park_optimizer_states needs predictor.direction"):
        parse_hybrid_config({"hybrid_predict": {"memory": {"park_optimizer_states": True}}})
    with pytest.raises(ConfigError, match="hybrid_predict.memory.velocity_dtype"):
        parse_hybrid_config({"hybrid_predict": {"memory": {"velocity_dtype": "int4"}}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap, mode", [(True, "stream"), (False, "deepspeed")])
def test_parking_frees_device_memory_on_gpu(overlap, mode):
    hybrid = dict(DRIFT, memory={"park_optimizer_states": True, "park_overlap": overlap})
    engine = make_engine(ds_config(stage=1, hybrid=hybrid))
    batches = Batches(device=engine.device)
    while not (engine.phase is Phase.PREDICT and engine.controller.predict_index > 0):
        engine.train_step(batches.step())
    torch.cuda.synchronize()
    assert engine._parking.mode == mode and engine._parking.device_bytes() == 0
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
    assert engine._parking.device_bytes() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overlapped_parking_trains_bit_identically_on_gpu(stage):
    # The side-stream copies (out under the Predict forwards, back under the next real
    # step's forward/backward) must not change a single number: same phases, losses, masters.
    plain = make_engine(ds_config(stage=stage, hybrid=DRIFT))
    rows_plain = _run(plain, Batches(device=plain.device), 24)
    hybrid = dict(DRIFT, memory={"park_optimizer_states": True, "park_overlap": True})
    parked = make_engine(ds_config(stage=stage, hybrid=hybrid))
    batches = Batches(device=parked.device)
    rows = _run(parked, batches, 24)
    assert parked._parking.mode == "stream"
    assert sum(r[0] == "predict" for r in rows) >= 4
    assert rows == rows_plain
    assert all(torch.equal(a, b) for a, b in zip(master_copies(plain), master_copies(parked)))
    while parked.phase is Phase.PREDICT:   # end the run: the moments come back to the GPU
        parked.train_step(batches.step())
    m = [t for t in parked._parking._moments()]
    assert m and all(t.is_cuda for t in m) and not parked._parking._incoming


@pytest.mark.parametrize("setup", ["z1-fp32", "z2-offload-cpu"])
def test_folding_real_updates_builds_no_autograd_graph(setup):
    # The masters are leaves that require grad: folding outside no_grad chained every
    # velocity chunk into a graph kept alive by the velocity (host memory grew ~10 GB a real
    # step at 1B parameters, found on the GPU machine).
    engine = make_engine(ds_config(**SETUPS[setup], hybrid=dict(DRIFT, memory={"velocity_dtype": "fp32"})))
    assert any(p.master.requires_grad for p in engine._masters.partitions())
    batches = Batches()
    for _ in range(6):
        engine.train_step(batches.step())
    assert engine._velocity.updates > 0
    bufs = [b for b in engine._velocity.buffers if b is not None]
    assert bufs and not any(b.data.requires_grad or b.data.grad_fn is not None for b in bufs)


# ------------------------------------------------------------------ Predict forwards
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_predict_forwards_skip_autograd_and_checkpointing_and_use_autocast(device):
    # On CUDA DeepSpeed's forward switches an outer autocast off (its autocast_if_enabled):
    # the dtype inside the model is what counts. (On the CPU accelerator it leaves it on.)
    hybrid = dict(DRIFT, memory={"predict_autocast": "bf16"})
    engine = make_engine(ds_config(stage=1, hybrid=hybrid))
    assert engine.device.type == device
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = []
    inside = []   # the dtype a Linear in the model computes in: DeepSpeed's forward could turn autocast off
    engine.module.lm_head.register_forward_hook(lambda m, i, out: inside.append(out.dtype))

    def loss_fn(eng, batch):
        layers = [m for m in eng.module.modules() if hasattr(m, "gradient_checkpointing")]
        seen.append((eng.phase.value, torch.is_grad_enabled(), torch.is_autocast_enabled(device),
                     any(m.gradient_checkpointing for m in layers)))
        loss = eng(**batch).loss
        seen[-1] += (inside[-1],)
        return loss

    batches = Batches(device=engine.device)
    for _ in range(12):
        engine.train_step(batches.step(), loss_fn=loss_fn)
    predict = [s for s in seen if s[0] == "predict"]
    real = [s for s in seen if s[0] != "predict"]
    assert predict and all(s[1:] == (False, True, False, torch.bfloat16) for s in predict)
    assert real and all(s[1:] == (True, False, True, torch.float32) for s in real)
    assert not engine.torch_autocast_enabled()   # the engine's own setting is back


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_save_in_a_parked_run_and_resume_is_exact(tmp_path, device):
    # CPU: DeepSpeed's offload_states path (forced: on the CPU nothing would move). CUDA: the
    # overlapped side-stream path, saved mid-run (torch's AdamW: no JIT-built FusedAdam needed).
    hybrid = dict(DRIFT, memory={"park_optimizer_states": True, "velocity_dtype": "int8"})
    cfg = ds_config(stage=2, hybrid=hybrid)
    if device == "cuda":
        cfg["optimizer"]["params"]["torch_adam"] = True
    mode = "deepspeed" if device == "cpu" else "stream"
    engine = make_engine(cfg)
    assert engine.device.type == device
    if device == "cpu":
        engine._parking.mode = mode
    batches = Batches(device=engine.device)
    saved_at = None
    rows = []
    for step in range(1, 19):
        r = engine.train_step(batches.step())
        rows.append((r.phase, r.loss, r.accepted))
        if saved_at is None and engine.phase is Phase.PREDICT and engine.controller.predict_index == 1:
            assert engine._parking.parked and engine._parking.mode == mode
            engine.save_checkpoint(tmp_path, "mid")
            assert engine._parking.parked, "saving must leave the run as it was"
            saved_at, stream_state = step, batches.gen.get_state()
    assert saved_at is not None
    resumed = make_engine(cfg, seed=5)
    if device == "cpu":
        resumed._parking.mode = mode
    resumed.load_checkpoint(tmp_path, "mid")
    batches.gen.set_state(stream_state)
    tail = []
    for _ in range(saved_at + 1, 19):
        r = resumed.train_step(batches.step())
        tail.append((r.phase, r.loss, r.accepted))
    assert tail == rows[saved_at:]
    assert all(torch.equal(a, b) for a, b in zip(master_copies(engine), master_copies(resumed)))


def test_lr_gate_predicts_only_once_the_lr_has_decayed():
    # WarmupDecayLR: up to 3e-3 in 4 steps, then linearly down to 0 at step 40.
    cfg = ds_config(stage=1, hybrid=dict(DRIFT, predict_lr_fraction=0.5),
                    scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                                  "warmup_num_steps": 4, "total_num_steps": 40}})
    engine = make_engine(cfg)
    batches = Batches()
    rows = [engine.train_step(batches.step()) for _ in range(36)]
    first = next(i for i, r in enumerate(rows) if r.phase == "predict")
    peak = max(r.lr for r in rows)
    assert rows[first - 1].lr <= 0.5 * peak + 1e-12, "the first Predict run starts once the LR is half its peak"
    assert all(r.lr > 0.5 * peak for r in rows[5:first - 1])  # ... and not before
    assert engine.hybrid_state_dict()["max_lr"] == peak


# ------------------------------------------------------------------ fused lp copy
@pytest.mark.parametrize("stage, extra", [(0, {}), (1, {}), (2, {}), (1, {"data_types": {"grad_accum_dtype": "fp32"}})],
                         ids=["zero0", "zero1", "zero2", "zero1-bf16-optimizer"])
def test_fused_update_writes_the_16bit_copy_and_propagate_only_gathers(stage, extra, monkeypatch):
    # bf16 on ZeRO 0 (FP16_Optimizer's flat buffers), ZeRO 1/2 and BF16_Optimizer: the predicted update writes each rank's
    # 16-bit partition in its pass, so propagate skips update_lp_params' copy. The weights the
    # forward reads must be bit-identical to the copying path, step for step.
    hybrid = dict(EAGER)
    fused = make_engine(ds_config(stage=stage, bf16=True, hybrid=hybrid, **extra))
    copying = make_engine(ds_config(stage=stage, bf16=True, hybrid=hybrid, **extra))
    assert fused._masters.kind in ("zero0-flat", "bf16-optimizer", "zero1-2")
    monkeypatch.setattr(copying._masters, "_lp", lambda i: None)   # this engine only
    skipped_copies = {"fused": 0, "copying": 0}   # propagations that found the 16-bit copy written
    for name, eng in (("fused", fused), ("copying", copying)):
        orig = eng._masters.propagate

        def counted(orig=orig, name=name, access=eng._masters):
            skipped_copies[name] += access.lp_current
            return orig()
        monkeypatch.setattr(eng._masters, "propagate", counted)
    b1, b2 = Batches(), Batches()
    predicted = 0
    for _ in range(14):
        r1, r2 = fused.train_step(b1.step()), copying.train_step(b2.step())
        assert (r1.phase, r1.loss) == (r2.phase, r2.loss)
        predicted += r1.phase == "predict"
        assert all(torch.equal(x, y) for x, y in zip(full_params(fused), full_params(copying)))
    assert predicted >= 4
    assert skipped_copies == {"fused": predicted, "copying": 0}
    assert not fused._masters.lp_current


@pytest.mark.parametrize("stage", [1, 2])
def test_an_offloaded_propagate_goes_through_pinned_chunks_and_writes_deepspeeds_bits(stage, monkeypatch):
    # Under offload_optimizer the masters reach the 16-bit partitions through the stager (beside
    # a GPU: pinned chunks, the cast on the host) instead of update_lp_params' direct copy; the
    # weights are DeepSpeed's copy bit for bit (bf16, masters moved off the bf16 grid by hand).
    _offloaded_propagate_matches_deepspeed(stage, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_an_offloaded_propagate_writes_deepspeeds_bits(monkeypatch):
    # The same beside a GPU: host masters, bf16 partitions on the GPU, pinned chunks on a side stream.
    _offloaded_propagate_matches_deepspeed(2, monkeypatch)


def _offloaded_propagate_matches_deepspeed(stage: int, monkeypatch) -> None:
    from ds_hybrid.staging import Stager
    eng = make_engine(ds_config(stage=stage, bf16=True, offload_opt="cpu", hybrid=dict(EAGER)))
    b = Batches(device=eng.device)
    for _ in range(3):
        eng.train_step(b.step())
    uploads = []
    upload = Stager.upload
    monkeypatch.setattr(Stager, "upload", lambda self, dst, src, *a, **k: (uploads.append(dst.numel()),
                                                                            upload(self, dst, src, *a, **k)))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for part in eng._masters.partitions():
            part.master.add_(torch.randn(part.master.shape, generator=gen) * 1e-3)
    eng._masters.propagate()
    ours = [p.detach().clone() for p in full_params(eng)]
    assert uploads == [part.master.numel() for part in eng._masters.partitions()]
    with torch.no_grad():
        for p in eng.module.parameters():
            p.zero_()
    eng.optimizer.update_lp_params()
    assert all(torch.equal(x, y) for x, y in zip(ours, full_params(eng)))
    assert not eng._masters.lp_current


def test_compact_buffer_work_buffers_give_the_same_bits():
    # The host path's reused work buffers (quant.scratch) and in-place quantization must
    # store and load exactly what the allocating path does.
    from ds_hybrid.quant import CHUNK, scratch
    n = 2 * BLOCK * 40 + 100          # a partial last block
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for dtype in ("fp32", "bf16", "int8"):
        a, b = CompactBuffer(n, dtype, "cpu"), CompactBuffer(n, dtype, "cpu")
        a.store(x, 0, torch.Generator().manual_seed(1))
        b.store(x.clone(), 0, torch.Generator().manual_seed(1), clobber=True)
        assert torch.equal(a.data, b.data)
        work = scratch("cpu", 1, n)
        got = b.load(0, n, out=work)
        assert torch.equal(got, a.load()) and got.data_ptr() == work.data_ptr()
        assert torch.equal(b.load(BLOCK, 3 * BLOCK, out=work), a.load(BLOCK, 3 * BLOCK))
    assert scratch("cpu", 1, 10) is scratch("cpu", 1, n) and scratch("cpu", 1, n).numel() >= n   # kept, grown
    assert scratch("cpu", 1, 10 * CHUNK).numel() == CHUNK                                       # at most a chunk
