"""PredictiveEngine on every ZeRO stage: Predict steps move the weights with no
backward pass, the update is the predicted Adam step, rollback is exact, the
counters stay DeepSpeed's, and ``enabled: false`` is plain DeepSpeed bit for bit."""
import math

import pytest
import torch

import ds_hybrid.zero_access as za
from ds_hybrid import Phase
from engine_utils import (NVME_AIO, EAGER, SWAPPED_LLAMA, BackwardCounter, Batches, aio_available, count_swap_ins,
                          ds_config, full_params, make_engine, master_copies, same_velocity, swap_params)

SETUPS = {
    "z0-fp32": dict(stage=0),
    "z0-bf16": dict(stage=0, bf16=True),
    "z1-fp32": dict(stage=1),
    "z1-bf16-gas2": dict(stage=1, bf16=True, gas=2),
    "z2-fp32": dict(stage=2),
    "z2-bf16": dict(stage=2, bf16=True),
    "z2-offload-cpu": dict(stage=2, offload_opt="cpu"),
    "z2-offload-cpu-gas3": dict(stage=2, offload_opt="cpu", gas=3),
    "z3-fp32": dict(stage=3),
    "z3-bf16": dict(stage=3, bf16=True),
    "z3-offload-opt-param-cpu": dict(stage=3, offload_opt="cpu", offload_param="cpu"),
    "z3-bf16-offload-cpu-gas2": dict(stage=3, bf16=True, offload_opt="cpu", offload_param="cpu", gas=2),
}


def run_until(engine, batches, phase, gas, limit=30):
    for _ in range(limit):
        if engine.phase is phase:
            return
        engine.train_step(batches.step(gas))
    raise AssertionError(f"never reached {phase}")


def expected_update(engine, scale):
    """The predicted update computed independently from the optimizer state."""
    out = []
    for part in engine._masters.partitions():
        if part.master.numel() == 0 or "exp_avg" not in part.state:
            out.append(torch.zeros_like(part.master))
            continue
        b1, b2 = part.group["betas"]
        m_hat = part.state["exp_avg"] / (1 - b1 ** part.step)
        v_hat = part.state["exp_avg_sq"] / (1 - b2 ** part.step)
        lr, wd = part.group["lr"], part.group["weight_decay"]
        out.append(-scale * lr * m_hat / (v_hat.sqrt() + part.group["eps"]) - lr * wd * part.master)
    return out


@pytest.mark.parametrize("name", list(SETUPS))
def test_predict_step_moves_weights_without_backward(name, monkeypatch):
    setup = dict(SETUPS[name])
    gas = setup.get("gas", 1)
    engine = make_engine(ds_config(hybrid=EAGER, **setup))
    batches = Batches()
    run_until(engine, batches, Phase.PREDICT, gas)

    masters_before = master_copies(engine)
    params_before = full_params(engine)
    expected = expected_update(engine, engine.predictor.step_scale())
    steps, samples, lr_before = engine.global_steps, engine.global_samples, engine.get_lr()[0]
    counter = BackwardCounter(monkeypatch)

    result = engine.train_step(batches.step(gas))

    assert result.phase == "predict" and not result.backward_ran
    assert counter.calls == 0, "a Predict step ran a backward pass"
    assert result.verified and result.accepted, "the lenient band should accept this step"
    assert result.step_scale > 0
    # The masters moved by exactly the predicted Adam step.
    for before, after, upd in zip(masters_before, master_copies(engine), expected):
        torch.testing.assert_close(after, before + upd, rtol=1e-5, atol=1e-7)
    # ... and the model's own parameters followed.
    changed = [not torch.equal(a, b) for a, b in zip(params_before, full_params(engine))]
    assert sum(changed) >= len(changed) - 1  # (a parameter with a zero Adam direction may stay)
    # DeepSpeed's counters advanced as for a real step.
    assert engine.global_steps == steps + 1
    assert engine.global_samples == samples + engine.train_batch_size()
    assert engine.get_lr()[0] != lr_before  # WarmupLR moved on
    assert engine.micro_steps == engine.global_steps * gas
    # A real step after the Predict run still works (ZeRO buffers are clean).
    run_until(engine, batches, Phase.CORRECT, gas)
    r = engine.train_step(batches.step(gas))
    assert r.backward_ran and math.isfinite(r.loss)


