"""The main job end to end on a small corpus, and its input errors."""
import json
from pathlib import Path

import pytest
import torch

from ds_hybrid import train
from ds_hybrid.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("def add(a, b):\n    return a + b\n\n" * 400)


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.py").write_text(TEXT)
    (d / "b.txt").write_text(TEXT.upper())
    return d


def test_train_job_writes_summary_and_plot(corpus, tmp_path):
    out = tmp_path / "run"
    summary = train.main(["--data", str(corpus), "--steps", "40", "--seq-len", "32", "--eval-every", "20",
                          "--val-batches", "2", "--model", "gpt2-test", "--out", str(out), "--no-progress"])
    st = summary["statistics"]
    assert sum(st["steps_per_phase"].values()) == 40
    assert summary["global_steps"] == 40
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] == summary["final_val_loss"]
    assert len((out / "steps.jsonl").read_text().splitlines()) == 40
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s for s, _ in summary["val_points"]] == [0, 20, 40]
    assert summary["val_points"][-1][1] < summary["val_points"][0][1]  # it learned something


def test_baseline_flag_disables_prediction(corpus, tmp_path):
    summary = train.main(["--data", str(corpus), "--steps", "12", "--seq-len", "32", "--eval-every", "12",
                          "--val-batches", "1", "--model", "gpt2-test", "--out", str(tmp_path / "b"),
                          "--no-progress", "--no-plot", "--baseline"])
    assert summary["statistics"]["steps_per_phase"]["full"] == 12
    assert summary["statistics"]["backward_skipped"] == 0


def test_set_overrides_hybrid_keys(corpus, tmp_path, capsys):
    summary = train.main(["--data", str(corpus), "--steps", "30", "--seq-len", "32", "--eval-every", "30",
                          "--val-batches", "1", "--model", "gpt2-test", "--out", str(tmp_path / "d"),
                          "--no-progress", "--no-plot", "--set", "predictor.direction=drift",
                          "--set", "memory.velocity_dtype=\"int8\"", "--set", "warmup_steps=5"])
    assert "takes no Predict step" not in capsys.readouterr().out   # (the note reads the warmup --set gives)
    section = summary["ds_config"]["hybrid_predict"]
    assert section["predictor"]["direction"] == "drift" and section["memory"]["velocity_dtype"] == "int8"
    assert section["warmup_steps"] == 5
    assert summary["statistics"]["direction"] == "drift" and summary["statistics"]["velocity_bytes"] > 0


def test_bf16_on_a_cpu_below_avx512_gets_a_note():
    bf16 = {"bf16": {"enabled": True}}
    note = train.cpu_bf16_note(bf16, "cpu", "AVX2")
    assert "bf16.enabled" in note and "AVX2" in note and "bf16.enabled: false" in note
    assert train.cpu_bf16_note(bf16, "cpu", "NO AVX") is not None
    assert train.cpu_bf16_note(bf16, "cpu", "AVX512") is None          # (wide kernels: no note)
    assert train.cpu_bf16_note(bf16, "cpu", "SVE256") is None          # (an Arm CPU: not measured)
    assert train.cpu_bf16_note(bf16, "cuda", "AVX2") is None           # (the GPU does the arithmetic)
    assert train.cpu_bf16_note({"bf16": {"enabled": False}}, "cpu", "AVX2") is None
    assert train.cpu_bf16_note({}, "cpu", "AVX2") is None


