"""DeepSpeed's wall_clock_breakdown timers booked per kind of step (ds_hybrid.wall_clock)."""
import pytest
from deepspeed.utils.timer import SynchronizedWallClockTimer

from engine_utils import EAGER, Batches, ds_config, make_engine
from ds_hybrid.wall_clock import TIMERS


@pytest.fixture
def timed(monkeypatch):
    """Every interval DeepSpeed's timers measure, by timer name: the truth the booking must add up to."""
    seen: dict[str, float] = {}
    stop = SynchronizedWallClockTimer.Timer.stop

    def recording(self, *args, **kwargs):
        stop(self, *args, **kwargs)
        seen[self.name_] = seen.get(self.name_, 0.0) + self.event_timers[-1] * 1e3
    monkeypatch.setattr(SynchronizedWallClockTimer.Timer, "stop", recording)
    return seen


@pytest.mark.parametrize("gas,stage", [(1, 1), (2, 2)])
def test_each_kind_of_step_gets_what_deepspeed_timed_in_it(timed, gas, stage):
    engine = make_engine(ds_config(stage=stage, gas=gas, hybrid=dict(EAGER), wall_clock_breakdown=True))
    batches = Batches()
    phases = [engine.train_step(batches.step(gas)).phase for _ in range(14)]
    assert "predict" in phases and "full" in phases
    wc = engine.statistics()["wall_clock_breakdown"]
    st = engine.statistics()["steps_per_phase"]
    assert {p: wc[p]["steps"] for p in wc if p not in ("real", "checks")} == {p: n for p, n in st.items() if n}
    # Nothing is lost or counted twice across DeepSpeed's resets at each accumulation boundary.
    for name in TIMERS:
        booked = sum(wc[p]["mean_ms"][name] * wc[p]["steps"] for p in wc if p not in ("real", "checks"))
        assert booked == pytest.approx(timed.get(name, 0.0), rel=1e-6, abs=1e-6), name
    # A Predict step runs a verification forward (verify_every 1), no backward; a real step all three.
    assert wc["predict"]["mean_ms"]["fwd"] > 0 and wc["predict"]["mean_ms"]["bwd"] == 0
    assert all(wc["real"]["mean_ms"][k] > 0 for k in ("fwd", "bwd", "step"))
    # The Predict forwards are not in the real steps' (DeepSpeed's own log would put them there).
    real = [p for p in ("warmup", "full", "correct") if p in wc]
    assert wc["real"]["steps"] == sum(wc[p]["steps"] for p in real)


def test_plain_engine_books_full_steps_and_nothing_without_the_flag():
    engine = make_engine(ds_config(stage=2, hybrid={"enabled": False}, wall_clock_breakdown=True))
    batches = Batches()
    for _ in range(3):
        engine.train_step(batches.step())
    wc = engine.statistics()["wall_clock_breakdown"]
    assert wc["full"]["steps"] == 3 and wc["real"]["steps"] == 3 and wc["real"]["mean_ms"]["step"] > 0
    quiet = make_engine(ds_config(stage=2, hybrid={"enabled": False}))
    quiet.train_step(batches.step())
    assert "wall_clock_breakdown" not in quiet.statistics()


def test_forwards_between_steps_are_no_steps():
    """An evaluation's forward between two steps is not booked to the next one."""
    engine = make_engine(ds_config(stage=1, hybrid={"enabled": False}, wall_clock_breakdown=True))
    batches = Batches()
    engine.train_step(batches.step())
    kept = engine._wall_clock._kept
    engine(**batches.micro())
    assert [name for name, _ in kept] == ["fwd"]
    engine.train_step(batches.step())
    assert engine.statistics()["wall_clock_breakdown"]["full"]["steps"] == 2 and not kept


@pytest.mark.parametrize("accept", [True, False])
def test_steps_that_check_a_predicted_update_are_booked_again_by_outcome(timed, monkeypatch, accept):
    """Under ``check: next_step`` the real step after a Predict run checks it with its own first
    forward. Those steps are booked to their phase and again to ``checks`` by outcome: their
    intervals exactly, their whole step time as ``whole``; a rolled-back run's step ran its forward
    twice. (The predictor's verdict is fixed: every run kept, or every run rolled back.)"""
    hybrid = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
              "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": "drift"},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}
    engine = make_engine(ds_config(stage=2, hybrid=hybrid, wall_clock_breakdown=True))
    monkeypatch.setattr(engine.predictor, "accept", lambda observed, *args, **kwargs: (accept, observed))
    forwards = []
    forward = engine.forward

    def counting(*args, **kwargs):
        forwards[-1] += 1
        return forward(*args, **kwargs)
    monkeypatch.setattr(engine, "forward", counting)
    batches = Batches()
    truth: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    whole: dict[str, float] = {}
    for _ in range(16):
        before = dict(timed)
        forwards.append(0)
        r = engine.train_step(batches.step())
        if r.checked is None:
            continue
        outcome = "kept" if r.checked else "rolled_back"
        assert forwards[-1] == (1 if r.checked else 2), outcome   # (a rollback redoes the forward)
        counts[outcome] = counts.get(outcome, 0) + 1
        whole[outcome] = whole.get(outcome, 0.0) + r.step_time_s * 1e3
        step = truth.setdefault(outcome, dict.fromkeys(TIMERS, 0.0))
        for name in TIMERS:
            step[name] += timed.get(name, 0.0) - before.get(name, 0.0)
    assert set(counts) == {"kept" if accept else "rolled_back"} and sum(counts.values()) >= 2, counts
    wc = engine.statistics()["wall_clock_breakdown"]
    assert {o: c["steps"] for o, c in wc["checks"].items()} == counts
    for outcome, n in counts.items():
        mean = wc["checks"][outcome]["mean_ms"]
        for name in TIMERS:
            assert mean[name] * n == pytest.approx(truth[outcome][name], rel=1e-6, abs=1e-6), (outcome, name)
        # the whole step as the engine timed it and reported it (StepResult.step_time_s)
        assert mean["whole"] * n == pytest.approx(whole[outcome], rel=1e-6)
    # The phases still add up to the steps taken: the checks are booked again, not moved.
    st = engine.statistics()["steps_per_phase"]
    assert {p: wc[p]["steps"] for p in wc if p not in ("real", "checks")} == {p: n for p, n in st.items() if n}