@pytest.mark.parametrize("name", ["z0-fp32", "z0-bf16", "z2-bf16", "z3-offload-opt-param-cpu"])
def test_rollback_restores_weights_exactly(name):
    setup = dict(SETUPS[name])
    gas = setup.get("gas", 1)
    hybrid = dict(EAGER, min_predict_steps=3, max_predict_steps=3, verify_every=3)
    engine = make_engine(ds_config(hybrid=hybrid, **setup))
    batches = Batches()
    run_until(engine, batches, Phase.PREDICT, gas)
    params_before, masters_before = full_params(engine), master_copies(engine)
    # Reject the verification whatever the loss: the band logic has its own tests.
    engine.predictor.accept = lambda observed, step, div, *more: (False, observed)

    results = [engine.train_step(batches.step(gas)) for _ in range(3)]

    assert [r.verified for r in results] == [False, False, True]
    assert results[-1].rolled_back_steps == 3
    for a, b in zip(params_before, full_params(engine)):
        assert torch.equal(a, b), "rollback did not restore the model parameters bit for bit"
    for a, b in zip(masters_before, master_copies(engine)):
        assert torch.equal(a, b), "rollback did not restore the fp32 masters bit for bit"
    assert engine.phase is Phase.FULL
    stats = engine.statistics()
    assert stats["predict_rolled_back"] == 3 and stats["predict_accepted"] == 0
    assert stats["snapshot_bytes"] == sum(m.numel() * 4 for m in masters_before)


@pytest.mark.parametrize("setup", [dict(stage=0), dict(stage=2, gas=2), dict(stage=3, bf16=True)],
                         ids=["z0", "z2-gas2", "z3-bf16"])
def test_disabled_equals_plain_deepspeed(setup):
    gas = setup.get("gas", 1)
    plain = make_engine(ds_config(**setup), plain=True)
    ours = make_engine(ds_config(hybrid={"enabled": False}, **setup))
    b_plain, b_ours = Batches(), Batches()
    for _ in range(8):
        r = ours.train_step(b_ours.step(gas))
        losses = []
        for mb in b_plain.step(gas):
            loss = plain(**mb).loss
            plain.backward(loss)
            plain.step()
            losses.append(loss.item())
        assert r.phase == "full" and r.backward_ran
        assert r.loss == sum(losses) / len(losses)  # the same float32 losses, bit for bit
    for a, c in zip(full_params(plain), full_params(ours)):
        assert torch.equal(a, c)
    assert ours.global_steps == plain.global_steps and ours.global_samples == plain.global_samples


def test_warmup_steps_match_plain_deepspeed():
    """The predictor's probing during real steps reads the optimizer state only."""
    hybrid = dict(EAGER, warmup_steps=6)
    engine = make_engine(ds_config(stage=2, hybrid=hybrid))
    plain = make_engine(ds_config(stage=2), plain=True)
    b1, b2 = Batches(), Batches()
    for _ in range(6):
        r = engine.train_step(b1.step())
        mb = b2.micro()
        loss = plain(**mb).loss
        plain.backward(loss)
        plain.step()
        assert r.phase == "warmup" and r.loss == loss.item()


