"""``memory.gradient_state_dtype: int8-factored``: a gradient Predict run's first moment in int8
blocks, its second from a matrix's row and column means, each parameter's gradient clipped to its
share of the threshold and folded into the first moment as the backward produces it (no gradient
held), the weights moved from the stored moments after the backward; kept, rolled back, saved in
the middle of a run and resumed on ZeRO 1, 2 and 3 under ``offload_optimizer: cpu`` (ZeRO 3 also
with ``offload_param: cpu``)."""
import math
from types import SimpleNamespace

import pytest
import torch

from ds_hybrid import kernels
from ds_hybrid.compact_moments import CompactMoments
from ds_hybrid.config import ConfigError
from ds_hybrid.engine import default_loss
from ds_hybrid.phases import Phase
from ds_hybrid.quant import BLOCK, CompactBuffer
from engine_utils import (EAGER, Batches, commit_and_check, ds_config, full_params, make_engine, master_copies,
                          steps_alike)

GRAD = dict(EAGER, check="next_step", correction_steps=0, predictor={"direction": "gradient"})


def _compact(stage: int | str = 2, bf16: bool = False, dtype: str = "int8-factored", seed: int = 0, gas: int = 1,
             **memory):
    """``stage`` 3p: ZeRO 3 with ``offload_param: cpu`` too (the 16-bit partitions in host memory)."""
    hybrid = dict(GRAD, memory={"offload_predict": "device", "gradient_state_dtype": dtype, **memory})
    param = "cpu" if stage == "3p" else None
    return make_engine(ds_config(stage=3 if stage == "3p" else stage, offload_opt="cpu", offload_param=param,
                                 bf16=bf16, gas=gas, hybrid=hybrid), seed=seed)


def _until(engine, batches, phase: Phase, limit: int = 40) -> None:
    for _ in range(limit):
        if engine.phase is phase:
            return
        engine.train_step(batches.step())
    raise AssertionError(f"no {phase.value} step within {limit} steps")


def _moments(engine, key: str) -> list[torch.Tensor]:
    return [p.state[key].detach().clone() for p in engine._masters.partitions()]


def _equal(xs, ys) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


def _run_m(engine) -> list[torch.Tensor]:
    """The run's first moment as fp32, laid out like each partition's ``exp_avg`` (the optimizer's
    values where the partition holds no slice)."""
    out = []
    for i, part in enumerate(engine._masters.partitions()):
        flat = part.state["exp_avg"].detach().clone().view(-1)
        for s in engine._gradient.moments.parts[i] or ():
            flat[s.ms:s.ms + s.n] = s.m.load()
        out.append(flat)
    return out


# ------------------------------------------------------------------ the state itself
def _fake_partition(v: torch.Tensor, m: torch.Tensor):
    return SimpleNamespace(state={"exp_avg": m, "exp_avg_sq": v}, master=torch.zeros(v.numel()),
                           group={"betas": (0.9, 0.999)}, step=5)


def _layout():
    """A 7 x 8 matrix whose slice starts inside its first row (values 3 .. 50: a head of 5, five
    whole rows, a tail of 3) and a 1-D parameter after it, in one partition of 54 values."""
    w, b = torch.nn.Parameter(torch.zeros(7, 8)), torch.nn.Parameter(torch.zeros(6))
    return w, b, [[(w, 3, 0, 48), (b, 0, 48, 6)]]


