"""memory.fold_in_step: a real step's fold, and a kept run's commit, inside DeepSpeed's CPU Adam
step, a chunk at a time (ds_hybrid/step_fusion.py).

What must hold: the chunked Adam step is DeepSpeed's one call bit for bit; the masters, moments,
weights and velocity are the inline commit's and fold's after every step, and so are the direction
sums the predictor sees, at the same step; rollbacks and a checkpoint in the middle of a run
resume bit for bit; settings it cannot serve are refused naming the key."""
from __future__ import annotations

import pytest
import torch

from ds_hybrid import host_kernels, step_fusion
from ds_hybrid.config import ConfigError
from engine_utils import Batches, ds_config, full_params, make_engine, master_copies, step_together
from test_device_predict import STAGES, _accept_then_reject, _hybrid, _same
from test_fold_overlap import _observed, _velocity

SMALL_CHUNK = 16384   # several chunks per test partition (a multiple of the fold's group and DeepSpeed's SIMD block)


def _cfg(stage: str, in_step, check: str = "next_step", velocity: str = "int8", bf16: bool = False,
         **changes) -> dict:
    """``in_step`` False: the reference, its fold a pass after the step from a snapshot of the
    masters before it (the displacement the fold inside the step keeps block by block)."""
    mem = {"velocity_dtype": velocity, "fold_in_step": in_step, "fold_overlap": False, "fold_during_run": False,
           "commit_overlap": False, "host_kernels": "cpp"}
    extra = dict(check="forward", verify_every=1, min_predict_steps=3, max_predict_steps=3) if check == "forward" else {}
    return ds_config(offload_opt="cpu", bf16=bf16, hybrid=_hybrid("device", fold="auto" if in_step else "snapshot",
                                                                  memory=mem, **extra, **changes), **STAGES[stage])


def _pair(stage: str, check: str = "next_step", bf16: bool = False, **changes):
    inline, fused = (make_engine(_cfg(stage, s, check, bf16=bf16, **changes), seed=0) for s in (False, True))
    assert inline.statistics()["fold_in_step"] is False and fused.statistics()["fold_in_step"] is True
    fused._fusion.chunk = SMALL_CHUNK
    return inline, fused


class _CountingOp:
    """DeepSpeed's C++ Adam op, the size of every call kept."""

    def __init__(self, op):
        self.op, self.sizes = op, []

    def adam_update(self, *args):
        self.sizes.append(args[8].numel())
        return self.op.adam_update(*args)

    def __getattr__(self, name):
        return getattr(self.op, name)


