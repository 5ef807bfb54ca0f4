"""``predictor.gradient_second_moment: updated``: a gradient Predict run folds each of its
gradients into a copy of Adam's second moment as into its first, steps with it, hands both to the
optimizer when the run is kept and drops both when it is rolled back; on both paths, ZeRO 0-3,
through a checkpoint saved in the middle of a run, and refused where the run's second moment is
not a whole copy (the compact state, ``memory.cpu_step_behind``) or there is no gradient."""
import pytest
import torch

from ds_hybrid.config import ConfigError
from ds_hybrid.engine import default_loss
from ds_hybrid.phases import Phase
from engine_utils import Batches, ds_config, full_params, make_engine, master_copies, steps_alike
from spawn import run_ranks
from test_grad_predict import GRAD, SETUPS, _engine, _equal, _moments, _until

UPDATED = dict(GRAD, predictor={"direction": "gradient", "gradient_second_moment": "updated"})


def test_a_predict_step_folds_its_gradient_into_the_runs_second_moment_and_steps_with_it():
    """ZeRO 0 fp32: two Predict steps computed by hand (the gradient clipped as DeepSpeed clips,
    each folded into m and v as Adam folds it, the step count the last real step's), the
    optimizer's moments untouched until the run is kept, then the run's v is the optimizer's."""
    engine = _engine(SETUPS["z0"], UPDATED)
    assert engine.statistics()["gradient_second_moment"] == "updated"
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    opt = engine._masters.base
    group = opt.param_groups[0]
    params = list(engine.module.parameters())
    m = [opt.state[p]["exp_avg"].clone() for p in params]
    v = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    m0, v0 = [t.clone() for t in m], [t.clone() for t in v]
    step = next(engine._masters.partitions()).step
    beta1, beta2 = group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    for _ in range(2):
        assert engine.phase is Phase.PREDICT
        lr = group["lr"]   # (the test config's warmup moves it every step)
        batch = batches.step()
        before = [p.detach().clone() for p in params]
        grads = torch.autograd.grad(default_loss(engine.module, batch[0]), params)
        coef = max(float(torch.cat([g.reshape(-1) for g in grads]).norm()) + 1e-6, 1.0)
        r = engine.train_step(batch)
        assert r.phase == "predict"
        for k, (p, x, g) in enumerate(zip(params, before, grads)):
            m[k] = beta1 * m[k] + (1 - beta1) * g / coef
            v[k] = beta2 * v[k] + (1 - beta2) * (g / coef) ** 2
            expect = x - lr * wd * x - lr * (m[k] / (1 - beta1 ** step)) / ((v[k] / (1 - beta2 ** step)).sqrt() + eps)
            torch.testing.assert_close(p.detach(), expect, rtol=1e-6, atol=1e-7)
            assert torch.equal(opt.state[p]["exp_avg_sq"], v0[k]), "the optimizer's v waits for the run's end"
            assert torch.equal(opt.state[p]["exp_avg"], m0[k])
    run_v = [t.clone() for t in engine._gradient.v]
    for want, got in zip(v, run_v):
        torch.testing.assert_close(got.view(want.shape), want, rtol=1e-5, atol=1e-12)
    engine._gradient.commit()
    for p, t in zip(params, run_v):
        assert torch.equal(opt.state[p]["exp_avg_sq"].view(-1), t.view(-1))


def test_the_held_second_moment_is_read_in_place_and_the_updated_one_is_a_copy():
    """Held: the host path's run keeps no copy of v (its memory is the first moment's alone);
    updated: a copy per partition, the optimizer's own never written during the run."""
    held, upd = _engine(SETUPS["z2-offload"]), _engine(SETUPS["z2-offload"], UPDATED)
    bh, bu = Batches(), Batches()
    _until(held, bh, Phase.PREDICT), _until(upd, bu, Phase.PREDICT)
    held.train_step(bh.step()), upd.train_step(bu.step())
    assert held._gradient.pending and all(v is None for v in held._gradient.v)
    parts = list(upd._masters.partitions())
    assert all(v is not None and v.data_ptr() != p.state["exp_avg_sq"].data_ptr()
               for v, p in zip(upd._gradient.v, parts) if p.master.numel())
    assert held.statistics()["gradient_second_moment"] == "held"


@pytest.mark.parametrize("name", ["z1", "z2-offload", "z3-offload", "z1-offload-gas2"])
def test_zero_1_to_3_take_the_same_updated_steps_as_zero_0(name):
    """The second moment's fold on ZeRO 1/2's flat partitions and on ZeRO 3's shares moves every
    parameter as ZeRO 0's does, and not as the held second moment would."""
    gas = SETUPS[name].get("gas", 1)
    ref, eng = _engine(SETUPS["z0"], UPDATED, gas=gas), _engine(SETUPS[name], UPDATED, gas=gas)
    held = _engine(SETUPS["z0"], gas=gas)
    a, b, c = Batches(), Batches(), Batches()
    phases = []
    for _ in range(16):
        ra, rb, rc = ref.train_step(a.step(gas)), eng.train_step(b.step(gas)), held.train_step(c.step(gas))
        assert ra.phase == rb.phase == rc.phase
        assert rb.loss == pytest.approx(ra.loss, rel=1e-5)
        phases.append(ra.phase)
    assert phases.count("predict") >= 6 and eng.statistics()["predict_accepted"] >= 6
    for x, y in zip(full_params(ref), full_params(eng)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=5e-5)
    assert max(float((x - z).abs().max()) for x, z in zip(full_params(ref), full_params(held))) > 1e-4


