"""Fault injection: each fault is injected for real and training must survive it; each
bad input must be rejected before training with a message naming what is wrong.

At the end of the module ONE summary, computed from what the tests observed, goes to
``runs/fault_summary.json`` and the pytest terminal: faults injected and survived,
bad inputs tried and rejected with the right message, steps lost (goal: zero).

Skipped-step semantics checked here (see PredictiveEngine._take_model_step): a NaN/Inf
in any rank's loss or gradients skips the optimizer update on every rank; the weights,
Adam state and LR schedule stay as they were, DeepSpeed's ``skipped_steps`` and our
``statistics()["skipped_steps"]`` count it, ``global_steps`` / ``global_samples`` /
``micro_steps`` advance (the batch was consumed), and the phase controller does not.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ds_hybrid
from ds_hybrid import checkpoint as ckpt
from ds_hybrid import train
from ds_hybrid.checkpoint import CheckpointError
from ds_hybrid.engine import default_loss
from ds_hybrid.models import build_model
from ds_hybrid.phases import Phase
from conftest import FAULT_SUMMARY_PATH as SUMMARY_PATH, free_port, xdist_worker
from engine_utils import EAGER, SEQ, Batches, ds_config, full_params, make_engine, master_copies
from spawn import HERE, main_job_args, rank_env, run_ranks, write_corpus, write_eager_preset

# (the README's pytest-xdist run keeps each module on one worker, --dist loadfile, so that the one
# LEDGER sees every test)

# --------------------------------------------------------------------------- the ledger

LEDGER: dict[str, list] = {"faults": [], "bad_inputs": [], "steps_lost": [], "updates_skipped": [],
                           "predict_steps_rolled_back": []}


def observe_fault(name: str, checks: dict[str, bool]) -> None:
    """Record a fault as survived when every check held, then fail the test on the first that did not."""
    failed = [k for k, ok in checks.items() if not ok]
    LEDGER["faults"].append({"fault": name, "survived": not failed, "failed_checks": failed})
    assert not failed, f"{name}: {failed}"


def observe_rejection(name: str, run, expected: list[str], exc=(SystemExit, CheckpointError)) -> str:
    """Run a bad input; it is rejected rightly when it raises one of ``exc`` (our clear errors,
    not a traceback from deep inside) with a message containing every expected part."""
    error = None
    try:
        run()
    except (Exception, SystemExit) as err:  # recorded either way; judged below
        error = err
    message = f"{type(error).__name__}: {error}" if error is not None else "(accepted: no error)"
    missing = [part for part in expected if part not in message]
    right = isinstance(error, exc) and not missing
    LEDGER["bad_inputs"].append({"input": name, "rejected_with_right_message": right, "message": message})
    assert right, f"{name}: expected {[e.__name__ for e in exc]} naming {expected}, got {message}"
    return message


@pytest.fixture(scope="module", autouse=True)
def fault_summary(request):
    """After the module: one summary, computed from LEDGER, to a JSON file and the terminal."""
    yield
    faults, bad = LEDGER["faults"], LEDGER["bad_inputs"]
    summary = {
        "faults_injected": len(faults),
        "faults_survived": sum(f["survived"] for f in faults),
        "bad_inputs_tried": len(bad),
        "bad_inputs_rejected_with_right_message": sum(b["rejected_with_right_message"] for b in bad),
        "steps_lost": sum(n for _, n in LEDGER["steps_lost"]),
        "steps_lost_by_fault": dict(LEDGER["steps_lost"]),
        "optimizer_updates_skipped": sum(LEDGER["updates_skipped"]),
        "predict_steps_rolled_back": sum(LEDGER["predict_steps_rolled_back"]),
        "faults": faults,
        "bad_inputs": bad,
    }
    line = (f"fault suite: {summary['faults_survived']}/{summary['faults_injected']} faults survived, "
            f"{summary['bad_inputs_rejected_with_right_message']}/{summary['bad_inputs_tried']} bad inputs rejected "
            f"with the right message, {summary['steps_lost']} steps lost, "
            f"{summary['optimizer_updates_skipped']} updates skipped, "
            f"{summary['predict_steps_rolled_back']} Predict steps rolled back -> {SUMMARY_PATH}")
    SUMMARY_PATH.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY_PATH.write_text(json.dumps(dict(summary, line=line), indent=2))
    if xdist_worker(request.config):   # (a worker's terminal is not shown: conftest prints the line)
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():  # to the terminal, not into the captured output
        reporter.write_line("")
        reporter.write_line(line)


# --------------------------------------------------------------------------- injected losses


def nan_loss(engine, batch):
    return default_loss(engine, batch) * float("nan")


def inf_loss(engine, batch):
    return default_loss(engine, batch) * float("inf")


def nan_gradient_loss(engine, batch):
    """A finite loss whose gradient is NaN: d/dz sqrt(z) at z = 0 is inf, times 0."""
    out = engine(**batch)
    z = out.logits.float().sum()
    return out.loss + 0.0 * torch.sqrt(z - z.detach())


# --------------------------------------------------------------------------- skipped real steps

SKIP_SETUPS = {
    "zero0-fp32": dict(stage=0),
    "zero0-bf16-fused": dict(stage=0, bf16=True),
    "zero1-gas2": dict(stage=1, gas=2),
    "zero1-bf16-optimizer": dict(stage=1, bf16=True, data_types={"grad_accum_dtype": "fp32"}),
    "zero2-bf16": dict(stage=2, bf16=True),
    "zero2-offload": dict(stage=2, offload_opt="cpu"),
    "zero3": dict(stage=3),
    "zero3-offload": dict(stage=3, offload_opt="cpu", offload_param="cpu"),
}


def adam_state(engine) -> list[torch.Tensor]:
    return [p.state[k].detach().clone() for p in engine._masters.partitions() for k in ("exp_avg", "exp_avg_sq")
            if k in p.state]


# A NaN loss on every setup (each optimizer wrapper DeepSpeed builds); Inf and a NaN
# gradient behind a finite loss on one setup per family.
SKIP_CASES = [("nan-loss", name) for name in SKIP_SETUPS] + \
    [(fault, name) for fault in ("inf-loss", "nan-gradient") for name in ("zero0-fp32", "zero2-bf16", "zero3")]


@pytest.mark.parametrize("fault, name", SKIP_CASES, ids=[f"{f}-{n}" for f, n in SKIP_CASES])
def test_nonfinite_real_step_is_skipped(fault, name):
    """The faulty step changes nothing but the counters, and the run afterwards is bit for
    bit the run that never saw the faulty batch."""
    setup = dict(SKIP_SETUPS[name])
    gas = setup.get("gas", 1)
    cfg = ds_config(hybrid=dict(EAGER, warmup_steps=100), **setup)  # hybrid on, still in Warmup
    faulty, clean = make_engine(cfg), make_engine(cfg)
    b_faulty, b_clean = Batches(), Batches()
    for _ in range(2):
        faulty.train_step(b_faulty.step(gas))
        clean.train_step(b_clean.step(gas))
    masters, moments, lr = master_copies(faulty), adam_state(faulty), faulty.get_lr()[0]
    counters = (faulty.global_steps, faulty.skipped_steps, faulty.micro_steps)
    controller = faulty.controller.state_dict()
    injected = {"nan-loss": nan_loss, "inf-loss": inf_loss, "nan-gradient": nan_gradient_loss}[fault]

    result = faulty.train_step(Batches(seed=9).step(gas), loss_fn=injected)

    checks = {
        "reported as skipped": result.skipped and result.backward_ran,
        "masters unchanged": all(torch.equal(a, c) for a, c in zip(masters, master_copies(faulty))),
        "Adam state unchanged": all(torch.equal(a, c) for a, c in zip(moments, adam_state(faulty))),
        "LR schedule not stepped": faulty.get_lr()[0] == lr,
        "counters": (faulty.global_steps, faulty.skipped_steps, faulty.micro_steps)
        == (counters[0] + 1, counters[1] + 1, counters[2] + gas),
        "statistics count it": faulty.statistics()["skipped_steps"] == 1,
        "phase controller did not advance": faulty.controller.state_dict() == controller,
    }
    later = [(faulty.train_step(b_faulty.step(gas)).loss, clean.train_step(b_clean.step(gas)).loss)
             for _ in range(3)]
    checks["later losses equal a run without the fault"] = all(a == c for a, c in later)
    checks["later weights equal a run without the fault"] = all(
        torch.equal(a, c) for a, c in zip(full_params(faulty), full_params(clean)))
    LEDGER["updates_skipped"].append(faulty.statistics()["skipped_steps"])
    observe_fault(f"{fault} in a real step ({name})", checks)


def test_skip_with_a_client_torch_optimizer_bf16():
    """ZeRO 0 + bf16 with a torch AdamW passed in: DeepSpeed's FP16_UnfusedOptimizer wrapper."""
    torch.manual_seed(0)
    model = build_model("gpt2-test", vocab_size=256, seq_len=SEQ)
    cfg = ds_config(stage=0, bf16=True, hybrid={"enabled": False})
    cfg.pop("optimizer")
    engine, *_ = ds_hybrid.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    b = Batches()
    engine.train_step(b.step())
    before = full_params(engine)
    result = engine.train_step(b.step(), loss_fn=nan_loss)
    after = full_params(engine)
    follow = engine.train_step(b.step())
    LEDGER["updates_skipped"].append(engine.statistics()["skipped_steps"])
    observe_fault("nan-loss in a real step (zero0-bf16, client torch AdamW)", {
        "wrapper is FP16_UnfusedOptimizer": type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer",
        "reported as skipped": result.skipped,
        "weights unchanged": all(torch.equal(a, c) for a, c in zip(before, after)),
        "next step finite and applied": math.isfinite(follow.loss) and not follow.skipped,
    })


