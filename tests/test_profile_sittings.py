"""benchmarks/profile_sittings.py: profiles of a finished bench suite's step kinds, one after another
(every kind, or the suite's runs' own), beside what the runs measured. The profiles here are
stand-ins (the real ones take minutes); its numbers are in
docs/results/profile-sittings-offload-b64.json."""
import json

import pytest

from bench_scripts import load


@pytest.fixture(scope="module")
def ps():
    return load("profile_sittings")


def _result(tmp_path):
    """A suite with plain DeepSpeed and one hybrid arm, one seed, their run directories written as
    ``ds-hybrid train`` writes them (as far as ``compare.load_run`` reads)."""
    runs = {}
    for arm, hybrid, kinds in (("baseline", False, ["full"] * 4),
                               ("predict-gradient-quarter-15", True, ["full", "predict", "predict", "full"])):
        d = tmp_path / arm
        d.mkdir()
        cfg = {"hybrid_predict": {"enabled": hybrid, "predictor": {"direction": "gradient",
                                                                   "gradient_batch_fraction": 0.25}}}
        summary = {"statistics": {"steps_per_phase": {"full": 2, "predict": 2},
                                  "mean_step_seconds": {"full": 0.4, "predict": 0.1},
                                  "seconds_per_phase": {"full": 0.8, "predict": 0.2},
                                  "predict_rolled_back": 0, "predict_accepted": 1, "backward_skipped_pct": 0.0},
                   "ds_config": cfg, "val_points": [[0, 3.0], [4, 2.0]], "args": {"seed": 1, "seq_len": 128},
                   "final_val_loss": 2.0, "train_seconds_excluding_eval": 1.0}
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "steps.jsonl").write_text("".join(json.dumps({"phase": p, "backward_ran": True, "step_time_s": 0.1})
                                               + "\n" for p in kinds))
        runs[arm] = {"1": {"1": {"run": str(d), "real_step_ms": 400.0 if hybrid else 380.0,
                                 "predict_step_ms": 90.0 if hybrid else None}}}
    result = {"suite": {"name": "offload-b64", "arms": ["baseline", "predict-gradient-quarter-15"]},
              "runs": runs, "best_lr": 4e-3, "data": None, "init": None, "own_lr": {}, "errors": {}}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    return result, path


def test_the_runs_own_step_costs_are_read_beside_the_profiles(ps, tmp_path, monkeypatch):
    result, path = _result(tmp_path)
    assert ps.in_run_costs(result) == {"predict-gradient-quarter-15": {
        "predict_over_plain_real": [90.0 / 380.0], "real_over_plain_real": [400.0 / 380.0]}}
    asked = []

    def profile(suite, lr, data, init, reps, ds_arms, kinds):   # (a stand-in: each profile's kinds and round)
        asked.append(kinds)
        cost = {k: 1.0 for k in (kinds or ["plain", "real", "partial_1"])}
        return {"reps": reps, "cost": cost, "cost_se": {k: 0.0 for k in cost}}
    monkeypatch.setattr(ps.bench_profile, "profile_steps", profile)
    out = ps.main(["--result", str(path), "--order", "all", "needed", "--reps", "2", "--json", str(tmp_path / "o.json")])
    # every kind first, then the suite's: its runs' gradient steps from a quarter of the batch
    assert asked[0] is None and {"plain", "real", "predict_gradient_f0.25", "predict_gradient_f0.25_run"} <= asked[1]
    assert "partial_1" not in asked[1]
    saved = json.loads((tmp_path / "o.json").read_text())
    assert [p["kinds"] for p in saved["profiles"]] == ["all", "needed"] and saved["profiles"][1]["reps"] == 2
    assert saved["in_runs"] == out["in_runs"] and saved["needed"] == sorted(asked[1])


def test_a_result_whose_runs_are_not_here_is_refused_naming_them(ps, tmp_path):
    result, path = _result(tmp_path)
    result["runs"]["baseline"]["1"]["1"]["run"] = str(tmp_path / "gone")
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="--result: 1 of its run directories are not here .*gone"):
        ps.main(["--result", str(path), "--json", str(tmp_path / "o.json")])