def test_the_run_prints_the_bf16_note_and_trains_as_configured(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    cfg = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    cfg["bf16"] = {"enabled": True}
    (tmp_path / "bf16.json").write_text(json.dumps(cfg))
    summary = train.main(["--config", str(tmp_path / "bf16.json"), "--data", str(corpus), "--steps", "2",
                          "--seq-len", "32", "--eval-every", "2", "--val-batches", "1", "--model", "gpt2-test",
                          "--out", str(tmp_path / "r"), "--no-progress", "--no-plot", "--baseline"])
    assert "note: bf16.enabled on a CPU whose PyTorch kernels are AVX2" in capsys.readouterr().out
    assert summary["global_steps"] == 2 and summary["ds_config"]["bf16"]["enabled"]


def test_cpu_bf16_benchmark_times_both_precisions(tmp_path):
    # benchmarks/cpu_bf16.py, small: one step of each (the figures in docs/benchmarks.md use 20, 2 runs each)
    import subprocess
    import sys
    cfg = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    (tmp_path / "fp32.json").write_text(json.dumps(cfg))
    (tmp_path / "bf16.json").write_text(json.dumps(dict(cfg, bf16={"enabled": True})))
    script = [sys.executable, str(ROOT / "benchmarks" / "cpu_bf16.py"), "--model", "gpt2-test", "--steps", "1"]
    proc = subprocess.run([*script, "--config", str(tmp_path / "fp32.json")], capture_output=True, text=True)
    assert proc.returncode != 0 and "--config:" in proc.stderr and "bf16.enabled" in proc.stderr
    proc = subprocess.run([*script, "--config", str(tmp_path / "bf16.json"), "--reps", "1", "--json",
                           str(tmp_path / "out.json")], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["table_markdown"] in proc.stdout
    assert all(len(v) == 1 and v[0] > 0 for v in result["full_step_seconds"].values())
    assert result["bf16_over_fp32"] == result["full_step_seconds"]["bf16"][0] / result["full_step_seconds"]["fp32"][0]


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["--config", "no-such-preset"], "--config: 'no-such-preset'"),
    (["--steps", "0"], "--steps"),
    (["--set", "predictor.direction=sideways"], "--set: hybrid_predict.predictor.direction"),
    (["--set", "warmup_steps"], "--set: expected KEY=VALUE"),
    (["--set", "predictor.direction=adam", "--set", "memory.park_optimizer_states=true"],
     "memory.park_optimizer_states needs predictor.direction"),
    (["--gpu-mem-cap", "lots"], "--gpu-mem-cap: cannot read 'lots'"),
    (["--gpu-mem-cap", "0"], "--gpu-mem-cap: must be more than 0"),
    (["--pinned-round-mb", "-1"], "--pinned-round-mb: must be 0"),
    (["--profile-warmup", "-1"], "--profile-warmup: must be 0 or more"),
    pytest.param(["--gpu-mem-cap", "16GB"], "--gpu-mem-cap: needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_bad_input_fails_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        train.main(argv + ["--no-progress"])
    assert message in str(err.value)


def test_short_corpus_and_bad_config_key(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(SystemExit, match="seq_len"):
        train.main(["--data", str(short), "--no-progress"])
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {}},
                               "hybrid_predict": {"verify_evry": 2}}))
    with pytest.raises(SystemExit, match="hybrid_predict.verify_evry"):
        train.main(["--config", str(cfg), "--no-progress"])


@pytest.mark.parametrize("preset, change, key", [
    ("zenflow", [], "zero_optimization.zenflow"),
    ("zenflow-accumulating", ["--baseline"], "gradient_accumulation_steps: 8 under zero_optimization.zenflow")])
def test_a_config_the_engine_refuses_fails_before_deepspeed_builds_anything(preset, change, key, tmp_path,
                                                                             monkeypatch):
    """What initialize refuses from the ds_config alone (ZenFlow with the hybrid, ZenFlow with
    gradient accumulation even without it) is one of train's input errors,
    naming the file and the key, before an op build or a model (train says what DeepSpeed is about
    to build: not reached)."""
    from ds_hybrid import op_build
    cfg = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    cfg.setdefault("zero_optimization", {}).update(stage=2, offload_optimizer={"device": "cpu"},
                                                   zenflow={"topk_ratio": 0.1})
    if preset == "zenflow-accumulating":   # (refused with the hybrid off too: DeepSpeed would shrink the batch)
        cfg.update(gradient_accumulation_steps=8, train_micro_batch_size_per_gpu=4)
    path = tmp_path / f"{preset}.json"
    path.write_text(json.dumps(cfg))

    def reached(*_):
        raise AssertionError("train went on to the op builds")
    monkeypatch.setattr(op_build, "check_op_builds", reached)
    with pytest.raises(SystemExit, match=f"{path.name}: {key}") as err:
        train.main(["--config", str(path), *change, "--no-progress"])
    if preset == "zenflow-accumulating":
        assert "train_micro_batch_size_per_gpu 32" in str(err.value)