def test_nonfinite_predict_verification_rolls_back():
    """A NaN or Inf loss seen by a Predict step's verification rolls the run back exactly,
    and training goes on with real steps."""
    hybrid = dict(EAGER, min_predict_steps=3, max_predict_steps=3, verify_every=3)
    for bad in (float("nan"), float("inf")):
        engine = make_engine(ds_config(stage=2, hybrid=hybrid))
        b = Batches()
        while engine.phase is not Phase.PREDICT:
            engine.train_step(b.step())
        weights, masters = full_params(engine), master_copies(engine)

        def verify_sees(eng, batch, bad=bad):
            loss = default_loss(eng, batch)
            return loss * bad if not torch.is_grad_enabled() else loss

        results = [engine.train_step(b.step(), loss_fn=verify_sees) for _ in range(3)]
        restored = (all(torch.equal(a, c) for a, c in zip(weights, full_params(engine))),
                    all(torch.equal(a, c) for a, c in zip(masters, master_copies(engine))))
        after = [engine.train_step(b.step()) for _ in range(2)]
        LEDGER["predict_steps_rolled_back"].append(results[-1].rolled_back_steps)
        observe_fault(f"{bad} loss in a Predict verification (zero2)", {
            "rolled back the 3 Predict steps": results[-1].rolled_back_steps == 3 and results[-1].accepted is False,
            "weights restored bit for bit": restored[0],
            "masters restored bit for bit": restored[1],
            "back to Full, training goes on": [r.phase for r in after] == ["full", "full"]
            and all(math.isfinite(r.loss) for r in after),
        })


