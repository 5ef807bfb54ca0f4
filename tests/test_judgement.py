"""Delayed-effect judgement (ds_hybrid/judgement.py): the sign of a run's effect, the verdict
over runs, the difficulty regressor, checkpoints; and the engine's gate on 1 and 2 ranks."""
import random

import pytest

from ds_hybrid.judgement import DelayedJudgement


def _trajectory(judge, run_gain, runs=12, noise=0.0, seed=0, difficulty=False):
    """A loss falling 0.01 per real step; after every 32 real steps a run that moves the loss by
    -run_gain (negative gain: harm). Returns the judge after the last run was judged."""
    rng = random.Random(seed)
    level = 5.0
    for r in range(runs + 2):
        for _ in range(32):
            level -= 0.01
            d = rng.gauss(0.0, 0.2) if difficulty else None
            judge.real_step(level + noise * rng.gauss(0.0, 1.0) + (0.5 * d if difficulty else 0.0), d)
        if r < runs and judge.real_index >= judge.window:
            level -= run_gain
            judge.run_ended(2)
    return judge


def test_paying_runs_have_a_negative_effect_and_are_not_harmful():
    j = _trajectory(DelayedJudgement(steps=8, window=16, min_runs=3), run_gain=0.05)
    assert j.n >= 8
    assert j.mean_effect() == pytest.approx(-0.05, abs=1e-9)   # a clean line: the run's jump exactly
    assert j.placebos.n >= 8 and j.net_effect()[0] == pytest.approx(-0.05, abs=1e-9)
    assert not j.harmful()
    assert j.summary()["paid_share"] == 1.0


def test_skip_runs_are_neutral_and_harmful_runs_are_found():
    assert abs(_trajectory(DelayedJudgement(steps=8, window=16), run_gain=0.0).mean_effect()) < 1e-9
    j = _trajectory(DelayedJudgement(steps=8, window=16, min_runs=3, z=2.0), run_gain=-0.05, noise=0.02)
    assert j.mean_effect() > 0 and j.harmful()
    # Noise far above the effect: no verdict either way.
    j = _trajectory(DelayedJudgement(steps=8, window=16, min_runs=3), run_gain=-0.001, noise=0.3)
    assert not j.harmful()


def test_placebos_take_out_the_bias_of_a_line_through_a_curving_loss():
    """A loss flattening out (exp decay): the line over-predicts the fall after runs and after no
    runs alike. Runs worth nothing are not judged harmful; harmful ones still are."""
    import math as m

    def curve(run_gain, noise):
        rng, j = random.Random(1), DelayedJudgement(steps=8, window=16, min_runs=4, z=2.0)
        t, shift = 0, 0.0
        for r in range(40):
            for _ in range(32):
                t += 1
                j.real_step(2.0 + 3.0 * m.exp(-t / 400.0) + shift + noise * rng.gauss(0.0, 1.0))
            if j.real_index >= j.window:
                shift -= run_gain
                j.run_ended(2)
        return j
    neutral = curve(0.0, 0.0)
    assert neutral.mean_effect() > 1e-4, "the line alone is biased upwards"
    assert abs(neutral.net_effect()[0]) < 0.1 * neutral.mean_effect() and not neutral.harmful()
    assert curve(-0.02, 0.005).harmful()


def test_the_difficulty_regressor_takes_out_the_batch_noise():
    with_d = _trajectory(DelayedJudgement(steps=8, window=16), run_gain=0.05, difficulty=True)
    assert with_d.mean_effect() == pytest.approx(-0.05, abs=1e-6)


def test_a_run_closes_early_at_the_next_run_and_state_round_trips():
    j = DelayedJudgement(steps=8, window=4)
    for i in range(4):
        j.real_step(3.0 - 0.1 * i)
    assert j.run_ended(2)
    j.real_step(2.0)
    j.real_step(1.9)
    # The first run is judged on the 2 real steps it had; the second is not judged: its window
    # holds the first run's jump.
    assert not j.run_ended(1)
    assert j.n == 1 and j.effects[0][1] == 2
    for x in (1.8, 1.7, 1.6, 1.5):
        j.real_step(x)
    assert j.open is not None and j.open.predicted_steps == 0   # a clean window again: a placebo
    k = DelayedJudgement(steps=8, window=4)
    k.load_state_dict(j.state_dict())
    for x in (1.4, 1.3):
        j.real_step(x)
        k.real_step(x)
    assert j.summary() == k.summary() and j.open.residuals == k.open.residuals


def test_no_window_no_judgement_and_nonfinite_losses_are_ignored():
    j = DelayedJudgement(steps=2, window=8)
    j.real_step(float("nan"))
    j.real_step(None)
    assert j.real_index == 0 and not j.run_ended(1)
    assert j.mean_effect() is None and j.net_effect() == (None, None) and j.summary()["judged_runs"] == 0


