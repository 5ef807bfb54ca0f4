"""memory.host_kernels: the drift velocity's fold on host masters by kernels/host_fold.cpp,
against the torch ops it replaces (zero_access.fold_real_update's reference path)."""
from __future__ import annotations

import logging

import pytest
import torch

import ds_hybrid.zero_access as za
from ds_hybrid import host_kernels
from ds_hybrid.quant import CHUNK
from engine_utils import Batches, ds_config, make_engine


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


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("from_state, wd", [(False, 0.1), (True, 0.0), (True, 0.1)])
def test_cpp_fold_matches_the_torch_ops(n, dtype, from_state, wd):
    """The same velocity as the torch path: bit for bit from a snapshot (the same operations and
    the same int8 noise); from the Adam state within an fp32 rounding or two (torch's vectorised
    CPU sqrt is not correctly rounded, the C++ one is), so int8 codes all but never differ.
    The sums agree to the torch path's own fp32 accumulation error."""
    moments = n == 1000
    ref_sums, ref = _fold_three_steps(n, dtype, wd, from_state, cpp=False, moments=moments)
    sums, got = _fold_three_steps(n, dtype, wd, from_state, cpp=True, moments=moments)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-4, atol=0.0)
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


def test_cpp_fold_releases_the_gil():
    """memory.fold_overlap runs the fold on a host thread while the main thread launches the next
    step: the pass must not hold Python's lock. The main thread keeps running Python all through
    the call on the other thread (measured here: with the lock held it stopped for ~75% of it)."""
    import threading
    import time
    host_kernels.load()
    n = 8 * CHUNK
    w, m, v2 = torch.randn(n), torch.randn(n), torch.rand(n) + 0.1
    vel = za.VelocityBuffers("fp32").buffer(0, w)
    span = {}

    def call():
        span["start"] = time.perf_counter()
        host_kernels.fold(w, m, v2, None, vel, [], CHUNK, 1e-3, 0.0, 0.9, 1.0, 1.0, 1e-8, False, True)
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