def test_nonfinite_correct_step_is_skipped():
    engine = make_engine(ds_config(stage=1, hybrid=EAGER))
    b = Batches()
    while engine.phase is not Phase.CORRECT:
        engine.train_step(b.step())
    predictor = json.dumps(engine.predictor.state_dict())
    result = engine.train_step(b.step(), loss_fn=nan_loss)
    unchanged = json.dumps(engine.predictor.state_dict()) == predictor
    retry = engine.train_step(b.step())
    LEDGER["updates_skipped"].append(engine.statistics()["skipped_steps"])
    observe_fault("nan-loss in a Correct step (zero1)", {
        "skipped": result.skipped and result.phase == "correct",
        "predictor learned nothing from it": unchanged,
        "the Correct step is taken again": retry.phase == "correct" and not retry.skipped,
    })


# --------------------------------------------------------------------------- several ranks


@pytest.fixture(scope="module")
def two_rank_faults(tmp_path_factory):
    """2 gloo ranks on ZeRO 1; one rank at a time sees a NaN loss, a NaN gradient, a loss spike.
    They save a checkpoint at the end (used below as a wrong-world-size input)."""
    out = tmp_path_factory.mktemp("two_ranks")
    ranks = run_ranks("multirank_worker.py", ["--stage", "1", "--steps", "14", "--faults",
                                              "--save-dir", str(out / "ckpt")], 2, out)
    return ranks, out / "ckpt"


