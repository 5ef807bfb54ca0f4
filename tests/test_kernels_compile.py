"""Every kernels/*.cu compiles with nvcc for sm_80 (A100) and sm_90 (H100), without register spills.

Part of the normal test run; skipped where nvcc is missing (CI machines without a CUDA toolkit).
The kernels are compiled as CuPy compiles them at run time (no host code; C++14); templates
are explicitly instantiated in the files, so every variant is compiled.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "kernels").glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")


@functools.lru_cache(maxsize=None)
def supported_archs() -> frozenset[str]:
    res = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True)
    return frozenset(a.replace("compute_", "sm_") for a in res.stdout.split())


def test_kernel_sources_exist():
    assert {p.stem for p in SOURCES} >= {"fused_update", "rssm", "encoder"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles(source, arch, tmp_path):
    if arch not in supported_archs():
        pytest.skip(f"{NVCC} does not support {arch}")
    cmd = [NVCC, "-std=c++14", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
           str(source)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert (tmp_path / "k.cubin").stat().st_size > 0
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    assert spills and all(s == "0" for s in spills), f"register spills in {source.name} for {arch}:\n{res.stderr}"


def test_compiler_errors_point_at_the_cu_file(tmp_path, monkeypatch):
    """The loader's #line directive makes a compiler error name kernels/NAME.cu and its line."""
    from ds_hybrid import kernels
    broken = tmp_path / "kernels"
    broken.mkdir()
    (broken / "broken.cu").write_text('extern "C" __global__ void k(float* x) {\n    x[0] = undefined_name;\n}\n')
    monkeypatch.setattr(kernels, "KERNEL_DIR", broken)
    compiled = tmp_path / "as_compiled.cu"          # what NVRTC is handed: another "file"
    compiled.write_text(kernels.kernel_source("broken"))
    res = subprocess.run([NVCC, "-std=c++14", "-arch=sm_80", "-cubin", "-o", str(tmp_path / "k.cubin"),
                          str(compiled)], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert f'{(broken / "broken.cu").resolve()}(2): error' in res.stderr, res.stderr


def _nvrtc():
    """CuPy's NVRTC bindings when CuPy and libnvrtc are installed (no GPU needed), else None."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="needs CuPy and libnvrtc (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_with_nvrtc_as_the_loader_does(arch):
    """NVRTC, CuPy's run-time compiler, accepts each source as ds_hybrid.kernels hands it over
    (with the #line directive, the loader's options, CuPy's own options and every name expression)."""
    from ds_hybrid import kernels
    nvrtc = _nvrtc()
    for name in kernels.KERNEL_FILES:
        names = kernels.FUSED_UPDATE_MODULE if name == "fused_update" else ()
        prog = nvrtc.createProgram(kernels.kernel_source(name), f"{name}.cu", [], [])
        try:
            for expr in names:
                nvrtc.addNameExpression(prog, expr)
            try:
                nvrtc.compileProgram(prog, [*kernels.NVRTC_OPTIONS, f"--gpu-architecture={arch}",
                                            "--device-as-default-execution-space"])
            except nvrtc.NVRTCError:
                pytest.fail(f"NVRTC rejected {name}.cu for {arch}:\n{nvrtc.getProgramLog(prog)}")
            assert len(nvrtc.getCUBIN(prog)) > 0
            assert all(nvrtc.getLoweredName(prog, expr).startswith("_Z") for expr in names)
        finally:
            nvrtc.destroyProgram(prog)
