"""Several gloo ranks on every ZeRO stage: the same phase at every step, the same
weights at the end, every rank reading its own data, and no hang when only one
rank sees a NaN loss, a NaN gradient or a loss spike (every decision is collective).

The matrix covers each stage and both world sizes without the full product (CI-sized)."""
import pytest

from engine_utils import aio_available
from spawn import run_ranks

STEPS = 18
MATRIX = [(1, 4), (2, 2), (3, 2), (3, 4)]  # (ZeRO stage, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("stage, world", MATRIX, ids=[f"zero{s}-{w}ranks" for s, w in MATRIX])
def test_ranks_agree_and_survive_one_rank_faults(stage, world, tmp_path):
    ranks = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", str(STEPS), "--faults"], world,
                      tmp_path)
    first = ranks[0]
    columns = ("phase", "loss", "rolled_back", "skipped", "accepted", "lr")
    for r, other in enumerate(ranks[1:], start=1):
        for col in columns:
            assert [s[col] for s in other["record"]] == [s[col] for s in first["record"]], \
                f"rank {r} differs from rank 0 in '{col}'"
        assert other["weights_sha256"] == first["weights_sha256"], f"rank {r} ended with different weights"
        assert other["hybrid_state"]["controller"] == first["hybrid_state"]["controller"]
    for rep in ranks:
        assert rep["global_steps"] == STEPS and rep["micro_steps"] == STEPS

    record = first["record"]
    # The NaN loss on the last rank (step 2) and the NaN gradient on rank 0 (step 3)
    # skipped the update on every rank, and nothing else did.
    assert [s["step"] for s in record if s["skipped"]] == [2, 3]
    assert all(rep["deepspeed_skipped_steps"] == 2 and rep["statistics"]["skipped_steps"] == 2 for rep in ranks)
    assert record[1]["loss"] != record[1]["loss"], "the all-reduced loss of step 2 carries rank's NaN"
    assert record[2]["lr"] == record[1]["lr"] == record[0]["lr"], "a skipped step does not advance the LR schedule"
    # The spike only rank 1 saw rolled a Predict run back on every rank; training went on.
    phases = [s["phase"] for s in record]
    assert any(s["rolled_back"] > 0 for s in record)
    assert first["statistics"]["predict_accepted"] > 0 and "correct" in phases
    assert all(s["loss"] == s["loss"] for s in record[3:] if s["loss"] is not None), "NaN leaked past the skip"
    # Each rank read its own shard: at every step the ranks' batches all differ.
    for step in range(STEPS):
        digests = [d for rep in ranks for d in rep["record"][step]["batches"]]
        assert len(set(digests)) == len(digests), f"two ranks read the same batch at step {step + 1}"


@pytest.mark.slow
def test_ranks_agree_with_the_rssm_predictor(tmp_path):
    """The dynamics model (its training, exploration, bandit and monitor) sees only shared
    values, and rank 0's decisions, scales and verdicts are broadcast: every rank takes
    the same phases and ends with the same weights."""
    ranks = run_ranks("multirank_worker.py", ["--stage", "2", "--steps", "30", "--predictor", "rssm"], 2, tmp_path)
    first, other = ranks
    for col in ("phase", "loss", "rolled_back", "accepted", "lr"):
        assert [s[col] for s in other["record"]] == [s[col] for s in first["record"]], f"ranks differ in '{col}'"
    assert other["weights_sha256"] == first["weights_sha256"]
    assert "predict" in [s["phase"] for s in first["record"]]