@pytest.mark.slow
def test_one_rank_faults_are_collective(two_rank_faults):
    ranks, _ = two_rank_faults
    r0, r1 = ranks
    col = lambda rep, key: [s[key] for s in rep["record"]]  # noqa: E731
    LEDGER["updates_skipped"].append(r0["statistics"]["skipped_steps"])
    LEDGER["predict_steps_rolled_back"].append(r0["statistics"]["predict_rolled_back"])
    observe_fault("NaN loss on rank 1, NaN gradient on rank 0, loss spike on rank 1 (2 ranks, zero1)", {
        "no hang (both ranks finished)": True,  # run_ranks fails the fixture on a timeout
        "both ranks skipped steps 2 and 3": [s["step"] for s in r0["record"] if s["skipped"]] == [2, 3]
        and col(r0, "skipped") == col(r1, "skipped"),
        "same phases": col(r0, "phase") == col(r1, "phase"),
        "rollback on both ranks": any(col(r0, "rolled_back")) and col(r0, "rolled_back") == col(r1, "rolled_back"),
        "same weights": r0["weights_sha256"] == r1["weights_sha256"],
    })
    observe_fault("save_checkpoint(None) and (\"\") on 2 ranks", {
        "ValueError on both ranks, then a good save (no hang)": all(
            len(r["bad_saves"]) == 2 and all("save_dir must be a non-empty string" in m for m in r["bad_saves"])
            for r in ranks),
    })