@pytest.mark.parametrize("name, where", [("z2-offload", "host"), ("z3-offload", "host"), ("z2-offload", "device")])
def test_a_rolled_back_run_drops_its_second_moment(name, where, monkeypatch):
    """The next step's check rejects the run: the masters, the model and both of the optimizer's
    moments are the last good point's bit for bit."""
    engine = _engine(SETUPS[name], dict(UPDATED, correction_steps=0, memory={"offload_predict": where}))
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    good = (master_copies(engine), full_params(engine), _moments(engine, "exp_avg"), _moments(engine, "exp_avg_sq"))
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
    assert not _equal([v.view(-1) for v in engine._gradient.v], [t.view(-1) for t in good[3]]), "the run moved its v"
    seen = {}
    check = engine._check_predicted_update

    def checked(loss, batch, out):
        redo = check(loss * 10, batch, out)   # a spike: out of the band
        seen.update(got=(master_copies(engine), full_params(engine), _moments(engine, "exp_avg"),
                         _moments(engine, "exp_avg_sq")))
        return redo
    monkeypatch.setattr(engine, "_check_predicted_update", checked)
    r = engine.train_step(batches.step())
    assert r.checked is False and engine.statistics()["predict_rolled_back"] == 2
    for got, want in zip(seen["got"], good):
        assert _equal(got, want)
    assert not engine._gradient.pending and engine._gradient.v == []


@pytest.mark.parametrize("name, where", [("z2-offload", "host"), ("z3-offload", "host"), ("z2-offload", "device")])
def test_a_save_in_the_middle_of_an_updated_run_resumes_bit_for_bit(name, where, tmp_path):
    """Saved after the first step of a 2-step run (the run's v ahead of the optimizer's), resumed
    in a fresh engine with other initial weights: every later step, the weights, masters and both
    moments equal the uninterrupted run's."""
    hybrid = dict(UPDATED, correction_steps=0, memory={"offload_predict": where})
    ref = _engine(SETUPS[name], hybrid)
    b = Batches(seed=6)
    _until(ref, b, Phase.PREDICT)
    ref.train_step(b.step())
    assert ref.phase is Phase.PREDICT and ref._gradient.pending
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    setup = dict(SETUPS[name])
    resumed = make_engine(ds_config(hybrid=hybrid, **setup), seed=1)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed._gradient.pending
    assert _equal([v.view(-1) for v in resumed._gradient.v], [v.view(-1) for v in ref._gradient.v])
    steps_alike(ref, resumed, b, 6, state)
    assert _equal(_moments(resumed, "exp_avg_sq"), _moments(ref, "exp_avg_sq"))
    assert ref.statistics()["predict_accepted"] >= 2


@pytest.mark.parametrize("hybrid, match", [
    (dict(GRAD, predictor={"direction": "drift", "gradient_second_moment": "updated"}),
     "gradient_second_moment"),
    (dict(UPDATED, memory={"offload_predict": "device", "gradient_state_dtype": "int8-factored"}),
     "gradient_state_dtype"),
    (dict(UPDATED, memory={"offload_predict": "device", "cpu_step_behind": True}), "cpu_step_behind"),
])
def test_settings_it_cannot_take_are_refused_naming_the_key(hybrid, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        make_engine(ds_config(stage=2, offload_opt="cpu", hybrid=hybrid))


def _betas(beta2: float) -> dict:
    from engine_utils import LR
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, beta2]}}


