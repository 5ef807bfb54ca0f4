"""The PredictiveEngine with ``predictor.type: rssm``: the dynamics model in the loop."""
import json

import pytest
import torch

from ds_hybrid import zero_access as za
from ds_hybrid.dynamics.trajectory import read_trajectory
from engine_utils import EAGER, Batches, ds_config, full_params, make_engine, master_copies

RSSM = dict(EAGER, predictor={"type": "rssm"}, min_predict_steps=1, max_predict_steps=4,
            divergence={"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0},
            dynamics={"min_observations": 4, "train_every": 2, "explore_every": 1, "window": 4,
                      "deter": 64, "stoch": 8})


def run(engine, steps: int, batches=None):
    batches = batches or Batches()
    return [engine.train_step(batches.step()) for _ in range(steps)]


@pytest.mark.parametrize("stage", [1, 3])
def test_rssm_predict_steps_move_weights_and_are_measured(stage, tmp_path):
    traj = tmp_path / "traj.jsonl"
    cfg = dict(RSSM, dynamics=dict(RSSM["dynamics"], trajectory_path=str(traj)))
    engine = make_engine(ds_config(stage=stage, hybrid=cfg))
    b = Batches()
    moved = 0
    rows = []
    for _ in range(40):
        before = [p.clone() for p in full_params(engine)]
        r = engine.train_step(b.step())
        rows.append(r)
        if r.phase == "predict" and r.accepted:
            moved += any(not torch.equal(x, y) for x, y in zip(before, full_params(engine)))
    assert moved > 0, "accepted Predict steps changed the weights"
    st = engine.statistics()
    assert st["predictor"] == "rssm" and st["backward_skipped"] > 0
    assert st["progress_measured"] == st["verifications"] > 0
    assert all(r.progress is not None for r in rows if r.phase == "predict")
    det = st["predictor_details"]
    assert det["trained_rounds"] > 0 and det["explored_runs"] > 0
    assert 0 < st["predictor_cost_fraction"] < 10
    meta, obs = read_trajectory(traj)
    assert meta["predictor"] == "rssm" and len(obs) == 40
    assert [o.phase for o in obs] == [r.phase for r in rows]
    assert all(o.groups for o in obs if o.phase in ("full", "correct"))


def test_per_group_scales_leave_a_zero_group_untouched():
    engine = make_engine(ds_config(stage=0, hybrid=EAGER))
    b = Batches()
    for _ in range(2):
        engine.train_step(b.step())
    groups = engine._masters.num_groups()
    assert groups == 1  # make_engine passes one param group
    before = master_copies(engine)
    za.apply_predicted_update(engine._masters, [0.0])
    assert all(torch.equal(x, y) for x, y in zip(before, master_copies(engine)))
    za.apply_predicted_update(engine._masters, [0.5])
    assert any(not torch.equal(x, y) for x, y in zip(before, master_copies(engine)))


def test_layer_groups_reach_the_optimizer_and_the_direction_sums():
    import copy
    import deepspeed
    import ds_hybrid
    from ds_hybrid.models import build_model, layer_groups
    from engine_utils import SEQ
    torch.manual_seed(0)
    model = build_model("gpt2-test", vocab_size=256, seq_len=SEQ)
    groups = layer_groups(model, 4)
    assert [g["name"] for g in groups] == ["embeddings", "blocks_0", "blocks_1", "head"]
    engine, *_ = ds_hybrid.initialize(model=model, model_parameters=groups,
                                      config=copy.deepcopy(ds_config(stage=1, hybrid=RSSM)))
    b = Batches()
    for _ in range(3):
        engine.train_step(b.step())
    za.stash_direction(engine._masters, engine._snapshot)  # compared with itself: projection 1 per group
    sums = za.compare_direction(engine._masters, engine._snapshot)
    assert sums.shape == (4, len(za.DIRECTION_STATS)) and (sums[:, 6] > 0).all()
    assert torch.allclose(sums[:, 0], sums[:, 1]) and torch.allclose(sums[:, 0], sums[:, 2])


def test_rssm_resume_is_bit_exact(tmp_path):
    cfg = ds_config(stage=1, hybrid=RSSM)
    engine = make_engine(cfg)
    b = Batches()
    rows = [(r.phase, r.loss, r.accepted, r.rolled_back_steps) for r in run(engine, 14, b)]
    engine.save_checkpoint(tmp_path, "mid")
    rows += [(r.phase, r.loss, r.accepted, r.rolled_back_steps) for r in run(engine, 14, b)]
    assert "predict" in [r[0] for r in rows[14:]]

    resumed = make_engine(cfg, seed=5)
    resumed.load_checkpoint(tmp_path, "mid")
    replay = Batches()
    for _ in range(14):
        replay.step()
    after = [(r.phase, r.loss, r.accepted, r.rolled_back_steps) for r in run(resumed, 14, replay)]
    assert after == rows[14:]
    for x, y in zip(full_params(engine), full_params(resumed)):
        assert torch.equal(x, y)
    a, c = engine.predictor, resumed.predictor
    for (k, v), (_, w) in zip(a.model.state_dict().items(), c.model.state_dict().items()):
        assert torch.equal(v, w), f"RSSM weight {k} differs after resume"
    assert a.bandit.state_dict()["pulls"] == c.bandit.state_dict()["pulls"]
    assert torch.equal(a.encoder.encode(), c.encoder.encode())
    assert a.corrector.state_dict()["count"] == c.corrector.state_dict()["count"]


def test_bad_dynamics_config_fails_before_training():
    from ds_hybrid.config import ConfigError, parse_hybrid_config
    with pytest.raises(ConfigError, match="hybrid_predict.dynamics.ensemble_size"):
        parse_hybrid_config({"hybrid_predict": {"predictor": {"type": "rssm"}, "dynamics": {"ensemble_size": 0}}})
    with pytest.raises(ConfigError, match="dynamics.horizon"):
        parse_hybrid_config({"hybrid_predict": {"predictor": {"type": "rssm"}, "max_predict_steps": 12}})