# --------------------------------------------------------------------------- killed in the middle of a save


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["deepspeed-files", "before-publish", "before-latest"])
def test_sigkill_during_save_leaves_previous_checkpoint(hold, tmp_path):
    """A worker killed (SIGKILL) at three points of a save: 'latest' still names the last
    complete checkpoint, it loads in a fresh process, and the next save succeeds."""
    save_dir = tmp_path / "ckpt"
    env = rank_env(0, 1, free_port())
    proc = subprocess.Popen([sys.executable, str(HERE / "save_kill_worker.py"), "--save-dir", str(save_dir),
                             "--hold", hold], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    saved: dict[str, int] = {}
    output = []
    deadline = time.monotonic() + 180
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("SAVED "):
                _, tag, steps = line.split()
                saved[tag] = int(steps)
            if line.startswith("HOLDING") or time.monotonic() > deadline:
                break
        proc.kill()  # SIGKILL, in the middle of saving step4
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the worker ended before it was killed:\n" + "".join(output)[-3000:]
    assert saved == {"step1": 1, "step2": 2, "step3": 3}
    latest_after_kill = (save_dir / "latest").read_text()
    step4_after_kill = (save_dir / "step4").is_dir()

    fresh = make_engine(ds_config(stage=2, hybrid=EAGER))
    load_path, _ = fresh.load_checkpoint(save_dir)  # whatever 'latest' names
    recovered = fresh.global_steps
    if step4_after_kill:  # renamed into place before the kill: it is complete
        complete = make_engine(ds_config(stage=2, hybrid=EAGER))
        complete.load_checkpoint(save_dir, "step4")
    r = fresh.train_step(Batches(seed=4).step())
    fresh.save_checkpoint(save_dir, "step4")  # a new save of the killed tag succeeds and cleans up
    lost = saved["step3"] - recovered  # steps of the last completed save that cannot be recovered
    LEDGER["steps_lost"].append((f"SIGKILL during save ({hold})", lost))
    observe_fault(f"SIGKILL during a save ({hold})", {
        "latest still names the last complete save": latest_after_kill == "step3",
        "the previous checkpoint loads": load_path is not None and recovered == 3,
        "no half-written tag folder": step4_after_kill == (hold == "before-latest")
        and (not step4_after_kill or complete.global_steps == 4),
        "training continues from it": math.isfinite(r.loss),
        "the next save publishes and cleans up": (save_dir / "latest").read_text() == "step4"
        and not any(p.name.startswith(".") for p in save_dir.iterdir()),
        "no steps lost": lost == 0,
    })


# --------------------------------------------------------------------------- Ctrl-C during ds-hybrid train


def _job(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a job of its own: train.py makes itself rank 0 of 1
    return subprocess.Popen([sys.executable, "-m", "ds_hybrid.cli", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(out: Path) -> list:
    return [(r["step"], r["phase"], r["loss"]) for r in map(json.loads, (out / "steps.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_sigint_stops_at_a_step_boundary_and_resume_is_exact(tmp_path):
    """Ctrl-C during `ds-hybrid train --save-dir D` stops at the next step boundary with a
    checkpoint; a new process resumes it; the losses equal an uninterrupted run's, bit for bit."""
    steps = 200
    common = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), steps)
    save = ["--save-dir", str(tmp_path / "ckpt")]
    # Validation on every step makes the interrupted run slow enough to be caught mid-way;
    # it reads the weights only, so it does not change the losses.
    job = _job(common + save + ["--save-every", "5", "--eval-every", "1", "--out", str(tmp_path / "a")], tmp_path)
    output = []
    for line in job.stdout:
        output.append(line)
        if line.startswith("saved checkpoint"):
            job.send_signal(signal.SIGINT)
            break
    rest, _ = job.communicate(timeout=300)
    output.append(rest)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    tag = (tmp_path / "ckpt" / "latest").read_text()
    manifest = json.loads((tmp_path / "ckpt" / tag / ckpt.MANIFEST_FILE).read_text())
    lost = summary["steps_done"] - manifest["global_steps"]
    LEDGER["steps_lost"].append(("SIGINT during training", lost))

    resumed = _job(common + save + ["--resume", "--eval-every", "50", "--out", str(tmp_path / "a")], tmp_path)
    whole = _job(common + ["--eval-every", "50", "--out", str(tmp_path / "b")], tmp_path)
    out_resumed, _ = resumed.communicate(timeout=300)
    out_whole, _ = whole.communicate(timeout=300)
    observe_fault("SIGINT during ds-hybrid train --save-dir", {
        "exit status 130": job.returncode == train.INTERRUPTED_EXIT_CODE,
        "stopped early at a step boundary": summary["interrupted"] and 5 <= summary["steps_done"] < steps
        and "stopped by SIGINT" in "".join(output),
        "checkpoint at the stop step": tag == f"global_step{summary['steps_done']}",
        "no steps lost": lost == 0,
        "resumed in a new process": resumed.returncode == 0 and f"resumed from {tmp_path / 'ckpt' / tag}" in out_resumed,
        "losses equal the uninterrupted run bit for bit": whole.returncode == 0
        and _losses(tmp_path / "a") == _losses(tmp_path / "b"),
    })


def test_sigterm_is_a_stop_request_too():
    """StopSignals turns SIGTERM (what launchers send) into the same step-boundary stop, and
    puts the previous handlers back."""
    before = signal.getsignal(signal.SIGTERM)
    with train.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        agreed = stop.agreed("cpu")
    observe_fault("SIGTERM during training", {
        "stop requested": stop.received == "SIGTERM" and agreed,
        "previous handler restored": signal.getsignal(signal.SIGTERM) is before,
    })


# --------------------------------------------------------------------------- bad inputs to the main job


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the main job builds a model: the input error must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the input error")
    monkeypatch.setattr("ds_hybrid.models.build_model", refuse)


def _main(args: list[str]):
    return lambda: train.main(args + ["--no-progress", "--no-plot"])


def test_bad_main_job_inputs_fail_before_training(tmp_path, no_model_built):
    empty_file = tmp_path / "empty.txt"
    empty_file.write_bytes(b"")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    short = tmp_path / "short.txt"
    short.write_text("tiny corpus")
    bad_key = tmp_path / "bad_key.json"
    bad_key.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "hybrid_predict": {"verify_evry": 2}}))
    not_json = tmp_path / "not_json.json"
    not_json.write_text("{ no")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    zenflow = tmp_path / "zenflow.json"
    zenflow.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                         "zenflow": {"topk_ratio": 0.1}},
                                   "hybrid_predict": {"enabled": True}}))
    zenflow_gas = tmp_path / "zenflow_gas.json"   # (each micro-batch would be a step of half the batch)
    zenflow_gas.write_text(json.dumps({**json.loads(zenflow.read_text()), "gradient_accumulation_steps": 2,
                                       "hybrid_predict": {"enabled": False}}))
    cases = [
        ("missing data path", ["--data", str(tmp_path / "nope")], ["--data", str(tmp_path / "nope")]),
        ("empty corpus file", ["--data", str(empty_file)], ["--data", "corpus is empty", str(empty_file)]),
        ("empty corpus directory", ["--data", str(empty_dir)], ["--data", str(empty_dir), "no readable text"]),
        ("corpus shorter than one sequence", ["--data", str(short), "--seq-len", "64"], ["--data", "seq_len"]),
        ("misspelt hybrid_predict key", ["--config", str(bad_key)], [str(bad_key), "hybrid_predict.verify_evry"]),
        ("config that is not JSON", ["--config", str(not_json)], [str(not_json), "not valid JSON"]),
        ("unknown preset", ["--config", "no-such-preset"], ["--config", "no-such-preset"]),
        ("zero steps", ["--steps", "0"], ["--steps"]),
        ("--save-every without --save-dir", ["--save-every", "5"], ["--save-every", "--save-dir"]),
        ("--resume without --save-dir", ["--resume"], ["--resume", "--save-dir"]),
        ("negative --save-every", ["--save-dir", str(tmp_path), "--save-every", "-1"], ["--save-every", "-1"]),
        ("--save-dir that is a file", ["--save-dir", str(a_file)], ["--save-dir", str(a_file)]),
        ("ZenFlow accumulating micro-batches", ["--config", str(zenflow_gas)],
         [str(zenflow_gas), "gradient_accumulation_steps: 2 under zero_optimization.zenflow"]),
        ("ZenFlow with hybrid_predict", ["--config", str(zenflow)], [str(zenflow), "zero_optimization.zenflow"]),
    ]
    for name, args, expected in cases:
        observe_rejection(name, _main(args), expected)


