"""``ds-hybrid report`` and ``ds-hybrid kernel-bench`` on a machine without a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from ds_hybrid import cli, kernel_bench, kernels, report


def test_report_lists_every_section_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    cli.main(["report", "--json", str(path)])
    text = capsys.readouterr().out
    for section in ("[gpu]", "[cupy]", "[nvml]", "[deepspeed]", "[libaio (NVMe offload)]",
                    "[nvcc (kernel compile check)]", "[ds_hybrid kernels]"):
        assert section in text
    data = json.loads(path.read_text())
    assert set(data) == {"system", "gpu", "cupy", "nvml", "deepspeed", "libaio", "nvcc", "kernels"}
    assert data["gpu"]["available"] == torch.cuda.is_available()
    ops = data["deepspeed"]["ops"]
    assert "cpu_adam" in ops and "fused_adam" in ops and "async_io" in ops     # builders probed, none built
    assert data["kernels"]["auto_on_cuda_tensors"] in ("cupy", "torch")
    assert all(data["kernels"]["kernel_files"].values())


def test_report_without_cupy(monkeypatch):
    real = kernels.importlib.import_module
    monkeypatch.setattr(kernels.importlib, "import_module",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError("no cupy")) if name == "cupy"
                        else real(name, *a, **k))
    kernels._reset_cupy_state()
    try:
        r = report.cupy_info()
        assert r["imports"] is False and "hybrid_predict.kernels" in r["error"]
        text = report.format_report({**report.collect(kernel_check=False), "cupy": r})
        assert "imports" in text and "'auto' on CUDA tensors" in text
    finally:
        kernels._reset_cupy_state()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_kernel_bench_needs_a_gpu(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["kernel-bench", "--json", str(tmp_path / "k.json")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU with CuPy" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()


def test_kernel_bench_cpu_reference_tables(tmp_path, monkeypatch):
    """The --cpu-reference path, shrunk to tiny sizes; results are labelled as references only."""
    monkeypatch.setattr(kernel_bench, "time_cpu", lambda fn, **k: (fn(), 1e-3)[1])
    path = tmp_path / "k.json"
    if torch.cuda.is_available():
        pytest.skip("with a GPU the bench runs the kernels")
    kernel_bench.main(["--cpu-reference", "--quick", "--json", str(path)])
    res = json.loads(path.read_text())
    assert res["kernels_run"] is False and "kernels not run" in res["device"]
    assert res["fused_update"] and res["rssm"] and res["encoder"]
    assert "kernel_ms" not in res["fused_update"][0]


def test_peak_bandwidth_table_names():
    assert kernel_bench.PEAK_BANDWIDTH["H100"] == 3.35e12
    assert kernels.fused_update_bytes(10, lp=True, snapshot=True) == 10 * 22