@pytest.mark.slow
def test_bf16_shards_written_by_the_update_are_gathered_like_deepspeeds_copy(tmp_path):
    """ZeRO 2, bf16, 2 ranks: each rank's predicted update writes its own bf16 shard and
    propagate only all-gathers. The weights must equal those of DeepSpeed's copy-then-gather."""
    args = ["--stage", "2", "--steps", "14", "--bf16"]
    (tmp_path / "fused").mkdir()
    (tmp_path / "copying").mkdir()
    fused = run_ranks("multirank_worker.py", args, 2, tmp_path / "fused")
    copying = run_ranks("multirank_worker.py", args + ["--copy-lp"], 2, tmp_path / "copying")
    predicted = sum(s["phase"] == "predict" for s in fused[0]["record"])
    assert predicted > 0
    assert [r["lp_written_propagations"] for r in fused] == [predicted] * 2
    assert [r["lp_written_propagations"] for r in copying] == [0, 0]
    assert fused[0]["record"] == copying[0]["record"]
    assert {r["weights_sha256"] for r in fused + copying} == {fused[0]["weights_sha256"]}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_device_side_predict_under_offload_agrees_with_the_host_path(stage, tmp_path):
    """offload_optimizer: cpu, 2 ranks: Predict runs that write each rank's 16-bit partition and
    all-gather (memory.offload_predict: device) take the same phases, losses and rollbacks as the
    host path, and every rank of both ends with the same weights. Rank 1's spike at the second
    check of a run rolls it back on both ranks."""
    runs = {}
    for where in ("host", "device"):   # both fold the velocity from the pre-step copy: comparable bit for bit
        (tmp_path / where).mkdir()
        runs[where] = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults",
                                                        "--offload-predict", where], 2, tmp_path / where)
    # The device path as it ships (the fold read back from the Adam state): its ranks agree with each other.
    (tmp_path / "auto").mkdir()
    auto = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults", "--offload-predict",
                                             "device", "--fold-source", "auto"], 2, tmp_path / "auto")
    assert auto[0]["statistics"]["fold_source"] == "optimizer_state" and auto[0]["statistics"]["snapshot_bytes"] == 0
    assert [s["phase"] for s in auto[1]["record"]] == [s["phase"] for s in auto[0]["record"]]
    assert [s["loss"] for s in auto[1]["record"]] == [s["loss"] for s in auto[0]["record"]]
    assert auto[0]["weights_sha256"] == auto[1]["weights_sha256"]
    assert auto[0]["statistics"]["predict_accepted"] > 0
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped")
    host0 = runs["host"][0]["record"]
    for where, ranks in runs.items():
        for rep in ranks:
            assert [tuple(s[c] for c in cols) for s in rep["record"]] == [tuple(s[c] for c in cols) for s in host0], \
                f"{where} rank differs from the host path's rank 0"
            assert rep["statistics"]["offload_predict"] == where
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1
    stats = {where: ranks[0]["statistics"] for where, ranks in runs.items()}
    for key in ("predict_rolled_back", "predict_accepted"):
        assert stats["device"][key] == stats["host"][key] > 0, key


@pytest.mark.slow
@pytest.mark.parametrize("during", ["true", "false"])
def test_fold_behind_the_next_step_keeps_the_ranks_together(during, tmp_path):
    """memory.fold_overlap, 2 ranks, ZeRO 2 under offload with the device path: each rank folds on
    its own thread and the direction statistics reach the predictor a real step late on every
    rank alike, so the phases, losses, rollbacks and weights stay the same on both, through the
    skipped NaN steps (a joined fold's statistics wait for the next applied step) and rank 1's
    rejected run. ``during``: memory.fold_during_run (each rank's run holds its own copy of its
    velocity partition while its fold runs)."""
    ranks = run_ranks("multirank_worker.py", ["--stage", "2", "--steps", "16", "--faults", "--offload-predict",
                                              "device", "--fold-source", "auto", "--fold-overlap",
                                              "--fold-during-run", during], 2, tmp_path)
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped")
    assert [tuple(s[c] for c in cols) for s in ranks[1]["record"]] == \
        [tuple(s[c] for c in cols) for s in ranks[0]["record"]]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    st = ranks[0]["statistics"]
    assert st["fold_overlap"] is True and st["fold_background_seconds"] > 0
    assert st["fold_during_run"] is (during == "true")
    assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0 and st["skipped_steps"] == 2


