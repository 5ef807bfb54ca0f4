"""ds_hybrid.step_profile: the operators a run's steps spend their time in, per phase
(``ds-hybrid train --op-profile``, ``memory-bench --op-profile``, ``gpu_run.sh prof1b``)."""
import json

import pytest
import torch

from ds_hybrid import step_profile, train
from spawn import main_job_args, write_corpus, write_eager_preset


def test_the_range_is_checked_naming_the_flag():
    assert step_profile.parse_range("3:5", 10) == (3, 5)
    with pytest.raises(SystemExit, match="--op-profile: expected FIRST:LAST"):
        step_profile.parse_range("3-5", 10)
    with pytest.raises(SystemExit, match=r"--op-profile: steps 4 to 12 must lie within 1..10"):
        step_profile.parse_range("4:12", 10)
    with pytest.raises(SystemExit, match="first <= last"):
        step_profile.parse_range("5:4", 10)


def test_each_step_is_booked_to_its_phase_per_step():
    """Two steps of one phase and one of another: calls and times are per step of their phase."""
    prof = step_profile.StepProfiler(1, 3, torch.device("cpu"))
    a = torch.randn(64, 64)
    for step, phase, mms in ((1, "full", 2), (2, "full", 2), (3, "predict", 1)):
        assert prof.wants(step)
        prof.start()
        for _ in range(mms):
            a @ a
        prof.stop(phase)
    assert not prof.wants(4)
    s = prof.summary()
    assert s["steps"] == [1, 3] and s["device"] == "cpu"
    full, predict = s["per_phase"]["full"], s["per_phase"]["predict"]
    assert full["steps"] == 2 and predict["steps"] == 1
    assert full["ops"]["aten::mm"]["calls"] == 2 and predict["ops"]["aten::mm"]["calls"] == 1
    assert full["ops"]["aten::mm"]["self_cpu_ms"] > 0 and full["ops"]["aten::mm"]["self_device_ms"] == 0
    assert full["step_ms"] > 0


def test_the_table_ranks_the_operators_by_what_a_run_adds_to_plain():
    def run(name, ops):
        return {"run": name, "op_profile": {"steps": [1, 2], "per_phase": {"full": {
            "steps": 2, "step_ms": 10.0, "ops": {k: {"calls": c, "self_cpu_ms": cpu, "self_device_ms": dev}
                                                 for k, (c, cpu, dev) in ops.items()}}}}}
    result = {"runs": [run("full", {"aten::mm": (4, 5.0, 2.0), "aten::add": (2, 1.0, 0.0)}),
                       run("fused", {"aten::mm": (4, 5.5, 2.0), "aten::add": (2, 1.0, 0.0),
                                     "cudaStreamSynchronize": (3, 9.0, 0.0)}),
                       {"run": "no-profile"}]}
    text = step_profile.table(result, "full", "full", top=2)
    lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert lines == ["| `cudaStreamSynchronize` | +3.0 | +9.00 | +0.00 |", "| `aten::mm` | +0.0 | +0.50 | +0.00 |"]
    assert "### fused against full" in text and "no-profile" not in text
    with pytest.raises(SystemExit, match="--against: no run 'plain'"):
        step_profile.table(result, "plain")
    with pytest.raises(SystemExit, match="--phase: run 'full' profiled no 'predict' step"):
        step_profile.table(result, "full", "predict")


def test_train_writes_the_profile_of_the_steps_asked_for(tmp_path):
    """ds-hybrid train --op-profile: the steps asked for, each booked to the phase it took; the
    summary and op_profile.json carry the same; a range past --steps is refused before training."""
    args = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 8)
    summary = train.main(args + ["--out", str(tmp_path / "o"), "--op-profile", "3:8"])
    prof = json.loads((tmp_path / "o" / "op_profile.json").read_text())
    assert prof == summary["op_profile"] and prof["steps"] == [3, 8]
    phases = [r["phase"] for r in map(json.loads, (tmp_path / "o" / "steps.jsonl").read_text().splitlines())][2:8]
    assert {p: phases.count(p) for p in set(phases)} == {p: v["steps"] for p, v in prof["per_phase"].items()}
    assert "predict" in prof["per_phase"]
    assert any(name.startswith("aten::") for name in prof["per_phase"]["warmup"]["ops"])
    with pytest.raises(SystemExit, match="--op-profile: steps 3 to 9 must lie within 1..8"):
        train.main(args + ["--out", str(tmp_path / "p"), "--op-profile", "3:9"])