def _moments(engine) -> list[torch.Tensor]:
    return [part.state[k].clone() for part in engine._masters.partitions() for k in ("exp_avg", "exp_avg_sq")
            if k in part.state]


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_step_with_commit_and_fold_inside_is_ds_step_and_the_passes_bit_for_bit(one_pass, adamw):
    """DeepSpeed's CPU Adam over two param groups (other betas and decay each, so its C++ state
    takes both its pow and its multiply paths), five steps, partitions with odd tails: with a
    commit and a fold inside the step (one pass, or DeepSpeed's op in chunks) the weights, moments,
    velocity and sums are those of the commit, DeepSpeed's own step and the fold as passes, the fold
    from a snapshot of the weights before the step (the step's displacement, which the one pass
    keeps block by block in L1)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from ds_hybrid.quant import CompactBuffer
    sizes = (3 * host_kernels.FOLD_GROUP + 1001, 777)
    results = []
    for fused_run in (False, True):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.05) for n in sizes]
        opt = DeepSpeedCPUAdam([{"params": [ps[0]], "weight_decay": 0.1},
                                {"params": [ps[1]], "betas": (0.8, 0.99), "weight_decay": 0.0}],
                               lr=2e-3, adamw_mode=adamw)
        fused = step_fusion.install(opt)
        fused.one_pass = one_pass
        vels = [CompactBuffer(n, "int8", "cpu") for n in sizes]
        sums = []
        for step in range(5):
            for p in ps:
                p.grad = torch.randn(p.numel(), generator=gen) * 1e-2
            jobs = []
            for i, p in enumerate(ps):
                job = step_fusion.PartitionJob(i, i, p.data)
                job.fold = step_fusion.FoldJob(lambda v=vels[i]: v, p.numel(), "int8",
                                               torch.Generator().manual_seed(10 + step + i), 0.9, step == 0, True, adamw)
                job.commit = (vels[i], [-1e-3, -5e-4]) if step else None
                jobs.append(job)
            if fused_run:
                fused.chunk = SMALL_CHUNK
                fused.arm(jobs)
                opt.step()
                assert fused.disarm() == [] and fused.unmatched == 0
            else:
                for job in jobs:
                    job.commit_rest()
                before = [p.data.clone() for p in ps]   # (the snapshot the fold in the step does without)
                opt.step()
                for job, p, w0 in zip(jobs, ps, before):
                    g = opt.param_groups[job.index]
                    st = opt.state[p]
                    job.fold.run(p.data, st["exp_avg"], st["exp_avg_sq"], 0, p.numel(), dict(
                        step=st["step"], lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                        weight_decay=g["weight_decay"], bias_correction=g["bias_correction"]), before=w0)
            sums.append([job.fold.acc.clone() for job in jobs])
        if fused_run:
            assert fused.passes["one_pass" if one_pass else "chunked"] == 10
        results.append(([p.data.clone() for p in ps] + [opt.state[p][k].clone() for p in ps
                                                        for k in ("exp_avg", "exp_avg_sq")]
                        + [v.load() for v in vels] + [v.scale.clone() for v in vels], sums))
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(results[0][1], results[1][1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("velocity", ["int8", "fp32"])
def test_fold_by_ranges_is_the_one_call_fold_bit_for_bit(velocity):
    """host_kernels.fold over a partition range by range (group-aligned, the last one short)
    leaves the velocity and the sums of one call, bit for bit."""
    from ds_hybrid.quant import CHUNK, CompactBuffer
    n = 5 * host_kernels.FOLD_GROUP + 777
    g = torch.Generator().manual_seed(4)
    w, m, v2 = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    outs = []
    for ranges in ([(0, n)], [(0, 2 * host_kernels.FOLD_GROUP), (2 * host_kernels.FOLD_GROUP, 3 * host_kernels.FOLD_GROUP),
                              (3 * host_kernels.FOLD_GROUP, n)]):
        vel = CompactBuffer(n, velocity, "cpu")
        vel.store(torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-2,
                  generator=torch.Generator().manual_seed(6))
        noise = [torch.rand(CHUNK, generator=torch.Generator().manual_seed(7))] if velocity == "int8" else []
        acc = torch.zeros(6, dtype=torch.float64)
        for r in ranges:
            sums = host_kernels.fold(w, m, v2, None, vel, noise, CHUNK, 1e-3, 0.1, 0.9, 0.5, 0.25, 1e-8, False, True,
                                     values=r, acc=acc)
        outs.append((vel.load(), sums))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    with pytest.raises(ValueError, match="multiple of"):
        host_kernels.fold(w, m, v2, None, vel, noise, CHUNK, 1e-3, 0.1, 0.9, 0.5, 0.25, 1e-8, False, True,
                          values=(100, n))


@pytest.mark.parametrize("stage, bf16", [("z1", False), ("z2", False), ("z3", False), ("z2", True)])
def test_fold_and_commit_in_step_are_the_inline_ones_bit_for_bit(stage, bf16):
    """Drift runs checked by the next real step, on ZeRO 1, 2 and 3 (CPU optimizer offload; ZeRO 3
    with the parameters offloaded too), fp32 and bf16 weights: the same phases and losses, weights,
    masters, moments and velocity after every step, and the same direction sums at the same
    steps; the commit and the fold ran inside the optimizer step."""
    inline, fused = _pair(stage, bf16=bf16)
    seen_inline, seen_fused = _observed(inline), _observed(fused)
    counting = _CountingOp(fused._fusion._op)
    fused._fusion._op = counting
    bi, bf = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(16):
        r = step_together(inline, fused, bi, bf)
        phases.append(r.phase)
        for x, y in zip(full_params(inline), full_params(fused)):
            assert torch.equal(x, y)
        if r.phase != "predict":
            _same(inline, fused)
            assert torch.equal(_velocity(inline), _velocity(fused))
            for a, b in zip(_moments(inline), _moments(fused)):
                assert torch.equal(a, b)
    assert seen_fused == seen_inline and any(s != (0.0, 0.0, 0.0) for s in seen_fused)
    st = fused.statistics()
    assert phases.count("predict") >= 4 and st["predict_accepted"] >= 4
    assert st["predict_accepted"] == inline.statistics()["predict_accepted"]
    b = st["bookkeeping_seconds"]
    assert b.get("fold_in_step", 0) > 0 and b.get("commit_in_step", 0) > 0 and "fold" not in b and "commit" not in b
    # one pass where it can (the rest, under FOLD_GROUP values, and LR-0 or fold-less steps through DeepSpeed's op
    # in chunks)
    assert st["fold_in_step_passes"]["one_pass"] >= 4 and max(counting.sizes) <= SMALL_CHUNK


@pytest.mark.parametrize("stage, check", [("z2", "forward"), ("z3", "next_step")])
def test_rollbacks_with_the_fold_in_step_are_the_inline_ones(stage, check):
    """Every other run (next_step) or every third verified step (forward) rejected: bit for bit
    the inline commit and fold, the rejected runs' masters never touched."""
    inline, fused = _pair(stage, check)
    keep = 2 if check == "forward" else 1
    for eng in (inline, fused):
        _accept_then_reject(eng, keep=keep)
    bi, bf = Batches(seed=5), Batches(seed=5)
    for _ in range(18):
        r = step_together(inline, fused, bi, bf)
        if r.phase != "predict" or r.accepted is False:
            _same(inline, fused)
            assert torch.equal(_velocity(inline), _velocity(fused))
    st = fused.statistics()
    assert st["predict_rolled_back"] >= 2 and st["predict_accepted"] >= 2
    assert st["predict_rolled_back"] == inline.statistics()["predict_rolled_back"]


