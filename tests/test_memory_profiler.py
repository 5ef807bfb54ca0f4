"""The memory profiler: what it records, per-phase summaries, spikes, its outputs, its cost, the train job."""
import csv
import json
import time
from pathlib import Path

import pytest
import torch

from ds_hybrid.memory import MemoryProfiler, MemorySample, detect_spikes

PNG = b"\x89PNG\r\n\x1a\n"


def synthetic(values, phases=None):
    """A profiler holding made-up samples (MB), for the summary / spike / output code."""
    prof = MemoryProfiler()
    prof.baseline_rss_mb = 100.0
    phases = phases or ["full"] * len(values)
    prof.samples = [MemorySample(step=i + 1, phase=ph, time_s=float(i), step_time_s=0.1, rss_mb=v - 5,
                                 rss_peak_mb=v, pinned_host_mb=0.0) for i, (v, ph) in enumerate(zip(values, phases))]
    return prof


# ------------------------------------------------------------ spikes
def test_spike_on_a_flat_series_is_found():
    values = [500.0] * 30
    values[20] = 700.0
    assert detect_spikes(values) == [(20, 700.0, 500.0)]


def test_spike_rule_needs_both_the_relative_and_the_absolute_jump():
    flat = [1000.0] * 10
    assert detect_spikes(flat + [1090.0]) == []                                # +90 MB but only +9%
    assert detect_spikes(flat + [1080.0], rel=0.05) == [(10, 1080.0, 1000.0)]  # +8% > 5% and 80 MB > 64
    small = [100.0] * 10
    assert detect_spikes(small + [150.0]) == []          # +50% but only 50 MB
    assert detect_spikes(small + [150.0], abs_mb=10) == [(10, 150.0, 100.0)]


def test_spike_rule_ignores_slow_growth_short_history_and_missing_values():
    assert detect_spikes([500.0 + 5 * i for i in range(50)]) == []     # a leak is not a spike
    assert detect_spikes([500.0, 500.0, 900.0]) == []                   # fewer than 5 steps of history
    assert detect_spikes([None] * 10 + [900.0]) == []
    values = [500.0, None] * 5 + [900.0]
    assert detect_spikes(values) == [(10, 900.0, 500.0)]
    with pytest.raises(ValueError):
        detect_spikes([1.0], window=0)


# ------------------------------------------------------------ recording
def test_record_sees_a_peak_inside_the_step_that_is_gone_by_its_end():
    prof = MemoryProfiler()
    prof.begin()
    block = bytearray(256 * 2 ** 20)
    for i in range(0, len(block), 4096):   # touch every page so it is resident
        block[i] = 1
    del block
    s = prof.record(1, "full", step_time_s=0.1)
    assert s.phase == "full" and s.step == 1
    if prof.peak_resettable:  # Linux: the step's own high-water mark
        assert s.rss_peak_mb - s.rss_mb > 200
    assert s.rss_peak_mb >= s.rss_mb > 0
    s2 = prof.record(2, "predict", step_time_s=0.1)  # a new window: the freed block is not in it
    if prof.peak_resettable:
        assert s2.rss_peak_mb < s.rss_peak_mb - 200
    assert prof.process_peak_rss_mb >= s.rss_peak_mb


def test_without_a_gpu_only_host_figures_are_recorded():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    prof = MemoryProfiler()
    s = prof.record(1, "warmup")
    assert s.gpu_allocated_mb is None and s.gpu_device_used_mb is None and s.pinned_host_mb == 0.0
    assert prof.process_peak_gpu_allocated_mb is None
    assert prof.summary()["nvml_error"] is None  # NVML is never touched without CUDA