def test_lr_schedule_and_counters_follow_plain_run():
    """global_steps, global_samples and the LR sequence are those of a plain run."""
    engine = make_engine(ds_config(stage=1, gas=2, hybrid=EAGER))
    plain = make_engine(ds_config(stage=1, gas=2), plain=True)
    b = Batches()
    phases, lrs, plain_lrs = [], [], []
    for _ in range(14):
        r = engine.train_step(b.step(2))
        phases.append(r.phase)
        lrs.append(engine.get_lr()[0])
        for mb in b.step(2):
            plain.backward(plain(**mb).loss)
            plain.step()
        plain_lrs.append(plain.get_lr()[0])
    assert "predict" in phases and "correct" in phases
    assert lrs == plain_lrs
    assert engine.global_steps == plain.global_steps == 14
    assert engine.global_samples == plain.global_samples
    assert engine.micro_steps == plain.micro_steps


def test_phase_cycle_and_statistics():
    engine = make_engine(ds_config(stage=2, hybrid=EAGER))
    b = Batches()
    phases, may = [], []   # (may: the step ends a Full or Correct phase, so a run may follow it)
    for _ in range(13):
        may.append(engine.controller.may_predict_next())
        phases.append(engine.train_step(b.step()).phase)
    # warmup 3, full 2, predict 2, correct 1, predict 2, correct 1, predict 2
    assert phases == (["warmup"] * 3 + ["full"] * 2 + ["predict"] * 2 + ["correct"]
                      + ["predict"] * 2 + ["correct"] + ["predict"] * 2)
    assert [k for k, m in enumerate(may) if m] == [4, 7, 10]
    s = engine.statistics()
    assert s["steps_per_phase"] == {"warmup": 3, "full": 2, "predict": 6, "correct": 2, "partial": 0}
    assert s["backward_skipped"] == 6 and s["backward_passes"] == 7
    assert s["backward_skipped_pct"] == pytest.approx(100 * 6 / 13)
    assert s["predict_accepted"] + s["predict_rolled_back"] == 6
    assert all(v >= 0 for v in s["seconds_per_phase"].values())
    # Correct steps recorded predicted vs observed loss and predicted vs actual update.
    assert [p for _, _, _, p in engine.predictor.loss_log].count("correct") == 2
    assert len(engine.predictor.update_log) == 2
    for _, proj, cos in engine.predictor.update_log:
        assert math.isfinite(proj) and -1.0 <= cos <= 1.0


def test_no_predict_without_confidence():
    """With threshold 1 (and a direction that is never exactly constant) the engine
    never predicts: it is plain full training with the same phase bookkeeping."""
    engine = make_engine(ds_config(stage=0, hybrid=dict(EAGER, confidence_threshold=1.0)))
    b = Batches()
    phases = {engine.train_step(b.step()).phase for _ in range(10)}
    assert phases == {"warmup", "full"}


