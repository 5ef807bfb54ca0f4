"""Checkpoints hold the whole training state: resuming gives the same following
losses, bit for bit, as a run never interrupted (crossing Warmup, a skipped step,
Predict, Correct and a rollback); the layout is atomic; DeepSpeed's universal
conversion keeps our state; the main job resumes with --resume."""
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from ds_hybrid import checkpoint as ckpt
from ds_hybrid import train
from ds_hybrid.engine import PredictiveEngine, default_loss
from ds_hybrid.phases import Phase
from engine_utils import EAGER, Batches, ds_config, full_params, make_engine, master_copies
from spawn import main_job_args, run_ranks, write_corpus, write_eager_preset

# Predict runs of 3 verified every 2nd step: the snapshot is older than the weights
# in the middle of a run, so a resume there needs the saved snapshot.
HYBRID = dict(EAGER, min_predict_steps=3, max_predict_steps=3, verify_every=2)
STEPS = 16
NAN_STEP = 5       # a real step whose loss is NaN: skipped
REJECT_STEP = 12   # a Predict verification forced to reject: rolls back steps 11-12
SAVE_AT = (5, 8, 11)
SETUPS = {"z0": dict(stage=0), "z1-gas2": dict(stage=1, gas=2), "z2-bf16": dict(stage=2, bf16=True),
          "z2-offload": dict(stage=2, offload_opt="cpu"), "z3": dict(stage=3),
          # The drift velocity is per-rank state too (int8: its stochastic rounding must replay),
          # and a save in the middle of a run with the moments parked must find them.
          "z1-drift-int8-parked": dict(stage=1, hybrid=dict(HYBRID, predictor={"direction": "drift"},
                                                            memory={"velocity_dtype": "int8",
                                                                    "park_optimizer_states": True})),
          "z3-drift": dict(stage=3, hybrid=dict(HYBRID, predictor={"direction": "drift"}))}


def noisy_loss(engine, batch):
    """The LM loss, with noise from Python's, NumPy's and torch's RNGs in real steps (so
    the gradients depend on every RNG state), a NaN at NAN_STEP, a spike at REJECT_STEP."""
    loss = default_loss(engine, batch)
    if torch.is_grad_enabled():
        if engine.global_steps + 1 == NAN_STEP:
            return loss * float("nan")
        noise = float(torch.rand(())) + random.random() + float(np.random.rand())
        return loss * (1 + 1e-3 * noise)
    if engine.phase is Phase.PREDICT and engine.global_steps == REJECT_STEP:
        return loss * 10
    return loss


def step_row(r) -> tuple:
    return r.step, r.phase, r.loss, r.rolled_back_steps, r.skipped, r.accepted, r.lr