# --------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def saved(tmp_path):
    """A small ZeRO 2 checkpoint at tmp_path/ckpt/t and a config to load it with."""
    cfg = ds_config(stage=2, hybrid=EAGER)
    engine = make_engine(cfg)
    b = Batches()
    for _ in range(4):
        engine.train_step(b.step())
    engine.save_checkpoint(tmp_path / "ckpt", "t")
    return tmp_path / "ckpt", cfg


def _load(save_dir: Path, cfg: dict, tag: str | None = "t", verify: bool = True, **model):
    def run():
        if model:
            torch.manual_seed(0)
            m = build_model("gpt2-test", vocab_size=256, **model)
            engine, *_ = ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        else:
            engine = make_engine(cfg)
        engine.load_checkpoint(save_dir, tag, verify=verify)
    return run


def test_corrupt_checkpoints_are_rejected_naming_the_file(saved):
    save_dir, cfg = saved
    tag_dir = save_dir / "t"
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    optim_file = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    rank_file = tag_dir / "hybrid_rank0.pt"
    manifest = tag_dir / ckpt.MANIFEST_FILE
    originals = {p: p.read_bytes() for p in (model_file, optim_file, rank_file, manifest)}

    def damaged(path: Path, data: bytes | None, verify: bool = True):
        def run():
            if data is None:
                path.unlink()
            else:
                path.write_bytes(data)
            try:
                _load(save_dir, cfg, verify=verify)()
            finally:
                path.write_bytes(originals[path])
        return run

    half = lambda p: originals[p][: len(originals[p]) // 2]  # noqa: E731
    observe_rejection("truncated model-states file", damaged(model_file, half(model_file)), [str(model_file)])
    observe_rejection("truncated optimizer file", damaged(optim_file, half(optim_file)), [str(optim_file)])
    observe_rejection("garbage of the same size", damaged(optim_file, os.urandom(len(originals[optim_file]))),
                      [str(optim_file)])
    observe_rejection("missing per-rank file", damaged(rank_file, None), [str(rank_file), "missing"])
    observe_rejection("manifest that is not JSON", damaged(manifest, b"{"), [str(manifest), "manifest"])

    def flipped(p: Path) -> bytes:   # 4 KB of random bytes inside the file: same size, zip still complete
        data = bytearray(originals[p])
        at = len(data) // 3
        data[at:at + 4096] = os.urandom(min(4096, len(data) - at))
        return bytes(data)
    def bit_flipped(p: Path) -> bytes:   # one bit, in the middle of the file
        data = bytearray(originals[p])
        data[len(data) // 2] ^= 0x01
        return bytes(data)
    # model-states: DeepSpeed's weights and our shared hybrid state (client_state); per-rank: hybrid_rank0.pt
    for label, path in (("model-states", model_file), ("optimizer", optim_file), ("per-rank", rank_file)):
        observe_rejection(f"4 KB changed inside the {label} file (same size)", damaged(path, flipped(path)),
                          [str(path), "rank 0 wrote", "XXH3-64"])
        observe_rejection(f"one bit flipped in the {label} file", damaged(path, bit_flipped(path)),
                          [str(path), "rank 0 wrote", "XXH3-64"])
    manifest.unlink()
    observe_rejection("manifest deleted", _load(save_dir, cfg), [str(tag_dir), "no hybrid_manifest.json",
                                                                 "verify=False"])
    # Loaded unverified on request (as a plain DeepSpeed checkpoint), the zip check still names a bad file.
    observe_rejection("truncated file, no manifest, verify=False",
                      damaged(model_file, half(model_file), verify=False), [str(model_file)])
    _load(save_dir, cfg, verify=False)()
    manifest.write_bytes(originals[manifest])
    (save_dir / "latest").write_bytes(b"\xff\xfe garbage \x00")
    observe_rejection("garbage in latest", _load(save_dir, cfg, tag=None), [str(save_dir / "latest"), "unreadable"])
    (save_dir / "latest").write_text("gone")
    observe_rejection("latest naming a missing tag", _load(save_dir, cfg, tag=None),
                      [str(save_dir / "latest"), str(save_dir / "gone")])
    # The damaged loads above left the checkpoint itself intact.
    _load(save_dir, cfg)()


@pytest.mark.slow
def test_mismatched_checkpoints_are_rejected(saved, two_rank_faults):
    save_dir, cfg = saved
    manifest = str(save_dir / "t" / ckpt.MANIFEST_FILE)
    observe_rejection("checkpoint of another model", _load(save_dir, cfg, seq_len=2 * SEQ),
                      [manifest, "different model", "transformer.wpe.weight"])
    observe_rejection("checkpoint of another ZeRO stage", _load(save_dir, ds_config(stage=3, hybrid=EAGER)),
                      [manifest, "ZeRO stage 2", "stage 3"])
    _, two_rank_dir = two_rank_faults
    observe_rejection("checkpoint of another world size (2 ranks into 1)",
                      _load(two_rank_dir, ds_config(stage=1, hybrid=EAGER), tag="final"),
                      [str(two_rank_dir / "final" / ckpt.MANIFEST_FILE), "2 data-parallel rank", "ds_to_universal"])


@pytest.mark.slow
def test_bit_flips_on_two_ranks_name_the_file_and_the_rank_that_wrote_it(two_rank_faults, tmp_path):
    """The 2-rank checkpoint: one bit flipped in each of its files in turn (each rank's optimizer
    partition and per-rank state, rank 0's model states) fails the check with that file and its rank."""
    _, two_rank_dir = two_rank_faults
    tag_dir = tmp_path / "final"
    shutil.copytree(two_rank_dir / "final", tag_dir)
    files = json.loads((tag_dir / ckpt.MANIFEST_FILE).read_text())["files"]
    assert files["hybrid_rank1.pt"]["rank"] == 1 and files["zero_pp_rank_1_mp_rank_00_optim_states.pt"]["rank"] == 1
    for rel, entry in sorted(files.items()):
        path = tag_dir / rel
        original = path.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        try:
            observe_rejection(f"one bit flipped in {rel} (2 ranks, written by rank {entry['rank']})",
                              lambda: ckpt.verify_files(tag_dir), [str(path), f"rank {entry['rank']} wrote",
                                                                   "XXH3-64"])
        finally:
            path.write_bytes(original)
    ckpt.verify_files(tag_dir)   # and intact again


def test_resume_with_a_truncated_checkpoint_fails_before_training(tmp_path, monkeypatch):
    common = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 3) + \
        ["--save-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o")]
    train.main(common)
    model_file = tmp_path / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint error")

    monkeypatch.setattr("ds_hybrid.models.build_model", refuse)
    observe_rejection("--resume from a truncated checkpoint", _main(common + ["--resume"]),
                      ["--resume", str(model_file)])