def test_the_second_moment_is_exact_off_the_rows_and_a_rank_one_fit_on_them():
    w, b, slices = _layout()
    gen = torch.Generator().manual_seed(0)
    r, c = torch.rand(7, generator=gen) + 0.1, torch.rand(8, generator=gen) + 0.1
    v_w = torch.outer(r, c).reshape(-1)[3:51]   # rank one: the factoring gives it back
    v_w[:5] += 1.0   # (the head is off the rows: held exactly whatever it is)
    v = torch.cat([v_w, torch.rand(6, generator=gen)])
    cm = CompactMoments(slices, [w, b], torch.device("cpu"))
    cm.build([_fake_partition(v, torch.zeros_like(v))], key=1, all_reduce=lambda t: None)
    s_w, s_b = cm.parts[0]
    assert (s_w.head, s_w.rows, s_w.tail, s_w.cols) == (5, 5, 3, 8) and (s_b.head, s_b.rows) == (6, 0)
    got = torch.cat([t for s in (s_w, s_b) for _, _, t in cm._v_ranges(s)])
    torch.testing.assert_close(got, v, rtol=1e-6, atol=0)
    assert s_w.r.numel() + s_w.c.numel() + s_w.dense_v.numel() == 5 + 8 + 8   # (not 48 values)
    # each parameter's share of the clip threshold: its part of the norm v expects
    total = math.sqrt(float(v.double().sum()))
    assert cm.shares[w] == pytest.approx(math.sqrt(float(v_w.double().sum())) / total, rel=1e-6)
    assert cm.shares[b] == pytest.approx(math.sqrt(float(v[48:].double().sum())) / total, rel=1e-6)


def test_a_fold_is_the_clipped_moment_within_the_int8_rounding_and_the_step_is_adams_from_the_stored_state():
    w, b, slices = _layout()
    gen = torch.Generator().manual_seed(1)
    m0, v = torch.randn(54, generator=gen) * 1e-2, torch.rand(54, generator=gen) * 1e-4 + 1e-6
    cm = CompactMoments(slices, [w, b], torch.device("cpu"))
    cm.build([_fake_partition(v, m0)], key=2, all_reduce=lambda t: None)
    start = torch.cat([s.m.load() for s in cm.parts[0]])
    # (one int8 step of a block's absmax: stochastic rounding moves a value by less)
    torch.testing.assert_close(start, m0, rtol=0, atol=float(m0.abs().max()) / 127)
    g = torch.randn(56, generator=gen)   # w's whole gradient
    norm = float(g.norm())
    cm.fold(w, g, torch.tensor(norm), clip=1.0, beta1=0.9, weight=1.0, first=True, key=3)
    coef = (norm + 1e-6) / (1.0 * cm.shares[w] + 1e-12)
    assert coef > 1   # (clipped: its norm is over its share of the threshold)
    want = 0.9 * start[:48] + 0.1 * g[3:51] / coef
    got = cm.parts[0][0].m.load()
    torch.testing.assert_close(got, want, rtol=0, atol=2 * float(want.abs().max()) / 127)
    assert torch.equal(cm.parts[0][1].m.load(), start[48:]), "another parameter's moment is untouched"
    # The step: Adam's with the stored first moment and the factored second, a range at a time.
    shard = torch.randn(54, generator=gen)
    expect = shard.clone()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=5, weight_decay=0.01, decoupled=True,
              bias_correction=True)
    m_all = torch.cat([s.m.load() for s in cm.parts[0]])
    v_all = torch.cat([t for s in cm.parts[0] for _, _, t in cm._v_ranges(s)])
    kernels.held_adam_step_reference(expect, m_all, v_all, **kw)
    cm.step(0, shard, lambda x, m, v, key: kernels.held_adam_step(x, m, v, key=key, backend="torch", **kw), key=4)
    torch.testing.assert_close(shard, expect, rtol=0, atol=1e-7)