@pytest.mark.parametrize("beta2, memory, want", [
    (0.95, {}, "updated"),            # v remembers ~20 steps: a run outgrows a held one
    (0.999, {}, "held"),              # ~1000: a run hardly moves it
    (0.95, {"offload_predict": "device", "gradient_state_dtype": "int8-factored"}, "held"),   # factored v
    (0.95, {"offload_predict": "device", "cpu_step_behind": True}, "held"),                  # the cover's v
])
def test_auto_updates_the_second_moment_where_adams_memory_is_short(beta2, memory, want):
    """``predictor.gradient_second_moment: auto`` (the default): ``updated`` below ``betas[1]``
    0.99 where the run keeps a whole ``v``, else ``held``; at 0.95 it takes the same steps as
    ``updated`` set by hand, bit for bit, and not the held ones."""
    hybrid = dict(GRAD, predictor={"direction": "gradient"}, memory=memory)
    auto = _engine(SETUPS["z2-offload"], hybrid, optimizer=_betas(beta2))
    assert auto.statistics()["gradient_second_moment"] == want
    assert auto._gradient.update_v is (want == "updated")
    if memory:
        return
    same = dict(hybrid, predictor={"direction": "gradient", "gradient_second_moment": want})
    other = dict(hybrid, predictor={"direction": "gradient",
                                    "gradient_second_moment": "held" if want == "updated" else "updated"})
    ref, alt = _engine(SETUPS["z2-offload"], same, optimizer=_betas(beta2)), \
        _engine(SETUPS["z2-offload"], other, optimizer=_betas(beta2))
    a, b, c = Batches(), Batches(), Batches()
    phases = [(auto.train_step(a.step()).phase, ref.train_step(b.step()).phase, alt.train_step(c.step()).phase)
              for _ in range(12)]
    assert sum(p[0] == "predict" for p in phases) >= 4 and all(p[0] == p[1] for p in phases)
    assert all(torch.equal(x, y) for x, y in zip(full_params(auto), full_params(ref)))
    assert not all(torch.equal(x, y) for x, y in zip(full_params(auto), full_params(alt)))


def test_the_planner_resolves_auto_from_the_presets_betas():
    """``ds-hybrid plan --set predictor.direction=gradient``: the 1B preset's ``betas[1]`` 0.95 counts
    the run's own ``v``, the CPU preset's 0.999 and the 4-bit state do not."""
    from ds_hybrid.arguments import resolve_config
    from ds_hybrid.memory import planner as pl
    for preset, memory, want in (("1b-16gb", {}, True), ("tiny-cpu", {}, False),
                                 ("1b-16gb", {"gradient_state_dtype": "int4-factored"}, False)):
        ds, _ = resolve_config(preset)
        ds["hybrid_predict"]["predictor"] = {"direction": "gradient"}
        ds["hybrid_predict"]["memory"] = dict(ds["hybrid_predict"].get("memory") or {}, **memory)
        assert pl.preset_spec(ds, preset).gradient_v_updated is want, (preset, memory)


@pytest.mark.slow
def test_an_updated_second_moment_keeps_the_ranks_together_on_both_paths(tmp_path):
    """ZeRO 2 under offload, 2 ranks, with the faults (rank 0's NaN loss in the first Predict step,
    rank 1's spike at a check): each rank folds the all-reduced gradient into its own share of v,
    so both ranks take the same steps and end on the same weights, the device path where the host
    path does."""
    runs = {}
    for where in ("host", "device"):
        (tmp_path / where).mkdir()
        runs[where] = run_ranks("multirank_worker.py", ["--stage", "2", "--steps", "16", "--faults",
                                                        "--offload-predict", where, "--direction", "gradient",
                                                        "--gradient-second-moment", "updated"], 2, tmp_path / where)
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped", "checked")
    want = [tuple(s[c] for c in cols) for s in runs["host"][0]["record"]]
    for ranks in runs.values():
        for rep in ranks:
            assert [tuple(s[c] for c in cols) for s in rep["record"]] == want
            st = rep["statistics"]
            assert st["gradient_second_moment"] == "updated"
            assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1


def test_the_planner_counts_the_host_paths_second_moment_copy():
    """``ds-hybrid plan``: on the host path an updated second moment is one more fp32 copy of the
    partition beside the first moment's; on the device path beside a GPU (whose moments are copies
    already) the count is unchanged."""
    import dataclasses

    from ds_hybrid.arguments import resolve_config
    from ds_hybrid.memory import planner as pl
    shape = pl.model_shape("llama-1b")
    (one,) = pl.load_presets(["1b-16gb"])
    grad = dataclasses.replace(one, gradient=True, velocity_bytes_per_value=0.0, offload_predict="host")
    held = pl.estimate(shape, grad, accelerator="cuda")
    upd = pl.estimate(shape, dataclasses.replace(grad, gradient_v_updated=True), accelerator="cuda")
    second = [i for i in upd.items if i.what.startswith("gradient Predict run's second moment")]
    first = [i for i in upd.items if i.what.startswith("gradient Predict run's first moment")]
    assert len(second) == 1 and second[0].where == "cpu" and second[0].bytes == pytest.approx(first[0].bytes)
    assert upd.cpu_bytes - held.cpu_bytes == pytest.approx(second[0].bytes)
    dev = dataclasses.replace(grad, offload_predict="auto")
    assert pl.estimate(shape, dataclasses.replace(dev, gradient_v_updated=True), accelerator="cuda").gpu_bytes == \
        pytest.approx(pl.estimate(shape, dev, accelerator="cuda").gpu_bytes)
    ds, _ = resolve_config("1b-16gb")
    ds["hybrid_predict"]["predictor"] = {"direction": "gradient", "gradient_second_moment": "updated"}
    assert pl.preset_spec(ds, "1b-grad-v").gradient_v_updated
