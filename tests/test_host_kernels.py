"""memory.host_kernels: the drift velocity's fold on host masters, and a drift Predict step's
update of a copy of the weights in host memory, by kernels/host_fold.cpp, against the torch ops
they replace (the reference paths of zero_access.fold_real_update, zero_access.apply_velocity_update
and device_predict.DevicePredict)."""
from __future__ import annotations

import logging

import pytest
import torch

import ds_hybrid.zero_access as za
from ds_hybrid import host_kernels
from ds_hybrid.device_predict import DevicePredict
from ds_hybrid.quant import CHUNK
from engine_utils import Batches, OneShardAccess, ds_config, full_params, make_engine, master_copies, step_together


def _trained(n: int, wd: float, seed: int = 0):
    """A partition of ``n`` values with two AdamW steps of Adam state behind it."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=wd)
    for _ in range(2):
        p.grad = torch.randn(n) * 1e-3
        opt.step()
    return p, opt


def _fold_three_steps(n: int, dtype: str, wd: float, from_state: bool, cpp: bool, moments: bool):
    """Three real steps, each folded (the first one starts the velocity)."""
    p, opt = _trained(n, wd)
    access, vel, snap = za._PlainAccess(opt), za.VelocityBuffers(dtype, seed=0), za.PartitionBuffers("same")
    sums = []
    for step in (1, 2, 3):
        if not from_state:
            za.capture_weights(access, snap)
        p.grad = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 1e-3
        opt.step()
        sums.append(za.fold_real_update(access, None if from_state else snap, vel, [1e-3], 0.95, step,
                                        moments=moments, host_kernel=cpp))
    return torch.stack(sums)[:, 0], vel.buffers[0]   # (one param group)


# a short last block, one chunk with noise drawn directly, several chunks from the noise table
SIZES = [1000, 70_000, CHUNK + 300]


def test_the_kernel_computes_the_noise_tables_windows_and_reads_drawn_noise():
    """A CPU store's int8 noise is a window of quant's table at a random offset (wrapping around its
    period) or, for a small store, drawn: the kernel computes a window's values from its offset
    (4 bytes a value it does not read) and reads drawn ones. Bit for bit the store of the same values
    with the same noise (quant.CompactBuffer.store), either way; a wrong offset would change the codes."""
    from ds_hybrid.quant import BLOCK, SMALL_STORE, CompactBuffer, _cpu_noise, noise_offset, noise_table_values
    n = 2 * BLOCK * 64   # one fold group
    for draw in ("table", "drawn"):
        gen = torch.Generator().manual_seed(11)
        noise = _cpu_noise(n if draw == "drawn" else SMALL_STORE + n, gen)[:n]
        off = noise_offset(noise)
        assert (off >= 0) == (draw == "table") and noise_offset(noise.clone()) == -1
        if draw == "table":
            assert torch.equal(noise, noise_table_values((off + torch.arange(n)) % CHUNK))
            # an offset near the period's end: the window wraps around the table
            late = _cpu_noise(SMALL_STORE + 1, gen)
            while noise_offset(late) + SMALL_STORE + 1 <= CHUNK:
                late = _cpu_noise(SMALL_STORE + 1, gen)
        w = torch.zeros(n)
        d = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3   # the update: w moves by d
        before = w - d
        vel = CompactBuffer(n, "int8", "cpu")
        host_kernels.fold(w, None, None, before, vel, [noise], CHUNK, 1e-3, 0.0, 0.9, 1.0, 1.0, 1e-8, True, False)
        ref = CompactBuffer(n, "int8", "cpu")
        x = d * (1.0 / 1e-3)   # the first fold: the velocity is the update per unit LR (times 1 / lr, as the kernel)
        scale = torch.maximum(x.view(-1, BLOCK).amax(1), x.view(-1, BLOCK).amin(1).neg()) / 127.0
        q = (x.view(-1, BLOCK) / scale.unsqueeze(1) + noise.view(-1, BLOCK)).floor().clamp(-127, 127)
        ref.data.copy_(q.flatten().to(torch.int8))
        assert torch.equal(vel.data, ref.data) and torch.equal(vel.scale, scale), draw
    window = late[:BLOCK * 64]
    wrapped = noise_table_values((noise_offset(late) + torch.arange(window.numel())) % CHUNK)
    assert torch.equal(window, wrapped)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("from_state, wd", [(False, 0.1), (True, 0.0), (True, 0.1)])
def test_cpp_fold_matches_the_torch_ops(n, dtype, from_state, wd):
    """The same velocity as the torch path: bit for bit from a snapshot (the same operations and
    the same int8 noise); from the Adam state within an fp32 rounding or two (torch's vectorised
    CPU sqrt is not correctly rounded, the C++ one is), so int8 codes all but never differ.
    The sums agree to the torch path's own fp32 accumulation error (which depends on torch's thread
    count: at 4M elements 1.4e-4 of a sum with one thread, under 1e-4 with two)."""
    moments = n == 1000
    ref_sums, ref = _fold_three_steps(n, dtype, wd, from_state, cpp=False, moments=moments)
    sums, got = _fold_three_steps(n, dtype, wd, from_state, cpp=True, moments=moments)
    torch.testing.assert_close(sums, ref_sums, rtol=5e-4, atol=0.0)
    assert sums[:, 6].tolist() == [float(n)] * 3
    if moments:
        assert (sums[:, 3:6] > 0).all()
    if not from_state:
        assert torch.equal(got.data, ref.data)
        if dtype == "int8":
            assert torch.equal(got.scale, ref.scale)
        return
    if dtype == "int8":
        assert (got.data != ref.data).float().mean().item() < 1e-4
        torch.testing.assert_close(got.scale, ref.scale, rtol=1e-6, atol=0.0)
    else:
        # (a value the EMA cancels to near 0 keeps the absolute error of the large ones)
        tol = 1e-6 if dtype == "fp32" else 8e-3
        torch.testing.assert_close(got.data.float(), ref.data.float(), rtol=tol,
                                   atol=tol * float(ref.data.float().abs().max()))


def test_the_setting_falls_back_or_fails_by_name(monkeypatch, tmp_path, caplog):
    """``torch`` never builds; ``cpp`` that cannot be built fails naming the key and the reason;
    ``auto`` then takes the torch ops, with a warning."""
    assert host_kernels.resolve("torch") is False
    monkeypatch.setattr(host_kernels, "_module", None)
    monkeypatch.setattr(host_kernels, "_error", None)
    monkeypatch.setattr(host_kernels, "KERNEL_DIR", tmp_path)
    with pytest.raises(host_kernels.HostKernelUnavailable, match="hybrid_predict.memory.host_kernels") as e:
        host_kernels.resolve("cpp")
    assert "host_fold.cpp" in str(e.value) and "torch" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="ds_hybrid.host_kernels"):
        assert host_kernels.resolve("auto") is False
    assert "falls back" in caplog.text


@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_folds_with_the_cpp_kernel_on_host_masters(stage):
    """A CPU run with drift Predict steps folds with the C++ kernel (``auto``) and takes the same
    phases as the torch ops, with a velocity within fp32 rounding of theirs."""
    hybrid = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
              "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": "drift"},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}
    engines = [make_engine(ds_config(stage=stage, hybrid={**hybrid, "memory": {"host_kernels": k}}), seed=0)
               for k in ("auto", "torch")]
    assert [e.statistics()["host_kernels"] for e in engines] == ["cpp", "torch"]
    runs = []
    for eng in engines:
        b = Batches(seed=3)
        runs.append([eng.train_step(b.step()) for _ in range(12)])
    assert [r.phase for r in runs[0]] == [r.phase for r in runs[1]]
    assert [r.phase for r in runs[0]].count("predict") >= 4
    for a, b in zip(runs[0], runs[1]):   # (a Predict step without its own forward has no loss)
        assert (a.loss is None and b.loss is None) or a.loss == pytest.approx(b.loss, rel=1e-4)
    cpp, ref = (e._velocity.buffers for e in engines)
    for x, y in zip(cpp, ref):
        if x is not None:
            # (the rounding differences reach the weights through the Predict steps and grow a little)
            torch.testing.assert_close(x.data, y.data, rtol=1e-3, atol=1e-3 * float(y.data.abs().max()))


# the scales of four Predict steps of one run: a zero one is skipped, as a predicted group's 0 scale
STEPS = [0.6, 0.0, 1.7, -0.2]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("vdtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_shift_matches_the_torch_ops(n, vdtype, xdtype):
    """A run's Predict updates into a copy of the weights in host memory (the device path's 16-bit
    partition under offload_param: cpu; the masters at a commit) and the host path's update of
    the masters: bit for bit the torch ops, 16-bit copies rounded after every step as theirs."""
    g = torch.Generator().manual_seed(n)
    x0 = (torch.randn(n, generator=g) * 0.02).to(xdtype)
    vel = za.VelocityBuffers(vdtype, seed=0)
    vel.buffer(0, x0).store(torch.randn(n, generator=g), generator=torch.Generator().manual_seed(1))
    lr = 1e-3
    out = {}
    for cpp in (False, True):
        shard, master = x0.clone(), x0.float().clone()   # (.float() of fp32 is x0 itself)
        dp = DevicePredict(OneShardAccess(shard, master))
        dp.host_kernel = cpp
        dp._add_to_shards(vel, [[c * lr] for c in STEPS])   # a Predict run's updates (as replay makes them)
        dp.pending = [[c * lr] for c in STEPS]
        dp.commit(vel)                                      # the kept run into the masters
        p = torch.nn.Parameter(x0.float().clone())
        access = za._PlainAccess(torch.optim.SGD([p], lr=lr))
        norm = za.apply_velocity_update(access, vel, [0.6], host_kernel=cpp)   # the host path's step
        out[cpp] = (shard, master, p.detach(), norm)
    (s0, m0, p0, n0), (s1, m1, p1, n1) = out[False], out[True]
    as_int = torch.int32 if xdtype == torch.float32 else torch.int16
    assert torch.equal(s0.view(as_int), s1.view(as_int))
    assert torch.equal(m0, m1) and torch.equal(p0, p1)
    assert not torch.equal(s1, x0) and not torch.equal(m1, x0.float()) and not torch.equal(p1, x0.float())
    # the update's squared norm: the torch path sums each chunk in fp32, the kernel in fp32 lanes
    # of a block, then both in fp64 (the torch path's error depends on torch's thread count: 1.1e-4
    # at 4M elements with one thread)
    exact = float((vel.buffers[0].load().double() ** 2).sum()) * (0.6 * lr) ** 2
    assert n1 == pytest.approx(exact, rel=1e-6) and n0 == pytest.approx(exact, rel=5e-4)


def test_cpp_shift_refuses_what_it_cannot_take():
    """The kernel checks its arguments: a velocity shorter than the weights, a weight dtype it
    has no rounding for."""
    host_kernels.load()
    vel = za.VelocityBuffers("fp32").buffer(0, torch.zeros(10))
    with pytest.raises(RuntimeError, match="too small"):
        host_kernels.shift(torch.zeros(11), vel, [1.0])
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        host_kernels.shift(torch.zeros(10, dtype=torch.float64), vel, [1.0])


@pytest.mark.parametrize("stage", ["z1", "z2", "z3"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_the_engine_moves_host_copies_with_the_cpp_kernel_bit_for_bit(stage, where):
    """Drift Predict runs under offload_optimizer: cpu with bf16 weights, the C++ kernels against
    the torch ops. The host path's Predict steps move the fp32 masters; the device path's move
    the 16-bit partitions (in host memory here, as ZeRO 3's with offload_param: cpu) and commit a
    kept run into the masters. Every weight after every step and every master after every real
    step are the torch ops' bit for bit. (The fold from a snapshot writes the torch ops' velocity
    bit for bit, but its sums, which teach the step scale, add up in another order: the scale is
    held at its clamp so that it cannot tell them apart.)"""
    hybrid = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
              "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": "drift", "step_scale": 1000.0, "max_step_scale": 0.5},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}
    extra = dict(offload_param="cpu") if stage == "z3" else {}
    engines = [make_engine(ds_config(stage=int(stage[1]), bf16=True, offload_opt="cpu", hybrid={
        **hybrid, "memory": {"host_kernels": k, "offload_predict": where, "fold_source": "snapshot",
                             "velocity_dtype": "int8"}}, **extra), seed=0) for k in ("cpp", "torch")]
    cpp, ref = engines
    assert [e.statistics()["host_kernels"] for e in engines] == ["cpp", "torch"]
    assert cpp.statistics()["offload_predict"] == where
    if where == "device":
        assert cpp._device_predict.host_kernel and not ref._device_predict.host_kernel
        assert all(cpp._masters.device_shard(i).dtype == torch.bfloat16 for i in range(cpp._masters._count()))
    start = full_params(cpp)
    ba, bb = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(14):
        phases.append(step_together(cpp, ref, ba, bb).phase)   # (every weight, every step)
        if phases[-1] != "predict":
            for x, y in zip(master_copies(cpp), master_copies(ref)):
                assert torch.equal(x, y)
    assert phases.count("predict") >= 4 and cpp.statistics()["predict_accepted"] >= 4
    assert any(not torch.equal(x, y) for x, y in zip(full_params(cpp), start))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_cpp_catch_up_matches_the_torch_ops(n, wdtype):
    """A kept gradient run's commit: the masters take the 16-bit weights the run moved plus their
    own residual below 16 bits; the one C++ pass is the torch ops bit for bit."""
    from ds_hybrid.grad_predict import _catch_up
    g = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=g) * 0.02
    master[:3] = torch.tensor([0.0, -1e-30, 3.0e4])   # a zero, a value below 16-bit range, a large one
    moved = (master + torch.randn(n, generator=g) * 1e-3).to(wdtype)
    got, want = master.clone(), master.clone()
    _catch_up(got, moved, host_kernel=True)
    _catch_up(want, moved, host_kernel=False)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got, master)
    host_kernels.load()
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        host_kernels.catch_up(got, moved.float())
    with pytest.raises(RuntimeError, match="as many as the master"):
        host_kernels.catch_up(got, moved[:-1])


def _held_adam_ieee(x, m, v, *, lr, eps, key, bc1, bc2, decay):
    """The held Adam step with IEEE fp32 operations (numpy's division and square root; torch's
    add with alpha, a fused multiply-add) and the reference's stochastic rounding."""
    import numpy as np
    from ds_hybrid.quant import stochastic_round_bf16_
    f = np.float32
    vv, mm = v.float().numpy(), m.float().numpy()
    u = torch.from_numpy(((mm / f(bc1)) / (np.sqrt(vv / f(bc2)) + f(eps))) * f(-lr))
    w = x.float()
    if decay:
        u.add_(w, alpha=decay)
    out = torch.empty_like(x)
    stochastic_round_bf16_(out, w.add_(u), key)
    return out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_cpp_held_adam_step_is_the_ieee_step_and_the_torch_ops_within_a_rounding(n, sdtype, wd):
    """A gradient Predict step on a bf16 partition in host memory (ZeRO 3's offload_param: cpu):
    Adam's step from the run's first moment with the second held, the weight rounded
    stochastically by the hash of (key, index). The C++ pass is that step with IEEE fp32
    operations bit for bit, as the CUDA kernel computes it. torch's CPU square root (MKL's vsSqrt)
    is not correctly rounded (about one value in five an ulp off here), so against the torch ops
    a value may differ by one bf16 step where an fp32 ulp meets the random bits: as few values as
    the GPU kernel's test allows (tests/test_kernels.py)."""
    from ds_hybrid import kernels
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    x[:3] = torch.tensor([0.0, -1e-30, 3.0e4])
    m = (torch.randn(n, generator=g) * 1e-3).to(sdtype)
    v = (torch.rand(n, generator=g) * 1e-6).to(sdtype)
    v[:2] = 0.0   # (eps alone in the denominator)
    kw = dict(lr=3e-4, eps=1e-8, key=0xDEADBEEF)
    bc1, bc2 = kernels._bias_corrections(0.9, 0.95, 7, True)
    got, ref = x.clone(), x.clone()
    host_kernels.held_adam(got, m, v, bc1=bc1, bc2=bc2, decay=-kw["lr"] * wd, **kw)
    ieee = _held_adam_ieee(x, m, v, bc1=bc1, bc2=bc2, decay=-kw["lr"] * wd, **kw)
    assert torch.equal(got.view(torch.int16), ieee.view(torch.int16))
    assert not torch.equal(got, x)
    kernels.held_adam_step_reference(ref, m, v, beta1=0.9, beta2=0.95, step=7, weight_decay=wd, decoupled=True, **kw)
    differ = got.view(torch.int16) != ref.view(torch.int16)
    assert int(differ.sum()) <= max(2, n // 2000)
    # one bf16 step of the result, or, where the update nearly cancels the weight (a weight crossing
    # zero), the fp32 ulp the torch ops' square root put into an update about as large as the weight
    step = (torch.finfo(torch.bfloat16).eps * ref.float().abs()
            + 2 * torch.finfo(torch.float32).eps * (x.float().abs() + ref.float().abs()))
    assert bool(((got.float() - ref.float()).abs() <= step)[differ].all())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        host_kernels.held_adam(got.float(), m, v, bc1=bc1, bc2=bc2, decay=0.0, **kw)
    with pytest.raises(RuntimeError, match="one dtype and as many"):
        host_kernels.held_adam(got, m, v[:-1], bc1=bc1, bc2=bc2, decay=0.0, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_cpp_held_adam_step_is_the_cuda_kernels_bit_for_bit(sdtype, wd):
    """The same gradient Predict step on a bf16 partition in host memory (C++) and on a GPU (CUDA
    kernel, NVRTC's IEEE division and square root, its roundings pinned: the decay's multiply-add
    fused, nothing else): the same operations and random bits, so the same bf16 weights bit for bit."""
    from ds_hybrid import kernels
    if not kernels.cupy_available():
        pytest.skip("CuPy does not import")
    n = CHUNK + 300
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    m, v = (torch.randn(n, generator=g) * 1e-3).to(sdtype), (torch.rand(n, generator=g) * 1e-6).to(sdtype)
    kw = dict(lr=3e-4, eps=1e-8, key=0xDEADBEEF)
    bc1, bc2 = kernels._bias_corrections(0.9, 0.95, 7, True)
    host = x.clone()
    host_kernels.held_adam(host, m, v, bc1=bc1, bc2=bc2, decay=-kw["lr"] * wd, **kw)
    dev = x.cuda()
    kernels.held_adam_step(dev, m.cuda(), v.cuda(), beta1=0.9, beta2=0.95, step=7, weight_decay=wd, decoupled=True,
                           backend="cupy", **kw)
    assert torch.equal(host.view(torch.int16), dev.cpu().view(torch.int16))


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_the_engine_catches_the_masters_up_with_the_cpp_kernel_bit_for_bit(stage):
    """Gradient Predict runs on the device path under offload_optimizer: cpu with bf16 weights
    (on ZeRO 3 the 16-bit partition in host memory): the kept runs' commits by the C++ pass and by
    the torch ops give the same masters after every real step and the same weights after every step."""
    hybrid = {"warmup_steps": 3, "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3,
              "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": "gradient"},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}
    extra = dict(offload_param="cpu") if stage == "z3" else {}
    engines = [make_engine(ds_config(stage=int(stage[1]), bf16=True, offload_opt="cpu", hybrid={
        **hybrid, "memory": {"host_kernels": k, "offload_predict": "device"}}, **extra), seed=0)
        for k in ("cpp", "torch")]
    cpp, ref = engines
    assert cpp._gradient.host_kernel and not ref._gradient.host_kernel
    # (the Predict steps' update by the torch ops in both: the C++ step's square root is IEEE's,
    # torch's CPU one is not, test_cpp_held_adam_step_...; the engine test of it is below)
    cpp._gradient._host_step = lambda *args: False
    ba, bb = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(14):
        phases.append(step_together(cpp, ref, ba, bb).phase)
        if phases[-1] != "predict":
            for x, y in zip(master_copies(cpp), master_copies(ref)):
                assert torch.equal(x, y)
    assert phases.count("predict") >= 6 and cpp.statistics()["predict_accepted"] >= 6


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_the_engines_gradient_steps_on_host_partitions_take_the_cpp_step(stage):
    """Gradient Predict runs on the device path with bf16 weights whose 16-bit partition is in host
    memory (ZeRO 3's offload_param: cpu; on the CPU accelerator ZeRO 2's too): each Predict step
    moves it by host_kernels.held_adam, and the run goes as with the torch ops: the same phases and
    kept runs, losses within 1e-3 (the square roots differ in the last fp32 bit)."""
    hybrid = {"warmup_steps": 3, "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3,
              "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": "gradient"},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}
    extra = dict(offload_param="cpu") if stage == "z3" else {}
    cpp, ref = (make_engine(ds_config(stage=int(stage[1]), bf16=True, offload_opt="cpu", hybrid={
        **hybrid, "memory": {"host_kernels": k, "offload_predict": "device"}}, **extra), seed=0)
        for k in ("cpp", "torch"))
    calls = []
    held = host_kernels.held_adam
    host_kernels.held_adam = lambda *a, **k: (calls.append(1), held(*a, **k))[1]
    try:
        ba, bb = Batches(seed=3), Batches(seed=3)
        for _ in range(14):
            rc, rr = cpp.train_step(ba.step()), ref.train_step(bb.step())
            assert rc.phase == rr.phase
            assert rc.loss is None and rr.loss is None or abs(rc.loss - rr.loss) <= 1e-3 * abs(rr.loss)
    finally:
        host_kernels.held_adam = held
    assert calls and cpp.statistics()["predict_accepted"] == ref.statistics()["predict_accepted"] >= 6