@pytest.mark.parametrize("chunk", [1 << 22, 256])
def test_a_real_steps_gradient_folds_into_both_moments_as_the_whole_steps_would(chunk, monkeypatch):
    """``fold_real_step`` (``memory.cpu_step_behind``'s cover): the first moment is ``0.9 m + 0.1 g`` within
    its int8 rounding, and the second's dense head and tail, row means and column means are those of
    ``0.999 v + 0.001 g^2``, whether a chunk holds the slice or cuts its rows (256 values across rows of
    24: each chunk's partial rows summed into the right ones); the shares follow the stepped second
    moment, and the caller's gradient is left as it was."""
    from ds_hybrid import compact_moments
    monkeypatch.setattr(compact_moments, "CHUNK", chunk)
    w, b = torch.nn.Parameter(torch.zeros(40, 24)), torch.nn.Parameter(torch.zeros(6))
    slices = [[(w, 5, 0, 900), (b, 0, 900, 6)]]   # (w's values 5 .. 904: a head of 19, 36 rows, a tail of 17)
    gen = torch.Generator().manual_seed(5)
    m0, v0 = torch.randn(906, generator=gen) * 1e-2, torch.rand(906, generator=gen) * 1e-4 + 1e-6
    cm = CompactMoments(slices, [w, b], torch.device("cpu"))
    cm.build([_fake_partition(v0, m0)], key=2, all_reduce=lambda t: None)
    s_w, s_b = cm.parts[0]
    assert (s_w.head, s_w.rows, s_w.tail) == (19, 36, 17)
    start = torch.cat([s.m.load() for s in cm.parts[0]])
    g = torch.randn(906, generator=gen) * 1e-2
    g_before = g.clone()
    for k, s in enumerate(cm.parts[0]):
        cm.fold_real_step(s, g[s.ms:s.ms + s.n], 0.9, 0.999, key=7 + k)
    cm.refresh_shares(lambda t: None)
    assert torch.equal(g, g_before)
    want_m = 0.9 * start + 0.1 * g
    got_m = torch.cat([s.m.load() for s in cm.parts[0]])
    torch.testing.assert_close(got_m, want_m, rtol=0, atol=2 * float(want_m.abs().max()) / 127)
    v = 0.999 * v0 + 0.001 * g * g
    body = v[19:19 + 36 * 24].view(36, 24)
    torch.testing.assert_close(s_w.r, body.mean(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close(s_w.c, body.mean(dim=0), rtol=1e-5, atol=0)
    torch.testing.assert_close(s_w.dense_v, torch.cat([v[:19], v[883:900]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(s_b.dense_v, v[900:], rtol=1e-6, atol=0)
    assert s_w.r_mean == pytest.approx(float(body.mean(dim=1).double().mean()), rel=1e-5)
    assert s_w.v_sum == pytest.approx(float(v[:900].double().sum()), rel=1e-5)
    total = math.sqrt(float(v.double().sum()))
    assert cm.shares[b] == pytest.approx(math.sqrt(float(v[900:].double().sum())) / total, rel=1e-5)


def _folded_state(g: torch.Tensor, device: str, **stage) -> list[torch.Tensor]:
    """The state of ``test_a_real_steps_gradient...``'s layout on ``device`` after ``fold_real_step``
    of ``g`` (given ``stage``): each slice's first moment, row and column means, dense values and sums."""
    w, b = torch.nn.Parameter(torch.zeros(40, 24)), torch.nn.Parameter(torch.zeros(6))
    gen = torch.Generator().manual_seed(5)
    m0, v0 = torch.randn(906, generator=gen) * 1e-2, torch.rand(906, generator=gen) * 1e-4 + 1e-6
    cm = CompactMoments([[(w, 5, 0, 900), (b, 0, 900, 6)]], [w, b], torch.device(device))
    cm.build([_fake_partition(v0.to(device), m0.to(device))], key=2, all_reduce=lambda t: None)
    for k, s in enumerate(cm.parts[0]):
        cm.fold_real_step(s, g[s.ms:s.ms + s.n], 0.9, 0.999, key=7 + k, **stage)
    out = []
    for s in cm.parts[0]:
        out += [s.m.load().cpu(), s.dense_v.cpu(), torch.tensor([s.r_mean, s.v_sum], dtype=torch.float64)]
        if s.rows:
            out += [s.r.cpu(), s.c.cpu()]
    return out


@pytest.mark.parametrize("chunk", [1 << 22, 256])
def test_a_real_steps_gradient_crosses_through_the_stager_as_its_16_bit_values(chunk, monkeypatch):
    """``fold_real_step`` with a stager's copy (the compact cover's gradient on its way to a GPU, in the
    16-bit weights' dtype): the state is bit for bit the fold of the gradient rounded to bf16 without
    one, chunk after chunk through the stager's two buffers in turn (its chunk of 64 values cuts
    each of the fold's), and the caller's fp32 gradient is left as it was."""
    from ds_hybrid import compact_moments
    from ds_hybrid.staging import Stager
    monkeypatch.setattr(compact_moments, "CHUNK", chunk)
    g = torch.randn(906, generator=torch.Generator().manual_seed(9)) * 1e-2
    g_before = g.clone()
    staged = _folded_state(g, "cpu", copy=Stager(chunk=64).upload, dtype=torch.bfloat16)
    assert torch.equal(g, g_before)
    direct = _folded_state(g.to(torch.bfloat16).float(), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(staged, direct))
    unrounded = _folded_state(g, "cpu")   # (the rounding is there: not the fp32 gradient's state)
    assert not all(torch.equal(x, y) for x, y in zip(staged, unrounded))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_real_steps_gradient_crosses_through_pinned_chunks_as_the_direct_copy_of_its_bf16(monkeypatch):
    from ds_hybrid import compact_moments
    from ds_hybrid.staging import Stager
    monkeypatch.setattr(compact_moments, "CHUNK", 256)   # (several chunks through the two pinned buffers)
    g = torch.randn(906, generator=torch.Generator().manual_seed(9)) * 1e-2
    staged = _folded_state(g, "cuda", copy=Stager(chunk=64).upload, dtype=torch.bfloat16)
    direct = _folded_state(g.to(torch.bfloat16).float().cuda(), "cuda")
    assert all(torch.equal(x, y) for x, y in zip(staged, direct))


def test_each_slices_first_moment_is_whole_int8_blocks_of_its_own():
    w, b, slices = _layout()
    cm = CompactMoments(slices, [w, b], torch.device("cpu"))
    cm.build([_fake_partition(torch.ones(54), torch.ones(54))], key=0, all_reduce=lambda t: None)
    assert [s.m.data.numel() for s in cm.parts[0]] == [BLOCK, BLOCK]
    # A matrix's whole state: a byte a value, a scale per block, its rows' and columns' means
    # (1.09 bytes a value at 64 x 512, 1.018 at 4096 x 4096; the bf16 state's two moments take 4)
    big = torch.nn.Parameter(torch.zeros(64, 512))
    cm = CompactMoments([[(big, 0, 0, big.numel())]], [big], torch.device("cpu"))
    cm.build([_fake_partition(torch.ones(big.numel()), torch.ones(big.numel()))], key=0, all_reduce=lambda t: None)
    assert cm.nbytes() == big.numel() + big.numel() // BLOCK * 4 + (64 + 512) * 4


def test_int4_blocks_hold_two_values_a_byte_unbiased_within_one_step():
    """``CompactBuffer`` int4: half a byte a value and a scale a block, each value within one
    step (absmax / 7) of what was stored, unbiased over many roundings, read back from any range,
    and a window and a saved state that give the same values."""
    g = torch.Generator().manual_seed(0)
    n = 3 * BLOCK + 17  # a partial last block
    x = torch.randn(n, generator=g) * torch.logspace(-3, 0, n)
    q = CompactBuffer(n, "int4", "cpu")
    q.store(x, generator=g)
    assert q.nbytes() == 4 * BLOCK // 2 + 4 * 4
    scale = x[:3 * BLOCK].view(3, BLOCK).abs().amax(1) / 7
    err = (q.load() - x)[:3 * BLOCK].view(3, BLOCK).abs()
    assert bool((err <= scale.unsqueeze(1) * 1.0001).all()), "stochastic rounding moves at most one step"
    assert torch.equal(q.load(BLOCK + 3, 2 * BLOCK + 9), q.load()[BLOCK + 3:2 * BLOCK + 9])
    assert torch.equal(q.window(BLOCK, n).load(), q.load()[BLOCK:])
    mean = torch.stack([(q.store(x, generator=g), q.load())[1] for _ in range(400)]).mean(0)
    assert (mean - x).abs().max() < 0.2 * scale.max()
    again = CompactBuffer(n, "int4", "cpu")
    again.load_state_dict(q.state_dict())
    assert torch.equal(again.load(), q.load())
    with pytest.raises(ValueError, match="int4 writes start on a multiple of"):
        q.store(x[:10], start=5, generator=g)


# ------------------------------------------------------------------ in the engine
@pytest.mark.parametrize("stage, dtype", [(1, "int8-factored"), (2, "int8-factored"), (2, "int4-factored"),
                                          (3, "int8-factored"), ("3p", "int4-factored")])
def test_runs_train_as_the_full_size_state_does_and_a_kept_run_hands_over_its_first_moment(stage, dtype):
    """The same phases as the fp32 device path's, losses within the compact state's reach of them,
    runs kept; at a kept run's end the optimizer's first moment is the run's, dequantized."""
    ref, eng = _compact(stage, dtype="fp32"), _compact(stage, dtype=dtype)
    assert eng._gradient.compact == dtype[:4] and eng._gradient.on_device
    assert eng.statistics()["commit_overlap"] is False
    a, b = Batches(seed=2), Batches(seed=2)
    handed = []
    commit = eng._gradient._commit_compact

    def recorded(resync, background=False):
        want = _run_m(eng)
        commit(resync, background)
        handed.append((want, _moments(eng, "exp_avg")))
    eng._gradient._commit_compact = recorded
    for _ in range(16):
        ra, rb = ref.train_step(a.step()), eng.train_step(b.step())
        assert ra.phase == rb.phase and rb.loss == pytest.approx(ra.loss, rel=3e-2)
        if rb.phase == "predict":
            assert eng._gradient.m is None and eng._gradient.moments is not None
            assert all(p.grad is None for p in eng.module.parameters())
    assert eng.statistics()["predict_accepted"] >= 4 and eng.statistics()["gradient_nonfinite_steps"] == 0
    assert len(handed) >= 2
    for want, got in handed:
        assert _equal([g.view(-1) for g in got], want)
    assert not eng._gradient.pending


@pytest.mark.parametrize("stage", [2, 3])
def test_with_accumulation_the_run_takes_the_mean_of_the_micro_batches_gradients(stage):
    """Two micro-batches a step and no clipping: after a run's first step the compact first moment is
    ``beta1 m + (1 - beta1) mean(g)`` over the micro-batches (the first decays it, the second only adds),
    as the full-size state's is, within its int8 rounding (stored at the build and at each fold)."""
    def make(dtype):
        hybrid = dict(GRAD, memory={"offload_predict": "device", "gradient_state_dtype": dtype})
        return make_engine(ds_config(stage=stage, offload_opt="cpu", gas=2, hybrid=hybrid, gradient_clipping=0.0))
    ref, eng = make("fp32"), make("int8-factored")
    a, b = Batches(seed=5), Batches(seed=5)
    for _ in range(40):
        ra, rb = ref.train_step(a.step(2)), eng.train_step(b.step(2))
        assert ra.phase == rb.phase and ra.loss == rb.loss
        if rb.phase == "predict":
            break
    else:
        raise AssertionError("no Predict step within 40 steps")
    pairs = [(got, want.view(-1)) for got, want in zip(_run_m(eng), ref._gradient.m) if want is not None]
    assert pairs
    for got, want in pairs:
        assert not torch.equal(want, torch.zeros_like(want))
        torch.testing.assert_close(got, want, rtol=0, atol=2 * float(want.abs().max()) / 127)


@pytest.mark.parametrize("stage", [1, 2, 3, "3p"])
def test_a_rolled_back_compact_run_restores_weights_masters_and_moments_exactly(stage, monkeypatch):
    engine = _compact(stage)
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    good = (master_copies(engine), full_params(engine), _moments(engine, "exp_avg"))
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
    assert not _equal(full_params(engine), good[1])
    seen = {}
    check = engine._check_predicted_update

    def checked(loss, batch, out):
        redo = check(loss * 10, batch, out)   # a spike: out of the band
        seen.update(state=(master_copies(engine), full_params(engine), _moments(engine, "exp_avg")))
        return redo
    monkeypatch.setattr(engine, "_check_predicted_update", checked)
    r = engine.train_step(batches.step())
    assert r.checked is False and engine.statistics()["predict_rolled_back"] == 2
    for got, want in zip(seen["state"], good):
        assert _equal(got, want)
    assert not engine._gradient.pending


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nonfinite_gradient_moves_nothing_and_takes_the_first_moment_again(stage):
    """A NaN gradient: the step moves no weight, is counted, and the run's first moment, which took
    the NaN, is taken again from the optimizer's (within the int8 rounding of it)."""
    engine = _compact(stage)
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    engine.train_step(batches.step())   # (the run's first step: its moments are made)
    before = full_params(engine)

    def nan_in_predict(eng, batch):
        loss = default_loss(eng, batch)
        return loss * float("nan") if eng.phase is Phase.PREDICT else loss
    r = engine.train_step(batches.step(), loss_fn=nan_in_predict)
    assert r.phase == "predict" and _equal(full_params(engine), before)
    assert engine.statistics()["gradient_nonfinite_steps"] == 1 and engine._gradient.pending
    for got, opt in zip(_run_m(engine), _moments(engine, "exp_avg")):
        torch.testing.assert_close(got, opt.view(-1), rtol=0, atol=float(opt.abs().max()) / 127 * 1.01)
    for _ in range(4):
        assert engine.train_step(batches.step()).loss is not None


@pytest.mark.parametrize("stage, bf16, dtype", [(1, False, "int8-factored"), (2, False, "int8-factored"),
                                               (2, True, "int8-factored"), (2, True, "int4-factored"),
                                               (3, True, "int8-factored"), ("3p", True, "int4-factored")])
def test_a_save_in_the_middle_of_a_compact_run_resumes_bit_for_bit(stage, bf16, dtype, tmp_path):
    """Saved after the run's first step (the int8 first moments and the next step's shares in the
    checkpoint, the second moment read again from the optimizer's), resumed in a fresh engine with
    other initial weights: every later step, weight, master and moment equals the uninterrupted run's."""
    ref = _compact(stage, bf16, dtype)
    b = Batches(seed=6)
    _until(ref, b, Phase.PREDICT)
    ref.train_step(b.step())
    assert ref.phase is Phase.PREDICT and ref._gradient.moments is not None
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    resumed = _compact(stage, bf16, dtype, seed=1)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed._gradient.pending and _equal(_run_m(resumed), _run_m(ref))
    steps_alike(ref, resumed, b, 6, state)
    assert ref.statistics()["predict_accepted"] >= 2


@pytest.mark.parametrize("other", ["fp32", "int4-factored", "host"])
def test_a_compact_run_loaded_by_an_engine_without_it_is_dropped_with_a_warning(other, tmp_path, caplog):
    """Loaded by the full-size device state, the other compact dtype or the host path, a compact run is
    dropped: the weights are the masters' (its last good point), as an engine that never ran it has them."""
    ref = _compact(2)
    b = Batches(seed=6)
    _until(ref, b, Phase.PREDICT)
    good = full_params(ref)
    ref.train_step(b.step())
    ref.save_checkpoint(str(tmp_path), tag="mid")
    engine = (_compact(2, dtype="fp32", seed=1, offload_predict="host") if other == "host"
              else _compact(2, dtype=other, seed=1))
    with caplog.at_level("WARNING"):
        engine.load_checkpoint(str(tmp_path), tag="mid")
    assert "another memory.gradient_state_dtype" in caplog.text and not engine._gradient.pending
    assert _equal(master_copies(engine), master_copies(ref)) and _equal(full_params(engine), good)


def test_a_full_size_run_loaded_by_a_compact_engine_is_kept_from_the_host_path_and_dropped_from_the_device_path(
        tmp_path, caplog):
    for where, says in (("host", "the run is kept as it stands"), ("device", "the run is dropped")):
        ref = _compact(2, dtype="fp32", offload_predict=where)
        b = Batches(seed=6)
        _until(ref, b, Phase.PREDICT)
        ref.train_step(b.step())
        assert ref._gradient.pending
        ref.save_checkpoint(str(tmp_path / where), tag="mid")
        run_m = [t.clone() for t in ref._gradient.m]
        engine = _compact(2, seed=1)
        caplog.clear()
        with caplog.at_level("WARNING"):
            engine.load_checkpoint(str(tmp_path / where), tag="mid")
        assert says in caplog.text and not engine._gradient.pending
        assert _equal(master_copies(engine), master_copies(ref))
        if where == "host":   # (the masters hold the run; the optimizer takes its first moment)
            assert _equal([m.view(-1) for m in _moments(engine, "exp_avg")], [m.view(-1) for m in run_m])
        for _ in range(4):
            assert engine.train_step(b.step()).loss is not None


@pytest.mark.parametrize("stage", [2, "3p"])
def test_the_commit_behind_the_next_steps_backward_matches_the_inline_commit_bit_for_bit(stage):
    """memory.commit_overlap: true (auto keeps a compact run's commit inline): a kept run's first moment
    dequantized into the optimizer's and the masters caught up on a host thread while the next real step's
    forward and backward go on, joined before its optimizer step; the weights, masters and moments are the
    inline commit's, step for step."""
    inline, behind = _compact(stage, bf16=True), _compact(stage, bf16=True, commit_overlap=True)
    assert inline.statistics()["commit_overlap"] is False and behind.statistics()["commit_overlap"] is True
    a, b = Batches(seed=4), Batches(seed=4)
    for _ in range(14):
        ra, rb = inline.train_step(a.step()), behind.train_step(b.step())
        assert (ra.phase, ra.loss, ra.checked) == (rb.phase, rb.loss, rb.checked)
        assert not behind._gradient._worker.running   # (joined within the step)
        for got, want in ((full_params(behind), full_params(inline)), (master_copies(behind), master_copies(inline)),
                          (_moments(behind, "exp_avg"), _moments(inline, "exp_avg"))):
            assert _equal(got, want)
    st = behind.statistics()
    assert st["commit_background_seconds"] > 0 and st["predict_accepted"] >= 4


@pytest.mark.parametrize("stage, gas", [("3p", 1), ("3p", 2), (2, 1)])
def test_a_fold_queued_through_pinned_buffers_is_the_fold_in_the_hook_bit_for_bit(stage, gas, monkeypatch):
    """ZeRO 3 with offload_param: cpu on a GPU: the gradient on the GPU, the compact moments in host memory;
    each hook queues the fold's scale and the parameter's slices (QueuedDownloads) and a host thread folds
    them. Forced here (stage_shares), with small chunks (quant's 1024 values, the queue's 2048 in 2
    buffers: several chunks a slice, cut again on the host thread, and hooks waiting for a buffer): every
    step the same phase, loss and check, and the same weights, masters, moments and compact first moment
    bit for bit as the fold in the hook, with one and two micro-batches a step."""
    import threading
    from ds_hybrid import compact_moments
    from ds_hybrid.staging import QueuedDownloads
    monkeypatch.setattr(compact_moments, "CHUNK", 1024)   # (both paths cut in CompactMoments.fold_range)
    direct, queued = _compact(stage, gas=gas), _compact(stage, gas=gas)
    queued._gradient.stage_shares = True
    queued._gradient._shares = queue = QueuedDownloads(chunk=2048, slots=2)
    threads, put = set(), queue.put
    queue.put = lambda src, take: put(src, lambda *a: (threads.add(threading.get_ident()), take(*a)))
    bd, bq = Batches(seed=5), Batches(seed=5)
    predicted, big = 0, 0
    for _ in range(12):
        rd, rq = direct.train_step(bd.step(gas)), queued.train_step(bq.step(gas))
        assert (rd.phase, rd.loss, rd.checked) == (rq.phase, rq.loss, rq.checked)
        predicted += rd.phase == Phase.PREDICT.value
        for got, want in ((full_params(queued), full_params(direct)), (master_copies(queued), master_copies(direct)),
                          (_moments(queued, "exp_avg"), _moments(direct, "exp_avg"))):
            assert _equal(got, want)
        if queued._gradient.moments is not None and queued.phase is Phase.PREDICT:
            assert _equal(_run_m(queued), _run_m(direct))
            big = max(s.n for part in queued._gradient.moments.parts if part for s in part)
    assert predicted >= 4 and big > 2048 and queue.chunks > 0 and queue.wait_seconds["slot"] > 0
    assert threads and threading.get_ident() not in threads   # folded off the thread that ran the backward


@pytest.mark.parametrize("changes, match", [
    (dict(offload_predict="host"), "resolved to host"),
])
def test_setups_it_cannot_take_are_refused_naming_the_key(changes, match):
    """(``cpu_step_behind`` is taken since 2026-12-01: tests/test_cpu_step_behind.py.)"""
    stage = changes.pop("stage", 2)
    memory = {"offload_predict": "device", "gradient_state_dtype": "int8-factored", **changes}
    with pytest.raises(ConfigError, match=f"gradient_state_dtype: int8-factored, but .*{match}"):
        make_engine(ds_config(stage=stage, offload_opt="cpu", hybrid=dict(GRAD, memory=memory)))


def _kept_run_over_bf16(stage, dtype: str):
    """Trains a compact run over bf16 weights to its end, checking that it left the masters and moments
    alone while the 16-bit weights moved; returns the engine and the masters from before the run."""
    eng = _compact(stage, bf16=True, dtype=dtype)
    b = Batches(seed=3, device=eng.device)
    _until(eng, b, Phase.PREDICT)
    masters, weights, m = master_copies(eng), full_params(eng), _moments(eng, "exp_avg")
    while eng.phase is Phase.PREDICT:
        eng.train_step(b.step())
    assert _equal(masters, master_copies(eng)) and _equal(m, _moments(eng, "exp_avg"))
    assert not _equal(weights, full_params(eng))
    return eng, masters


@pytest.mark.parametrize("stage, dtype", [(2, "int8-factored"), ("3p", "int4-factored")])
def test_a_kept_run_over_bf16_weights_commits_each_master_as_its_weight_plus_its_residual(stage, dtype):
    """bf16 weights on the CPU accelerator: a kept run's commit sets each master to its weight plus the
    residual below bf16 it had before the run, and the optimizer's first moment to the run's (the GPU
    test's check, on the CPU)."""
    eng, masters = _kept_run_over_bf16(stage, dtype)
    commit_and_check(eng, masters, _run_m(eng))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage, dtype", [(2, "int8-factored"), (2, "int4-factored"), (3, "int4-factored"),
                                          ("3p", "int4-factored")])
def test_on_gpu_the_compact_state_lives_beside_the_bf16_weights(stage, dtype):
    """On a GPU with offload_optimizer: cpu and bf16 weights: the run's compact moments beside the 16-bit
    weights (on the GPU; with offload_param: cpu in host memory, each gradient's fold queued behind the
    backward), the host masters and moments untouched during the run while the weights move; the kept
    run's masters are the weights plus their residual below bf16, the optimizer's first moment the run's."""
    eng, masters = _kept_run_over_bf16(stage, dtype)
    assert eng.statistics()["offload_predict"] == "device"
    sl = [s for part in eng._gradient.moments.parts if part for s in part]
    on_gpu = stage != "3p"
    assert sl and all(s.m.data.is_cuda == on_gpu and s.m.dtype == dtype[:4] for s in sl)
    assert (eng._gradient._shares.chunks > 0) != on_gpu
    commit_and_check(eng, masters, [t.cpu() for t in _run_m(eng)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_the_commit_behind_the_next_step_on_its_side_stream_matches_the_inline_commit():
    """memory.commit_overlap: true on a GPU: the first moment's dequantization and copy to host memory on a
    side stream that waits only for the run's last update, beside the next step's forward and backward;
    the weights, masters and moments equal the inline commit's bit for bit."""
    inline, behind = _compact(2, bf16=True, dtype="int4-factored"), _compact(2, bf16=True, dtype="int4-factored",
                                                                            commit_overlap=True)
    a, b = Batches(seed=4, device=inline.device), Batches(seed=4, device=behind.device)
    for _ in range(14):
        ra, rb = inline.train_step(a.step()), behind.train_step(b.step())
        assert (ra.phase, ra.loss, ra.checked) == (rb.phase, rb.loss, rb.checked)
        for got, want in ((full_params(behind), full_params(inline)), (master_copies(behind), master_copies(inline)),
                          (_moments(behind, "exp_avg"), _moments(inline, "exp_avg"))):
            assert _equal(got, want)
    assert behind.statistics()["commit_background_seconds"] > 0 and behind.statistics()["predict_accepted"] >= 4
