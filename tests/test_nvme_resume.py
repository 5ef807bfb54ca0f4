"""A run of ZeRO 3 with ``offload_optimizer: nvme`` saved by one process and resumed by a fresh one
(``ds_hybrid/nvme_resume.py``): DeepSpeed 0.19.8's load restores the masters but not the Adam
state; ds_hybrid's restores it, so the resumed run takes the saved run's steps bit for bit,
also from the middle of a drift or gradient Predict run, on one rank or two."""
import pytest
from ds_hybrid.checkpoint import CheckpointError
from engine_utils import NVME_AIO, Batches, aio_available, ds_config, make_engine
from spawn import run_ranks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")]


def _save_and_resume(tmp_path, *flags: str, world: int = 1) -> tuple:
    """Rank 0's reports of the save and the load (with ``world`` > 1: every rank's, saved then loaded)."""
    runs = []
    for role in ("save", "load"):
        (tmp_path / role).mkdir()
        runs.append(run_ranks("nvme_resume_worker.py", ["--role", role, "--ckpt", str(tmp_path / "ckpt"),
                                                        "--swap", str(tmp_path / f"swap-{role}"), *flags],
                              world, tmp_path / role))
    return (runs[0][0], runs[1][0]) if world == 1 else (runs[0], runs[1])


def test_a_fresh_process_resumes_the_masters_and_the_adam_state(tmp_path):
    saved, resumed = _save_and_resume(tmp_path)
    assert saved["adam_keys"] == resumed["adam_keys"] == [["exp_avg", "exp_avg_sq", "step"]] * 2
    assert resumed["record"] == saved["record"] and resumed["weights_sha256"] == saved["weights_sha256"]


def test_plain_deepspeed_resumes_the_masters_but_not_the_adam_state(tmp_path):
    """What nvme_resume.py mends, measured: the first step after DeepSpeed's own load has the saved
    run's loss (the masters are back), its Adam state is empty, and the next steps differ."""
    saved, resumed = _save_and_resume(tmp_path, "--plain")
    assert saved["adam_keys"] == [["exp_avg", "exp_avg_sq", "step"]] * 2 and resumed["adam_keys"] == [[], []]
    assert resumed["record"][0] == saved["record"][0] and resumed["record"][1:] != saved["record"][1:]


@pytest.mark.parametrize("direction, params", [("drift", "memory"), ("drift", "nvme"), ("gradient", "nvme")])
def test_a_fresh_process_resumes_a_run_from_its_middle(direction, params, tmp_path):
    """Saved one Predict step into a run on the device path: the resumed run finishes that run, is
    checked by the same real step and goes on, bit for bit. ``nvme``: the 16-bit weights on NVMe
    too (the 50b-24gb-nvme layout), where the drift run's step is added again through the drive and
    the gradient run's 16-bit partitions are written back from the checkpoint; SWAPPED_LLAMA's last
    optimizer sub-group is below DeepSpeed's smallest swappable tensor, so it stays in host memory
    and its masters and moments come from the ZeRO file."""
    saved, resumed = _save_and_resume(tmp_path, "--hybrid", "--after", "6",
                                      *(["--params-nvme"] if params == "nvme" else []),
                                      *(["--gradient"] if direction == "gradient" else []))
    assert saved["pending"] == resumed["pending"] == 1
    assert resumed["record"] == saved["record"] and resumed["weights_sha256"] == saved["weights_sha256"]
    assert "predict" in {s["phase"] for s in saved["record"]} and "full" in {s["phase"] for s in saved["record"]}


@pytest.mark.parametrize("direction", ["drift", "gradient"])
def test_two_ranks_resume_a_run_from_its_middle_each_from_its_own_files(direction, tmp_path):
    """Two gloo ranks, each with its own micro-batches, its ZeRO file and its folder of NVMe files
    (``offloaded_tensors/rank01`` for the second), the 16-bit weights on NVMe too: saved one
    Predict step into a drift or gradient run, resumed by two fresh processes, every rank takes its
    saved steps bit for bit and both take the same phases."""
    saved, resumed = _save_and_resume(tmp_path, "--hybrid", "--after", "6", "--params-nvme",
                                      *(["--gradient"] if direction == "gradient" else []), world=2)
    assert len(list((tmp_path / "ckpt" / "t" / "offloaded_tensors").iterdir())) == 2
    for s, r in zip(saved, resumed):
        assert s["pending"] == r["pending"] == 1
        assert s["adam_keys"] == r["adam_keys"] and r["record"] == s["record"]
        assert r["weights_sha256"] == s["weights_sha256"] == saved[0]["weights_sha256"]
    # (the same phases and the loss each reports, the ranks' mean)
    assert saved[0]["record"] == saved[1]["record"] and resumed[0]["record"] == resumed[1]["record"]


def test_a_load_into_other_parameter_ids_is_refused_naming_the_file(tmp_path):
    """A second engine in the same process numbers its parameters on from the first: DeepSpeed's copy
    of the NVMe files lands under the first's names and loads nothing; ds_hybrid refuses it."""
    cfg = ds_config(stage=3, offload_opt="nvme", nvme_path=str(tmp_path / "a"), **NVME_AIO)
    cfg["zero_optimization"]["sub_group_size"] = 420_000
    first, b = make_engine(cfg, model="gpt2-tiny"), Batches(seed=3)
    first.train_step(b.step())
    first.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "b")
    second = make_engine(cfg, model="gpt2-tiny", seed=1)
    with pytest.raises(CheckpointError, match=r"offloaded_tensors/rank00/\d+_\d+\.tensor\.swp: missing.*named for "
                                              "other parameter ids"):
        second.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