def _made(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.slow
def test_fold_in_step_keeps_the_ranks_together_and_equals_the_inline_fold(tmp_path):
    """memory.fold_in_step, 2 ranks, ZeRO 2 under offload with the device path: each rank folds its
    partition, and commits kept runs into it, inside its CPU Adam step; through the skipped NaN
    steps (a taken commit added without a step) and rank 1's rejected run, both ranks take the
    same steps, and the same as the inline fold (from a snapshot of the masters before the step: the
    displacement the fold in the step keeps block by block) and commit, bit for bit."""
    runs = {}
    for in_step, source in (("true", "auto"), ("false", "snapshot")):
        runs[in_step] = run_ranks("multirank_worker.py", ["--stage", "2", "--steps", "16", "--faults",
                                                          "--offload-predict", "device", "--fold-source", source,
                                                          "--fold-in-step", in_step], 2, _made(tmp_path / in_step))
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped")
    records = {tuple(tuple(s[c] for c in cols) for s in rep["record"]) for ranks in runs.values() for rep in ranks}
    assert len(records) == 1
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1
    st = runs["true"][0]["statistics"]
    assert st["fold_in_step"] is True and runs["false"][0]["statistics"]["fold_in_step"] is False
    assert st["bookkeeping_seconds"].get("fold_in_step", 0) > 0 and st["bookkeeping_seconds"].get("commit_in_step", 0) > 0
    assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0 and st["skipped_steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_the_shard_fold_keeps_the_ranks_together(stage, tmp_path):
    """memory.fold_source: weights16, 2 ranks under offload with bf16 weights: each rank folds its
    own 16-bit shard's difference into the velocity beside it, and leaves out the real step that
    commits a kept run, on every rank alike: the same phases, losses, rollbacks and weights on
    both, through the skipped NaN steps and rank 1's rejected run."""
    ranks = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults", "--bf16",
                                              "--offload-predict", "device", "--fold-source", "weights16"], 2, tmp_path)
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped")
    assert [tuple(s[c] for c in cols) for s in ranks[1]["record"]] == \
        [tuple(s[c] for c in cols) for s in ranks[0]["record"]]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    st = ranks[0]["statistics"]
    assert st["fold_source"] == "weights16" and st["snapshot_bytes"] == 0
    assert st["shard_folds"] == ranks[1]["statistics"]["shard_folds"]
    assert st["shard_folds"]["folded"] > 0 and st["shard_folds"]["skipped"] > 0
    assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0 and st["skipped_steps"] == 2


def _cpu_and_nvme_runs(tmp_path, args) -> dict:
    """The worker on 2 ranks with ``args("cpu")`` and with ``args("nvme")``, each in its own folder;
    every rank of both took the same steps (``_runs_alike``)."""
    runs = {}
    for where in ("cpu", "nvme"):
        (tmp_path / where).mkdir()
        runs[where] = run_ranks("multirank_worker.py", args(where), 2, tmp_path / where)
    _runs_alike(runs, "cpu")
    return runs


def _runs_alike(runs: dict, ref: str) -> None:
    """Every rank of every run took the steps of ``ref``'s rank 0: phases, losses and checks."""
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped", "checked")
    want = [tuple(s[c] for c in cols) for s in runs[ref][0]["record"]]
    for name, ranks in runs.items():
        for rep in ranks:
            assert [tuple(s[c] for c in cols) for s in rep["record"]] == want, f"{name} differs from {ref} rank 0"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_predict_under_offload_keeps_the_ranks_together_on_both_paths(stage, tmp_path):
    """predictor.direction: gradient, ZeRO 2 or 3 with offload_optimizer: cpu, 2 ranks: each Predict
    step's private gradient is all-reduced by ds_hybrid itself (on ZeRO 3 a parameter at a time
    as the backward produces it, each rank keeping its share), so both ranks take the same
    steps; rank 0's NaN loss in the first Predict step moves nothing on either rank, and rank 1's
    spike at the second check rolls the run back on both. The device path (the run beside the
    16-bit partitions, the masters untouched until the check) ends bit for bit where the host
    path does (fp32 weights: the same arithmetic)."""
    runs = {}
    for where in ("host", "device"):
        (tmp_path / where).mkdir()
        runs[where] = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults",
                                                        "--offload-predict", where, "--direction", "gradient"],
                                2, tmp_path / where)
    _runs_alike(runs, "host")
    for where, ranks in runs.items():
        for rep in ranks:
            st = rep["statistics"]
            assert st["offload_predict"] == where and st["gradient_nonfinite_steps"] == 1
            assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0 and st["skipped_steps"] == 2
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("state", ["auto", "int8-factored"])
def test_gradient_predict_with_the_optimizer_on_nvme_keeps_the_ranks_together(state, tmp_path):
    """predictor.direction: gradient on the device path, ZeRO 3 with offload_optimizer: nvme, 2
    ranks (gpt2-tiny: each rank's partition, one sub-group, really is swapped): the same steps,
    losses and weights on both ranks, bit for bit those of offload_optimizer: cpu, through rank 0's
    NaN Predict gradient and rank 1's spike that rolls a run back on both. Under NVMe each run's
    state is made inside the real step before it (memory.gradient_prefetch; the compact state's
    sums shared after that step on both ranks)."""
    runs = _cpu_and_nvme_runs(tmp_path, lambda where: [
        "--stage", "3", "--steps", "16", "--faults", "--tiny", "--offload-predict", "device", "--direction", "gradient",
        "--gradient-state-dtype", state, *(["--nvme", str(tmp_path / "swap")] if where == "nvme" else [])])
    for where, ranks in runs.items():
        for rep in ranks:
            st = rep["statistics"]
            assert st["offload_predict"] == "device" and st["gradient_nonfinite_steps"] == 1
            assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
            assert rep["swapped_sub_groups"] == ([True] if where == "nvme" else [])
            assert (st["gradient_prefetched_runs"] > 0) is (where == "nvme")
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_drift_with_the_optimizer_on_nvme_folds_inside_the_step_on_every_rank(tmp_path):
    """predictor.direction: drift on the device path, ZeRO 3 with offload_optimizer: nvme, 2 ranks,
    with the faults: each rank folds its own sub-group inside DeepSpeed's step (memory.fold_in_step,
    swap_fold.py) and the direction statistics are shared after it, so both ranks take the same
    steps, bit for bit those of offload_optimizer: cpu with the fold after the step."""
    runs = _cpu_and_nvme_runs(tmp_path, lambda where: [
        "--stage", "3", "--steps", "16", "--faults", "--tiny", "--offload-predict", "device", "--direction", "drift",
        *(["--nvme", str(tmp_path / "swap"), "--fold-in-step", "true"] if where == "nvme" else
          ["--fold-in-step", "false"])])
    for where, ranks in runs.items():
        for rep in ranks:
            st = rep["statistics"]
            assert st["offload_predict"] == "device" and st["fold_in_step"] is (where == "nvme")
            assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
            assert rep["swapped_sub_groups"] == ([True] if where == "nvme" else [])
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
@pytest.mark.parametrize("direction", ["drift", "gradient"])
def test_the_weights_on_nvme_take_the_same_steps_on_every_rank(direction, tmp_path):
    """The device path with offload_param: nvme too (the 50b-24gb-nvme layout), 2 ranks, with the
    faults: each rank reads, steps and writes back its own 16-bit partitions on the drive (the drift
    step, or the gradient step from its all-reduced gradient's share), and both take the same
    steps, bit for bit those of offload_param: cpu."""
    runs = _cpu_and_nvme_runs(tmp_path, lambda where: [
        "--stage", "3", "--steps", "16", "--faults", "--offload-predict", "device", "--direction", direction,
        "--nvme", str(tmp_path / f"swap-{where}"), "--params-on", where])
    for where, ranks in runs.items():
        for rep in ranks:
            st = rep["statistics"]
            assert st["offload_predict"] == "device" and st["snapshot_bytes"] == 0
            assert st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
            if where == "nvme":   # (some of each rank's partitions on the drive)
                assert rep["shards_on_drive"] > 0 and True in rep["shards_swapped"]
            else:
                assert rep["shards_on_drive"] == 0 and True not in rep["shards_swapped"]
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload_param, behind", [(1, False, False), (2, False, False), (3, False, False),
                                                           (3, True, False), (2, False, True), (3, False, True)])
