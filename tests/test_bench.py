"""ds-hybrid bench: the analysis on constructed curves, and a CI-sized end-to-end run."""
import json

import pytest

from ds_hybrid import bench


def test_time_to_target_interpolates_first_crossing():
    curve = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert bench.time_to_target(curve, 2.5) == pytest.approx(15.0)
    assert bench.time_to_target(curve, 3.0) == pytest.approx(10.0)
    assert bench.time_to_target(curve, 1.5) == pytest.approx(30.0)
    assert bench.time_to_target(curve, 1.0) is None


def _row(curve, seconds, skipped=0.0):
    return {"final_val_loss": curve[-1][1], "val_curve": curve, "train_seconds": seconds, "peak_rss_mb": 100.0,
            "tokens_per_step": 1000,
            "statistics": {"backward_skipped_pct": skipped, "predict_accepted": 3, "predict_rolled_back": 1,
                           "mean_step_seconds": {"warmup": 0.1, "full": 0.1, "predict": 0.02, "correct": 0.1}}}


def test_compare_seed_against_the_baselines_final_loss():
    base = _row([(0.0, 5.0), (10.0, 3.0), (20.0, 2.0)], 20.0)
    fast = _row([(0.0, 5.0), (5.0, 3.0), (10.0, 2.0), (12.0, 1.9)], 12.0, skipped=40.0)
    r = bench.compare_seed(base, fast)
    assert r["target_val_loss"] == 2.0
    assert r["baseline_time_to_target_s"] == 20.0 and r["time_to_target_s"] == 10.0
    assert r["time_to_target_ratio"] == pytest.approx(0.5)
    assert r["final_val_gap_pct"] == pytest.approx(-5.0)
    assert r["val_at_equal_time"] == pytest.approx(1.9) and r["baseline_val_at_equal_time"] == pytest.approx(2.8)
    assert r["tokens_per_s_by_phase"]["predict"] == pytest.approx(50000)
    slow = _row([(0.0, 5.0), (20.0, 2.5)], 20.0)
    assert bench.compare_seed(base, slow)["time_to_target_ratio"] is None


def test_suites_reject_bad_overrides_and_gpu_suite_needs_gpu(monkeypatch):
    with pytest.raises(SystemExit, match="--seeds"):
        bench.main(["--suite", "cpu-small", "--seeds", "1"])
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--suite", "gpu-gpt2"])


@pytest.mark.slow
def test_quick_bench_end_to_end(tmp_path, monkeypatch):
    """The CI-sized run: sweep, baselines, hybrids, profile, JSON/markdown/PNG, README regeneration."""
    result = bench.main(["--quick", "--out", str(tmp_path / "b")])
    saved = json.loads((tmp_path / "b" / "result.json").read_text())
    sweep = sorted(float(m) for m in saved["sweep"])
    assert saved["best_lr_multiplier"] in sweep
    # The sweep is extended while its best is at an edge (at most twice).
    assert len(sweep) == 4 or sweep[0] < saved["best_lr_multiplier"] < sweep[-1]
    hyb = saved["analysis"]["hybrid"]
    eq = hyb["equal_compute"]["per_seed"]
    assert len(eq) == 2 and all(0 < r["real_steps"] <= r["steps"] for r in eq.values())
    assert saved["analysis"]["hybrid-x1.5"]["aggregate"]["seeds"] == 2
    # Its control: plain DeepSpeed on the same stretched schedule, no Predict steps.
    control = saved["analysis"]["baseline-x1.5"]
    assert control["aggregate"]["seeds"] == 2 and control["aggregate"]["backward_skipped_pct"]["mean"] == 0
    assert "against its control" in (tmp_path / "b" / "result.md").read_text()
    assert "At equal compute" in (tmp_path / "b" / "result.md").read_text()
    assert hyb["aggregate"]["seeds"] == 2
    assert hyb["aggregate"]["backward_skipped_pct"]["mean"] > 0  # Predict steps happened
    for r in hyb["per_seed"].values():
        assert r["target_val_loss"] > 0 and r["final_val_loss"] > 0
    prof = saved["profile"]
    assert prof["full_step"] > 0 and prof["predict_step_verified"] > 0 and prof["forward_only"] > 0
    assert (tmp_path / "b" / "val_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "time to target" in (tmp_path / "b" / "result.md").read_text()
    # --reuse keeps every finished run whose config and arguments match: nothing retrains.
    again = bench.main(["--quick", "--out", str(tmp_path / "b"), "--reuse", "--no-profile"])
    for name, a in saved["analysis"].items():
        for seed, r in a["per_seed"].items():
            assert again["analysis"][name]["per_seed"][seed]["train_seconds"] == r["train_seconds"]
    # README regeneration from the JSON, on a copy of the README.
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:cpu-small:start -->\nold\n<!-- bench:cpu-small:end -->\noutro\n")
    monkeypatch.setattr(bench, "REPO_ROOT", tmp_path)
    bench.update_readme(result, readme)
    text = readme.read_text()
    assert "old" not in text and "docs/results/cpu-small.json" in text and text.endswith("outro\n")
    assert json.loads((tmp_path / "docs" / "results" / "cpu-small.json").read_text())["suite"]["name"] == "cpu-small"


def test_reuse_needs_the_same_config_and_arguments(tmp_path):
    suite = bench.SUITES["cpu-small"]
    run = bench.Run("hybrid-s1", "hybrid", 1, 2e-3, {"a": 1}, tmp_path / "r")
    assert not bench.reusable(run, suite, None)  # nothing there yet
    run.out.mkdir()
    (run.out / "ds_config.json").write_text(json.dumps({"a": 1}))
    args = {"model": suite.model, "steps": suite.steps, "seq_len": suite.seq_len, "seed": 1, "lr": 2e-3,
            "eval_every": suite.eval_every, "val_batches": suite.val_batches, "data": None, "baseline": False}
    (run.out / "summary.json").write_text(json.dumps({"args": args, "interrupted": False}))
    assert bench.reusable(run, suite, None)
    assert not bench.reusable(bench.Run("b", "baseline", 1, 2e-3, {"a": 1}, run.out), suite, None)
    assert not bench.reusable(bench.Run("h", "hybrid", 2, 2e-3, {"a": 1}, run.out), suite, None)
    assert not bench.reusable(bench.Run("h", "hybrid", 1, 2e-3, {"a": 2}, run.out), suite, None)
    assert not bench.reusable(run, suite, "other.txt")
    (run.out / "summary.json").write_text(json.dumps({"args": args, "interrupted": True}))
    assert not bench.reusable(run, suite, None)


def test_gpu_peak_is_reported_only_where_measured():
    base = _row([(0.0, 5.0), (10.0, 2.0)], 10.0)
    gpu = dict(_row([(0.0, 5.0), (10.0, 2.1)], 10.0), gpu_peak_allocated_mb=900.0)
    base["gpu_peak_allocated_mb"] = 1800.0
    r = bench.compare_seed(base, gpu)
    assert (r["gpu_peak_mb"], r["baseline_gpu_peak_mb"]) == (900.0, 1800.0)
    agg = {k: bench.mean_spread([r[k], r[k]]) for k in bench.AGG_KEYS}
    assert bench._gpu_cell(agg) == "; GPU 900 ± 0 (1800 ± 0)"
    cpu = bench.compare_seed(_row([(0.0, 5.0), (10.0, 2.0)], 10.0), _row([(0.0, 5.0), (10.0, 2.1)], 10.0))
    assert bench._gpu_cell({k: bench.mean_spread([cpu[k]]) for k in bench.AGG_KEYS}) == ""