def test_a_checkpoint_in_the_middle_of_a_run_resumes_bit_for_bit(tmp_path):
    """Saved during a Predict run (its commit still to come, inside the next real step's optimizer
    step), loaded into a fresh engine: the same phases, losses, weights, masters and velocity as
    the uninterrupted run, step after step."""
    cfg = _cfg("z2", True)
    ref, b = make_engine(cfg, seed=0), Batches(seed=6)
    ref._fusion.chunk = SMALL_CHUNK
    r = ref.train_step(b.step())
    while ref.statistics()["predict_accepted"] < 2 or r.phase != "predict":
        r = ref.train_step(b.step())
    assert ref._device_predict.pending
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    resumed = make_engine(cfg, seed=1)
    resumed._fusion.chunk = SMALL_CHUNK
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed._device_predict.pending
    b2 = Batches(seed=6)
    b2.gen.set_state(state)
    phases = []
    for _ in range(8):
        phases.append(step_together(ref, resumed, b, b2).phase)
        for x, y in zip(full_params(ref), full_params(resumed)):
            assert torch.equal(x, y)
    assert phases[0] in ("predict", "full") and "full" in phases
    _same(ref, resumed)
    assert torch.equal(_velocity(ref), _velocity(resumed))
    assert resumed.statistics()["bookkeeping_seconds"].get("commit_in_step", 0) > 0


def test_fold_in_step_refuses_what_it_cannot_do():
    """true where the setup cannot: named key and reason, nothing trained; what auto picks."""
    with pytest.raises((ValueError, ConfigError), match="fold_in_step: true, but memory.fold_overlap is true"):
        make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto", memory={
            "fold_in_step": True, "fold_overlap": True}), stage=2))
    with pytest.raises((ValueError, ConfigError), match="fold_in_step: true, but the optimizer is"):
        make_engine(ds_config(hybrid=_hybrid("host", fold="auto", memory={"fold_in_step": True}), stage=2))
    with pytest.raises((ValueError, ConfigError), match="fold_in_step: true, but memory.fold_source is snapshot"):
        make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="snapshot",
                                                                memory={"fold_in_step": True}), stage=2))
    # auto: on DeepSpeed's CPU accelerator (measured there: benchmarks/fold_in_step.py), off where it cannot be
    eng = make_engine(ds_config(offload_opt="cpu", hybrid=_hybrid("device", fold="auto"), stage=2))
    assert eng.statistics()["fold_in_step"] is True
    assert make_engine(ds_config(hybrid=_hybrid("host", fold="auto"), stage=2)).statistics()["fold_in_step"] is False
    assert make_engine(ds_config(offload_opt="cpu", stage=2, hybrid=_hybrid("device", fold="auto", memory={
        "fold_overlap": True}))).statistics()["fold_in_step"] is False