def test_saves_of_nonfinite_states_and_bad_directories_lose_nothing(saved, tmp_path, monkeypatch):
    """`latest` only ever names a good state; None / "" directories fail before any rank writes; an
    empty folder loads nothing and says so (DeepSpeed's (None, None))."""
    save_dir, cfg = saved
    engine = make_engine(cfg)
    engine.load_checkpoint(save_dir, "t")
    with torch.no_grad():
        next(engine.module.parameters()).view(-1)[0] = float("nan")
    engine.save_checkpoint(save_dir, "nan")
    observe_fault("NaN weights at save time", {
        "latest still names the good state": (save_dir / "latest").read_text() == "t",
        "the NaN state is kept under its tag": (save_dir / "nan").is_dir(),
    })
    observe_rejection("resume from a NaN checkpoint", _load(save_dir, cfg, tag="nan"),
                      [str(save_dir / "nan"), "non-finite weights"])
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for bad in (None, ""):
        observe_rejection(f"save_checkpoint({bad!r})", lambda bad=bad: engine.save_checkpoint(bad),
                          ["save_dir must be a non-empty string"], exc=(ValueError,))
    empty = tmp_path / "empty"
    empty.mkdir()
    observe_fault("load_checkpoint of an empty folder", {
        "returns (None, None)": make_engine(cfg).load_checkpoint(empty) == (None, None),
        "nothing written by the bad saves": sorted(p.name for p in tmp_path.iterdir()) == before + ["empty"],
    })