@pytest.mark.parametrize("kernel", ["fold", "shift", "catch_up"])
def test_cpp_kernels_release_the_gil(kernel):
    """memory.fold_overlap runs the fold, and memory.commit_overlap a kept run's commit, on a host
    thread while the main thread launches the next step: the pass must not hold Python's lock.
    The main thread keeps running Python all through the call on the other thread (measured
    here: with the fold holding the lock it stopped for ~75% of it)."""
    import threading
    import time
    host_kernels.load()
    n = 8 * CHUNK
    w, m, v2 = torch.randn(n), torch.randn(n), torch.rand(n) + 0.1
    vel = za.VelocityBuffers("fp32").buffer(0, w)
    span = {}

    def call():
        span["start"] = time.perf_counter()
        if kernel == "fold":
            host_kernels.fold(w, m, v2, None, vel, [], CHUNK, 1e-3, 0.0, 0.9, 1.0, 1.0, 1e-8, False, True)
        elif kernel == "shift":   # a long run's commit
            host_kernels.shift(w, vel, [1e-3] * 16)
        else:   # a gradient run's commit
            for _ in range(16):
                host_kernels.catch_up(w, m.to(torch.bfloat16))
        span["end"] = time.perf_counter()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a core left for the main thread, whatever the machine
    try:
        thread = threading.Thread(target=call)
        ticks = []
        thread.start()
        while thread.is_alive():
            ticks.append(time.perf_counter())
        thread.join()
    finally:
        torch.set_num_threads(threads)
    inside = torch.tensor([span["start"]] + [t for t in ticks if span["start"] < t < span["end"]] + [span["end"]],
                          dtype=torch.float64)
    assert float(inside.diff().max()) < 0.5 * (span["end"] - span["start"])


def test_the_commit_benchmark_times_both_catch_ups_and_writes_its_table(tmp_path):
    """benchmarks/grad_commit.py: the gradient run's commit on the host and its steps' update of a
    bf16 partition there, the torch ops and the C++ passes, against DeepSpeed's CPU Adam step on as
    many values, into JSON and a table."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "grad_commit.py"
    spec = importlib.util.spec_from_file_location("grad_commit", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    result = mod.main(["--values", "5000", "--repeat", "1", "--json", str(out)])
    assert [r["part"] for r in result["rows"]] == ["catch_up_torch", "catch_up_cpp", "first_moment_hand_over",
                                                   "held_adam_step_torch", "held_adam_step_cpp"]
    assert all(r["ms"] > 0 and r["over_cpu_adam"] > 0 for r in result["rows"]) and result["cpu_adam_ms"] > 0
    assert json.loads(out.read_text())["table_markdown"] == result["table_markdown"]
    with pytest.raises(SystemExit, match="--values and --repeat"):
        mod.main(["--values", "0"])