def test_a_compact_gradient_state_keeps_the_ranks_together(stage, offload_param, behind, tmp_path):
    """memory.gradient_state_dtype: int8-factored, ZeRO 1-3 under offload (ZeRO 3 also with offload_param:
    cpu, the state in host memory beside the 16-bit partitions), 2 ranks, with the faults:
    each parameter's gradient all-reduced in its hook (its clip share from norms every rank shares),
    each rank folding its own slices (a parameter cut between the ranks: a partial first or last row
    held dense); the same steps, checks and rollbacks on both ranks, the same weights at the end.
    ``behind``: memory.cpu_step_behind too, each rank covering its real step before a run from its own
    slices of DeepSpeed's reduced gradient (the first shares from sums every rank shares)."""
    param = (["--offload-param"] if offload_param else []) + (["--cpu-step-behind"] if behind else [])
    ranks = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults",
                                              "--offload-predict", "device", "--direction", "gradient",
                                              "--gradient-state-dtype", "int8-factored", *param], 2, tmp_path)
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped", "checked")
    first, other = ranks
    for col in cols:
        assert [s[col] for s in other["record"]] == [s[col] for s in first["record"]], f"ranks differ in '{col}'"
    assert first["weights_sha256"] == other["weights_sha256"]
    for rep in ranks:
        st = rep["statistics"]
        assert st["gradient_nonfinite_steps"] == 1 and st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
        assert (st["cpu_steps_behind"] > 0) is behind


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_cpu_step_behind_the_run_keeps_the_ranks_together(stage, tmp_path):
    """memory.cpu_step_behind, ZeRO 2 and 3 under offload, 2 ranks, with the faults: each rank's GPU
    covers its real step before a run (its shard, then the all-gather) while its CPU step runs
    behind; both ranks take the same steps, checks and rollbacks as the engine that steps at once
    (whose losses they match to the GPU step's rounding) and end with the same weights."""
    runs = {}
    for name, extra in (("now", []), ("behind", ["--cpu-step-behind"])):
        (tmp_path / name).mkdir()
        runs[name] = run_ranks("multirank_worker.py", ["--stage", str(stage), "--steps", "16", "--faults",
                                                       "--offload-predict", "device", "--direction", "gradient", *extra],
                               2, tmp_path / name)
    cols = ("phase", "accepted", "rolled_back", "skipped", "checked")
    want = [tuple(s[c] for c in cols) for s in runs["now"][0]["record"]]
    for ranks in runs.values():
        for rep in ranks:
            assert [tuple(s[c] for c in cols) for s in rep["record"]] == want
    behind = runs["behind"]
    for got, mine, ref in zip(behind[1]["record"], behind[0]["record"], runs["now"][0]["record"]):
        assert (got["loss"] is None) == (mine["loss"] is None) == (ref["loss"] is None)
        if got["loss"] is not None:   # (the faults' NaN losses on every rank alike)
            assert got["loss"] == pytest.approx(mine["loss"], rel=0, abs=0, nan_ok=True)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, nan_ok=True)
    assert behind[0]["weights_sha256"] == behind[1]["weights_sha256"]
    for rep in behind:
        st = rep["statistics"]
        assert st["cpu_steps_behind"] > 0 and st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0