@pytest.mark.gpu
def test_gpu_figures_are_the_allocators_own():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prof = MemoryProfiler(device=torch.device("cuda", 0))
    # Earlier GPU tests in the same process leave segments in torch's cache; a free block of one
    # could take the 64 MB below without a call to the driver (the 2026-11-30 H200 run: 0 calls).
    torch.cuda.empty_cache()
    keep = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    prof.begin()
    calls = torch.cuda.memory_stats(0).get("num_device_alloc")
    tmp = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del tmp
    calls = None if calls is None else torch.cuda.memory_stats(0)["num_device_alloc"] - calls
    want = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(0))
    s = prof.record(1, "full")
    assert (s.gpu_allocated_mb, s.gpu_reserved_mb, s.gpu_peak_allocated_mb) == tuple(v / 2**20 for v in want)
    assert s.gpu_peak_allocated_mb - s.gpu_allocated_mb >= 64   # the freed block is in this step's peak
    s2 = prof.record(2, "predict")                               # ... and not in the next one's
    assert s2.gpu_peak_allocated_mb == s2.gpu_allocated_mb == s.gpu_allocated_mb
    assert s.gpu_allocated_mb >= keep.numel() / 2**20
    # The allocator's calls to the driver, per step: the new 64 MB segment, then none, then the cache emptied.
    assert s.gpu_device_allocs >= 1 and s.gpu_alloc_retries == 0
    assert calls is None or s.gpu_device_allocs == calls      # the allocator's own count, not more
    assert (s2.gpu_device_allocs, s2.gpu_device_frees, s2.gpu_alloc_retries) == (0, 0, 0)
    torch.cuda.empty_cache()
    assert prof.record(3, "full").gpu_device_frees >= 1
    assert prof.phase_summary()["full"]["gpu_device_allocs"] == s.gpu_device_allocs


def test_allocator_call_counts_come_from_either_torchs_counters():
    """cudaMalloc / cudaFree calls from torch's event counters, or, where a torch has none, from the
    segments it took and gave back; None where it has neither (the figures are then left out)."""
    from ds_hybrid.memory.profiler import _alloc_counts
    seg = {"segment": {"all": {"allocated": 7, "freed": 3}}, "num_alloc_retries": 1}
    assert _alloc_counts(dict(seg, num_device_alloc=9, num_device_free=4)) == (9, 4, 1)
    assert _alloc_counts(seg) == (7, 3, 1)
    assert _alloc_counts({"segment": {"all": {}}}) is None
    prof = synthetic([300, 310, 320], ["full", "full", "predict"])
    prof.samples[0].gpu_device_allocs, prof.samples[0].gpu_device_frees, prof.samples[0].gpu_alloc_retries = 5, 2, 1
    prof.samples[1].gpu_device_allocs, prof.samples[1].gpu_device_frees, prof.samples[1].gpu_alloc_retries = 1, 0, 0
    summ = prof.phase_summary()
    assert (summ["full"]["gpu_device_allocs"], summ["full"]["gpu_device_frees"], summ["full"]["gpu_alloc_retries"]) \
        == (6, 2, 1)
    assert "gpu_device_allocs" not in summ["predict"]   # not measured: left out, not 0


def test_record_costs_well_under_one_percent_of_a_step():
    prof = MemoryProfiler()
    for i in range(200):
        prof.record(i + 1, "full", step_time_s=0.05)  # a 50 ms step is short for training
    per_step = prof.overhead_s / 200
    assert per_step < 1e-3, per_step
    assert prof.overhead_fraction() < 0.01
    assert prof.summary()["overhead_us_per_step"] == pytest.approx(per_step * 1e6)
    parts = prof.summary()["overhead_parts_s"]
    # Every record's cost is split into host / CUDA allocator / NVML reads; without CUDA it is all host.
    assert parts["host"] > 0 and sum(parts.values()) == pytest.approx(prof.overhead_s, rel=0.05)
    if not torch.cuda.is_available():
        assert parts["cuda"] == parts["nvml"] == 0.0 and prof.summary()["nvml_init_s"] is None
    assert "profiler cost:" in prof.report() and "host " in prof.report()


def test_phase_summary_is_per_phase_in_cycle_order():
    prof = synthetic([300, 310, 400, 420, 200, 210, 320],
                     ["warmup", "warmup", "full", "full", "predict", "predict", "correct"])
    summ = prof.phase_summary()
    assert list(summ) == ["warmup", "full", "predict", "correct"]
    assert summ["full"]["steps"] == 2 and summ["full"]["rss_peak_mb"] == 420
    assert summ["full"]["rss_peak_mean_mb"] == pytest.approx(410)
    assert summ["predict"]["rss_peak_above_baseline_mb"] == pytest.approx(110)
    assert summ["predict"]["rss_mean_mb"] == pytest.approx(200)   # end-of-step = peak - 5 in synthetic()


def test_spikes_are_reported_with_step_and_phase():
    values = [500.0] * 25
    values[22] = 800.0
    prof = synthetic(values, ["full"] * 20 + ["predict"] * 5)
    (spike,) = prof.spikes()
    assert (spike["step"], spike["phase"], spike["metric"]) == (23, "predict", "rss_peak_mb")
    assert spike["jump_mb"] == pytest.approx(300)
    assert "step 23 (predict)" in prof.report()


