"""The ``ds-hybrid`` command line follows DeepSpeed's habits: ``--deepspeed_config`` / ``--deepspeed``,
presets and models in ``--help``, one-line errors for bad input, no writes into the current directory or
the repository unless asked, ``--version``, help that states each default once, and a word about
DeepSpeed's op builds (and a build lock that an interrupted build left behind)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

import ds_hybrid
from ds_hybrid import arguments, attn_bench, cli, compare, kernel_bench, op_build, train
from ds_hybrid.memory import bench as mbench
from ds_hybrid.memory import planner

ROOT = Path(__file__).resolve().parent.parent
TEXT = "def add(a, b):\n    return a + b\n\n" * 400
T5 = {"model_type": "t5", "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "vocab_size": 256}


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):   # its own world of 1
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "ds_hybrid.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=300)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def exit_message(call) -> str:
    with pytest.raises(SystemExit) as err:
        call()
    message = str(err.value)
    assert message and "\n" not in message and "Traceback" not in message
    return message


# ------------------------------------------------------------ --deepspeed_config / --deepspeed
def test_train_takes_deepspeeds_config_flags_as_deepspeed_defines_them():
    import deepspeed
    argv = ["--deepspeed", "--deepspeed_config", "ds_config.json"]
    theirs, _ = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_known_args(argv)
    ours = train.build_parser().parse_args(argv)
    assert (ours.deepspeed, ours.deepspeed_config) == (theirs.deepspeed, theirs.deepspeed_config) == (True,
                                                                                                      "ds_config.json")
    assert train.build_parser().parse_args([]).deepspeed is False


def test_config_source_takes_either_flag_and_rejects_two_that_disagree(tmp_path):
    parse = train.build_parser().parse_args
    preset = arguments.PRESET_DIR / "tiny-cpu.json"
    other = tmp_path / "other.json"
    other.write_text(preset.read_text())
    assert train.config_source(parse([])) == "tiny-cpu"
    assert train.config_source(parse(["--deepspeed_config", str(other)])) == str(other)
    assert train.config_source(parse(["--config", "tiny-cpu", "--deepspeed_config", str(preset)])) == "tiny-cpu"
    message = exit_message(lambda: train.config_source(parse(["--config", "tiny-cpu", "--deepspeed_config",
                                                              str(other)])))
    assert "--config 'tiny-cpu' and --deepspeed_config" in message and str(other) in message
    message = exit_message(lambda: train.config_source(parse(["--config", "tiny-cpu", "--deepspeed_config",
                                                              "missing.json"])))
    assert message.startswith("--deepspeed_config: 'missing.json' is neither a file nor a preset")
    message = exit_message(lambda: train.main(["--deepspeed_config", str(tmp_path / "nope.json"), "--no-progress"]))
    assert message.startswith("--deepspeed_config: ")


def test_train_runs_from_deepspeed_config(corpus, tmp_path):
    cfg = json.loads((arguments.PRESET_DIR / "tiny-cpu.json").read_text())
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    summary = train.main(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json"), "--data", str(corpus),
                          "--model", "gpt2-test", "--steps", "2", "--seq-len", "16", "--eval-every", "2",
                          "--val-batches", "1", "--out", str(tmp_path / "run"), "--no-progress", "--no-plot",
                          "--no-memory-profile"])
    assert summary["config_file"] == str(tmp_path / "ds.json") and summary["steps_done"] == 2
    assert summary["args"]["config"] == str(tmp_path / "ds.json")   # what a --resume compares
    # the planner's estimate for the run, made before it, beside what it measured
    plan = summary["plan"]
    assert plan["fits"] and plan["accelerator"] == "cpu" and plan["gpu_bytes"] == 0 and plan["cpu_bytes"] > 0


def test_train_warns_first_when_the_planner_puts_the_run_over_the_machines_memory(corpus, tmp_path, monkeypatch,
                                                                                 capsys):
    """A host with 1 MiB by MemTotal: a warning with the figures before training, which still runs
    (an estimate is no reason to refuse); the summary keeps the estimate and the reason."""
    from ds_hybrid.memory import planner
    monkeypatch.setattr(planner, "host_memory_bytes", lambda *a: 2 ** 20)
    summary = train.main(["--data", str(corpus), "--model", "gpt2-test", "--steps", "2", "--seq-len", "16",
                          "--eval-every", "2", "--val-batches", "1", "--out", str(tmp_path / "run"), "--no-progress",
                          "--no-plot", "--no-memory-profile"])
    out = capsys.readouterr().out
    assert "WARNING: the memory planner puts this run over the machine's memory: CPU" in out
    assert "ds-hybrid plan --model gpt2-test" in out
    assert summary["steps_done"] == 2 and not summary["plan"]["fits"]
    assert summary["plan"]["cpu_mem_bytes"] == 2 ** 20 and summary["plan"]["reasons"][0].startswith("CPU ")


def test_a_setup_only_the_built_engine_refuses_ends_the_run_naming_the_key_without_a_traceback(corpus, tmp_path,
                                                                                                capsys):
    """The compact gradient state on the host path (on the CPU accelerator the gradient direction's
    auto is the host path): the planner says first that the engine will refuse it (its own rule, not
    an over-memory estimate), and the engine's ConfigError ends train as an input error naming the
    file, the --set and the key, before any step."""
    with pytest.raises(SystemExit) as err:
        train.main(["--data", str(corpus), "--model", "gpt2-test", "--steps", "2", "--seq-len", "16",
                    "--set", "predictor.direction=gradient", "--set", "memory.gradient_state_dtype=int4-factored",
                    "--out", str(tmp_path / "run"), "--no-progress", "--no-plot", "--no-memory-profile"])
    assert str(err.value).startswith(str(ROOT / "ds_configs" / "tiny-cpu.json") + " with --set: hybrid_predict."
                                     "memory.gradient_state_dtype: int4-factored, but memory.offload_predict "
                                     "resolved to host")
    out = capsys.readouterr().out
    assert ("WARNING: the memory planner expects the engine to refuse this run: hybrid_predict.memory."
            "gradient_state_dtype: int4-factored, but ") in out
    assert "puts this run over the machine's memory" not in out
    assert not (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------ --help and --version
def test_train_help_lists_presets_and_models():
    from ds_hybrid.models import known_models
    text = train.build_parser().format_help()
    for name in arguments.preset_names() + known_models():
        assert name in text, name
    assert set(arguments.preset_names()) >= {"tiny-cpu", "gpt2-124m"}
    assert "--deepspeed_config" in text


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help, joined over its wrapped lines."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current and line.startswith("      "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def help_of(main, capsys) -> str:
    with pytest.raises(SystemExit) as err:
        main(["--help"])
    assert err.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "plan", "memory-bench", "attn-bench", "kernel-bench"])
def test_help_states_each_default_once_and_no_repository_path(command, capsys):
    main = {"train": train.main, "plan": planner.main, "memory-bench": mbench.main, "attn-bench": attn_bench.main,
            "kernel-bench": kernel_bench.main}[command]
    text = help_of(main, capsys)
    blocks = option_blocks(text)
    assert len(blocks) > 3
    for flag, block in blocks.items():
        assert block.count("(default") <= 1, block
        assert "(default: None)" not in block and "(default: False)" not in block, block
        assert "docs/results" not in block, block   # the repository's results only where a flag names them
    if command == "train":
        assert "(default: 600)" in blocks["--steps"] and "(default: tiny-cpu)" in blocks["--config"]


def test_train_help_matches_the_readme():
    readme = (ROOT / "README.md").read_text()
    defaults = train.build_parser().parse_args([])
    assert f"for {defaults.steps} steps" in readme and "runs/train/summary.json" in readme
    assert defaults.out == "runs/train"
    assert f"{defaults.steps} steps" in cli.COMMANDS["train"] and "0.84M parameters" in cli.COMMANDS["train"]
    assert "0.84M parameters" in readme


def test_version(capsys):
    cli.main(["--version"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"ds-hybrid {ds_hybrid.__version__} (deepspeed {metadata.version('deepspeed')}, torch ")
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == line


# ------------------------------------------------------------ one-line errors
def test_unknown_model_and_a_model_that_is_not_a_causal_lm(tmp_path):
    message = exit_message(lambda: train.main(["--model", "gpt5-huge", "--no-progress"]))
    assert message.startswith("--model: unknown model 'gpt5-huge'") and "gpt2-tiny" in message
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps(T5))
    message = exit_message(lambda: train.main(["--model", str(t5), "--no-progress"]))
    assert message.startswith("--model: ") and "'t5' is not a causal language model" in message
    message = exit_message(lambda: planner.main(["--model", str(t5), "--gpu-mem", "24GB", "--cpu-mem", "64GB"]))
    assert "--model: " in message and "causal language model" in message
    message = exit_message(lambda: attn_bench.main(["--models", f"gpt2-test,{t5}", "--seq-lens", "16"]))
    assert message.startswith("--models: ") and "causal language model" in message
    message = exit_message(lambda: attn_bench.main(["--models", "gpt2-test", "--seq-lens", "16,lots"]))
    assert message.startswith("--seq-lens: expected comma-separated integers")


def test_bad_model_from_the_command_line_is_one_line_and_a_failure():
    done = run_cli("train", "--model", "gpt5-huge")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("--model: unknown model 'gpt5-huge'")


def test_compare_rejects_files_that_are_not_summaries(tmp_path):
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    other_json = tmp_path / "other.json"
    other_json.write_text(json.dumps({"rows": []}))
    message = exit_message(lambda: compare.main([str(not_json)]))
    assert message.startswith(f"compare: {not_json} is not a ds-hybrid train summary.json (not JSON")
    message = exit_message(lambda: compare.main([str(other_json)]))
    assert message.startswith(f"compare: {other_json} is not a ds-hybrid train summary.json (no args, ds_config")
    done = run_cli("compare", str(other_json))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip() == message


# ------------------------------------------------------------ where results go
def test_attn_bench_writes_under_runs_unless_told(tmp_path, monkeypatch):
    repo_result = ROOT / "docs" / "results" / "attention-cpu.json"
    before = repo_result.read_bytes() if repo_result.exists() else None
    monkeypatch.chdir(tmp_path)
    attn_bench.main(["--models", "gpt2-test", "--seq-lens", "16", "--batch", "1", "--repeat", "1", "--device", "cpu"])
    result = json.loads((tmp_path / "runs" / "attn-bench" / "attention-cpu.json").read_text())
    assert [r["seq_len"] for r in result["rows"]] == [16, 16]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert (repo_result.read_bytes() if repo_result.exists() else None) == before


def test_kernel_bench_writes_under_runs_unless_told(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_bench, "time_cpu", lambda fn, **k: (fn(), 1e-3)[1])
    monkeypatch.chdir(tmp_path)
    kernel_bench.main(["--cpu-reference", "--quick"])
    result = json.loads((tmp_path / "runs" / "kernel-bench" / "kernels-cpu-reference.json").read_text())
    assert result["kernels_run"] is False
    # the drift step's bytes: a bf16 shard read and written, an int8 velocity and a scale per 256 values
    assert [(r["velocity"], r["bytes"]) for r in result["drift_shift"]] == [("int8", 2 ** 18 * 5 + 4 * 2 ** 10),
                                                                           ("bf16", 2 ** 18 * 6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def _bench_summary() -> dict:
    """What a memory-bench training subprocess's summary.json holds, for a faked run."""
    phase = {"steps": 4, "rss_peak_mb": 900.0, "rss_peak_mean_mb": 890.0, "rss_mean_mb": 880.0,
             "step_time_mean_s": 0.01}
    return {"memory": {"baseline_rss_mb": 800.0, "phases": {"full": phase}, "setup_peak_rss_mb": 850.0,
                       "process_peak_rss_mb": 900.0, "overhead_fraction": 0.001, "overhead_us_per_step": 200.0,
                       "spikes": []},
            "parameters": 38_000, "statistics": {"steps_per_phase": {"full": 4}}, "host": {"accelerator": "cpu"}}


