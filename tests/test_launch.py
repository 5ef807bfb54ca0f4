"""launch/*.sh: every script explains itself on -h, builds the launcher command it
documents from its arguments (checked with --dry-run), rejects bad arguments, and
cpu_ranks.sh really trains with two CPU ranks."""
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import free_port
from spawn import main_job_args, write_corpus, write_eager_preset

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
SCRIPTS = ["single_node.sh", "multi_node.sh", "cpu_ranks.sh", "torchrun.sh"]
VENV_BIN = ROOT / ".venv" / "bin"


def run(script: str, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def dry_run(script: str, *args: str, env: dict | None = None) -> list[str]:
    """The command the script would run, as an argument list (in a launcher-free environment
    unless ``env`` is given: the test process itself has MASTER_PORT set)."""
    done = run(script, "--dry-run", *args, env=_clean_env() if env is None else env)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def _clean_env() -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        env.pop(key, None)  # the launcher sets them for its ranks
    return env


def tool(name: str) -> str:
    """What the scripts call: the .venv's copy when there is one (there is, under launch/install.sh)."""
    return str(VENV_BIN / name) if (VENV_BIN / name).exists() else name


def test_every_launch_script_is_covered():
    assert sorted(p.name for p in LAUNCH.glob("*.sh")) == sorted(SCRIPTS + ["install.sh"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    for flag in ("-h", "--help"):
        done = run(script, flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: launch/{script}") and "--dry-run" in done.stdout
        assert "ds_hybrid.train" in done.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_arguments_are_rejected(script):
    missing = run(script)
    assert missing.returncode == 2 and "usage:" in missing.stderr
    unknown = run(script, "--no-such-option", "2")
    assert unknown.returncode == 2 and "unknown option '--no-such-option'" in unknown.stderr
    if script != "multi_node.sh":
        bad = run(script, "two")
        assert bad.returncode == 2 and "must be a positive integer (got 'two')" in bad.stderr


def test_single_node_command():
    cmd = dry_run("single_node.sh", "--master-port", "29611", "4", "--config", "tiny-cpu", "--steps", "10",
                  "--data", "my dir/with space")
    assert cmd == [tool("deepspeed"), "--num_gpus", "4", "--master_port", "29611", "--module", "ds_hybrid.train",
                   "--config", "tiny-cpu", "--steps", "10", "--data", "my dir/with space"]
    env = dict(_clean_env(), MASTER_PORT="29612")
    assert dry_run("single_node.sh", "1", env=env)[3:5] == ["--master_port", "29612"]


def test_cpu_ranks_command():
    env = dict(_clean_env(), OMP_NUM_THREADS="3")
    cmd = dry_run("cpu_ranks.sh", "--master-port", "29613", "2", "--steps", "8", env=env)
    assert cmd == ["env", "DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=3", tool("deepspeed"), "--num_gpus", "2",
                   "--master_port", "29613", "--module", "ds_hybrid.train", "--steps", "8"]
    cmd = dry_run("cpu_ranks.sh", "4")
    assert cmd[2] == f"OMP_NUM_THREADS={max(os.cpu_count() // 4, 1)}", "threads default to cores / ranks"
    assert cmd[6] == "--master_port" and 0 < int(cmd[7]) < 65536, "a free port is picked"


def test_torchrun_command():
    cmd = dry_run("torchrun.sh", "3", "--steps", "5", "--", "x")
    assert cmd == [tool("torchrun"), "--standalone", "--nproc_per_node", "3", "-m", "ds_hybrid.train",
                   "--steps", "5", "--", "x"]


def test_multi_node_command(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\n\nnode-a slots=8\nnode-b slots=8\n")
    cmd = dry_run("multi_node.sh", "--num-nodes", "2", "--gpus-per-node", "4", "--launcher", "openmpi",
                  str(hostfile), "--steps", "100")
    assert cmd == [tool("deepspeed"), "--hostfile", str(hostfile), "--master_addr", "node-a", "--master_port", "29500",
                   "--num_nodes", "2", "--num_gpus", "4", "--launcher", "openmpi", "--module", "ds_hybrid.train",
                   "--steps", "100"]
    cmd = dry_run("multi_node.sh", "--master-addr", "10.0.0.5", "--master-port", "29614", str(hostfile))
    assert cmd[3:7] == ["--master_addr", "10.0.0.5", "--master_port", "29614"]
    missing = run("multi_node.sh", str(tmp_path / "none"))
    assert missing.returncode == 2 and f"hostfile not found: {tmp_path / 'none'}" in missing.stderr
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    no_hosts = run("multi_node.sh", str(empty))
    assert no_hosts.returncode == 2 and f"hostfile {empty} lists no hosts" in no_hosts.stderr


@pytest.mark.slow
def test_two_cpu_ranks_end_together_on_a_setup_only_the_built_engine_refuses(tmp_path):
    """A ConfigError raised inside the engine's construction (the compact gradient state on the host
    path) ends both ranks as one input error naming the key: each rank refuses at the same point,
    so neither waits in a collective for the other (a hang would run into the timeout)."""
    args = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 4) + \
        ["--out", str(tmp_path / "run"), "--set", "predictor.direction=gradient",
         "--set", "memory.gradient_state_dtype=int4-factored"]
    done = run("cpu_ranks.sh", "--master-port", str(free_port()), "2", *args, env=_clean_env(), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    refusal = ("eager.json with --set: hybrid_predict.memory.gradient_state_dtype: int4-factored, but "
               "memory.offload_predict resolved to host")
    assert output.count(refusal) >= 2, output[-4000:]   # (each rank's own line)
    assert "Traceback" not in output and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["cpu_ranks.sh", "torchrun.sh"])
def test_two_cpu_ranks_really_train(script, tmp_path):
    """Two CPU ranks over gloo through the real launcher; rank 0 writes the outputs."""
    out = tmp_path / "run"
    args = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 8) + \
        ["--eval-every", "4", "--out", str(out), "--save-dir", str(tmp_path / "ckpt")]
    opts = ["--master-port", str(free_port())] if script == "cpu_ranks.sh" else []
    done = run(script, *opts, "2", *args, env=_clean_env(), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "2 rank(s), batch 4x1x2, 8 steps" in output and f"wrote {out / 'summary.json'}" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == 8 and summary["steps_done"] == 8
    assert len((out / "steps.jsonl").read_text().splitlines()) == 8
    assert {"warmup", "full", "predict"} <= {s for s, n in summary["statistics"]["steps_per_phase"].items() if n}
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step8"
    assert sorted(p.name for p in (tmp_path / "ckpt" / "global_step8").glob("hybrid_rank*.pt")) == \
        ["hybrid_rank0.pt", "hybrid_rank1.pt"]


def test_free_port_is_below_the_ephemeral_range_bindable_and_not_one_already_given(monkeypatch):
    import socket

    from ds_hybrid import dist_env
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = dist_env.free_port()
    assert 1024 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))   # (free as handed out)
        # a port held by a listener is never handed out; nor one in `taken`
        s.listen()
        for _ in range(50):
            assert dist_env.free_port({port + 1}) not in (port, port + 1)
    # nothing free below the range: the kernel's choice, still not one in `taken`
    monkeypatch.setattr(dist_env.random.SystemRandom, "randrange", lambda self, a, b: port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert dist_env.free_port() != port
