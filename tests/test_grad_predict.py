"""``predictor.direction: gradient``: a Predict step takes its own gradient (a private forward
and backward through the module), moves by Adam's step with that gradient in a first moment the
run keeps and the second moment held, hands that moment to the optimizer when the run is kept
and drops it when the run is rolled back; on ZeRO 0 (fp32) and ZeRO 1/2, offloaded or not."""
import copy

import pytest
import torch

from ds_hybrid.checkpoint import CheckpointError
from ds_hybrid.config import ConfigError
from ds_hybrid.engine import default_loss
from ds_hybrid.grad_predict import batch_share
from ds_hybrid.phases import Phase
from engine_utils import (NVME_AIO, EAGER, MICRO, Batches, aio_available, commit_and_check, count_swap_ins, ds_config,
                          full_params, make_engine, master_copies, steps_alike)

GRAD = dict(EAGER, check="next_step", predictor={"direction": "gradient"})
SETUPS = {"z0": dict(stage=0), "z1": dict(stage=1), "z2": dict(stage=2), "z2-offload": dict(stage=2, offload_opt="cpu"),
          "z1-offload-gas2": dict(stage=1, offload_opt="cpu", gas=2), "z3": dict(stage=3),
          "z3-offload": dict(stage=3, offload_opt="cpu", offload_param="cpu"),
          "z3-offload-gas2": dict(stage=3, offload_opt="cpu", gas=2),
          # every parameter released after its module's forward and gathered again for its backward
          # (the test model's are all below DeepSpeed's default persistence threshold)
          "z3-offload-released": dict(stage=3, zero_optimization={
              "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
              "stage3_param_persistence_threshold": 0})}


def _engine(setup: dict, hybrid: dict = GRAD, **extra):
    setup = dict(setup)
    setup.pop("gas", None)
    return make_engine(ds_config(hybrid=hybrid, gas=extra.pop("gas", 1), **setup, **extra))


def _until(engine, batches, phase: Phase, gas: int = 1, loss_fn=None, limit: int = 40) -> list:
    """Train until the next step is in ``phase``; the results so far."""
    out = []
    while engine.phase is not phase:
        out.append(engine.train_step(batches.step(gas), loss_fn=loss_fn))
        assert len(out) < limit, f"no {phase.value} step within {limit} steps"
    return out


def _moments(engine, key: str) -> list[torch.Tensor]:
    return [p.state[key].detach().clone() for p in engine._masters.partitions()]


@pytest.mark.parametrize("gas, fraction, used, scale", [(1, 1.0, None, 1.0), (2, 0.5, "first micro-batch", 1.0),
                                                        (1, 0.5, "first half of the sequences", 1.0),
                                                        (4, 0.6, "first 2 micro-batches", 1.0),
                                                        (2, 0.5, "first micro-batch", 0.7),
                                                        (1, 1.0, None, 0.3)])
