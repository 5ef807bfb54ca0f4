"""``ds-hybrid report``: what this machine offers ds_hybrid, in the spirit of DeepSpeed's ``ds_report``.

GPU (torch.cuda), CuPy (which package, versions, whether it runs a kernel), NVML, DeepSpeed's
version and op compatibility, libaio (NVMe offload), nvcc (the kernels' compile check), and
the kernel backend that ``hybrid_predict.kernels: auto`` picks. Nothing is JIT-compiled: the
DeepSpeed ops are probed with their builders' ``is_compatible()`` (as ``ds_report`` does;
async_io's probe links a tiny test program against libaio), never built. With a GPU and CuPy,
ds_hybrid's own kernels are compiled (NVRTC, cached) and checked once against their references.

    ds-hybrid report [--json PATH] [--no-kernel-check]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def _try(fn, *a, **k) -> tuple[Any, str | None]:
    try:
        return fn(*a, **k), None
    except Exception as exc:  # a report reports; it does not fail
        return None, f"{type(exc).__name__}: {exc}"


def gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "available": torch.cuda.is_available(), "devices": []}
    if info["available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "memory_gb": round(p.total_memory / 2 ** 30, 1),
                                    "sms": p.multi_processor_count,
                                    "bf16": torch.cuda.is_bf16_supported() if i == 0 else None})
    return info


def cupy_info(run_kernel: bool = True) -> dict[str, Any]:
    from . import kernels
    info: dict[str, Any] = {"packages": kernels.cupy_packages()}
    try:
        cp = kernels.import_cupy()
    except kernels.KernelUnavailable as exc:
        info.update(imports=False, error=str(exc))
        return info
    info.update(imports=True, version=cp.__version__)
    rt = cp.cuda.runtime
    info["runtime_version"], _ = _try(rt.runtimeGetVersion)
    info["driver_version"], err = _try(rt.driverGetVersion)
    if err:
        info["driver_error"] = err
    nvrtc_version, err = _try(lambda: cp.cuda.nvrtc.getVersion())
    info["nvrtc_version"] = ".".join(map(str, nvrtc_version)) if nvrtc_version else None
    if err:
        info["nvrtc_error"] = err
    info["devices"], err = _try(rt.getDeviceCount)
    if err:
        info["device_error"] = err
    if run_kernel and info["devices"]:
        def add_one():
            x = cp.arange(4, dtype=cp.float32)
            k = cp.RawKernel(r'extern "C" __global__ void add1(float* x) { x[threadIdx.x] += 1.0f; }', "add1")
            k((1,), (4,), (x,))
            return bool((x.get() == [1, 2, 3, 4]).all())
        info["runs_a_kernel"], err = _try(add_one)
        if err:
            info["kernel_error"] = err
    else:
        info["runs_a_kernel"] = False
    if len(info["packages"]) > 1:
        info["warning"] = "several CuPy packages are installed; keep the one that matches the driver"
    return info


def nvml_info() -> dict[str, Any]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as exc:
        return {"imports": False, "error": f"{exc} (pip install nvidia-ml-py)"}
    info: dict[str, Any] = {"imports": True}
    _, err = _try(pynvml.nvmlInit)
    if err:
        info.update(init=False, error=err)
        return info
    try:
        info["init"] = True
        drv = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        n = pynvml.nvmlDeviceGetCount()
        info["devices"] = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            info["devices"].append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                                    "memory_used_gb": round(mem.used / 2 ** 30, 2),
                                    "memory_total_gb": round(mem.total / 2 ** 30, 1)})
    finally:
        _try(pynvml.nvmlShutdown)
    return info


def deepspeed_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    # DeepSpeed's builders print warnings while probing: keep them out of the report. A real
    # file, not a StringIO: async_io's probe redirects stderr's file descriptor.
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
            from deepspeed.git_version_info import installed_ops
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible
        except Exception as exc:
            return {"imports": False, "error": f"{type(exc).__name__}: {exc}"}
        info.update(imports=True, version=deepspeed.__version__, accelerator=get_accelerator()._name)
        ops = {}
        for name, builder in sorted(ALL_OPS.items()):
            if name == "deepspeed_not_implemented":
                continue
            ops[name] = {"compatible": bool(probe_is_compatible(builder, False)),
                         "installed": bool(installed_ops.get(name, False))}
        info["ops"] = ops
    from torch.utils.cpp_extension import is_ninja_available
    info["ninja"] = is_ninja_available()
    return info


def libaio_info() -> dict[str, Any]:
    lib = ctypes.util.find_library("aio")
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    listed = []
    if ldconfig:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
        listed = sorted({line.split("=>")[-1].strip() for line in out.splitlines() if "libaio.so" in line})
    header = next((p for p in ("/usr/include/libaio.h", "/usr/local/include/libaio.h") if os.path.exists(p)), None)
    return {"library": lib, "ldconfig": listed, "header": header,
            "usable_for_nvme_offload": bool(lib or listed) and header is not None}


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_info() -> dict[str, Any]:
    nvcc = find_nvcc()
    if nvcc is None:
        return {"path": None}
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    archs = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    return {"path": nvcc, "version": m.group(1) if m else out.strip().splitlines()[-1:],
            "sm_80": "compute_80" in archs, "sm_90": "compute_90" in archs}


def kernel_info(check: bool = True) -> dict[str, Any]:
    from . import kernels
    info = kernels.availability()
    if check and info["cuda_device"] and info["cupy_import"]:
        info["check"] = kernels.smoke_test_kernels()
    return info


def collect(kernel_check: bool = True) -> dict[str, Any]:
    return {
        "system": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
        "gpu": gpu_info(),
        "cupy": cupy_info(run_kernel=kernel_check),
        "nvml": nvml_info(),
        "deepspeed": deepspeed_info(),
        "libaio": libaio_info(),
        "nvcc": nvcc_info(),
        "kernels": kernel_info(check=kernel_check),
    }


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def format_report(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []

    def add(key: str, value: Any) -> None:
        rows.append((key, str(value)))

    def section(title: str) -> None:
        rows.append(("", ""))
        rows.append((f"[{title}]", ""))

    s = r["system"]
    section("system")
    add("python", s["python"])
    add("platform", s["platform"])
    add("cpu cores", s["cpus"])
    g = r["gpu"]
    section("gpu")
    add("torch", f"{g['torch']} (CUDA build: {g['torch_cuda'] or 'none'})")
    add("CUDA device", _yes(g["available"]))
    for d in g["devices"]:
        add(f"  cuda:{d['index']}", f"{d['name']}, sm_{d['capability'].replace('.', '')}, {d['memory_gb']} GB, "
                                    f"{d['sms']} SMs")
    c = r["cupy"]
    section("cupy")
    add("packages", ", ".join(f"{k} {v}" for k, v in c["packages"].items()) or "none (pip install cupy-cuda12x)")
    add("imports", _yes(c["imports"]) + ("" if c["imports"] else f" ({c['error']})"))
    if c["imports"]:
        add("version", c["version"])
        add("CUDA runtime", c.get("runtime_version"))
        add("driver", c.get("driver_version") or c.get("driver_error") or "none (no CUDA driver)")
        add("NVRTC", c.get("nvrtc_version") or c.get("nvrtc_error"))
        add("devices", c.get("devices") if c.get("devices") is not None else c.get("device_error"))
        add("runs a kernel", _yes(c.get("runs_a_kernel")) + (f" ({c['kernel_error']})" if c.get("kernel_error") else ""))
    if c.get("warning"):
        add("WARNING", c["warning"])
    n = r["nvml"]
    section("nvml")
    add("nvidia-ml-py imports", _yes(n["imports"]))
    if n["imports"]:
        add("nvmlInit", "ok" if n.get("init") else n.get("error"))
        if n.get("init"):
            add("driver", n["driver"])
            for d in n["devices"]:
                add(f"  gpu {d['index']}", f"{d['name']}, {d['memory_used_gb']} / {d['memory_total_gb']} GB used")
    else:
        add("error", n["error"])
    d = r["deepspeed"]
    section("deepspeed")
    if not d["imports"]:
        add("imports", f"no ({d['error']})")
    else:
        add("version", f"{d['version']} (accelerator: {d['accelerator']}, ninja: {_yes(d['ninja'])})")
        for op, st in d["ops"].items():
            add(f"  op {op}", f"compatible: {_yes(st['compatible'])}, prebuilt: {_yes(st['installed'])}")
    a = r["libaio"]
    section("libaio (NVMe offload)")
    add("library", a["library"] or "not found")
    add("header libaio.h", a["header"] or "not found (apt-get install libaio-dev)")
    add("usable", _yes(a["usable_for_nvme_offload"]))
    v = r["nvcc"]
    section("nvcc (kernel compile check)")
    if v["path"] is None:
        add("nvcc", "not found (tests/test_kernels_compile.py skips)")
    else:
        add("nvcc", f"{v['path']} (release {v['version']})")
        add("sm_80 / sm_90", f"{_yes(v['sm_80'])} / {_yes(v['sm_90'])}")
    k = r["kernels"]
    section("ds_hybrid kernels")
    add("kernel sources", ", ".join(f"{n}.cu" + ("" if ok else " MISSING") for n, ok in k["kernel_files"].items()))
    why = "" if k["auto_on_cuda_tensors"] == "cupy" else (
        " (no CUDA device)" if not k["cuda_device"] else " (CuPy does not import)")
    add("'auto' on CUDA tensors", k["auto_on_cuda_tensors"] + why)
    add("'auto' on CPU tensors", "torch")
    for name, res in k.get("check", {}).items():
        add(f"  {name}", res)
    width = max(len(key) for key, _ in rows)
    lines = []
    for key, value in rows:
        if not key:
            lines.append("")
        elif not value:
            lines.append(key)
        else:
            lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines).strip("\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ds-hybrid report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    ap.add_argument("--no-kernel-check", action="store_true",
                    help="do not compile and check ds_hybrid's kernels (GPU + CuPy only)")
    args = ap.parse_args(argv)
    report = collect(kernel_check=not args.no_kernel_check)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
