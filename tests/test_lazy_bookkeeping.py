"""hybrid_predict.lazy_bookkeeping: real steps whose capture, velocity fold and direction
statistics no decision would read leave them out, and nothing a decision reads changes."""
import torch

from engine_utils import Batches, ds_config, make_engine, master_copies
from ds_hybrid.phases import Phase

# drift_beta and scale_ema 0.5: a lead of 7 steps (0.5^7 < 1%), so 23 of 30 warmup steps are idle.
LAZY = {"warmup_steps": 30, "full_steps": 4, "min_predict_steps": 2, "max_predict_steps": 2,
        "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
        "predictor": {"direction": "drift", "drift_beta": 0.5, "scale_ema": 0.5},
        "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}


def _velocity(engine):
    return torch.cat([engine._velocity.buffers[i].load().flatten()
                      for i, p in enumerate(engine._masters.partitions()) if p.master.numel()])


def test_early_warmup_steps_are_bare_and_the_velocity_is_folded_over_the_lead():
    engine = make_engine(ds_config(stage=1, hybrid=LAZY))
    assert engine._lead == 7
    b = Batches()
    beta, expected, results = 0.5, None, []
    for _ in range(30):
        before = master_copies(engine)
        lrs = [float(g["lr"]) for g in engine._masters.base.param_groups]
        results.append(engine.train_step(b.step()))
        if results[-1].bookkeeping:
            d = [(a - w) / lrs[p.group_index] for a, w, p in zip(master_copies(engine), before,
                                                                  engine._masters.partitions())]
            expected = d if expected is None else [beta * e + (1 - beta) * x for e, x in zip(expected, d)]
    assert [r.bookkeeping for r in results] == [False] * 23 + [True] * 7
    assert all(r.phase == Phase.WARMUP.value for r in results)
    st = engine.statistics()
    assert st["idle_steps"] == 23
    # The velocity holds exactly the fold of the last 7 warmup updates (the first one starts it).
    want = torch.cat([e.flatten() for e, p in zip(expected, engine._masters.partitions()) if p.master.numel()])
    torch.testing.assert_close(_velocity(engine), want, rtol=1e-4, atol=1e-6)


def test_lazy_and_eager_bookkeeping_train_the_same_weights_and_decide_the_same():
    """Bookkeeping never touches the weights: through warmup both are bit-identical; the
    velocity differs only by the updates older than the lead (under a few percent), and the
    decisions after warmup are the same."""
    lazy = make_engine(ds_config(stage=1, hybrid=LAZY))
    eager = make_engine(ds_config(stage=1, hybrid=dict(LAZY, lazy_bookkeeping=False)))
    bl, be = Batches(), Batches()
    for _ in range(30):
        lazy.train_step(bl.step())
        eager.train_step(be.step())
    for a, b in zip(master_copies(lazy), master_copies(eager)):
        assert torch.equal(a, b)
    assert eager.statistics()["idle_steps"] == 0
    vl, ve = _velocity(lazy), _velocity(eager)
    assert float((vl - ve).norm() / ve.norm()) < 0.05
    assert abs(lazy.predictor.proj_ema - eager.predictor.proj_ema) < 0.05 * abs(eager.predictor.proj_ema)
    phases = [([e.train_step(bb.step()).phase for _ in range(12)]) for e, bb in ((lazy, bl), (eager, be))]
    assert phases[0] == phases[1] and Phase.PREDICT.value in phases[0]


def test_steps_that_feed_every_step_learners_are_never_bare():
    """The layer-group planner reads every step's statistics: no step is left bare."""
    cfg = dict(LAZY, whole_model=False, group_predict={"enabled": True})
    engine = make_engine(ds_config(stage=1, hybrid=cfg), groups=4)
    b = Batches()
    assert all(engine.train_step(b.step()).bookkeeping for _ in range(25))
    assert engine.statistics()["idle_steps"] == 0