def test_a_predict_step_is_adams_step_with_its_own_gradient_and_the_second_moment_held(gas, fraction, used, scale):
    """ZeRO 0 fp32, where the masters are the parameters: one gradient Predict step, computed by
    hand from the step's batch (clipped as DeepSpeed clips; with ``gradient_batch_fraction`` from
    the share of it that says, at ``gradient_lr_scale``'s share of the LR and decay), the
    optimizer's first moment, its second moment and step count untouched."""
    hybrid = dict(GRAD, predictor={"direction": "gradient", "gradient_batch_fraction": fraction,
                                   "gradient_lr_scale": scale})
    engine = _engine(SETUPS["z0"], hybrid, gas=gas)
    batches = Batches()
    _until(engine, batches, Phase.PREDICT, gas=gas)
    opt = engine._masters.base
    group = opt.param_groups[0]
    params = [p for p in engine.module.parameters()]
    before = [p.detach().clone() for p in params]
    m0 = [opt.state[p]["exp_avg"].clone() for p in params]
    v0 = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    step = next(engine._masters.partitions()).step   # (FusedAdam counts on the group's last parameter only)
    batch = batches.step(gas)
    share = {None: batch, "first micro-batch": batch[:1], "first 2 micro-batches": batch[:2],
             "first half of the sequences": [{k: v[:v.shape[0] // 2] for k, v in batch[0].items()}]}[used]
    assert share[0]["input_ids"].shape[0] == (MICRO // 2 if used == "first half of the sequences" else MICRO)
    # (the mean over the micro-batches it takes, as the private backward takes it)
    loss = sum(default_loss(engine.module, b) for b in share) / len(share)
    grads = torch.autograd.grad(loss, params)
    norm = float(torch.cat([g.reshape(-1) for g in grads]).norm())
    coef = max((norm + 1e-6) / 1.0, 1.0)   # ds_config gradient_clipping 1.0
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    lr *= scale
    r = engine.train_step(batch)
    assert r.phase == "predict" and r.backward_ran and r.loss == pytest.approx(float(loss), rel=1e-6)
    assert engine.micro_steps == gas * engine.global_steps, "the step stands for its whole batch"
    for p, x, g, m, v in zip(params, before, grads, m0, v0):
        m_run = beta1 * m + (1 - beta1) * g / coef
        expect = x - lr * wd * x - lr * (m_run / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
        torch.testing.assert_close(p.detach(), expect, rtol=1e-6, atol=1e-7)
        assert torch.equal(opt.state[p]["exp_avg"], m), "the optimizer's first moment waits for the run's end"
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert p.grad is None, "the private backward accumulates into no .grad"
    assert next(engine._masters.partitions()).step == step


@pytest.mark.parametrize("name", ["z1", "z2", "z2-offload", "z1-offload-gas2", "z3", "z3-offload", "z3-offload-gas2",
                                  "z3-offload-released"])
def test_zero_1_to_3_take_the_same_steps_as_zero_0(name):
    """The gradient laid onto ZeRO 1/2's flat master partition (MasterAccess.param_slices), or on
    ZeRO 3 each parameter's share taken as the backward produces it, moves every parameter as
    ZeRO 0 moves it, over Predict runs kept by the next step's check."""
    gas = SETUPS[name].get("gas", 1)
    ref, eng = _engine(SETUPS["z0"], gas=gas), _engine(SETUPS[name], gas=gas)
    if name == "z3-offload-released":
        assert not any(p.ds_persist for p in eng.module.parameters())
    a, b = Batches(), Batches()
    phases = []
    for _ in range(16):
        ra, rb = ref.train_step(a.step(gas)), eng.train_step(b.step(gas))
        assert ra.phase == rb.phase
        assert rb.loss == pytest.approx(ra.loss, rel=1e-5)
        phases.append(ra.phase)
    assert phases.count("predict") >= 6 and eng.statistics()["predict_accepted"] >= 6
    # ZeRO's reductions round differently from ZeRO 0's; a gradient laid on the wrong values
    # would move them by about the LR (2e-3 here) per Predict step.
    for x, y in zip(full_params(ref), full_params(eng)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("name", ["z2-offload", "z3-offload"])
def test_a_batch_share_takes_the_same_steps_on_zero_1_to_3_as_on_zero_0(name):
    """``gradient_batch_fraction`` 0.5 with 2 micro-batches a step: the Predict steps' gradient
    from the first alone (on ZeRO 3 each parameter's share taken once), as on ZeRO 0."""
    hybrid = dict(GRAD, predictor={"direction": "gradient", "gradient_batch_fraction": 0.5})
    ref, eng = _engine(SETUPS["z0"], hybrid, gas=2), _engine(SETUPS[name], hybrid, gas=2)
    full = _engine(SETUPS["z0"], gas=2)
    a, b, c = Batches(), Batches(), Batches()
    for _ in range(12):
        ra, rb, rc = ref.train_step(a.step(2)), eng.train_step(b.step(2)), full.train_step(c.step(2))
        assert ra.phase == rb.phase == rc.phase
        assert rb.loss == pytest.approx(ra.loss, rel=1e-5)
    assert ref.statistics()["predict_accepted"] >= 4
    for x, y in zip(full_params(ref), full_params(eng)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=5e-5)
    # (and not the steps of the whole batch: the share is what moved them)
    assert max(float((x - z).abs().max()) for x, z in zip(full_params(ref), full_params(full))) > 1e-4


def test_batch_share_cuts_micro_batches_or_sequences_alike_on_every_rank():
    x = torch.arange(24).reshape(6, 4)
    mask = torch.ones(4, 4)   # shared by the sequences: not cut
    one = [{"input_ids": x, "labels": x, "mask": mask}]
    cut = batch_share(one, 0.5)[0]
    assert torch.equal(cut["input_ids"], x[:3]) and torch.equal(cut["labels"], x[:3]) and cut["mask"] is mask
    assert batch_share(one, 0.01)[0]["input_ids"].shape[0] == 1, "at least one sequence"
    assert batch_share(one, 1.0) is one
    assert torch.equal(batch_share([(x, mask)], 0.34)[0][0], x[:2])
    four = [x, x + 1, x + 2, x + 3]
    assert len(batch_share(four, 0.3)) == 1 and batch_share(four, 0.3)[0] is x, "the first, whole"
    assert len(batch_share([x] * 8, 0.5)) == 4 and len(batch_share([x] * 8, 0.01)) == 1
    with pytest.raises(ConfigError, match="gradient_batch_fraction"):
        batch_share([object()], 0.5)


@pytest.mark.parametrize("name", ["z0", "z2-offload", "z3-offload"])
def test_a_kept_run_hands_its_first_moment_to_the_optimizer_before_the_next_step(name, monkeypatch):
    engine = _engine(SETUPS[name])
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    events = []
    grad = engine._gradient
    original_commit = grad.commit

    def commit(**kw):
        run_m = [t.clone() for t in grad.m]
        original_commit(**kw)
        grad.wait()
        parts = list(engine._masters.partitions())
        events.append(("commit", all(torch.equal(p.state["exp_avg"], m) for p, m in zip(parts, run_m)),
                       # the optimizer has not stepped yet: the second moment is still the run's
                       all(torch.equal(p.state["exp_avg_sq"], v) for p, v in zip(parts, v_run))))
    monkeypatch.setattr(grad, "commit", commit)
    v_run = _moments(engine, "exp_avg_sq")
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
        assert grad.pending and not events
    r = engine.train_step(batches.step())
    assert r.checked is True
    assert events == [("commit", True, True)]
    assert not any(torch.equal(x, y) for x, y in zip(_moments(engine, "exp_avg_sq"), v_run)), "then it stepped"
    assert not grad.pending


@pytest.mark.parametrize("name", ["z2-offload", "z3-offload"])
def test_a_rolled_back_run_restores_the_weights_and_drops_its_first_moment(name, monkeypatch):
    """The next step's check rejects the run: the masters and the model are back at the last
    good point bit for bit, and the optimizer's first moment is the one from before the run."""
    engine = _engine(SETUPS[name])
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    good_masters, good_params, good_m = master_copies(engine), full_params(engine), _moments(engine, "exp_avg")
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
    assert any(not torch.equal(x, y) for x, y in zip(good_masters, master_copies(engine)))
    seen = {}
    check = engine._check_predicted_update

    def checked(loss, batch, out):
        redo = check(loss * 10, batch, out)   # a spike: out of the band
        seen.update(masters=master_copies(engine), params=full_params(engine), m=_moments(engine, "exp_avg"))
        return redo
    monkeypatch.setattr(engine, "_check_predicted_update", checked)
    r = engine.train_step(batches.step())
    assert r.checked is False and engine.statistics()["predict_rolled_back"] == 2
    for got, want in ((seen["masters"], good_masters), (seen["params"], good_params), (seen["m"], good_m)):
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert not engine._gradient.pending


@pytest.mark.parametrize("name", ["z2", "z3"])
def test_a_nonfinite_gradient_moves_nothing_and_is_counted(name):
    engine = _engine(SETUPS[name])
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    before, m = full_params(engine), engine._gradient.m

    def nan_in_predict(eng, batch):
        loss = default_loss(eng, batch)
        return loss * float("nan") if eng.phase is Phase.PREDICT else loss
    r = engine.train_step(batches.step(), loss_fn=nan_in_predict)
    assert r.phase == "predict"
    assert all(torch.equal(x, y) for x, y in zip(before, full_params(engine)))
    assert engine._gradient.m is m is None and engine.statistics()["gradient_nonfinite_steps"] == 1
    # the private backward's NaN is not the next real step's: that one steps as usual
    while engine.phase is Phase.PREDICT:
        engine.train_step(batches.step())
    r = engine.train_step(batches.step())
    assert r.phase in ("full", "correct") and not r.skipped and engine.statistics()["skipped_steps"] == 0


@pytest.mark.parametrize("name", ["z1", "z2-offload", "z3-offload"])
def test_a_save_in_the_middle_of_a_run_resumes_bit_for_bit(name, tmp_path):
    """Saved after the first step of a 2-step run (the run's first moment pending, the snapshot
    older than the weights), resumed in a fresh engine: the same steps, weights, masters and
    moments as the run never interrupted, the run kept and its moment handed over."""
    engine = _engine(SETUPS[name])
    batches = Batches()
    _until(engine, batches, Phase.PREDICT)
    engine.train_step(batches.step())
    assert engine.phase is Phase.PREDICT and engine._gradient.pending
    engine.save_checkpoint(tmp_path, "mid")
    consumed = engine.global_steps
    rows = [engine.train_step(batches.step()) for _ in range(6)]
    resumed = _engine(SETUPS[name])
    resumed.load_checkpoint(tmp_path, "mid")
    assert resumed._gradient.pending
    replay = Batches()
    for _ in range(consumed):
        replay.step()
    again = [resumed.train_step(replay.step()) for _ in range(6)]
    key = lambda r: (r.step, r.phase, r.loss, r.checked, r.accepted)   # noqa: E731
    assert [key(r) for r in again] == [key(r) for r in rows]
    assert any(r.checked for r in rows)
    for got, want in ((full_params(resumed), full_params(engine)), (master_copies(resumed), master_copies(engine)),
                      (_moments(resumed, "exp_avg"), _moments(engine, "exp_avg")),
                      (_moments(resumed, "exp_avg_sq"), _moments(engine, "exp_avg_sq"))):
        assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("setup, hybrid, match", [
    (dict(stage=0, bf16=True), GRAD, "bf16.enabled"),
    (dict(stage=2), dict(GRAD, memory={"park_optimizer_states": True}), "park_optimizer_states"),
    (dict(stage=0), dict(GRAD, memory={"offload_predict": "device"}), "offload_predict: device"),
    (dict(stage=2, fp16={"enabled": True}), GRAD, "fp16.enabled"),
    (dict(stage=2), dict(GRAD, predictor={"direction": "gradient", "type": "rssm"}), "predictor.type: rssm"),
    (dict(stage=2), dict(GRAD, group_predict={"enabled": True}), "group_predict.enabled"),
    (dict(stage=2, optimizer={"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01, "adam_w_mode": False}}),
     GRAD, "optimizer.params.weight_decay"),
])
def test_layouts_it_cannot_take_are_refused_naming_the_key(setup, hybrid, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        make_engine(ds_config(hybrid=hybrid, **setup))


# ---------------------------------------------------------------- the device path under offload
# memory.offload_predict: device on DeepSpeed's CPU accelerator: the run's moments are copies beside
# this rank's 16-bit partition, each step moves that partition, and the masters wait for the check.

def _paths(stage: int = 2, bf16: bool = False, gas: int = 1, offload_param: str | None = None, **changes) -> list:
    """The host path and the device path, built alike (offload_optimizer: cpu)."""
    out = []
    for where in ("host", "device"):
        hybrid = dict(GRAD, correction_steps=0, **changes)
        hybrid["memory"] = {**hybrid.get("memory", {}), "offload_predict": where}
        out.append(make_engine(ds_config(stage=stage, offload_opt="cpu", offload_param=offload_param, bf16=bf16,
                                         gas=gas, hybrid=hybrid)))
    return out


def _equal(xs, ys) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.mark.parametrize("stage, gas, offload_param, second", [(1, 1, None, "held"), (2, 1, None, "held"),
                                                               (2, 2, None, "held"), (3, 1, None, "held"),
                                                               (3, 2, "cpu", "held"), (2, 2, None, "updated"),
                                                               (3, 1, None, "updated"), (3, 2, "cpu", "updated")])
def test_device_path_matches_the_host_path_bit_for_bit(stage, gas, offload_param, second):
    """fp32 parameters: the same arithmetic on the same values, so the weights are the host path's
    after every step, and the masters and both moments after every real step (inside a run they
    wait at the last good point); the device path takes no snapshot of the masters. On ZeRO 3 the
    16-bit partition it moves is in host memory with ``offload_param: cpu``. With
    ``predictor.gradient_second_moment: updated`` the device path's v (a copy beside the 16-bit
    partition) takes the same fold as the host path's copy beside the masters."""
    host, dev = _paths(stage, gas=gas, offload_param=offload_param,
                       predictor={"direction": "gradient", "gradient_second_moment": second})
    assert (host.statistics()["offload_predict"], dev.statistics()["offload_predict"]) == ("host", "device")
    bh, bd = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(15):
        rh, rd = host.train_step(bh.step(gas)), dev.train_step(bd.step(gas))
        assert (rh.phase, rh.loss, rh.checked) == (rd.phase, rd.loss, rd.checked)
        assert _equal(full_params(host), full_params(dev))
        if rd.phase != "predict":
            assert _equal(master_copies(host), master_copies(dev))
            assert _equal(_moments(host, "exp_avg"), _moments(dev, "exp_avg"))
            assert _equal(_moments(host, "exp_avg_sq"), _moments(dev, "exp_avg_sq"))
        phases.append(rd.phase)
    st = dev.statistics()
    assert st["gradient_second_moment"] == host.statistics()["gradient_second_moment"] == second
    assert phases.count("predict") >= 6 and st["predict_accepted"] == host.statistics()["predict_accepted"] >= 4
    assert "snapshot" not in st["bookkeeping_seconds"] and "snapshot" in host.statistics()["bookkeeping_seconds"]
    assert st["snapshot_bytes"] == 0


@pytest.mark.parametrize("stage, offload_param", [(2, None), (3, "cpu")])
def test_a_share_of_the_learning_rate_is_taken_alike_on_both_paths(stage, offload_param):
    """``predictor.gradient_lr_scale`` 0.5: the device path's step (on ZeRO 3 with ``offload_param:
    cpu`` the host kernel's) takes half the LR and decay as the host path's fused update does,
    bit for bit, and the weights are not those of the whole LR."""
    half = dict(predictor={"direction": "gradient", "gradient_lr_scale": 0.5})
    host, dev = _paths(stage, offload_param=offload_param, **half)
    (whole,) = _paths(stage, offload_param=offload_param)[:1]
    bh, bd, bw = Batches(seed=3), Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(14):
        rh, rd, rw = host.train_step(bh.step()), dev.train_step(bd.step()), whole.train_step(bw.step())
        assert (rh.phase, rh.loss) == (rd.phase, rd.loss)
        assert _equal(full_params(host), full_params(dev))
        phases.append(rd.phase)
    assert phases.count("predict") >= 4 and dev._gradient.lr_scale == 0.5
    assert not _equal(full_params(host), full_params(whole))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_device_run_leaves_the_masters_and_moments_alone_and_rolls_back_exactly(stage, monkeypatch):
    """During the run the host masters and both Adam moments do not change (the run's state is
    its own copy); the next step's check rejects it: the weights are back where they were before
    it, bit for bit, with no snapshot (the masters re-propagated), and training goes on."""
    _, dev = _paths(stage)
    b = Batches(seed=5)
    _until(dev, b, Phase.PREDICT)
    masters, weights = master_copies(dev), full_params(dev)
    m, v = _moments(dev, "exp_avg"), _moments(dev, "exp_avg_sq")
    while dev.phase is Phase.PREDICT:
        dev.train_step(b.step())
        assert _equal(masters, master_copies(dev)) and _equal(m, _moments(dev, "exp_avg"))
        assert _equal(v, _moments(dev, "exp_avg_sq"))
    assert not _equal(weights, full_params(dev)) and dev._gradient.pending
    seen = {}
    check = dev._check_predicted_update

    def rejected(loss, batch, out):
        redo = check(loss * 10, batch, out)
        seen.update(weights=full_params(dev), masters=master_copies(dev), m=_moments(dev, "exp_avg"))
        return redo
    monkeypatch.setattr(dev, "_check_predicted_update", rejected)
    r = dev.train_step(b.step())
    assert r.checked is False and dev.statistics()["predict_rolled_back"] == 2
    assert _equal(seen["weights"], weights) and _equal(seen["masters"], masters) and _equal(seen["m"], m)
    assert not dev._gradient.pending


@pytest.mark.parametrize("stage, why", [(2, "crossing"), (3, "crossing"), (3, "host")])
def test_a_runs_moments_copied_behind_the_step_before_it_train_as_copies_made_at_its_start(stage, why):
    """Beside a GPU the run's moments cross PCIe (or, ZeRO 3's offload_param: cpu, are copied within
    host memory while the GPU works): the engine starts their copies on the host thread after the
    real step before the run (``prefetch``), and the run's first step joins them only after its
    gradient. Here the crossing (or the GPU beside, ``prefetch_host``) is declared on the CPU
    accelerator: every step's weights, masters and moments are those of copies made at the run's
    start, and a copy made from a state that changed since (here the first moment replaced) is
    dropped, not used."""
    kw = dict(offload_param="cpu") if why == "host" else {}
    ref, fetch = _paths(stage, **kw)[1], _paths(stage, **kw)[1]
    assert not fetch._gradient.prefetch_host   # (no accelerator beside the host memory here)
    if why == "crossing":
        fetch._gradient._crosses = lambda parts, shards: True
    else:
        fetch._gradient.prefetch_host = True
    a, b = Batches(seed=6), Batches(seed=6)
    began = changed = 0
    for _ in range(16):
        if began == 2 and not changed:   # a state change the copies must not miss (as a checkpoint's load makes)
            fetch._gradient.wait()   # (the copies are made; their key says from what)
            for eng in (ref, fetch):
                part = next(eng._masters.partitions())
                part.state["exp_avg"] = part.state["exp_avg"] * 2
            changed = 1
        ra, rb = ref.train_step(a.step()), fetch.train_step(b.step())
        assert (ra.phase, ra.loss, ra.checked) == (rb.phase, rb.loss, rb.checked)
        if fetch.phase is Phase.PREDICT and rb.phase != "predict":
            assert fetch._gradient.running   # the copies go on behind the next step's start
            began += 1
        for got, want in ((full_params(fetch), full_params(ref)), (master_copies(fetch), master_copies(ref)),
                          (_moments(fetch, "exp_avg"), _moments(ref, "exp_avg"))):
            assert _equal(got, want)
    st = fetch.statistics()
    assert began >= 3 and st["gradient_prefetched_runs"] + st["gradient_prefetch_stale"] == began
    assert st["gradient_prefetch_stale"] >= 1 and st["gradient_prefetched_runs"] >= 2
    assert ref.statistics()["gradient_prefetched_runs"] == 0   # (nothing crosses on this CPU)


def test_without_gradient_prefetch_no_thread_runs_beside_the_real_step_and_the_run_is_the_same():
    """memory.gradient_prefetch: false (memory-bench's grad-device-noprefetch): where the moments
    would cross (declared here as above), the real step before a run starts no copies behind
    itself; the run's first step makes them, and every step's weights, masters and moments are
    the prefetching engine's bit for bit."""
    ahead, inline = _paths(2)[1], _paths(2, memory={"gradient_prefetch": False})[1]
    for eng in (ahead, inline):
        eng._gradient._crosses = lambda parts, shards: True
    a, b = Batches(seed=7), Batches(seed=7)
    runs = 0
    for _ in range(12):
        ra, rb = ahead.train_step(a.step()), inline.train_step(b.step())
        assert (ra.phase, ra.loss, ra.checked) == (rb.phase, rb.loss, rb.checked)
        if inline.phase is Phase.PREDICT and rb.phase != "predict":
            assert ahead._gradient.running and not inline._gradient.running
            runs += 1
        for got, want in ((full_params(inline), full_params(ahead)), (master_copies(inline), master_copies(ahead)),
                          (_moments(inline, "exp_avg"), _moments(ahead, "exp_avg"))):
            assert _equal(got, want)
    assert runs >= 2
    assert ahead.statistics()["gradient_prefetched_runs"] >= 2
    assert inline.statistics()["gradient_prefetched_runs"] == inline.statistics()["gradient_prefetch_stale"] == 0
    assert inline.statistics()["bookkeeping_seconds"]["state_upload"] > 0   # (made at each run's first step)


def test_device_path_bf16_weights_within_stochastic_rounding():
    """bf16 parameters: the first Predict step of a run moves the host path's weights and the
    device path's by the same update (the same gradient and moments), rounded to nearest from the
    fp32 master there and stochastically from the bf16 weight here: within two bf16 steps. The
    kept run's masters are the device path's 16-bit weights plus the residual the masters had
    below 16 bits, and the losses stay within 1% of the host path's."""
    host, dev = _paths(2, bf16=True)
    bh, bd = Batches(seed=3), Batches(seed=3)
    while dev.phase is not Phase.PREDICT:
        assert host.train_step(bh.step()).loss == dev.train_step(bd.step()).loss
    good, before = master_copies(dev), full_params(dev)
    assert _equal(master_copies(host), good)
    host.train_step(bh.step()), dev.train_step(bd.step())
    ulp = torch.finfo(torch.bfloat16).eps   # a bf16 step at x is at most eps |x|
    for x, y, w in zip(full_params(host), full_params(dev), before):
        x, y, w = x.float(), y.float(), w.float()
        # the master's residual below bf16 at the start (the device path starts from the rounded
        # weight), then one rounding of the result on either side
        assert bool(((x - y).abs() <= ulp * (w.abs() + 2 * torch.maximum(x.abs(), y.abs()))).all())
    while dev.phase is Phase.PREDICT:
        host.train_step(bh.step()), dev.train_step(bd.step())
    weights = [w.float() for w in _params_of(dev, [dev._gradient._shard(i) for i in range(len(good))])]
    dev._gradient.commit()   # what the next real step does when its check keeps the run
    residual = [g - g.to(torch.bfloat16).float() for g in good]
    assert _equal(_params_of(dev, master_copies(dev)), [w + r for w, r in
                                                         zip(weights, _params_of(dev, residual))])
    for _ in range(6):
        rh, rd = host.train_step(bh.step()), dev.train_step(bd.step())
        assert rh.phase == rd.phase and rd.loss == pytest.approx(rh.loss, rel=1e-2)


@pytest.mark.parametrize("stage, bf16", [(1, False), (2, False), (2, True), (3, False), (3, True)])
def test_a_save_in_the_middle_of_a_device_run_resumes_bit_for_bit(stage, bf16, tmp_path):
    """The masters in the checkpoint are the last good point and the run lives in the 16-bit
    weights and the run's moments: resumed in a fresh engine with other initial weights, the
    weights, masters, moments and every later step equal the uninterrupted run's."""
    _, ref = _paths(stage, bf16=bf16)
    b = Batches(seed=6)
    _until(ref, b, Phase.PREDICT)
    ref.train_step(b.step())
    assert ref.phase is Phase.PREDICT and ref._gradient.pending
    ref.save_checkpoint(str(tmp_path), tag="mid")
    state = b.gen.get_state()
    hybrid = dict(GRAD, correction_steps=0, memory={"offload_predict": "device"})
    resumed = make_engine(ds_config(stage=stage, offload_opt="cpu", bf16=bf16, hybrid=hybrid), seed=1)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed._gradient.pending
    steps_alike(ref, resumed, b, 6, state)
    assert ref.statistics()["predict_accepted"] >= 2


def test_a_device_run_saved_and_loaded_on_the_host_path_is_dropped_with_a_warning(tmp_path, caplog):
    """Saved on the device path, loaded on the host path: the masters hold the last good point and
    not the run, so the run is dropped (the weights re-propagated from the masters), and the log
    says so."""
    _, dev = _paths(2)
    b = Batches(seed=6)
    _until(dev, b, Phase.PREDICT)
    good = master_copies(dev)
    dev.train_step(b.step())
    dev.save_checkpoint(str(tmp_path), tag="mid")
    host = make_engine(ds_config(stage=2, offload_opt="cpu", hybrid=dict(GRAD, memory={"offload_predict": "host"})),
                       seed=1)
    with caplog.at_level("WARNING"):
        host.load_checkpoint(str(tmp_path), tag="mid")
    assert "the run is dropped" in caplog.text
    assert not host._gradient.pending and _equal(master_copies(host), good)
    assert _equal([p.reshape(-1) for p in full_params(host)], _params_of(host, master_copies(host)))


def _params_of(engine, masters) -> list:
    """The model's parameters as they lie in the (unpartitioned, one-rank) masters."""
    out = []
    for i, m in enumerate(masters):
        for p, ps, ms, n in engine._masters.param_slices(i):
            out.append(m.view(-1)[ms:ms + n])
    return out


def test_held_adam_step_in_fp32_is_the_fused_update_and_in_bf16_unbiased():
    """kernels.held_adam_step: with fp32 weights and moments it is fused_update at scale 1 bit for
    bit; with bf16 weights each value lands on one of the two bf16 neighbours of the fp32 result,
    with the fp32 result as the mean over draws; with bf16 moments it stays within their rounding."""
    from ds_hybrid import kernels
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=gen)
    m, v = torch.randn(5000, generator=gen) * 1e-3, torch.rand(5000, generator=gen) * 1e-6
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=7, weight_decay=0.01, decoupled=True)
    a, b = x.clone(), x.clone()
    kernels.held_adam_step(a, m, v, backend="torch", **kw)
    kernels.fused_update(b, m, v, scale=1.0, backend="torch", **kw)
    assert torch.equal(a, b) and not torch.equal(a, x)
    xb = x.to(torch.bfloat16)
    exact = xb.float()
    kernels.held_adam_step(exact, m, v, backend="torch", **kw)   # the fp32 result from the bf16 weights
    lo = exact.to(torch.bfloat16)   # round to nearest
    draws = []
    for seed in range(200):
        y = xb.clone()
        kernels.held_adam_step(y, m, v, key=seed, backend="torch", **kw)
        draws.append(y.float())
    draws = torch.stack(draws)
    step = torch.finfo(torch.bfloat16).eps * exact.abs()
    assert bool(((draws - exact).abs() <= step).all()), "every draw is a neighbour of the fp32 result"
    mean_err = (draws.mean(0) - exact).abs() / step
    assert float(mean_err.mean()) < 0.05, "unbiased: the mean over draws is the fp32 result"
    # the step is mostly a few percent of a bf16 step here: round to nearest leaves most weights
    # where they were; stochastic rounding moves each of those with the probability of its share
    stuck = lo.float() == xb.float()
    assert float(stuck.float().mean()) > 0.5
    assert float((draws[:, stuck] != xb.float()[stuck]).float().mean()) > 0.01
    c = x.clone()
    kernels.held_adam_step(c, m.to(torch.bfloat16), v.to(torch.bfloat16), backend="torch", **kw)
    torch.testing.assert_close(c - x, a - x, rtol=1e-2, atol=3e-7)   # (x + u rounds in fp32)


@pytest.mark.parametrize("name", ["z2", "z3-offload"])
def test_the_private_backward_works_under_non_reentrant_activation_checkpointing(name):
    """The main job turns transformers' non-reentrant checkpointing on for presets with an
    activation_checkpointing section; autograd.grad goes through it (the reentrant kind would
    refuse it), and the Predict step moves the weights as without checkpointing (on ZeRO 3 each
    parameter's hook still sees its whole gradient once, the recomputed forward included)."""
    ref, ckpt = _engine(SETUPS[name]), _engine(SETUPS[name])
    ckpt.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    a, b = Batches(), Batches()
    for _ in range(8):
        ra, rb = ref.train_step(a.step()), ckpt.train_step(b.step())
        assert ra.phase == rb.phase and rb.loss == pytest.approx(ra.loss, rel=1e-5)
    assert ckpt.statistics()["steps_per_phase"]["predict"] >= 2
    for x, y in zip(full_params(ref), full_params(ckpt)):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_path_on_gpu_keeps_the_run_beside_the_bf16_weights():
    """On a GPU with offload_optimizer: cpu and bf16 weights: offload_predict auto takes the device
    path with the run's moments in bf16 on the GPU; during the run the host masters and moments do
    not move while the GPU weights do; the kept run's masters are the GPU weights plus their
    residual below bf16, and the optimizer's first moment is the run's."""
    from ds_hybrid import kernels
    hybrid = dict(GRAD, correction_steps=0)
    eng = make_engine(ds_config(stage=2, offload_opt="cpu", bf16=True, hybrid=hybrid))
    assert eng.statistics()["offload_predict"] == "device" and eng._gradient.state_dtype == torch.bfloat16
    b = Batches(seed=3, device=eng.device)
    _until(eng, b, Phase.PREDICT)
    masters, weights, m = master_copies(eng), full_params(eng), _moments(eng, "exp_avg")
    launches = kernels.LAUNCHES["held_adam_step"]
    while eng.phase is Phase.PREDICT:
        eng.train_step(b.step())
    if kernels.cupy_available():   # hybrid_predict.kernels: auto takes the kernel for GPU shards
        assert kernels.LAUNCHES["held_adam_step"] > launches
    assert _equal(masters, master_copies(eng)) and _equal(m, _moments(eng, "exp_avg"))
    assert not _equal(weights, full_params(eng))
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in eng._gradient.m if t is not None)
    commit_and_check(eng, masters, [t.float().cpu() for t in eng._gradient.m])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_a_runs_moments_are_copied_behind_the_step_before_it_as_the_direct_cast():
    """On a GPU with offload_optimizer: cpu: after the real step before a run the moments' copies
    run on the host thread (the cast on the host, pinned chunks); joined, they are the GPU cast of
    the optimizer's moments bit for bit, and the run begins from them (none dropped as stale)."""
    eng = make_engine(ds_config(stage=2, offload_opt="cpu", bf16=True, hybrid=dict(GRAD, correction_steps=0)))
    b = Batches(seed=3, device=eng.device)
    _until(eng, b, Phase.PREDICT)
    assert eng._gradient.running   # the copies go on behind the next step's start
    eng._gradient.wait()
    key, ms, vs = eng._gradient._next
    for part, m, v in zip(eng._masters.partitions(), ms, vs):
        if m is None:
            continue
        assert m.is_cuda and v.is_cuda
        assert torch.equal(m, part.state["exp_avg"].view(-1).cuda().to(torch.bfloat16))
        assert torch.equal(v, part.state["exp_avg_sq"].view(-1).cuda().to(torch.bfloat16))
    while eng.phase is Phase.PREDICT:
        eng.train_step(b.step())
    st = eng.statistics()
    assert st["gradient_prefetched_runs"] == 1 and st["gradient_prefetch_stale"] == 0


def test_bf16_run_state_and_gradient_sum_stay_close_to_fp32():
    """memory.gradient_state_dtype: bf16 (what auto takes beside a GPU with bf16 weights): the run's
    moments and the gradient's sum over micro-batches are bf16 (half the device memory), the loss
    reported in fp32, and training stays within bf16 rounding's reach of the fp32 state's."""
    engines = []
    for dtype in ("fp32", "bf16"):
        hybrid = dict(GRAD, correction_steps=0, memory={"offload_predict": "device", "gradient_state_dtype": dtype})
        engines.append(make_engine(ds_config(stage=2, offload_opt="cpu", gas=2, hybrid=hybrid)))
    ref, low = engines
    assert low._gradient.state_dtype == low._gradient.sum_dtype == torch.bfloat16
    a, b = Batches(seed=2), Batches(seed=2)
    for _ in range(14):
        ra, rb = ref.train_step(a.step(2)), low.train_step(b.step(2))
        assert ra.phase == rb.phase and rb.loss == pytest.approx(ra.loss, rel=2e-3)
        if rb.phase == "predict":
            assert all(t.dtype == torch.bfloat16 for t in low._gradient.m if t is not None)
            assert rb.loss == pytest.approx(low._gradient.last_loss, rel=0)
    assert low.statistics()["predict_accepted"] >= 4


def test_the_commit_behind_the_backward_matches_the_inline_commit_bit_for_bit():
    """memory.commit_overlap: true (auto beside a GPU): a kept run's first moment and the masters'
    catch-up run on a host thread while the next real step's forward and backward go on, joined
    before its optimizer step; the weights, masters and moments are the inline commit's."""
    engines = []
    for overlap in (False, True):
        hybrid = dict(GRAD, correction_steps=0, memory={"offload_predict": "device", "commit_overlap": overlap})
        engines.append(make_engine(ds_config(stage=2, offload_opt="cpu", hybrid=hybrid)))
    inline, behind = engines
    a, b = Batches(seed=4), Batches(seed=4)
    for _ in range(14):
        ra, rb = inline.train_step(a.step()), behind.train_step(b.step())
        assert (ra.phase, ra.loss, ra.checked) == (rb.phase, rb.loss, rb.checked)
        assert not behind._gradient.running   # (joined within the step)
        for got, want in ((full_params(behind), full_params(inline)), (master_copies(behind), master_copies(inline)),
                          (_moments(behind, "exp_avg"), _moments(inline, "exp_avg"))):
            assert _equal(got, want)
    st = behind.statistics()
    assert st["commit_overlap"] is True and st["commit_background_seconds"] > 0 and st["predict_accepted"] >= 4
    assert inline.statistics()["commit_overlap"] is False


def test_a_host_run_saved_and_loaded_on_the_device_path_is_kept_with_a_warning(tmp_path, caplog):
    """Saved on the host path (the masters hold the run, the snapshot its last good point), loaded on
    the device path (which keeps no snapshot): the run is kept as it stands, its first moment handed
    to the optimizer, and the log says it can no longer be rolled back."""
    host, _ = _paths(2)
    b = Batches(seed=6)
    _until(host, b, Phase.PREDICT)
    host.train_step(b.step())
    run_m = [t.clone() for t in host._gradient.m]
    host.save_checkpoint(str(tmp_path), tag="mid")
    hybrid = dict(GRAD, correction_steps=0, memory={"offload_predict": "device"})
    dev = make_engine(ds_config(stage=2, offload_opt="cpu", hybrid=hybrid), seed=1)
    with caplog.at_level("WARNING"):
        dev.load_checkpoint(str(tmp_path), tag="mid")
    assert "the run is kept as it stands" in caplog.text
    assert not dev._gradient.pending and _equal(master_copies(dev), master_copies(host))
    assert _equal([m.view(-1) for m in _moments(dev, "exp_avg")], [m.view(-1) for m in run_m])
    for _ in range(4):
        assert dev.train_step(b.step()).loss is not None


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("where, state", [("device", "auto"), ("device", "int8-factored"), ("host", "auto")])
def test_the_16_bit_partitions_on_nvme_take_the_same_gradient_steps_as_in_host_memory(where, state, tmp_path):
    """ZeRO-Infinity with both offloads on NVMe (50b-24gb-nvme's layout): on the device path each
    gradient Predict step reads a sub-group's 16-bit partition from the drive into one host buffer,
    takes Adam's step there and writes it back (zero_access.SwappedShards), a kept run's catch-up
    inside DeepSpeed's next step reads it again, a rejected run is re-propagated from the untouched
    masters; the host path moves the masters and DeepSpeed swaps the weights out. Phases, losses,
    weights and (outside a run) masters and moments, bit for bit the same run with the 16-bit
    weights in host memory (``offload_param: cpu``), through kept and rejected runs."""
    from engine_utils import SWAPPED_LLAMA, swap_params
    hybrid = dict(GRAD, correction_steps=0, memory={"offload_predict": where, "gradient_state_dtype": state})

    def build(param: str):
        cfg = ds_config(stage=3, bf16=True, offload_opt="nvme", offload_param=param,
                        nvme_path=str(tmp_path / param), hybrid=copy.deepcopy(hybrid), **NVME_AIO)
        if param == "nvme":
            swap_params(cfg)
        cfg["zero_optimization"]["sub_group_size"] = 1_000_000
        engine = make_engine(cfg, **SWAPPED_LLAMA)
        check, seen = engine._check_predicted_update, []

        def judged(loss, batch, out):   # (each second run checked is rejected)
            if engine._check_groups is not None:
                seen.append(float(loss))
            return check(loss * 10 if len(seen) % 2 == 0 and engine._check_groups is not None else loss, batch, out)
        engine._check_predicted_update = judged
        return engine
    ram, nvme = build("cpu"), build("nvme")
    access = nvme._masters
    swapped = [i for i in range(access._count()) if access.shard_swapped(i)]
    assert swapped and not any(map(ram._masters.shard_swapped, range(ram._masters._count())))
    assert nvme.statistics()["offload_predict"] == where
    br, bn, phases = Batches(seed=3), Batches(seed=3), []
    for _ in range(16):
        rr, rn = ram.train_step(br.step()), nvme.train_step(bn.step())
        assert (rr.phase, rr.loss, rr.checked, rr.rolled_back_steps) == (rn.phase, rn.loss, rn.checked,
                                                                          rn.rolled_back_steps)
        assert _equal(full_params(ram), full_params(nvme)), phases + [rn.phase]
        if rn.phase != "predict":
            assert _equal(master_copies(ram), master_copies(nvme))
            assert _equal(_moments(ram, "exp_avg"), _moments(nvme, "exp_avg"))
        phases.append(rn.phase)
    st = nvme.statistics()
    assert phases.count("predict") >= 6 and st["predict_accepted"] >= 2 and st["predict_rolled_back"] >= 2
    if where == "device":   # (no snapshot; the one host buffer, as long as the largest partition on NVMe)
        assert st["snapshot_bytes"] == 0
        assert st["shard_swap_buffer_bytes"] == 2 * max(access.numel(i) for i in swapped)


def _nan_gradient_loss(engine, batch):
    """A finite loss whose gradient is NaN (d/dz sqrt(z) at z = 0, times 0)."""
    out = engine(**batch)
    z = out.logits.float().sum()
    return out.loss + 0.0 * torch.sqrt(z - z.detach())


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("where, second, state", [("host", "held", "auto"), ("device", "held", "auto"),
                                                  ("device", "updated", "auto"), ("device", "held", "int8-factored")])
def test_masters_and_adam_state_on_nvme_take_the_same_steps_as_in_host_memory(where, second, state, tmp_path):
    """ZeRO 3 with ``offload_optimizer: nvme`` (ZeRO-Infinity): each sub-group's masters and moments
    are swapped in for their turn only (a run's start, a kept run's commit, a rollback's
    re-propagation; on the host path each step's update too). The same steps, weights, masters and
    both moments, bit for bit, as the same run with them in host memory (``offload_optimizer:
    cpu``), through kept runs and a rejected one. gpt2-tiny in sub-groups of about 300k values: the
    first two are above DeepSpeed's smallest swappable tensor (1 MiB) and really are swapped, the
    last (149k) stays in memory, as DeepSpeed keeps such a one. A checkpoint saved in the middle of
    a run and loaded into a second engine of this process is refused, naming the file: DeepSpeed's
    NVMe files are named by parameter ids, which the second engine numbers on from the first
    (a fresh process resumes: tests/test_nvme_resume.py)."""
    hybrid = dict(GRAD, correction_steps=0, predictor={"direction": "gradient", "gradient_second_moment": second},
                  memory={"offload_predict": where, "gradient_state_dtype": state})

    def build(device: str, folder: str = "swap", seed: int = 0):
        mine = copy.deepcopy(hybrid)
        if device == "nvme" and where == "device":   # (auto takes the device path where the masters swap)
            mine["memory"]["offload_predict"] = "auto"
        cfg = ds_config(stage=3, offload_opt=device, nvme_path=str(tmp_path / folder), hybrid=mine, **NVME_AIO)
        cfg["zero_optimization"]["sub_group_size"] = 300_000
        return make_engine(cfg, seed=seed, model="gpt2-tiny")
    ram, nvme = build("cpu"), build("nvme")
    count = nvme._masters._count()
    assert nvme._masters.swaps and not ram._masters.swaps and count >= 2
    assert [nvme.optimizer._swappable_optimizer_subgroup(i) for i in range(count)] == [True, True, False]
    assert nvme.statistics()["offload_predict"] == where

    rejected = []
    for engine in (ram, nvme):   # (the second run checked in each engine is rejected)
        check, seen = engine._check_predicted_update, []

        def judged(loss, batch, out, check=check, seen=seen, engine=engine):
            if engine._check_groups is not None:   # (a run's check, not another step's first forward)
                seen.append(float(loss))
            return check(loss * 10 if len(seen) == 2 and engine._check_groups is not None else loss, batch, out)
        engine._check_predicted_update = judged
        rejected.append(seen)
    swapped = count_swap_ins(nvme)   # sub-groups swapped in by the NVMe engine since the count was reset
    br, bn = Batches(seed=3), Batches(seed=3)
    phases, kept, swaps = [], [], []   # per step of the NVMe engine: phase, a run kept, sub-groups swapped in
    for _ in range(16):
        swapped[0] = 0
        # The third run's check keeps it and the step's gradient is NaN: the guard skips DeepSpeed's
        # step, which then takes no part of the commit; it is added before anything reads it next.
        poison = len(rejected[1]) == 2 and nvme._check_groups is not None
        loss_fn = _nan_gradient_loss if poison else None
        rr, rn = ram.train_step(br.step(), loss_fn=loss_fn), nvme.train_step(bn.step(), loss_fn=loss_fn)
        swaps.append(swapped[0])
        kept.append(rn.checked and not rn.rolled_back_steps and not poison)
        assert (rr.phase, rr.loss, rr.checked) == (rn.phase, rn.loss, rn.checked)
        assert _equal(full_params(ram), full_params(nvme))
        if rn.phase != "predict":
            assert _equal(master_copies(ram), master_copies(nvme))
            assert _equal(_moments(ram, "exp_avg"), _moments(nvme, "exp_avg"))
            assert _equal(_moments(ram, "exp_avg_sq"), _moments(nvme, "exp_avg_sq"))
        phases.append(rn.phase)
    st = nvme.statistics()
    assert phases.count("predict") >= 6 and st["predict_accepted"] >= 4 and st["predict_rolled_back"] >= 2
    assert st["gradient_second_moment"] == second and len(rejected[1]) >= 3 and st["skipped_steps"] == 1
    # Each of the 2 swapped sub-groups in: on the device path never in a run (its copies of the
    # moments, or its compact moments, are made inside the DeepSpeed step of the real step before
    # it, each sub-group's while it is swapped in: memory.gradient_prefetch); on the host path at
    # every step for the update and the propagation, and at the first also for the copies and the
    # snapshot.
    firsts = [n for k, (p, n) in enumerate(zip(phases, swaps)) if p == "predict" and phases[k - 1] != "predict"]
    later = [n for k, (p, n) in enumerate(zip(phases, swaps)) if p == "predict" and phases[k - 1] == "predict"]
    assert set(firsts) == ({0} if where == "device" else {8}) and later
    assert set(later) == ({0} if where == "device" else {4})
    if where == "device":   # (the real step before each run made its state: memory.gradient_prefetch)
        assert st["gradient_prefetched_runs"] == len(firsts) and st["gradient_prefetch_stale"] == 0
    # A real step that keeps a run swaps each sub-group in once: the commit goes into DeepSpeed's
    # step, before each sub-group's Adam step, not through a swap of its own.
    assert {n for n, k in zip(swaps, kept) if k} == {2}

    _until(nvme, bn, Phase.PREDICT)
    nvme.train_step(bn.step())
    assert nvme.phase is Phase.PREDICT and nvme._gradient.pending
    nvme.save_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    resumed = build("nvme", folder="swap-resumed", seed=1)
    with pytest.raises(CheckpointError, match="named for other parameter ids"):
        resumed.load_checkpoint(str(tmp_path / "ckpt"), tag="mid")


@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_a_run_state_made_in_the_nvme_step_for_a_run_that_does_not_come_is_dropped(tmp_path):
    """``memory.gradient_prefetch`` under NVMe swap: the last real step of a Full phase makes the
    next run's state inside its DeepSpeed step; where the decision then takes another Full phase,
    the next real step drops it (its memory back before that step's forward and backward), and a
    real step no run may follow makes none."""
    cfg = ds_config(stage=3, offload_opt="nvme", nvme_path=str(tmp_path), hybrid=dict(GRAD, correction_steps=0),
                    **NVME_AIO)
    cfg["zero_optimization"]["sub_group_size"] = 300_000
    engine = make_engine(cfg, model="gpt2-tiny")
    assert engine._masters.swaps and engine.statistics()["offload_predict"] == "device"
    engine._decide = lambda: (False, 0)   # (no run comes)
    b = Batches(seed=3)
    made = []   # per step: a run may follow it, the state is held after it
    for _ in range(9):
        ends = engine.controller.may_predict_next()
        engine.train_step(b.step())
        made.append((ends, engine._gradient._next is not None))
        assert engine.phase is not Phase.PREDICT
    assert all(ends == held for ends, held in made) and sum(ends for ends, _ in made) == 3, made
    st = engine.statistics()
    assert st["gradient_prefetch_stale"] == 2 and st["gradient_prefetched_runs"] == 0


def test_zero3_shares_from_a_gpu_are_queued_and_added_on_a_host_thread_bit_for_bit():
    """ZeRO 3 with offload_param: cpu beside a GPU: each parameter's gradient share reaches the
    sums in host memory through queued chunks (not a copy per parameter waited for on autograd's
    thread), added in order on a host thread of their own. Made to queue on the CPU too, in chunks
    of 100 values so that shares span several and 2 buffers so that the hooks wait for free ones:
    the same weights, masters and first moments as the direct add, at every step."""
    import threading
    from ds_hybrid.staging import QueuedDownloads
    direct, staged = (_engine(SETUPS["z3-offload"]) for _ in range(2))
    staged._gradient.stage_shares = True
    staged._gradient._shares = queue = QueuedDownloads(chunk=100, slots=2)
    calls, threads = [], set()
    put = queue.put

    def counting_put(src, take):
        calls.append(src.numel())
        put(src, lambda *a: (threads.add(threading.get_ident()), take(*a)))
    queue.put = counting_put
    bd, bs = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(12):
        rd, rs = direct.train_step(bd.step()), staged.train_step(bs.step())
        assert (rd.phase, rd.loss) == (rs.phase, rs.loss)
        phases.append(rd.phase)
        assert _equal(full_params(direct), full_params(staged))
        assert _equal(master_copies(direct), master_copies(staged))
        assert _equal(_moments(direct, "exp_avg"), _moments(staged, "exp_avg"))
    assert phases.count(Phase.PREDICT.value) >= 3
    assert calls and max(calls) > 100 and queue.chunks > len(calls)
    assert threads and threading.get_ident() not in threads   # added off the thread that ran the backward
    waits = staged.statistics()["gradient_share_wait_seconds"]
    assert set(waits) == {"slot", "drain"} and waits["slot"] > 0