# ------------------------------------------------------------ outputs
def test_csv_report_and_png_are_written(tmp_path):
    values = [500.0] * 12
    values[9] = 900.0
    prof = synthetic(values, ["warmup"] * 4 + ["full"] * 4 + ["predict"] * 2 + ["correct"] * 2)
    paths = prof.write(tmp_path)
    assert {p.name for p in paths} == {"memory.csv", "memory_report.txt", "memory.png"}
    with open(tmp_path / "memory.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and rows[9]["phase"] == "predict" and float(rows[9]["rss_peak_mb"]) == 900
    assert rows[0]["gpu_allocated_mb"] == ""   # not measured: empty, not 0
    report = (tmp_path / "memory_report.txt").read_text()
    for word in ("warmup", "full", "predict", "correct", "spikes", "profiler cost"):
        assert word in report
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG


def test_plot_with_gpu_columns(tmp_path):
    prof = synthetic([500.0] * 6, ["full"] * 3 + ["predict"] * 3)
    for i, s in enumerate(prof.samples):
        s.gpu_allocated_mb, s.gpu_reserved_mb, s.gpu_peak_allocated_mb = 1000.0, 1200.0, 1500.0 + i
    prof.plot(tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG
    assert "GPU peak" in prof.report()
    with pytest.raises(ValueError):
        MemoryProfiler().plot(tmp_path / "empty.png")


# ------------------------------------------------------------ the train job
def test_train_job_writes_memory_outputs(tmp_path):
    from ds_hybrid import train
    from ds_hybrid.arguments import PRESET_DIR
    corpus = tmp_path / "c.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    cfg = json.loads((PRESET_DIR / "tiny-cpu.json").read_text())
    cfg["hybrid_predict"].update({"warmup_steps": 3, "full_steps": 2, "confidence_threshold": 0.0,
                                  "min_predict_steps": 2, "max_predict_steps": 3, "predict_lr_fraction": 1.0})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    t = time.perf_counter()
    summary = train.main(["--data", str(corpus), "--config", str(tmp_path / "cfg.json"), "--steps", "14",
                          "--seq-len", "32", "--eval-every", "7", "--val-batches", "1", "--model", "gpt2-test",
                          "--out", str(out), "--no-progress"])
    wall = time.perf_counter() - t
    mem = summary["memory"]
    phases = summary["statistics"]["steps_per_phase"]
    assert {p: v["steps"] for p, v in mem["phases"].items()} == {p: n for p, n in phases.items() if n}
    assert phases["predict"] > 0   # the run reached Predict steps, so the table compares phases
    with open(out / "memory.csv") as f:
        assert len(list(csv.DictReader(f))) == 14
    assert (out / "memory.png").read_bytes()[:8] == PNG
    assert "predict" in (out / "memory_report.txt").read_text()
    # (<=: this 0.03M-parameter set-up can be served entirely from pages earlier tests in this
    # process freed but left resident, and then does not raise the high-water mark)
    assert mem["baseline_rss_mb"] <= mem["setup_peak_rss_mb"] <= mem["process_peak_rss_mb"]
    assert summary["peak_rss_mb"] >= mem["process_peak_rss_mb"] - 1  # the reset did not lose the run's peak
    # the profiler times its own reads, inside the run (what they cost is a benchmark's number, not
    # this test's: 1.3% of this 1.2 s run on a busy 2-core machine, 15 ms over 14 steps)
    assert 0 < mem["overhead_s"] < wall
    assert mem["overhead_us_per_step"] == pytest.approx(mem["overhead_s"] / 14 * 1e6)
    assert json.loads((out / "summary.json").read_text())["memory"]["steps_recorded"] == 14


# ------------------------------------------------------------ memory-bench
def test_memory_bench_compares_variants(tmp_path):
    from ds_hybrid.memory import bench as mbench
    result = mbench.main(["--models", "gpt2-test", "--variants", "full", "drift-fp32", "drift-int8",
                          "--steps", "10", "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "m.json")])
    runs = {r["run"]: r for r in result["runs"]}
    assert set(runs) == {"full", "drift-fp32", "drift-int8"}
    assert runs["full"]["steps_per_phase"]["predict"] == 0 and not runs["full"]["velocity_bytes"]
    for name in ("drift-fp32", "drift-int8"):
        assert runs[name]["steps_per_phase"]["predict"] > 0
    # int8: one byte per value and a scale per 256, against four bytes.
    assert runs["drift-int8"]["velocity_bytes"] < 0.3 * runs["drift-fp32"]["velocity_bytes"]
    steps = {(r["run"], r["phase"]): r["steps"] for r in result["rows"]}
    assert steps[("drift-int8", "predict")] > 0
    # plain DeepSpeed's first steps are left out of its Full figures, as the hybrid's Warmup is
    assert steps[("full", "warmup")] == steps[("drift-int8", "warmup")] == 2 and steps[("full", "full")] == 8
    assert json.loads((tmp_path / "m.json").read_text())["table_markdown"] == result["table_markdown"]


def test_memory_bench_kills_a_run_past_its_timeout_and_goes_on(tmp_path, monkeypatch):
    """--run-timeout: a run still going is killed (subprocess.run's timeout) and listed as failed,
    and the next variant runs (a hang on a lent GPU must not take the rest of the call). The
    children are not really started: a child killed while it loads DeepSpeed's ops would leave
    their build lock behind for every later test."""
    import subprocess
    from ds_hybrid.memory import bench as mbench
    calls = []

    def run(cmd, timeout=None, **kw):
        calls.append((Path(cmd[cmd.index("--out") + 1]).name, timeout))
        raise subprocess.TimeoutExpired(cmd, timeout)
    monkeypatch.setattr(mbench.subprocess, "run", run)
    with pytest.raises(SystemExit, match="2 run\\(s\\) failed: gpt2-test/full, gpt2-test/drift-int8"):
        mbench.main(["--models", "gpt2-test", "--variants", "full", "drift-int8", "--steps", "8", "--run-timeout",
                     "3", "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "m.json")])
    assert calls == [("gpt2-test-full", 3.0), ("gpt2-test-drift-int8", 3.0)]
    result = json.loads((tmp_path / "m.json").read_text())
    assert [f["run"] for f in result["failed"]] == ["full", "drift-int8"]
    assert "--run-timeout 3 s" in result["failed"][0]["error"]
    with pytest.raises(SystemExit, match="--run-timeout: must be more than 0"):
        mbench.main(["--run-timeout", "0"])


def test_memory_bench_reports_the_predictor_and_replaces_the_precision(tmp_path):
    from ds_hybrid.memory import bench as mbench
    result = mbench.main(["--models", "gpt2-test", "--variants", "rssm-cpu", "--steps", "12", "--precision", "bf16",
                          "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "m.json")])
    (run,) = result["runs"]
    cfg = json.loads((tmp_path / "runs" / "gpt2-test-rssm-cpu" / "ds_config.json").read_text())
    assert cfg["bf16"] == {"enabled": True} and result["precision"] == "bf16"
    assert cfg["hybrid_predict"]["dynamics"]["device"] == "cpu"
    assert run["predictor_device"] == "cpu" and run["predictor_ms_per_step"] > 0
    assert run["kernel_launches"] == {}            # the CPU predictor takes the torch paths
    assert set(run["profiler_ms_per_record"]) == {"host", "cuda", "nvml"}
    assert "| gpt2-test | rssm-cpu | - | cpu |" in result["table_markdown"]
    with pytest.raises(SystemExit):
        mbench.main(["--precision", "fp8"])


def test_memory_bench_gpu_tables_and_retable(tmp_path):
    # The GPU columns of a result (as a CUDA run writes them), rendered and re-derived.
    from ds_hybrid.memory import bench as mbench
    phase = {"steps": 4, "rss_peak_mb": 1300.0, "rss_peak_mean_mb": 1290.0, "rss_mean_mb": 1280.0,
             "step_time_mean_s": 0.1}
    full = dict(phase, gpu_peak_allocated_max_mb=10000.0, gpu_allocated_max_mb=1500.0, gpu_reserved_max_mb=11000.0,
                gpu_device_used_max_mb=12800.0, pinned_host_peak_mb=300.0)
    pred = dict(phase, gpu_peak_allocated_max_mb=2000.0, gpu_allocated_max_mb=1500.0, gpu_reserved_max_mb=2400.0,
                gpu_device_used_max_mb=4200.0, gpu_device_allocs=8, gpu_device_frees=4, gpu_alloc_retries=2)
    summaries = {"full": {"full": full}, "drift-int8-park": {"full": full, "predict": pred}}
    rows, runs = [], []
    for kind, phases in summaries.items():
        summary = {"memory": {"baseline_rss_mb": 800.0, "phases": phases}}
        rows += mbench.rows_from_summary("m", kind, summary)
        runs.append({"model": "m", "run": kind, "parameters": 1e6, "baseline_rss_mb": 800.0,
                     "setup_peak_above_baseline_mb": 10.0, "profiler_overhead_fraction": 0.001,
                     "gpu_peak_mb": 10000.0, "planner_gpu_mb": 14080.0, "full_tokens_per_second": 1e5,
                     "final_val_loss": 3.0, "per_phase": phases})
    table = mbench.format_table(rows, runs)
    assert "| m | drift-int8-park | predict | 4 | 500.0 |" in table
    assert "| 2000 | 0.20 | 1500 | 2400 | - |" in table          # Predict peak / plain DeepSpeed's Full peak
    assert "| 2400 | - | 2.0 / 1.0 / 0.5 |" in table              # ... its cudaMalloc / cudaFree / retries per step
    assert "| 11000 | 300 | - |" in table                          # (not counted: no figures)
    assert "| 10000 | 1.00 | 1500 | 11000 | 300 |" in table     # ... and the pinned allocator's peak
    assert "| - | 10000 | - | 14080 | - | 100,000 | 3.000 |" in table   # device use not derived yet
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows, "runs": runs, "table_markdown": table}))
    out = mbench.main(["--retable", str(path)])
    assert [r["gpu_device_used_mb"] for r in out["runs"]] == [12800.0, 12800.0]
    assert "| 10000 | 12800 | 14080 | 1.10 |" in out["table_markdown"]
    assert json.loads(path.read_text())["table_markdown"] == out["table_markdown"]
    with pytest.raises(SystemExit, match="--retable: no such file"):
        mbench.main(["--retable", str(tmp_path / "missing.json")])


def test_benchmark_scripts_print_tables_and_write_json(tmp_path):
    # benchmarks/host_path.py and benchmarks/profiler_cost.py, small (the README's figures use larger sizes).
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for script, args in (("host_path.py", ["--values", "70000", "--repeat", "1", "--dtypes", "int8"]),
                         ("profiler_cost.py", ["--records", "20"])):
        out = tmp_path / f"{script}.json"
        proc = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args, "--json", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(out.read_text())
        assert result["table_markdown"] in proc.stdout
    rows = json.loads((tmp_path / "host_path.py.json").read_text())["rows"]
    assert {r["part"] for r in rows} == {"capture", "fold", "velocity_update", "adam_update", "fold_from_state",
                                         "fold_from_state_cpp", "fold_cpp", "velocity_update_cpp",
                                         "shard_update_bf16", "shard_update_bf16_cpp", "commit_4_steps",
                                         "commit_4_steps_cpp"}
    assert all(r["over_cpu_adam"] > 0 for r in rows)   # each against DeepSpeed's CPU Adam step on as many values
    assert all(r["ms"] > 0 for r in rows)
    cost = json.loads((tmp_path / "profiler_cost.py.json").read_text())
    assert cost["records"] == 20 and cost["record_ms"] > 0


def test_memory_bench_times_deepspeeds_forward_backward_and_step_per_phase(tmp_path):
    """``--wall-clock``: the runs' ds_config turns on DeepSpeed's ``wall_clock_breakdown``, each run keeps the
    engine's per-phase timers, and a table gives forward, backward (own + reduction) and optimizer step beside the
    whole step: the forward and backward's own part are a share of it. Without the flag neither appears."""
    from ds_hybrid.memory import bench as mbench
    result = mbench.main(["--models", "gpt2-test", "--variants", "full", "drift-int8", "--steps", "10", "--wall-clock",
                          "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "m.json")])
    cfg = json.loads((tmp_path / "runs" / "gpt2-test-full" / "ds_config.json").read_text())
    assert cfg["wall_clock_breakdown"] is True
    runs = {r["run"]: r for r in result["runs"]}
    full = runs["full"]["wall_clock_ms"]["full"]
    # (plain DeepSpeed's first steps booked as the hybrid's Warmup is: max(2, 10 // 8) of them)
    assert full["steps"] == 8 and runs["full"]["wall_clock_ms"]["warmup"]["steps"] == 2
    assert all(full["mean_ms"][k] > 0 for k in ("fwd", "bwd", "bwd_inner", "step"))
    assert {"warmup", "predict"} <= set(runs["drift-int8"]["wall_clock_ms"])
    # Each run's steps in its record: which real steps were the slow ones (no allocator figures on a CPU)
    for r in runs.values():
        log = r["step_log"]
        assert [s[0] for s in log] == list(range(1, 11))
        assert {p: sum(s[1] == p for s in log) for p in r["steps_per_phase"]} == r["steps_per_phase"]
        assert all(s[2] > 0 for s in log) and all(s[4] is None and s[5] is None for s in log)
    table = result["table_markdown"]
    assert "| (forward + backward's own) / whole |" in table
    line = next(x for x in table.splitlines() if x.startswith("| gpt2-test | full | full | 8 |") and "(" in x)
    assert 0 < float(line.rstrip(" |").rsplit("|", 1)[1]) < 1.5
    plain = mbench.main(["--models", "gpt2-test", "--variants", "full", "--steps", "4", "--op-profile", "3:4",
                         "--out", str(tmp_path / "plain"), "--json", str(tmp_path / "p.json")])
    assert plain["runs"][0]["wall_clock_ms"] is None and "backward's own" not in plain["table_markdown"]
    # --op-profile: the runs' operators over those steps in their records (gpu_run.sh prof1b); none without it
    assert "op_profile" not in runs["full"]
    prof = plain["runs"][0]
    assert prof["op_profile_steps"] == [3, 4] and prof["op_profile"]["per_phase"]["full"]["steps"] == 2
    with pytest.raises(SystemExit, match="--op-profile: steps 3 to 5 must lie within 1..4"):
        mbench.main(["--models", "gpt2-test", "--variants", "full", "--steps", "4", "--op-profile", "3:5",
                     "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("preset", ["tiny-cpu", "1b-16gb", "7b-24gb", "7b-24gb-z2"])
def test_every_memory_bench_variant_is_a_valid_config_on_the_gpu_stages_presets(preset):
    """benchmarks/gpu_run.sh runs these on a lent GPU whose minutes are few: a variant that does not
    parse there would waste a stage."""
    from ds_hybrid.config import parse_hybrid_config
    from ds_hybrid.memory import bench as mbench
    for kind, variant in mbench.VARIANTS.items():
        if variant is not None:
            assert parse_hybrid_config(mbench.run_config(4, 12, variant, preset)).enabled, kind


def test_the_gpu_runs_tests_stage_runs_every_file_with_gpu_tests():
    """benchmarks/gpu_run.sh's ``tests`` stage names its test files: one with GPU-marked tests left
    out of the list would go unrun on the lent GPU."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    stage = (root / "benchmarks" / "gpu_run.sh").read_text().split("    tests)", 1)[1].split(";;", 1)[0]
    marked = {p.name for p in (root / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()}
    assert marked and {name for name in marked if f"tests/{name}" not in stage} == set()


def test_wall_clock_table_gives_a_gradient_predict_steps_own_forward_and_backward():
    """A gradient Predict step's forward and backward go around DeepSpeed's timers (zero there): the
    table's share is then its bookkeeping `gradient` time over the whole step, and says so."""
    from ds_hybrid.memory import bench as mbench
    zero = {k: 0.0 for k in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")}
    real = {"fwd": 10.0, "bwd": 25.0, "bwd_inner": 20.0, "bwd_allreduce": 5.0, "step": 40.0}
    runs = [{"model": "m", "run": "grad-device", "bookkeeping_ms": {"gradient": 30.0, "predicted_update": 2.0},
             "wall_clock_ms": {"full": {"steps": 4, "mean_ms": real}, "predict": {"steps": 9, "mean_ms": zero},
                               "checks": {"rolled_back": {"steps": 2, "mean_ms": dict(real, fwd=20.0, whole=100.0)}}}}]
    rows = [{"model": "m", "run": "grad-device", "phase": "full", "mean_step_ms": 80.0},
            {"model": "m", "run": "grad-device", "phase": "predict", "mean_step_ms": 40.0}]
    lines = mbench.wall_clock_table(rows, runs)
    assert any(x.startswith("| m | grad-device | full | 4 |") and x.endswith("| 80.0 | 0.38 |") for x in lines)
    assert any(x.startswith("| m | grad-device | predict | 9 |")
               and "| 0.75 (its own forward and backward: 30.0 ms, not DeepSpeed's timers) |" in x for x in lines)
    # The real steps that checked a run, by outcome, after the phases, with their own whole step
    assert lines[-1] == ("| m | grad-device | checked, rolled back | 2 | 20.0 | 25.0 (20.0 + 5.0) | 40.0 | 100.0 "
                         "| 0.40 |")