def test_direction_comparison_sums():
    """compare_direction measures the projection of the new Adam direction on the stashed one."""
    engine = make_engine(ds_config(stage=2, hybrid=EAGER))
    b = Batches()
    engine.train_step(b.step())
    za.stash_direction(engine._masters, engine._snapshot)
    old = [za.adam_direction(p).clone() for p in engine._masters.partitions()]
    # the stash is built a chunk at a time with the same operations: the same bits
    assert all(torch.equal(buf.view_as(o), o) for buf, o in zip(engine._snapshot.buffers, old))
    engine.train_step(b.step())  # (probes again internally; stash ours again for the check)
    za.stash_direction(engine._masters, engine._snapshot)
    engine._snapshot.buffers = [o.clone() for o in old]
    new = [za.adam_direction(p) for p in engine._masters.partitions()]
    sums = za.compare_direction(engine._masters, engine._snapshot)
    dot = sum(float((n.double() * o.double()).sum()) for n, o in zip(new, old))
    # fp32 dots per 16 MiB chunk, summed in fp64: within 1e-5 of an fp64 computation. torch.dot
    # goes to BLAS, whose accumulation order follows the thread count (one thread: 1.6e-6 off).
    assert sums[:, 0].sum().item() == pytest.approx(dot, rel=1e-5)
    assert sums[:, 1].sum().item() == pytest.approx(sum(float(o.double().pow(2).sum()) for o in old), rel=1e-5)
    assert sums[:, 2].sum().item() == pytest.approx(sum(float(n.double().pow(2).sum()) for n in new), rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("offload", [dict(offload_opt="nvme"), dict(offload_opt="nvme", offload_param="nvme")],
                         ids=["opt-nvme", "opt-param-nvme"])
def test_zero3_nvme_offload_predict_and_rollback(offload, tmp_path):
    """ZeRO-Infinity: masters and Adam state swapped to NVMe between uses (gpt2-tiny in sub-groups
    of about 300k values: the first two are above DeepSpeed's smallest swappable tensor, 1 MiB,
    and really are swapped)."""
    cfg = ds_config(stage=3, hybrid=dict(EAGER, min_predict_steps=2, max_predict_steps=2, verify_every=2),
                    nvme_path=str(tmp_path), **offload, **NVME_AIO)
    cfg["zero_optimization"]["sub_group_size"] = 300_000
    engine = make_engine(cfg, model="gpt2-tiny")
    assert engine._masters.swaps and engine.optimizer._swappable_optimizer_subgroup(0)
    b = Batches()
    run_until(engine, b, Phase.PREDICT, 1)
    params_before = full_params(engine)
    r1 = engine.train_step(b.step())
    assert not r1.backward_ran
    assert any(not torch.equal(a, c) for a, c in zip(params_before, full_params(engine)))
    engine.predictor.accept = lambda observed, step, div, *more: (False, observed)
    r2 = engine.train_step(b.step())
    assert r2.rolled_back_steps == 2
    for a, c in zip(params_before, full_params(engine)):
        assert torch.equal(a, c)
    r3 = engine.train_step(b.step())  # real step after the rollback, state swapped back in
    assert r3.backward_ran and math.isfinite(r3.loss)


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("direction, where", [("adam", "host"), ("drift", "host"), ("drift", "device")])
def test_zero3_optimizer_state_on_nvme_trains_as_in_host_memory(direction, where, tmp_path):
    """ZeRO 3 with ``offload_optimizer: nvme``: the same phases, losses, weights and (outside a
    run) masters as ``offload_optimizer: cpu``, bit for bit, through kept runs and a rejected one.
    On the drift direction's device path the commit adds each run to the masters one sub-group at
    a time, each swapped in for its additions (listed beforehand, they would be swapped out and
    empty, and the run lost at the next real step). Under NVMe the drift fold runs inside
    DeepSpeed's sub-group steps (``memory.fold_in_step``, ``swap_fold.py``): the host path's from a
    copy of each sub-group before its step (its fold source is the snapshot), the device path's
    from the moments; with ``offload_optimizer: cpu`` the fold after the step (``fold_in_step``
    off: on in host memory its fold from inside CPU Adam's step differs from the fold read back
    from the moments by fp32 rounding), with the velocity bit for bit the same."""
    def build(device: str):
        memory = {"offload_predict": where, "fold_in_step": "auto" if device == "nvme" else False}
        hybrid = dict(EAGER, correction_steps=0, check="next_step", predictor={"direction": direction},
                      memory=memory if direction == "drift" else {})
        cfg = ds_config(stage=3, offload_opt=device, nvme_path=str(tmp_path), hybrid=hybrid, **NVME_AIO)
        cfg["zero_optimization"]["sub_group_size"] = 300_000
        engine = make_engine(cfg, model="gpt2-tiny")
        check, seen = engine._check_predicted_update, []

        def judged(loss, batch, out):   # (the second run checked is rejected)
            if engine._check_groups is not None:
                seen.append(float(loss))
            return check(loss * 10 if len(seen) == 2 and engine._check_groups is not None else loss, batch, out)
        engine._check_predicted_update = judged
        return engine
    ram, nvme = build("cpu"), build("nvme")
    assert nvme._masters.swaps and nvme.optimizer._swappable_optimizer_subgroup(0)
    if direction == "drift":
        st = nvme.statistics()
        assert st["offload_predict"] == where and st["fold_in_step"] is True
        assert st["fold_source"] == ("optimizer_state" if where == "device" else "snapshot")
    br, bn = Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(16):
        rr, rn = ram.train_step(br.step()), nvme.train_step(bn.step())
        assert (rr.phase, rr.loss, rr.checked, rr.rolled_back_steps) == (rn.phase, rn.loss, rn.checked,
                                                                          rn.rolled_back_steps)
        assert all(torch.equal(a, c) for a, c in zip(full_params(ram), full_params(nvme))), phases + [rn.phase]
        if rn.phase != "predict":
            assert all(torch.equal(a, c) for a, c in zip(master_copies(ram), master_copies(nvme)))
        if direction == "drift":
            assert same_velocity(ram, nvme)
        phases.append(rn.phase)
    st = nvme.statistics()
    assert phases.count("predict") >= 6 and st["predict_accepted"] >= 2 and st["predict_rolled_back"] >= 2
    if direction == "drift":
        assert st["bookkeeping_seconds"]["fold_in_step"] > 0 and ram._velocity.updates >= 8
        # (the snapshot source's copy: one sub-group's fp32 masters, the largest; none from the moments)
        largest = max(nvme._masters.numel(i) for i in range(nvme._masters._count()))
        assert st["fold_in_step_copy_bytes"] == (0 if where == "device" else 4 * largest)



def _swapped_params_engine(param: str, path, **memory):
    """ZeRO 3, bf16, ``offload_optimizer: nvme`` on SWAPPED_LLAMA, the 16-bit parameters in host
    memory (``param`` cpu) or on NVMe (nvme, past max_in_cpu): the drift direction, each second
    checked run rejected (its check's loss times 10)."""
    hybrid = dict(EAGER, correction_steps=0, check="next_step", predictor={"direction": "drift"}, memory=memory)
    cfg = ds_config(stage=3, bf16=True, offload_opt="nvme", offload_param=param, nvme_path=str(path), hybrid=hybrid,
                    **NVME_AIO)
    if param == "nvme":
        swap_params(cfg)
    cfg["zero_optimization"]["sub_group_size"] = 1_000_000
    engine = make_engine(cfg, **SWAPPED_LLAMA)
    check, seen = engine._check_predicted_update, []

    def judged(loss, batch, out):
        if engine._check_groups is not None:
            seen.append(float(loss))
        return check(loss * 10 if len(seen) % 2 == 0 and engine._check_groups is not None else loss, batch, out)
    engine._check_predicted_update = judged
    return engine


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_drift_predict_with_the_weights_on_nvme_stays_off_the_masters(tmp_path):
    """ZeRO-Infinity with both offloads on NVMe (the 50b-24gb-nvme preset's layout): ``auto`` takes
    the device path, whose Predict step reads each sub-group's 16-bit partition from the drive
    into one host buffer, adds the step and writes it back, with no snapshot and no swap of the
    masters or Adam state; a kept run goes into the next real step's DeepSpeed step, a rejected
    one is rolled back by writing the 16-bit partitions from the untouched masters. Phases,
    losses, weights, masters (outside a run) and velocity are bit for bit the same run with the
    16-bit weights in host memory (``offload_param: cpu``, whose device path adds in place). The
    host path (``offload_predict: host``) keeps its fp32 snapshot."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    ram, nvme = _swapped_params_engine("cpu", tmp_path / "ram"), _swapped_params_engine("nvme", tmp_path / "nvme")
    host = _swapped_params_engine("nvme", tmp_path / "host", offload_predict="host")
    access, opt = nvme._masters, nvme.optimizer
    swapped = [i for i in range(access._count()) if access.shard_swapped(i)]
    assert 0 < len(swapped) < access._count()   # (the first sub-group's partition in host memory)
    on_drive = [i for i in swapped if any(p.ds_tensor.final_location == OffloadDeviceEnum.nvme
                                          for p in opt.fp16_groups[i])]
    kept = [i for i in swapped if any(p.ds_tensor.final_location != OffloadDeviceEnum.nvme for p in opt.fp16_groups[i])]
    assert on_drive and kept   # partitions really on the drive, and small ones kept in memory beside them
    st = nvme.statistics()
    assert st["offload_predict"] == "device" and host.statistics()["offload_predict"] == "host"
    optimizer_swaps = count_swap_ins(nvme)
    writes = [0]
    swapper = opt.fp16_groups[on_drive[0]][0].nvme_swapper
    write = swapper.swap_out_partitioned_params

    def counted(*args, **kwargs):
        writes[0] += 1
        return write(*args, **kwargs)
    swapper.swap_out_partitioned_params = counted
    br, bn, bh = Batches(seed=3), Batches(seed=3), Batches(seed=3)
    phases = []
    for _ in range(16):
        optimizer_swaps[0] = writes[0] = 0
        rr, rn, rh = ram.train_step(br.step()), nvme.train_step(bn.step()), host.train_step(bh.step())
        assert (rr.phase, rr.loss, rr.checked, rr.rolled_back_steps) == (rn.phase, rn.loss, rn.checked,
                                                                          rn.rolled_back_steps)
        assert rh.phase == rn.phase
        assert all(torch.equal(a, c) for a, c in zip(full_params(ram), full_params(nvme))), phases + [rn.phase]
        if rn.phase != "predict":
            assert all(torch.equal(a, c) for a, c in zip(master_copies(ram), master_copies(nvme)))
        else:   # no optimizer sub-group swapped; each partition on the drive written once
            assert optimizer_swaps[0] == 0 and writes[0] == len(on_drive), (optimizer_swaps[0], writes[0])
        assert same_velocity(ram, nvme)
        phases.append(rn.phase)
    st = nvme.statistics()
    assert phases.count("predict") >= 6 and st["predict_accepted"] >= 2 and st["predict_rolled_back"] >= 2
    assert st["snapshot_bytes"] == 0 and host.statistics()["snapshot_bytes"] == 4 * sum(map(access.numel, range(
        access._count())))
    assert st["shard_swap_buffer_bytes"] == 2 * max(access.numel(i) for i in swapped)


@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_the_shard_fold_refuses_16_bit_partitions_on_nvme(tmp_path):
    """``memory.fold_source: weights16`` reads the real step's update from the 16-bit shards: with
    some on the drive, a config error naming the key and why."""
    with pytest.raises(ValueError, match="fold_source: weights16, but zero_optimization.offload_param.device is nvme"):
        _swapped_params_engine("nvme", tmp_path, fold_source="weights16", offload_predict="device")


@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_fold_in_step_under_nvme_refuses_what_it_cannot_fold(tmp_path):
    """``memory.fold_in_step: true`` under ``offload_optimizer: nvme`` with no velocity to fold (the
    adam direction): a config error naming the key and why; ``auto`` is off there."""
    def build(fold_in_step):
        hybrid = dict(EAGER, predictor={"direction": "adam"}, memory={"fold_in_step": fold_in_step})
        cfg = ds_config(stage=3, offload_opt="nvme", nvme_path=str(tmp_path), hybrid=hybrid, **NVME_AIO)
        return make_engine(cfg, model="gpt2-tiny")
    with pytest.raises(ValueError, match="memory.fold_in_step: true, but predictor.direction is not drift"):
        build(True)
    st = build("auto").statistics()
    assert st["fold_in_step"] is False and "fold_in_step_copy_bytes" not in st


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_a_kept_drift_run_goes_into_deepspeeds_nvme_step(tmp_path):
    """The drift direction's device path under ``offload_optimizer: nvme`` (the 7b-24gb-nvme
    preset's): a kept run's additions to the masters go into the real step's DeepSpeed step, each
    sub-group's just before its Adam step, and the real step's fold goes in too, each sub-group's
    just after its Adam step (``memory.fold_in_step``: ``swap_fold.py``), so that every real step
    swaps what a plain step does (not each sub-group once more for the fold, nor for a commit of
    its own), and a Predict step swaps nothing. The weights, masters, moments and velocity stay bit
    for bit ``offload_optimizer: cpu``'s (its fold after the step), also where the step that keeps
    a run is skipped on a NaN gradient (its additions are then made when it ends).
    ``fold_in_step: false`` under NVMe: the fold after the step, swapping each sub-group again."""
    def build(device: str, fold_in_step="auto"):
        hybrid = dict(EAGER, correction_steps=0, check="next_step", predictor={"direction": "drift"},
                      memory={"offload_predict": "device", "fold_in_step": fold_in_step if device == "nvme" else False})
        cfg = ds_config(stage=3, offload_opt=device, nvme_path=str(tmp_path / f"{device}-{fold_in_step}"),
                        hybrid=hybrid, **NVME_AIO)
        cfg["zero_optimization"]["sub_group_size"] = 300_000
        return make_engine(cfg, model="gpt2-tiny")

    def nan_gradient(engine, batch):   # (a finite loss whose gradient is NaN: d/dz sqrt(z) at z = 0, times 0)
        out = engine(**batch)
        z = out.logits.float().sum()
        return out.loss + 0.0 * torch.sqrt(z - z.detach())

    def moments(engine):
        return [p.state[k].detach().clone() for p in engine._masters.partitions() for k in ("exp_avg", "exp_avg_sq")]
    ram, nvme, after = build("cpu"), build("nvme"), build("nvme", fold_in_step=False)
    swappable = sum(nvme.optimizer._swappable_optimizer_subgroup(i) for i in range(nvme._masters._count()))
    assert swappable == 2 and nvme.statistics()["offload_predict"] == "device"
    assert nvme.statistics()["fold_in_step"] is True and after.statistics()["fold_in_step"] is False
    swapped, swapped_after = count_swap_ins(nvme), count_swap_ins(after)
    br, bn, ba = Batches(seed=3), Batches(seed=3), Batches(seed=3)
    rows = []   # per step: phase, a run checked (and kept), skipped on NaN, sub-groups swapped in (in step, after)
    for _ in range(18):
        swapped[0] = swapped_after[0] = 0
        checks = sum(1 for r in rows if r[1])
        poison = nvme._check_groups is not None and checks == 1   # (the second run's check: a NaN gradient)
        loss_fn = nan_gradient if poison else None
        rr, rn = ram.train_step(br.step(), loss_fn=loss_fn), nvme.train_step(bn.step(), loss_fn=loss_fn)
        ra = after.train_step(ba.step(), loss_fn=loss_fn)
        assert (rr.phase, rr.loss, rr.checked, rr.rolled_back_steps) == (rn.phase, rn.loss, rn.checked,
                                                                          rn.rolled_back_steps)
        assert (ra.phase, ra.loss) == (rn.phase, rn.loss)
        rows.append((rn.phase, rn.checked and not rn.rolled_back_steps, poison, swapped[0], swapped_after[0]))
        assert all(torch.equal(a, c) for a, c in zip(full_params(ram), full_params(nvme)))
        assert same_velocity(ram, nvme) and same_velocity(ram, after)
        if rn.phase != "predict":
            assert all(torch.equal(a, c) for a, c in zip(master_copies(ram), master_copies(nvme)))
            assert all(torch.equal(a, c) for a, c in zip(moments(ram), moments(nvme)))
    # A real step swaps each sub-group in once, for DeepSpeed's step, which also takes the fold;
    # the one that keeps a run, the same. With the fold after the step, twice.
    plain = {n for phase, k, poisoned, n, _ in rows if phase in ("warmup", "full") and not k and not poisoned}
    kept = [n for _, k, poisoned, n, _ in rows if k and not poisoned]
    assert plain == {swappable} and len(kept) >= 2 and set(kept) == plain, rows
    assert {m for phase, k, poisoned, _, m in rows if phase != "predict" and not poisoned} == {2 * swappable}, rows
    assert {n for phase, _, _, n, _ in rows if phase == "predict"} == {0}, rows
    # the skipped step: DeepSpeed swaps nothing in, and the run's additions swap each sub-group once
    assert [n for _, k, poisoned, n, _ in rows if poisoned] == [swappable] and nvme.statistics()["skipped_steps"] == 1
    assert ram._velocity.updates >= 8


def test_scalars_reach_deepspeeds_monitor(tmp_path):
    """Hybrid/* scalars are written through DeepSpeed's monitor (the CSV section here)."""
    cfg = ds_config(stage=1, hybrid=EAGER, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    engine = make_engine(cfg)
    b = Batches()
    results = [engine.train_step(b.step()) for _ in range(8)]
    files = {p.name: p for p in tmp_path.rglob("*.csv")}
    for name in ("Hybrid_phase.csv", "Hybrid_confidence.csv", "Hybrid_loss.csv", "Hybrid_step_time_s.csv",
                 "Hybrid_backward_skipped_pct.csv"):
        assert name in files, sorted(files)
    phase_rows = files["Hybrid_phase.csv"].read_text().strip().splitlines()[1:]
    assert [int(float(r.split(",")[1])) for r in phase_rows] == [Phase(r.phase).code for r in results]


@pytest.mark.parametrize("zero, device, warns", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "cuda", True),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "cuda", True),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "cpu", False),   # CPU accelerator: all host memory
    ({"stage": 1}, "cuda", False),
])
def test_offload_warning_applies_to_host_masters_beside_a_gpu(zero, device, warns):
    from types import SimpleNamespace
    from ds_hybrid.engine import PredictiveEngine
    fake = SimpleNamespace(_config=SimpleNamespace(_param_dict={"zero_optimization": zero}),
                           device=torch.device(device))
    assert PredictiveEngine._host_masters_beside_an_accelerator(fake) is warns


class _GradientOf(torch.autograd.Function):
    """A finite loss (0) whose gradient for ``w`` is ``values``: a bad gradient behind a good loss."""

    @staticmethod
    def forward(ctx, w, values):
        ctx.save_for_backward(values)
        return (w * 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        return ctx.saved_tensors[0].view(1, -1) * grad, None


@pytest.mark.parametrize("values, bad", [
    ([1.0, -2.0, 3.0], False),
    ([1.0, float("nan"), 3.0], True),
    ([float("inf"), 0.0, 1.0], True),
    ([float("inf"), float("-inf"), 1.0], True),   # Inf - Inf in the running sum is NaN: still caught
], ids=["finite", "nan", "inf", "inf-and-minus-inf"])
def test_nonfinite_guard_sees_any_bad_gradient_element(values, bad):
    """The guard's hook adds each gradient's fp32 sum to one running total (one reduction per
    gradient): one non-finite element anywhere, in any parameter, flags the step."""
    from ds_hybrid.engine import _NonFiniteGuard
    module = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 1, bias=False), "b": torch.nn.Linear(3, 1, bias=False)})
    guard = _NonFiniteGuard(module)
    x = torch.tensor(values)
    loss = module["a"](torch.ones(1, 3)).sum() + _GradientOf.apply(module["b"].weight, x)
    guard.record_loss(loss)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.equal(module["b"].weight.grad.isfinite().all(), torch.tensor(not bad))
    assert guard.collect()[2] is bad
    assert guard.collect() == (0, 0, False)   # collect resets
    guard.remove()
    _GradientOf.apply(module["b"].weight, torch.full((3,), float("nan"))).backward()
    assert guard.collect()[2] is False         # hooks off: nothing recorded