# ------------------------------------------------------------------ in the engine
HARM = {"warmup_steps": 3, "full_steps": 10, "min_predict_steps": 2, "max_predict_steps": 2,
        "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
        "predictor": {"direction": "drift", "drift_beta": 0.8},
        "divergence": {"rel_tolerance": 2.0, "z_threshold": 10.0, "max_loss_ratio": 10.0},
        "judge": {"steps": 3, "window": 6, "min_runs": 3, "z": 1.0}}   # runs 10 real steps apart: clean windows


def harmful_update(monkeypatch, scale: float = 0.05):
    """Every predicted update also adds noise to the masters: runs the lenient check keeps, but
    that leave the real steps after them above their line."""
    import torch
    from ds_hybrid import zero_access as za
    real = za.apply_velocity_update
    gen = torch.Generator().manual_seed(0)

    def noisy(access, velocity, scales, **kw):
        real(access, velocity, scales, **kw)
        for part in access.partitions():
            part.master.add_(torch.randn(part.master.shape, generator=gen, dtype=part.master.dtype) * scale)
    monkeypatch.setattr(za, "apply_velocity_update", noisy)


@pytest.mark.parametrize("gate", [True, False])
def test_the_engine_judges_kept_runs_and_the_verdict_stops_harmful_prediction(monkeypatch, gate):
    from engine_utils import Batches, ds_config, make_engine
    from ds_hybrid.phases import Phase
    harmful_update(monkeypatch)
    cfg = dict(HARM, judge=dict(HARM["judge"], gate=gate))
    engine = make_engine(ds_config(stage=1, hybrid=cfg))
    b = Batches()
    results = [engine.train_step(b.step()) for _ in range(130)]
    phases = [r.phase for r in results]
    j = engine.statistics()["judgement"]
    assert j["judged_runs"] >= 3 and j["placebos"] >= 3 and j["net_effect"] > 0 and j["harmful"]
    assert j["stopped_predict"] is gate
    last_predict = max(i for i, p in enumerate(phases) if p == Phase.PREDICT.value)
    if gate:
        assert last_predict < 100, "Predict stopped once the verdict was in"
        # Predict is off for good: the real steps after it leave the velocity bookkeeping out.
        bare = [not r.bookkeeping for r in results]
        first = bare.index(True)
        assert first > last_predict and all(bare[first:]) and engine.statistics()["idle_steps"] == sum(bare) > 20
        # A resume keeps the verdict.
        engine2 = make_engine(ds_config(stage=1, hybrid=cfg))
        engine2.load_hybrid_state_dict(engine.hybrid_state_dict())
        assert engine2.statistics()["judgement"] == j and engine2._judge_stopped
    else:
        assert last_predict > 110, "judge-only: Predict goes on"
        assert all(r.bookkeeping for r in results)


@pytest.mark.slow
def test_two_ranks_stop_predicting_at_the_same_step(tmp_path):
    """The verdict rides on rank 0's agreement: both ranks stop at the same step, same weights."""
    from spawn import run_ranks
    first, other = run_ranks("multirank_worker.py", ["--stage", "1", "--steps", "110", "--judge-harm"], 2, tmp_path)
    for col in ("phase", "loss", "checked", "lr"):
        assert [s[col] for s in other["record"]] == [s[col] for s in first["record"]], f"ranks differ in '{col}'"
    assert other["weights_sha256"] == first["weights_sha256"]
    for r in (first, other):
        assert r["statistics"]["judgement"]["stopped_predict"]
    phases = [s["phase"] for s in first["record"]]
    assert "predict" in phases and "predict" not in phases[100:]


def test_the_bench_replay_judges_kept_runs_in_the_engines_order(tmp_path):
    """benchmarks/delayed_judgement.py: a run whose check rejected it is not judged; partial steps
    are not real-step losses; a kept run's jump shows as its effect."""
    import importlib.util
    import json
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "delayed_judgement", Path(__file__).resolve().parent.parent / "benchmarks" / "delayed_judgement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows, level = [], 4.0
    for cycle in range(6):
        for i in range(20):
            level -= 0.01
            first = i == 0 and cycle > 0
            rows.append({"phase": "full", "loss": level, "checked": (cycle % 2 == 1) if first else None})
        rows += [{"phase": "predict", "loss": None}, {"phase": "predict", "loss": None}]
        level -= 0.03 if cycle % 2 == 0 else 0.0   # kept runs (the next step's check passes) pay 0.03
    rows.append({"phase": "partial", "loss": 99.0})
    f = tmp_path / "steps.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    j = mod.replay(f, steps=8, window=8)
    runs = [e for _, k, e in j.effects if k > 0]
    assert len(runs) == 3 and all(e == pytest.approx(-0.03, abs=1e-9) for e in runs)
