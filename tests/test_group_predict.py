"""Layer-group Predict: partial real steps whose lower layer groups take the predicted update
and no gradient. The optimizer leaves those groups untouched bit for bit, the backward stops
at the first real block, a rejected check rolls back exactly the predicted groups, the
planner's decision follows its measurements, and whole-model Predict runs can be checked by
the next real step's forward instead of forwards of their own."""
import math

import pytest
import torch

import ds_hybrid.engine as engine_mod
import ds_hybrid.zero_access as za
from ds_hybrid import Phase
from ds_hybrid.config import ConfigError, GroupPredictConfig, parse_hybrid_config
from ds_hybrid.group_predict import GroupLayout, GroupPlanner
from ds_hybrid.models import build_model, layer_groups
from engine_utils import EAGER, SEQ, Batches, ds_config, full_params, make_engine, master_copies

PINNED = {"warmup_steps": 3, "full_steps": 8, "confidence_threshold": 1.0, "whole_model": False,
          "predictor": {"direction": "drift", "drift_beta": 0.8},
          "group_predict": {"enabled": True, "pinned": 2, "refresh_every": 3}}
SETUPS = {"z0-fp32": dict(stage=0), "z0-bf16": dict(stage=0, bf16=True), "z1-fp32": dict(stage=1),
          "z1-bf16-gas2": dict(stage=1, bf16=True, gas=2), "z2-fp32-gas2": dict(stage=2, gas=2),
          "z2-bf16": dict(stage=2, bf16=True), "z2-offload-cpu": dict(stage=2, offload_opt="cpu")}


def _state(part):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in part.state.items()}


def _group_params(engine, groups):
    return [p for g in groups for p in engine._masters.model_param_groups()[g]]


# ------------------------------------------------------------------ layout and config
def test_layout_finds_input_side_prefixes_and_puts_the_tied_embedding_with_the_head():
    for name in ("gpt2-test", "llama-tiny"):
        model = build_model(name, vocab_size=256, seq_len=SEQ)
        groups = layer_groups(model, 4)
        layout = GroupLayout(model, [g["params"] for g in groups], [g["name"] for g in groups])
        assert layout.names == ["embeddings", "blocks_0", "blocks_1", "head"]
        assert [layout.valid(k) for k in range(5)] == [True, True, True, False, False]
        assert layout.max_prefix == 2 and layout.cut[1] == 0
        assert layout.cut[2] == (1 if name == "gpt2-test" else 2)
    gpt2 = build_model("gpt2-test", vocab_size=256, seq_len=SEQ)
    head = layer_groups(gpt2, 4)[-1]["params"]
    assert any(p is gpt2.get_output_embeddings().weight for p in head), "the tied wte belongs to the head group"
    with pytest.raises(ConfigError, match="group_predict.pinned: predicting the lower 3"):
        layout.check(3, "hybrid_predict.group_predict.pinned")