def without_seconds(stats: dict) -> dict:
    timings = ("seconds_per_phase", "mean_step_seconds", "predictor_seconds", "predictor_cost_fraction",
               "bookkeeping_seconds")
    out = {k: v for k, v in stats.items() if k not in timings}
    if isinstance(out.get("predictor_details"), dict):
        out["predictor_details"] = {k: v for k, v in out["predictor_details"].items() if k != "seconds"}
    return out


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("name", list(SETUPS))
def test_resume_is_bit_exact(name, tmp_path):
    setup = dict(SETUPS[name])
    gas = setup.get("gas", 1)
    cfg = ds_config(**{"hybrid": HYBRID, **setup})
    seed_everything()
    engine = make_engine(cfg)
    batches = Batches()
    rows, saved_states = [], {}
    for step in range(1, STEPS + 1):
        rows.append(step_row(engine.train_step(batches.step(gas), loss_fn=noisy_loss)))
        if step in SAVE_AT:
            engine.save_checkpoint(tmp_path, f"s{step}")
            saved_states[step] = engine.hybrid_state_dict()
    # The run crossed what a resume must carry: a skipped step, Predict and Correct
    # phases, and a rollback right after a save made in the middle of a Predict run.
    assert [r[0] for r in rows if r[4]] == [NAN_STEP]
    assert {"predict", "correct"} <= {r[1] for r in rows}
    assert rows[REJECT_STEP - 1][3] == 2, "the forced rejection rolled back steps 11 and 12"
    assert saved_states[11]["controller"]["phase"] == "predict" and saved_states[11]["pending"] == 1

    for k in SAVE_AT:
        seed_everything(99)  # the resumed process starts from other RNG states: the load must restore them
        resumed = make_engine(cfg)
        path, client = resumed.load_checkpoint(tmp_path, f"s{k}")
        assert path is not None and ckpt.STATE_KEY not in client
        replay = Batches()
        for _ in range(k):  # the data stream's position: skip what was consumed
            replay.step(gas)
        after = [step_row(resumed.train_step(replay.step(gas), loss_fn=noisy_loss)) for _ in range(STEPS - k)]
        assert after == rows[k:], f"resumed at step {k}: the losses differ from the uninterrupted run"
        for a, b in zip(full_params(engine), full_params(resumed)):
            assert torch.equal(a, b)
        for a, b in zip(master_copies(engine), master_copies(resumed)):
            assert torch.equal(a, b)
        assert (resumed.global_steps, resumed.global_samples, resumed.micro_steps, resumed.skipped_steps) == \
            (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps)
        assert without_seconds(resumed.statistics()) == without_seconds(engine.statistics())
        assert resumed.predictor.state_dict() == engine.predictor.state_dict()


def test_layout_client_state_and_resave(tmp_path):
    engine = make_engine(ds_config(stage=2, hybrid=EAGER))
    b = Batches()
    for _ in range(4):
        engine.train_step(b.step())
    engine.save_checkpoint(tmp_path, "t", client_state={"mine": {"epoch": 3}})
    engine.train_step(b.step())
    engine.save_checkpoint(tmp_path, "t", client_state={"mine": {"epoch": 4}})  # re-save the same tag

    assert (tmp_path / "latest").read_text() == "t"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], "staging left behind"
    tag_dir = tmp_path / "t"
    manifest = json.loads((tag_dir / ckpt.MANIFEST_FILE).read_text())
    on_disk = {p.name for p in tag_dir.iterdir()} - {ckpt.MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk and "hybrid_rank0.pt" in on_disk
    assert manifest["global_steps"] == 5 and manifest["world_size"] == 1 and manifest["zero_stage"] == 2

    fresh = make_engine(ds_config(stage=2, hybrid=EAGER))
    _, client = fresh.load_checkpoint(tmp_path)  # tag None: the one 'latest' names
    assert client["mine"] == {"epoch": 4} and ckpt.STATE_KEY not in client
    assert fresh.global_steps == 5 and fresh.micro_steps == 5

    with pytest.raises(ValueError, match="reserved"):
        engine.save_checkpoint(tmp_path, "u", client_state={ckpt.STATE_KEY: 1})
    with pytest.raises(ValueError, match="plain folder name"):
        engine.save_checkpoint(tmp_path, "a/b")
    assert fresh.load_checkpoint(tmp_path / "empty") == (None, None)


def test_rng_states_round_trip():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state = ckpt.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    ckpt.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_disabled_engine_checkpoints_plain_state(tmp_path):
    """enabled: false keeps DeepSpeed's state plus micro_steps, statistics and RNG."""
    cfg = ds_config(stage=1, gas=2, hybrid={"enabled": False})
    engine = make_engine(cfg)
    b = Batches()
    for _ in range(3):
        engine.train_step(b.step(2))
    engine.save_checkpoint(tmp_path, "p")
    follow = [engine.train_step(b.step(2)).loss for _ in range(3)]
    fresh = make_engine(cfg)
    fresh.load_checkpoint(tmp_path, "p")
    replay = Batches()
    for _ in range(3):
        replay.step(2)
    assert fresh.micro_steps == 6
    assert [fresh.train_step(replay.step(2)).loss for _ in range(3)] == follow


@pytest.mark.slow
def test_universal_checkpoint_keeps_our_state(tmp_path, caplog):
    """2 ranks on ZeRO 2 save in the middle of a Predict run; ds_to_universal converts;
    1 rank on ZeRO 1 loads it with load_universal: weights, controller, predictor,
    pending steps, statistics and micro_steps all come through."""
    save_dir = tmp_path / "ckpt"
    ranks = run_ranks("multirank_worker.py", ["--stage", "2", "--steps", "7", "--save-dir", str(save_dir)], 2,
                      tmp_path)
    saved = ranks[0]["hybrid_state"]
    assert saved["controller"]["phase"] == "predict" and saved["controller"]["predict_index"] == 2
    convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                              "--input_folder", str(save_dir / "final"),
                              "--output_folder", str(save_dir / "final_universal"), "--inject_missing_state"],
                             capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stdout[-2000:] + convert.stderr[-2000:]

    cfg = ds_config(stage=1, hybrid=dict(EAGER, min_predict_steps=3, max_predict_steps=3),
                    checkpoint={"load_universal": True})
    engine = make_engine(cfg, seed=5)  # other initial weights: the load must replace them
    with caplog.at_level(logging.WARNING, logger="ds_hybrid"):
        engine.load_checkpoint(save_dir, "final_universal")
    # Per-rank files do not travel through the conversion; the loader says what that means.
    assert "no hybrid_rank0.pt" in caplog.text and "loaded weights become the last good point" in caplog.text
    loaded = {k: v for k, v in engine.hybrid_state_dict().items() if k != "difficulty"}  # (tensors: not JSON)
    assert json.loads(json.dumps(loaded)) == saved
    digest = hashlib.sha256(b"".join(p.float().numpy().tobytes() for p in full_params(engine)))
    assert digest.hexdigest() == ranks[0]["weights_sha256"], "the universal load changed the weights"
    assert engine.global_steps == 7 and engine.micro_steps == 7
    # Training goes on from the middle of the Predict run (snapshot retaken from the loaded weights).
    b = Batches(seed=3)
    results = [engine.train_step(b.step()) for _ in range(3)]
    assert [r.phase for r in results][:1] == ["predict"]
    assert all(r.loss is None or r.loss == r.loss for r in results)