def test_memory_bench_writes_its_result_into_its_out_folder(tmp_path, monkeypatch):
    summary = _bench_summary()
    ran = []

    def fake_run(spec, kind, out, *rest):   # stands in for the training subprocess
        ran.append((spec.name, kind, out))
        out.mkdir(parents=True)
        return summary

    monkeypatch.setattr(mbench, "run_one", fake_run)
    repo_result = ROOT / "docs" / "results" / "memory-cpu.json"
    before = repo_result.read_bytes()
    monkeypatch.chdir(tmp_path)
    result = mbench.main(["--models", "gpt2-test", "--variants", "full", "--steps", "4"])
    assert ran == [("gpt2-test", "full", Path("runs/memory-bench/gpt2-test-full"))]
    written = json.loads((tmp_path / "runs" / "memory-bench" / "result.json").read_text())
    assert written["table_markdown"] == result["table_markdown"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert repo_result.read_bytes() == before
    message = exit_message(lambda: mbench.main(["--preset", "no-such-preset"]))
    assert message.startswith("--preset: 'no-such-preset' is neither a file nor a preset")


def test_memory_bench_keeps_going_past_a_failed_run_and_writes_after_every_run(tmp_path, monkeypatch):
    summary = _bench_summary()
    seen = []   # what the result file held when each run started

    def fake_run(spec, kind, out, *rest):
        jp = tmp_path / "r.json"
        seen.append(json.loads(jp.read_text()) if jp.is_file() else None)
        out.mkdir(parents=True)
        if kind == "adam":
            (out / "train.log").write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory\n")
            raise RuntimeError(f"memory-bench run {spec.name}/{kind} failed (exit 1); see {out / 'train.log'}")
        return summary

    monkeypatch.setattr(mbench, "run_one", fake_run)
    monkeypatch.chdir(tmp_path)
    message = exit_message(lambda: mbench.main(["--models", "gpt2-test", "--variants", "full", "adam", "drift-int8",
                                                "--steps", "4", "--json", "r.json"]))
    assert message.startswith("memory-bench: 1 run(s) failed: gpt2-test/adam")
    assert seen[0] is None
    assert [r["run"] for r in seen[1]["runs"]] == ["full"] and not seen[1]["complete"]
    assert [f["run"] for f in seen[2]["failed"]] == ["adam"]
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["complete"] and [r["run"] for r in written["runs"]] == ["full", "drift-int8"]
    assert written["failed"][0]["log_tail"][-1] == "torch.OutOfMemoryError: CUDA out of memory"


# ------------------------------------------------------------ DeepSpeed's op builds
TINY = json.loads((arguments.PRESET_DIR / "tiny-cpu.json").read_text())


def test_ops_each_config_makes_deepspeed_build():
    presets = {n: json.loads((arguments.PRESET_DIR / f"{n}.json").read_text()) for n in arguments.preset_names()}
    assert op_build.ops_for_config(TINY, "cpu") == ["deepspeed_shm_comm", "fused_adam"]
    assert op_build.ops_for_config(presets["gpt2-124m"], "cuda") == ["fused_adam"]
    assert op_build.ops_for_config(presets["1b-16gb"], "cuda") == ["cpu_adam"]
    assert op_build.ops_for_config(presets["50b-24gb-nvme"], "cuda") == ["cpu_adam", "async_io"]
    torch_adam = {**TINY, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert op_build.ops_for_config(torch_adam, "cuda") == []


def test_extensions_root_is_torchs(tmp_path, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(os, "makedirs", lambda *a, **k: None)   # torch's lookup would create the folder

    def torchs() -> Path:
        return Path(cpp_extension._get_build_directory("fused_adam", False)).parent

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert op_build.extensions_root() == torchs()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_build.extensions_root() == tmp_path == torchs()


def test_first_run_says_deepspeed_builds_its_ops(tmp_path):
    said = []
    assert op_build.check_op_builds(TINY, "cpu", said.append, root=tmp_path) == []
    assert said == [f"DeepSpeed builds its deepspeed_shm_comm, fused_adam ops for this machine now: a minute or two, "
                    f"once (kept in {tmp_path})"]
    for name in ("deepspeed_shm_comm", "fused_adam"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    said.clear()
    op_build.check_op_builds(TINY, "cpu", said.append, root=tmp_path)
    assert said == []


def test_a_stale_build_lock_is_named_with_what_to_delete(tmp_path):
    folder = tmp_path / "fused_adam"
    folder.mkdir()
    for name in ("fused_adam.so", "build.ninja", "lock"):
        (folder / name).write_bytes(b"")
        old = time.time() - 2 * op_build.STALE_AFTER_S
        os.utime(folder / name, (old, old))
    message = exit_message(lambda: op_build.check_op_builds(TINY, "cpu", print, root=tmp_path))
    assert str(folder / "lock") in message and f"rm {folder / 'lock'}" in message
    assert "op fused_adam; nothing in its folder changed for 20 min" in message


def test_a_live_build_lock_is_noted_and_watched(tmp_path):
    folder = tmp_path / "fused_adam"
    folder.mkdir()
    (folder / "fused_adam.so").write_bytes(b"")
    (folder / "lock").write_bytes(b"")   # just now: another process may be building
    said = []
    locks = op_build.check_op_builds(TINY, "cpu", said.append, root=tmp_path)
    assert [lock.path for lock in locks] == [folder / "lock"] and not locks[0].stale
    assert len(said) == 2 and f"lock {folder / 'lock'} exists: another process is building or loading fused_adam" \
        in said[1]
    said.clear()
    with op_build.watch_build_locks(locks, said.append, after_s=0.05):
        time.sleep(0.5)
    assert said == [f"still waiting on DeepSpeed's op build lock {folder / 'lock'} after 0 s; "
                    f"{locks[0].advice()}"]
    said.clear()
    (folder / "lock").unlink()
    with op_build.watch_build_locks(locks, said.append, after_s=0.05):
        time.sleep(0.2)
    assert said == []


def test_build_ops_names_a_bad_op_or_jobs(monkeypatch):
    message = exit_message(lambda: op_build.build_ops(["fused_adam", "nope"]))
    assert "unknown op nope" in message and all(name in message for name in op_build.BUILDERS)
    assert "--jobs must be at least 1, got 0" in exit_message(lambda: op_build.build_ops(["fused_adam"], jobs=0))
    assert "--config: 'missing.json' is neither a file nor a preset" in \
        exit_message(lambda: op_build.main(["--config", "missing.json"]))
    said = []
    monkeypatch.setattr(op_build, "build_ops", lambda names, jobs: said.append(names))
    op_build.main(["--config", "50b-24gb-nvme"])   # (a preset's name, as train takes it)
    from deepspeed.accelerator import get_accelerator
    cpu = get_accelerator().device_name() == "cpu"
    assert said == [[n for n in ["deepspeed_shm_comm"] * cpu + ["cpu_adam", "async_io"]
                     if n not in op_build.prebuilt_ops()]]


def test_build_ops_builds_each_op_in_a_process_of_its_own():
    """The host fold, built (or, built already, loaded) by its own process into this machine's
    extensions folder; the line it says."""
    said = []
    took = op_build.build_ops(["ds_hybrid_host_fold"], jobs=2, say=said.append)
    root = op_build.extensions_root()
    assert list(took) == ["ds_hybrid_host_fold"] and op_build.is_built(root / "ds_hybrid_host_fold",
                                                                          "ds_hybrid_host_fold")
    assert said == [f"ds_hybrid_host_fold: ready in {took['ds_hybrid_host_fold']:.0f} s"]


def test_a_failed_op_build_is_named_with_the_end_of_its_output(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")   # (the extensions folder is a file: the build cannot write there)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(blocker)}
    said = []
    message = exit_message(lambda: op_build.build_ops(["ds_hybrid_host_fold"], say=said.append, env=env))
    assert message.startswith("build-ops: the build of ds_hybrid_host_fold failed (HostKernelUnavailable: ") \
        and str(blocker) in message
    assert said[0].startswith("ds_hybrid_host_fold: failed in ") and "HostKernelUnavailable" in said[1]
    assert op_build.build_locks(["fused_adam"], root=blocker) == []   # (no lock under a file: none to name)


def test_an_op_build_stopped_by_sigterm_leaves_no_lock(tmp_path):
    """A build stopped mid-way (the test suite's background build at the session's end) releases
    torch's build lock, so no later run waits on it forever."""
    import signal
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = tmp_path / "ds_hybrid_host_fold" / "lock"
    proc = subprocess.Popen([sys.executable, "-m", "ds_hybrid.op_build", "--one", "ds_hybrid_host_fold"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not lock.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert lock.exists(), "the build never took its lock"
    os.killpg(proc.pid, signal.SIGTERM)   # (as conftest stops the suite's background build)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "op build of ds_hybrid_host_fold stopped by signal" in err
    assert not lock.exists() and not op_build.is_built(lock.parent, "ds_hybrid_host_fold")
    # and no compiler of it goes on (ninja runs each in a process group of its own, in the op's folder)
    time.sleep(0.5)
    left = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            left += [cwd.parent.name] if Path(os.readlink(cwd)).is_relative_to(tmp_path) else []
        except OSError:   # (a process that ended, or one not ours to read)
            pass
    assert left == []


def _stale_fused_adam_lock(tmp_path, monkeypatch):
    """An extensions folder (TORCH_EXTENSIONS_DIR) whose fused_adam build left a lock long ago."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    folder = tmp_path / "ext" / "fused_adam"
    folder.mkdir(parents=True)
    (folder / "lock").write_bytes(b"")
    old = time.time() - 2 * op_build.STALE_AFTER_S
    os.utime(folder / "lock", (old, old))
    return folder


def test_train_stops_on_a_stale_build_lock_before_building_anything(corpus, tmp_path, monkeypatch):
    folder = _stale_fused_adam_lock(tmp_path, monkeypatch)
    message = exit_message(lambda: train.main(["--data", str(corpus), "--model", "gpt2-test", "--steps", "2",
                                               "--out", str(tmp_path / "run"), "--no-progress"]))
    assert f"rm {folder / 'lock'}" in message
    assert not (tmp_path / "run").exists()


def test_initialize_names_a_stale_build_lock_instead_of_waiting_on_it(tmp_path, monkeypatch):
    """A script calling ds_hybrid.initialize directly gets the same error, before DeepSpeed starts
    building (which would wait on the lock forever)."""
    import ds_hybrid
    from ds_hybrid.models import build_model
    folder = _stale_fused_adam_lock(tmp_path, monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(RuntimeError, match=f"rm {folder / 'lock'}"):
        ds_hybrid.initialize(model=build_model("gpt2-test", vocab_size=256, seq_len=16), config=cfg)