@pytest.mark.slow
def test_a_gradient_from_part_of_the_batch_keeps_the_ranks_together_on_zero_3(tmp_path):
    """predictor.gradient_batch_fraction 0.5 with 2 micro-batches a step, ZeRO 3, 2 ranks, the
    device path: every rank takes the first micro-batch alone (the rule reads only shapes), so
    the per-parameter all-reduces pair up and both ranks end on the same weights, through rank
    0's NaN loss and rank 1's rejected check."""
    ranks = run_ranks("multirank_worker.py", ["--stage", "3", "--steps", "16", "--faults", "--gas", "2",
                                              "--offload-predict", "device", "--direction", "gradient",
                                              "--gradient-batch-fraction", "0.5"], 2, tmp_path)
    cols = ("phase", "loss", "accepted", "rolled_back", "skipped", "checked")
    assert [tuple(s[c] for c in cols) for s in ranks[1]["record"]] == [tuple(s[c] for c in cols)
                                                                      for s in ranks[0]["record"]]
    st = ranks[0]["statistics"]
    assert st["gradient_nonfinite_steps"] == 1 and st["predict_accepted"] > 0 and st["predict_rolled_back"] > 0
    assert len({rep["weights_sha256"] for rep in ranks}) == 1
    # the gradient noise scale from norms every rank shares (its step cost is each rank's own timing)
    noise = [{k: v for k, v in rep["statistics"]["gradient_noise_scale"].items()
              if k not in ("share_step_cost", "worth_per_cost")} for rep in ranks]
    assert noise[0] == noise[1] and noise[0]["pairs"] > 0
    assert (noise[0]["share_samples"], noise[0]["batch_samples"]) == (4 * 2, 4 * 2 * 2)   # (MICRO, 2 ranks, gas 2)


@pytest.mark.slow
def test_gradient_predict_steps_recompute_or_not_alike_on_every_rank(tmp_path):
    """predictor.gradient_checkpointing: auto, a checkpointed model, ZeRO 3 under offload, 2 ranks
    (whose per-parameter all-reduces pair up only if both run the same backward): where rank 1
    finds no room for the blocks' activations both ranks keep recomputing, else both stop after
    their one measured step; the same steps and, the gradient being the same, the same weights."""
    runs = {}
    for name, extra in (("room", []), ("no-room", ["--no-room-rank", "1"])):
        (tmp_path / name).mkdir()
        runs[name] = run_ranks("multirank_worker.py", ["--stage", "3", "--steps", "12", "--offload-predict", "device",
                                                       "--direction", "gradient", "--checkpointing", "auto", *extra],
                               2, tmp_path / name)
    _runs_alike(runs, "room")
    for name, plain in (("room", True), ("no-room", False)):
        stats = [rep["statistics"]["gradient_recompute"] for rep in runs[name]]
        assert stats[0]["steps"] == stats[1]["steps"] and (stats[0]["steps"]["plain"] > 0) is plain
        assert [d["plain"] for d in stats[0]["decisions"]] == [plain] == [d["plain"] for d in stats[1]["decisions"]]
    assert len({rep["weights_sha256"] for ranks in runs.values() for rep in ranks}) == 1