def test_main_job_resume_matches_uninterrupted_run(tmp_path, monkeypatch):
    """train.main stopped by SIGINT after step 11 (mid-Predict-run), then --resume, gives
    the uninterrupted run's steps.jsonl losses and validation points exactly. (In one
    process; tests/test_faults.py does it across processes with a real Ctrl-C.)"""
    common = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 30) + ["--eval-every", "10"]
    save = ["--save-dir", str(tmp_path / "ckpt")]
    step_once = PredictiveEngine.train_step

    def interrupt_after_11(self, *args, **kwargs):
        result = step_once(self, *args, **kwargs)
        if self.global_steps == 11:
            os.kill(os.getpid(), signal.SIGINT)  # the real handler: stop at the step boundary
        return result

    monkeypatch.setattr(PredictiveEngine, "train_step", interrupt_after_11)
    first = train.main(common + save + ["--out", str(tmp_path / "a"), "--save-every", "5"])
    monkeypatch.setattr(PredictiveEngine, "train_step", step_once)
    assert first["interrupted"] and first["steps_done"] == 11
    assert first["checkpoint"].endswith("global_step11")
    resumed = train.main(common + save + ["--out", str(tmp_path / "a"), "--resume"])
    whole = train.main(common + ["--out", str(tmp_path / "b")])

    assert resumed["resumed_from"].endswith("global_step11") and not resumed["interrupted"]
    rows_a = [json.loads(line) for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "steps.jsonl").read_text().splitlines()]
    assert len(rows_a) == len(rows_b) == 30
    key = ("step", "phase", "loss", "rolled_back_steps", "skipped", "lr")
    assert [[r[k] for k in key] for r in rows_a] == [[r[k] for k in key] for r in rows_b]
    assert {r["phase"] for r in rows_b[11:]} >= {"predict", "correct"}
    assert resumed["val_points"] == whole["val_points"]
    assert without_seconds(resumed["statistics"]) == without_seconds(whole["statistics"])


