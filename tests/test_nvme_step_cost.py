"""benchmarks/nvme_step_cost.py: its engines, step kinds and swap counts on a short sitting."""
import json

import pytest
from bench_scripts import load
from engine_utils import aio_available


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_a_short_sitting_books_each_step_kind_with_its_swaps(tmp_path):
    out = load("nvme_step_cost").main(["--out", str(tmp_path), "--micro-batch", "1", "--steps", "8",
                                       "--sittings", "2", "--seq-len", "32"])
    assert json.loads((tmp_path / "nvme_step_cost.json").read_text())["summary"] == out["summary"]
    table = out["summary"]
    assert table["plain:real"]["cost_mean"] == 1.0 and table["plain:real"]["swapped_in_per_step"] == 1.0
    # (the device path swaps nothing in a run's later steps; the real step that keeps it, only its own step's)
    assert table["device:predict"]["swapped_in_per_step"] == 0.0 and table["device:predict"]["steps"] == 8
    # (nor at a run's first step: the real step before it made the run's moments inside its DeepSpeed step)
    assert table["device:predict_first"]["swapped_in_per_step"] == 0.0
    assert table["device-noprefetch:predict_first"]["swapped_in_per_step"] == 1.0   # (memory.gradient_prefetch: false)
    assert table["device:real_after_run"]["swapped_in_per_step"] == 1.0
    assert table["host:predict"]["swapped_in_per_step"] == 2.0   # (the update and the propagation)
    assert table["plain-cpu:real"]["swapped_in_per_step"] == 0.0
    # (drift: a Predict step swaps nothing; the real step that keeps a run, what a plain step does:
    # the commit and the fold go into its DeepSpeed step; with the fold after that step, once more)
    assert table["drift:predict"]["swapped_in_per_step"] == 0.0
    assert table["drift:real_after_run"]["swapped_in_per_step"] == 1.0
    assert table["drift-after:real_after_run"]["swapped_in_per_step"] == 2.0
    assert table["drift-host:predict"]["swapped_in_per_step"] == 2.0   # (the host path: as the gradient's)
    assert not list(tmp_path.glob("swap-*"))   # (each sitting's swap folders removed after it)
    for sitting in out["sittings"]:
        assert sitting["device"]["_offload_predict"] == "device" and sitting["host"]["_offload_predict"] == "host"
        assert sitting["device"]["_rolled_back"] == 0 and sitting["device"]["_accepted"] > 0
        for drift in ("drift", "drift-after"):
            assert sitting[drift]["_offload_predict"] == "device" and sitting[drift]["_accepted"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_with_the_weights_on_nvme_the_device_path_swaps_no_optimizer_state(tmp_path):
    """--params-on nvme (50b-24gb-nvme's layout): the device path of either direction takes Predict
    steps with no optimizer sub-group swapped in; the drift host path swaps each in twice a step."""
    out = load("nvme_step_cost").main(["--out", str(tmp_path), "--micro-batch", "1", "--steps", "8", "--sittings",
                                       "1", "--seq-len", "32", "--params-on", "nvme", "--engines", "plain", "drift",
                                       "drift-host", "device", "--model", "llama-tiny", "--model-set",
                                       "hidden_size=384", "intermediate_size=1536", "num_hidden_layers=2"])
    table = out["summary"]
    for engine in ("drift", "device"):
        assert table[f"{engine}:predict"]["swapped_in_per_step"] == 0.0 and table[f"{engine}:predict"]["steps"] > 0
        assert out["sittings"][0][engine]["_offload_predict"] == "device"
    assert table["drift-host:predict"]["swapped_in_per_step"] == 2.0
    assert table["drift:real_after_run"]["swapped_in_per_step"] == table["plain:real"]["swapped_in_per_step"]
    assert out["sittings"][0]["drift-host"]["_offload_predict"] == "host"