def _fused_against_inline(copy_velocity: bool) -> None:
    """bf16 weights, ZeRO 2, the device-side drift path checked by the next real step, its memory
    settings left to auto: the fold and commit run inside DeepSpeed's CPU Adam step, no host
    thread runs, and the losses, weights, masters and velocity are those of the inline fold (from
    a snapshot of the masters before the step) and commit after every real step. (Against the inline fold, not the fold behind the step: that
    one gives the predictor its statistics a real step later, so its runs take other step sizes.)
    ``copy_velocity``: a velocity copy beside the shards where they share its device, as beside a GPU."""
    apart = {"fold_in_step": False, "fold_during_run": False, "commit_overlap": False, "fold_overlap": False}
    inline, fused = (make_engine(ds_config(offload_opt="cpu", bf16=True, stage=2, hybrid=_hybrid(
        "device", fold=fold, memory={"velocity_dtype": "int8", **m})), seed=0)
        for m, fold in ((apart, "snapshot"), ({}, "auto")))
    st = fused.statistics()
    assert st["fold_in_step"] is True and st["fold_overlap"] is False and st["commit_overlap"] is False
    assert inline.statistics()["fold_in_step"] is False
    for e in (inline, fused):
        e._device_predict.copy_always = copy_velocity
    bi, bf = Batches(seed=3, device=inline.device), Batches(seed=3, device=fused.device)
    for _ in range(14):
        ri, rf = inline.train_step(bi.step()), fused.train_step(bf.step())
        assert (ri.phase, ri.loss) == (rf.phase, rf.loss)
        if rf.phase != "predict":
            _same(inline, fused)
            assert torch.equal(_velocity(inline), _velocity(fused))
    st = fused.statistics()
    assert st["predict_accepted"] >= 4 and st["fold_background_seconds"] == 0
    assert st["device_velocity_bytes"] > 0   # the runs moved along a copy of the velocity
    assert fused._fusion.passes["one_pass"] > 0


def test_fold_in_step_with_the_velocity_copied_is_the_inline_fold_bit_for_bit():
    """The GPU test's sequence on DeepSpeed's CPU accelerator, the velocity copied for each run."""
    _fused_against_inline(copy_velocity=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_the_fold_in_step_is_the_inline_fold_bit_for_bit():
    """Beside a GPU (bf16 weights on it, masters in pinned host memory)."""
    _fused_against_inline(copy_velocity=False)


def test_the_benchmark_runs_small_and_writes_its_table(tmp_path):
    """benchmarks/fold_in_step.py at a small size: every arm timed, the JSON and its table written."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fold_in_step.py"
    spec = importlib.util.spec_from_file_location("fold_in_step_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "f.json"
    result = bench.main(["--values", "70000", "--repeat", "1", "--chunks", "14", "--json", str(out)])
    arms = [r["arm"] for r in json.loads(out.read_text())["rows"]]
    assert len(arms) == 9 and arms[0] == "DeepSpeed CPU Adam step" and "one pass" in arms[3]
    assert arms[5] == "+ fold inside the step, one pass, its update read back from the moments"
    assert arms[6] == "+ fold inside the step, one pass, int8 noise read"
    assert all(r["ms"] > 0 for r in result["rows"]) and result["rows"][0]["over_cpu_adam"] == 1.0
    with pytest.raises(SystemExit, match="--chunks"):
        bench.main(["--values", "70000", "--chunks", "10"])
    # other velocity dtypes: their fold after the step and inside it, in one pass (without the moment sums)
    result = bench.main(["--values", "70000", "--repeat", "1", "--chunks", "14", "--velocity", "int8", "bf16",
                         "--no-moments"])
    arms = [r["arm"] for r in result["rows"]]
    assert len(arms) == 12 and arms[-3:] == ["+ fold, a pass after the step, bf16 velocity",
                                             "+ fold inside the step, one pass, bf16 velocity",
                                             "+ fold inside the step, one pass, bf16 velocity, its update read back "
                                             "from the moments"]