def test_main_job_resume_rejects_other_run_settings(tmp_path):
    common = main_job_args(write_corpus(tmp_path), write_eager_preset(tmp_path), 3) + \
        ["--save-dir", str(tmp_path / "ckpt")]
    train.main(common + ["--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="--seed 1234"):
        train.main(common + ["--out", str(tmp_path / "o"), "--resume", "--seed", "7"])
    done = train.main(common + ["--out", str(tmp_path / "o"), "--resume"])  # already complete: nothing to run
    assert done["steps_done"] == 3 and done["resumed_from"].endswith("global_step3")


# ------------------------------------------------------------------ broken inputs (issue 17, first part)
@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage\x81", b"global_step5\nglobal_step6", b"../elsewhere",
                                     b"\x01\x02"])
def test_a_malformed_latest_is_one_error_naming_the_file(tmp_path, content):
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=str(tmp_path / "latest")):
        ckpt.read_latest(tmp_path, universal=False)


def test_save_and_load_of_empty_or_missing_folders_behave_as_deepspeed(tmp_path, monkeypatch, caplog):
    engine = make_engine(ds_config(stage=1, hybrid=HYBRID))
    engine.train_step(Batches().step())
    monkeypatch.chdir(tmp_path)
    for bad in (None, ""):
        with pytest.raises(ValueError, match="save_dir must be a non-empty string"):
            engine.save_checkpoint(bad)
    assert list(tmp_path.iterdir()) == [], "nothing written into the current directory"
    with caplog.at_level(logging.WARNING):
        assert engine.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    assert f"no checkpoint in {tmp_path / 'empty'}" in caplog.text
    assert engine.global_steps == 1


def test_latest_only_names_a_finite_state_and_a_nonfinite_one_will_not_load(tmp_path, caplog):
    engine = make_engine(ds_config(stage=1, hybrid=HYBRID))
    b = Batches()
    engine.train_step(b.step())
    engine.save_checkpoint(str(tmp_path), tag="good")
    with torch.no_grad():
        next(engine.module.parameters()).view(-1)[0] = float("nan")
    with caplog.at_level(logging.WARNING):
        engine.save_checkpoint(str(tmp_path), tag="bad")
    assert (tmp_path / "latest").read_text() == "good", "latest keeps naming the last good state"
    assert "keeps naming the last good checkpoint" in caplog.text and (tmp_path / "bad").is_dir()
    other = make_engine(ds_config(stage=1, hybrid=HYBRID))
    with pytest.raises(ckpt.CheckpointError, match=r"bad: holds non-finite weights"):
        other.load_checkpoint(str(tmp_path), tag="bad")
    path, _ = other.load_checkpoint(str(tmp_path))   # latest: the good one
    assert path is not None and "good" in path and ckpt.params_finite(other)