def test_config_errors_name_the_key_before_training():
    gp = {"hybrid_predict": {"group_predict": {"enabled": True}}}
    with pytest.raises(ConfigError, match="zero_optimization.stage: 3"):
        parse_hybrid_config({**gp, "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="zero_optimization.ignore_unused_parameters"):
        parse_hybrid_config({**gp, "zero_optimization": {"stage": 2, "ignore_unused_parameters": False}})
    with pytest.raises(ConfigError, match="group_predict.refresh_every"):
        parse_hybrid_config({"hybrid_predict": {"group_predict": {"refresh_every": 0}}})
    # One param group: nothing below a block to predict.
    with pytest.raises(ConfigError, match="group_predict: the optimizer's 1 param group"):
        make_engine(ds_config(stage=1, hybrid=PINNED))
    with pytest.raises(ConfigError, match="group_predict.pinned"):
        make_engine(ds_config(stage=1, hybrid={**PINNED, "group_predict": {"enabled": True, "pinned": 3}}), groups=4)


# ------------------------------------------------------------------ the partial step
@pytest.mark.parametrize("name", list(SETUPS))
def test_partial_step_leaves_predicted_groups_to_the_predicted_update_only(name):
    """Predicted groups: no gradient, no backward below the cut, Adam state and step counts
    bit for bit unchanged, masters moved by exactly scale * lr * velocity. Real groups step."""
    gas = SETUPS[name].get("gas", 1)
    engine = make_engine(ds_config(hybrid=PINNED, **SETUPS[name]), groups=4)
    batches = Batches()
    predicted = {0, 1}
    fired = {"predicted": 0, "real": 0, "below_cut": 0}
    for p in _group_params(engine, predicted):
        p.register_hook(lambda g: fired.__setitem__("predicted", fired["predicted"] + 1))
    for p in _group_params(engine, {2, 3}):
        p.register_hook(lambda g: fired.__setitem__("real", fired["real"] + 1))
    engine._layout.blocks[0].register_full_backward_hook(
        lambda *a: fired.__setitem__("below_cut", fired["below_cut"] + 1))
    partial_seen = moved = 0
    for _ in range(12):
        if engine._next_groups != 2 or engine.phase is not Phase.FULL:
            engine.train_step(batches.step(gas))
            continue
        parts = list(engine._masters.partitions())
        before = [(p.group_index, p.master.clone(), _state(p)) for p in parts]
        steps = [dict(g).get("step") for g in engine._masters.base.param_groups]
        scales = engine._planner.scales(2)
        vel = [engine._velocity.buffers[i].load() if i < len(engine._velocity.buffers)
               and engine._velocity.buffers[i] is not None else None for i in range(len(parts))]
        lrs = [float(g["lr"]) for g in engine._masters.base.param_groups]
        fired.update(predicted=0, real=0, below_cut=0)
        r = engine.train_step(batches.step(gas))
        assert r.phase == "partial" and r.predicted_groups == 2 and r.backward_ran
        assert fired == {"predicted": 0, "real": fired["real"], "below_cut": 0} and fired["real"] > 0
        for (gi, m0, st0), part, v in zip(before, engine._masters.partitions(), vel):
            if gi in predicted:
                for k, x in st0.items():
                    same = torch.equal(x, part.state[k]) if torch.is_tensor(x) else x == part.state[k]
                    assert same, f"{name}: the optimizer touched '{k}' of predicted group {gi}"
                expected = m0.clone()
                if v is not None and scales[gi] > 0:
                    expected.view(-1).add_(v, alpha=scales[gi] * lrs[gi])
                    moved += 1
                assert torch.equal(part.master, expected), f"{name}: group {gi} is not master + scale*lr*v"
            elif part.master.numel():
                assert not torch.equal(part.master, m0), f"{name}: real group {gi} did not step"
        assert [dict(g).get("step") for g in engine._masters.base.param_groups][:2] == steps[:2]
        partial_seen += 1
    assert partial_seen >= 3 and moved > 0
    stats = engine.statistics()
    assert stats["partial_backward"] == partial_seen * gas and stats["backward_skipped"] == 0
    assert 0 < stats["partial_backward_share"] < 1
    # The weights the forward reads are the masters (cast): DeepSpeed's own copy after the
    # step carried the predicted groups' update too.
    if SETUPS[name]["stage"] in (1, 2):
        opt = engine.optimizer
        for flat, master in zip(opt.bit16_groups_flat, opt.single_partition_of_fp32_groups):
            n = min(flat.numel(), master.numel())
            assert torch.equal(flat[:n], master[:n].to(flat.dtype))


def test_rollback_restores_exactly_the_predicted_groups_and_reruns_the_forward(monkeypatch):
    engine = make_engine(ds_config(stage=2, bf16=True, hybrid=PINNED), groups=4)
    batches = Batches()
    while not (engine._next_groups == 2 and engine._masters.has_adam_state()):
        engine.train_step(batches.step())
    before = master_copies(engine)
    groups = [p.group_index for p in engine._masters.partitions()]
    r = engine.train_step(batches.step())
    assert r.phase == "partial" and engine._check_groups == frozenset({0, 1})
    after_partial = master_copies(engine)
    restored = {}
    real_restore = za.restore_weights

    def spy(access, bufs, groups=None):
        real_restore(access, bufs, groups)
        restored["masters"] = master_copies(engine)
        restored["model"] = [p.detach().clone() for p in engine.module.parameters()]
    monkeypatch.setattr(za, "restore_weights", spy)
    monkeypatch.setattr(engine_mod, "within_band", lambda *a: (False, math.inf))
    forwards = {"n": 0}

    def counting_loss(eng, batch):
        forwards["n"] += 1
        return engine_mod.default_loss(eng, batch)
    r = engine.train_step(batches.step(), loss_fn=counting_loss)
    assert r.checked is False and forwards["n"] == 2, "the check's forward runs again after the rollback"
    for gi, x0, x1, x in zip(groups, before, after_partial, restored["masters"]):
        assert torch.equal(x, x0 if gi in (0, 1) else x1), f"group {gi} after the rollback"
    for p, m in zip(engine.module.parameters(), restored["model"]):
        assert m.dtype == torch.bfloat16
    assert engine.statistics()["predicted_update_rolled_back"] == 1


def test_a_resume_with_a_check_pending_is_bit_exact(tmp_path):
    cfg = ds_config(stage=1, hybrid=PINNED)
    engine = make_engine(cfg, groups=4)
    b = Batches()
    while engine._check_groups is None:
        engine.train_step(b.step())
    done = engine.global_steps
    engine.save_checkpoint(tmp_path, "mid")
    rows = [(r.phase, r.loss, r.checked) for r in (engine.train_step(b.step()) for _ in range(8))]
    resumed = make_engine(cfg, seed=3, groups=4)
    resumed.load_checkpoint(tmp_path, "mid")
    assert resumed._check_groups == frozenset({0, 1})
    replay = Batches()
    for _ in range(done):
        replay.step()
    again = [(r.phase, r.loss, r.checked) for r in (resumed.train_step(replay.step()) for _ in range(8))]
    assert again == rows
    for x, y in zip(full_params(engine), full_params(resumed)):
        assert torch.equal(x, y)


# ------------------------------------------------------------------ the planner
def _planner(**cfg):
    model = build_model("gpt2-test", vocab_size=256, seq_len=SEQ)
    groups = layer_groups(model, 4)
    layout = GroupLayout(model, [g["params"] for g in groups], [g["name"] for g in groups])
    return GroupPlanner(GroupPredictConfig(enabled=True, **cfg), layout, ema=0.0)


def _sums(dots, old_sq=1.0):
    out = torch.zeros(4, len(za.DIRECTION_STATS), dtype=torch.float64)
    out[:, 0] = torch.tensor(dots, dtype=torch.float64)
    out[:, 1] = old_sq
    return out


def test_planner_predicts_where_worth_over_cost_beats_a_whole_step():
    pl = _planner(refresh_every=10)
    assert pl.decide(True) == 0, "no measurements yet: whole steps"
    # Lower groups move little and predictably, upper groups carry the progress.
    pl.observe_groups(_sums([0.01, 0.05, 1.0, 1.0]), [True] * 4)
    pl.observe_time(0, 1.0)
    pl.observe_time(2, 0.6)
    assert 0.9 < pl.worth(2) < 1.0 and pl.cost(2) == pytest.approx(0.6)
    assert pl.decide(True) == 2
    assert pl.scales(2)[:2] == [pytest.approx(0.01), pytest.approx(0.05)] and pl.scales(2)[2:] == [0.0, 0.0]
    assert pl.decide(False) == 0, "the LR gate"
    # The lower groups carry most of the persistent movement and the velocity foresees none of it.
    pl2 = _planner(refresh_every=10)
    pl2.observe_groups(_sums([-0.5, 2.0, 0.2, 0.2]), [True] * 4)
    pl2.observe_groups(_sums([0.0, 2.0, 0.2, 0.2], old_sq=1e9), [True] * 4)   # projections ~0
    pl2.observe_time(0, 1.0)
    pl2.observe_time(2, 0.6)
    assert pl2.worth(2) < 0.6 and pl2.decide(True) == 0


def test_planner_refreshes_and_cools_down_after_measured_harm():
    pl = _planner(refresh_every=3, pinned=1)
    taken = []
    for _ in range(6):
        k = pl.decide(True)
        pl.stepped(k)
        taken.append(k)
    assert taken == [1, 1, 0, 1, 1, 0], "every third step is whole"
    for _ in range(16):
        pl.observe_check(False, 0.0)
        pl.observe_check(True, 1.0)   # a band above the forecast after partial steps
    assert pl.stats.cooldown > 0 and pl.decide(True) == 0


# ------------------------------------------------------------------ whole-model runs checked by the next step
NEXT = dict(EAGER, check="next_step", verify_every=1, predictor={"direction": "drift", "drift_beta": 0.8})


def test_next_step_check_costs_no_forward_in_the_run_and_undoes_it_exactly(monkeypatch):
    engine = make_engine(ds_config(stage=1, hybrid=NEXT))
    b = Batches()
    forwards = {"predict": 0}

    def counting(eng, batch):
        if eng.phase is Phase.PREDICT:
            forwards["predict"] += 1
        return engine_mod.default_loss(eng, batch)
    snap = {}
    while engine.phase is not Phase.PREDICT:
        engine.train_step(b.step(), loss_fn=counting)
    snap["start"] = master_copies(engine)
    while engine.phase is Phase.PREDICT:
        r = engine.train_step(b.step(), loss_fn=counting)
        assert not r.verified and r.loss is None
    assert forwards["predict"] == 0 and engine._check_run
    monkeypatch.setattr(engine.predictor, "accept", lambda observed, step, div, *a: (False, observed))
    restored = {}
    real_restore = za.restore_weights

    def spy(access, bufs, groups=None):
        real_restore(access, bufs, groups)
        restored["masters"] = master_copies(engine)
    monkeypatch.setattr(za, "restore_weights", spy)
    r = engine.train_step(b.step(), loss_fn=counting)
    assert r.checked is False and r.backward_ran
    assert all(torch.equal(x, y) for x, y in zip(restored["masters"], snap["start"]))
    st = engine.statistics()
    assert st["predict_rolled_back"] == 2 and st["verifications"] == 1


def test_a_next_step_run_is_always_followed_by_a_real_step_that_checks_it():
    """``correction_steps: 0`` decides at once after a run; with ``check: next_step`` that would
    put runs back to back and none would ever be checked: the controller goes to Full."""
    from ds_hybrid.config import HybridPredictConfig
    from ds_hybrid.phases import PhaseController
    for check, after in (("next_step", Phase.FULL), ("forward", Phase.PREDICT)):
        cfg = HybridPredictConfig(warmup_steps=1, full_steps=3, correction_steps=0, min_predict_steps=2,
                                  max_predict_steps=2, check=check)
        ctl = PhaseController(cfg)
        ctl.end_step(lambda: (True, 2))          # warmup -> full
        for _ in range(3):
            ctl.end_step(lambda: (True, 2))      # full -> predict
        assert ctl.phase is Phase.PREDICT
        ctl.end_step(lambda: (True, 2))
        ctl.end_step(lambda: (True, 2))          # the run is over
        assert ctl.phase is after
        if after is Phase.FULL:
            assert ctl.remaining == 3


# ------------------------------------------------------------------ ranks
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_take_the_same_partial_steps_and_roll_back_together(stage, tmp_path):
    """The planner's choice is broadcast from rank 0; a check that only rank 1 sees fail (its
    loss x 10, all-reduced) rolls the predicted groups back on both; whole-model runs checked
    by the next step run beside them. Same records, same weights."""
    from spawn import run_ranks
    ranks = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "30", "--group-predict",
                                              "--faults"], 2, tmp_path)
    first, other = ranks
    for col in ("phase", "loss", "predicted_groups", "checked", "rolled_back", "lr"):
        assert [s[col] for s in other["record"]] == [s[col] for s in first["record"]], f"ranks differ in '{col}'"
    assert other["weights_sha256"] == first["weights_sha256"]
    phases = [s["phase"] for s in first["record"]]
    assert "partial" in phases and "predict" in phases
    assert False in [s["checked"] for s in first["record"]], "rank 1's bad check rolled back on both ranks"
    assert first["statistics"]["predicted_update_rolled_back"] >= 1