def test_cli_lists_commands_and_rejects_unknown(capsys):
    cli_main([])
    assert "train" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown command 'fly'"):
        cli_main(["fly"])


def test_save_model_then_init_starts_where_the_first_run_ended(corpus, tmp_path):
    """``--save-model`` / ``--init``: how the bench's cpu-finetune starts every run from one
    pre-trained model; a missing or mismatched file is an error naming ``--init``."""
    weights = tmp_path / "w" / "model.pt"
    common = ["--data", str(corpus), "--seq-len", "32", "--val-batches", "2", "--model", "gpt2-test", "--no-progress",
              "--no-plot", "--baseline"]
    first = train.main([*common, "--steps", "30", "--eval-every", "30", "--out", str(tmp_path / "a"),
                        "--save-model", str(weights)])
    second = train.main([*common, "--steps", "10", "--eval-every", "10", "--out", str(tmp_path / "b"),
                         "--init", str(weights)])
    # The second run's step-0 validation is the first run's final one: the same weights, the same batches.
    assert second["val_points"][0][1] == pytest.approx(first["final_val_loss"], rel=1e-6)
    with pytest.raises(SystemExit, match="--init: no such file"):
        train.main([*common, "--steps", "2", "--out", str(tmp_path / "c"), "--init", str(tmp_path / "none.pt")])
    with pytest.raises(SystemExit, match="--init: .* does not hold weights of this model"):
        train.main([*common, "--steps", "2", "--out", str(tmp_path / "d"), "--init", str(weights),
                    "--model", "llama-tiny"])


def test_zero3_builds_the_model_partitioned_with_its_own_initialisation(corpus, tmp_path):
    """ZeRO 3: the model is built under deepspeed.zero.Init through transformers (by default), so
    the full fp32 model never exists in host memory and GPT-2's own weight initialisation still
    runs (under a bare zero.Init its embeddings keep PyTorch's N(0, 1), and the first loss is far
    above ln 256); --init loads into the partitioned model; --zero-init below ZeRO 3 is refused."""
    from ds_hybrid.arguments import resolve_config
    from ds_hybrid.models import build_model, count_parameters
    cfg, _ = resolve_config("tiny-cpu")
    cfg["zero_optimization"] = {"stage": 3}
    z3 = tmp_path / "z3.json"
    z3.write_text(json.dumps(cfg))
    common = ["--data", str(corpus), "--seq-len", "32", "--val-batches", "2", "--model", "gpt2-test", "--no-progress",
              "--no-plot", "--config", str(z3), "--steps", "6", "--eval-every", "6"]
    weights = tmp_path / "model.pt"
    part = train.main([*common, "--out", str(tmp_path / "a"), "--save-model", str(weights)])
    whole = train.main([*common, "--out", str(tmp_path / "b"), "--no-zero-init"])
    assert part["zero_init"] is True and whole["zero_init"] is False
    assert part["parameters"] == whole["parameters"] == count_parameters(build_model("gpt2-test", 256, 32))
    # Different draws of the same initialisation: the first losses agree to well within their spread.
    assert part["val_points"][0][1] == pytest.approx(whole["val_points"][0][1], abs=0.05)
    assert part["val_points"][0][1] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)
    assert part["final_val_loss"] < part["val_points"][0][1]
    again = train.main([*common, "--out", str(tmp_path / "c"), "--init", str(weights)])
    assert again["val_points"][0][1] == pytest.approx(part["final_val_loss"], rel=1e-6)
    with pytest.raises(SystemExit, match="--zero-init: .* zero_optimization.stage 1"):
        train.main([*common[:-6], "--steps", "2", "--out", str(tmp_path / "d"), "--zero-init"])