# ------------------------------------------------------------------ content digests (issue 17)
def _flip_bit(path, at=None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_digest_taken_while_writing_is_the_files(tmp_path):
    """HashingWriter: the XXH3-64 of the bytes torch.save wrote is that of the file on disk
    (zip and legacy formats, a tensor written in many 1 MiB pieces, the atomic rank-file path)."""
    import io
    import xxhash
    obj = {"big": torch.arange(3 << 20, dtype=torch.float32), "small": [1, 2.0, "x"]}   # 12 MiB of data
    for zip_format in (True, False):
        path = tmp_path / f"zip{zip_format}.pt"
        digest = ckpt.torch_save_hashed(obj, path, _use_new_zipfile_serialization=zip_format)
        assert digest == xxhash.xxh3_64(path.read_bytes()).hexdigest() == ckpt.digest_file(path)
        assert torch.equal(torch.load(path)["big"], obj["big"])
    path = tmp_path / "atomic.pt"
    assert ckpt.torch_save_atomic(obj, path) == ckpt.digest_file(path)
    with open(tmp_path / "holes.bin", "wb") as fh:   # a seek: the digest is not known without a read-back
        writer = ckpt.HashingWriter(fh)
        writer.write(b"abc")
        writer.seek(10, io.SEEK_CUR)
        writer.write(b"d")
    assert writer.hexdigest() is None


def test_a_save_hashes_its_files_while_writing_them(tmp_path, monkeypatch):
    """Every digest in the manifest is the file's, and no .pt file was read back to take it."""
    read_back = []
    real = ckpt.digest_file
    monkeypatch.setattr(ckpt, "digest_file", lambda p: read_back.append(p.name) or real(p))
    engine = make_engine(ds_config(stage=2, hybrid=EAGER))
    engine.train_step(Batches().step())
    engine.save_checkpoint(tmp_path, "t")
    files = json.loads((tmp_path / "t" / ckpt.MANIFEST_FILE).read_text())["files"]
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "hybrid_rank0.pt"} <= set(files)
    for rel, entry in files.items():
        assert entry[ckpt.DIGEST_KEY] == real(tmp_path / "t" / rel) and entry["rank"] == 0, rel
    assert not [n for n in read_back if n.endswith(".pt")], f"read back after the save: {read_back}"


def test_files_written_another_way_are_hashed_by_reading_them_back(tmp_path, monkeypatch):
    """A replaced checkpoint-engine save (or another engine) cannot be hashed while writing: its files
    are read back after the save, and a flipped bit in one still fails the load naming it."""
    read_back = []
    real = ckpt.digest_file
    monkeypatch.setattr(ckpt, "digest_file", lambda p: read_back.append(p.name) or real(p))
    cfg = ds_config(stage=2, hybrid=EAGER)
    engine = make_engine(cfg)
    engine.train_step(Batches().step())
    engine.checkpoint_engine.save = engine.checkpoint_engine.save   # an instance attribute: "replaced"
    engine.save_checkpoint(tmp_path, "t")
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(read_back)
    assert "hybrid_rank0.pt" not in read_back   # ours: still hashed while written
    make_engine(cfg).load_checkpoint(tmp_path, "t")
    victim = tmp_path / "t" / "mp_rank_00_model_states.pt"
    _flip_bit(victim)
    with pytest.raises(ckpt.CheckpointError) as err:
        make_engine(cfg).load_checkpoint(tmp_path, "t")
    assert all(part in str(err.value) for part in (str(victim), "rank 0 wrote", "XXH3-64")), str(err.value)


def test_an_old_crc32_manifest_still_loads_and_catches_a_flipped_bit(tmp_path):
    """Manifests saved before XXH3-64 hold "crc32": they are checked with CRC-32."""
    cfg = ds_config(stage=2, hybrid=EAGER)
    engine = make_engine(cfg)
    engine.train_step(Batches().step())
    engine.save_checkpoint(tmp_path, "t")
    tag_dir = tmp_path / "t"
    manifest = json.loads((tag_dir / ckpt.MANIFEST_FILE).read_text())
    for rel, entry in manifest["files"].items():   # what the earlier code wrote
        del entry[ckpt.DIGEST_KEY]
        entry["crc32"] = ckpt.crc32_file(tag_dir / rel)
    (tag_dir / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    path, _ = make_engine(cfg).load_checkpoint(tmp_path, "t")
    assert path is not None
    victim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _flip_bit(victim)
    with pytest.raises(ckpt.CheckpointError) as err:
        make_engine(cfg).load_checkpoint(tmp_path, "t")
    assert all(part in str(err.value) for part in (str(victim), "rank 0 wrote", "CRC-32")), str(err.value)
