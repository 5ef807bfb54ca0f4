"""benchmarks/nvme_resume_check.py: plain DeepSpeed's resume of ZeRO 3 with the optimizer in host
memory and on NVMe, recorded side by side (docs/deepspeed-parity.md cites the NVMe result)."""
import json

import pytest
from bench_scripts import load
from engine_utils import aio_available


@pytest.mark.slow
@pytest.mark.skipif(not aio_available(), reason="NVMe offload needs libaio (Debian: libaio-dev)")
def test_the_check_resumes_the_host_memory_run_and_records_the_nvme_one(tmp_path):
    out = load("nvme_resume_check").main(["--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == out
    cpu, nvme = out["cpu"], out["nvme"]
    # (the run in host memory resumes: its next losses are the saved run's to fp32 rounding)
    assert cpu["adam_state_keys_after_load"] == ["exp_avg", "exp_avg_sq", "step"]
    assert cpu["losses_loaded_run"] == pytest.approx(cpu["losses_saved_run"], abs=1e-4)
    # (the NVMe run really swapped both sub-groups; what its load gave is recorded, not judged here)
    assert nvme["swapped_sub_groups"] == [True, True] and len(nvme["losses_loaded_run"]) == 3
