"""``ds-hybrid kernel-bench``: each CUDA kernel against its torch reference.

    ds-hybrid kernel-bench [--json PATH] [--quick]         # default runs/kernel-bench/kernels.json
    ds-hybrid kernel-bench --cpu-reference [--threads N] [--json PATH]

The repository's docs/results/ files (docs/kernels.md's tables) are written only when ``--json`` names them.

On a GPU with CuPy: the fused predicted update's time and achieved bandwidth (bytes read and
written / time) against the device's peak (memory clock x bus width, from the CUDA device
attributes; a table by device name otherwise) and against a plain device-to-device copy; the
device path's drift step (``drift_shift``), gradient step (``held_adam_step``) and the real step's fold
from the shards (``shard_fold``) against their torch ops, in the same terms; the
RSSM step and K-step rollout against torch eager; the encoder's window features against the
torch reference (a CPU function). Kernel and GPU-reference timings use CUDA events around a
batch of calls (median of several batches, after warm-up); CPU timings use perf_counter.
Goals (from the issue): the fused update at >= 80% of HBM bandwidth, the rollout >= 3x eager.

Without a GPU it exits with status 2 and says so; ``--cpu-reference`` then times only the
torch references on the CPU (labelled as such; there is nothing to compare them with).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import kernels
from .arguments import HelpFormatter

# The result files when --json is not given: the repository's results are written only on request.
DEFAULT_JSON = Path("runs/kernel-bench/kernels.json")
DEFAULT_CPU_JSON = Path("runs/kernel-bench/kernels-cpu-reference.json")

# Peak memory bandwidth (bytes/s) by device-name substring; used when the CUDA attributes are
# not available. Vendor figures.
PEAK_BANDWIDTH = {
    "H200": 4.8e12, "GH200": 4.0e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12,
    "L40S": 0.864e12, "L40": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12,
    "RTX 4090": 1.008e12, "RTX 3090": 0.936e12, "V100": 0.9e12, "T4": 0.32e12,
}
# cudaDeviceAttr values (cuda_runtime_api.h).
_ATTR_MEMORY_CLOCK_KHZ, _ATTR_BUS_WIDTH_BITS = 36, 37


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """(bytes/s, where the figure comes from) for a CUDA device."""
    name = torch.cuda.get_device_name(device)
    try:
        cp = kernels.import_cupy()
        clock = cp.cuda.runtime.deviceGetAttribute(_ATTR_MEMORY_CLOCK_KHZ, device.index)
        width = cp.cuda.runtime.deviceGetAttribute(_ATTR_BUS_WIDTH_BITS, device.index)
        if clock and width:
            return 2.0 * clock * 1e3 * width / 8, f"2 x memory clock {clock / 1e3:.0f} MHz x bus {width} bits"
    except Exception:
        pass
    for key, bw in PEAK_BANDWIDTH.items():
        if key in name:
            return bw, f"table entry '{key}'"
    return None, "unknown device"


def time_cuda(fn: Callable[[], Any], inner: int = 10, batches: int = 5, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events around ``inner`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def time_cpu(fn: Callable[[], Any], inner: int = 5, batches: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


UPDATE_KW = dict(lr=1e-4, scale=0.5, beta1=0.9, beta2=0.999, eps=1e-8, step=100, weight_decay=0.01, decoupled=True)


def _update_tensors(n: int, device, lp_dtype, snapshot: bool):
    master = torch.randn(n, device=device)
    m = torch.randn(n, device=device) * 1e-3
    v = torch.rand(n, device=device) * 1e-6
    lp = torch.empty(n, dtype=lp_dtype, device=device) if lp_dtype else None
    snap = torch.empty(n, device=device) if snapshot else None
    return master, m, v, lp, snap


def bench_fused_update(device, sizes, timer) -> tuple[list[dict], str]:
    rows = []
    peak, peak_src = peak_bandwidth(device) if device.type == "cuda" else (None, "")
    for n in sizes:
        src = torch.empty(n * 4, dtype=torch.uint8, device=device)   # a plain copy of 4n bytes, as a ceiling
        dst = torch.empty_like(src)
        copy_s = timer(lambda: dst.copy_(src)) if device.type == "cuda" else None
        copy_bw = 2 * src.numel() / copy_s if copy_s else None
        del src, dst
        for lp_dtype, snapshot in ((torch.bfloat16, False), (torch.bfloat16, True), (None, False)):
            master, m, v, lp, snap = _update_tensors(n, device, lp_dtype, snapshot)
            nbytes = kernels.fused_update_bytes(n, lp is not None, snapshot)
            ref_s = timer(lambda: kernels.fused_update_reference(master, m, v, lp_out=lp, snapshot_out=snap,
                                                                 **UPDATE_KW))
            row = {"n": n, "lp": str(lp_dtype).replace("torch.", "") if lp_dtype else None, "snapshot": snapshot,
                   "bytes": nbytes, "torch_ms": ref_s * 1e3}
            if device.type == "cuda":
                ker_s = timer(lambda: kernels.fused_update(master, m, v, lp_out=lp, snapshot_out=snap,
                                                           backend="cupy", **UPDATE_KW))
                bw = nbytes / ker_s
                row.update(kernel_ms=ker_s * 1e3, speedup=ref_s / ker_s, kernel_gb_s=bw / 1e9,
                           torch_gb_s=nbytes / ref_s / 1e9,
                           peak_gb_s=peak / 1e9 if peak else None, pct_of_peak=100 * bw / peak if peak else None,
                           copy_gb_s=copy_bw / 1e9, pct_of_copy=100 * bw / copy_bw)
            rows.append(row)
            del master, m, v, lp, snap
    return rows, peak_src


def _kernel_row(row: dict, nbytes: int, ref: Callable[[], Any], kernel: Callable[[], Any], timer, device,
                peak: float | None) -> dict:
    """``row`` with the torch reference's time and bandwidth for ``nbytes`` moved, and on a GPU the
    kernel's, its speedup and its share of the peak bandwidth."""
    ref_s = timer(ref)
    row.update(bytes=nbytes, torch_ms=ref_s * 1e3, torch_gb_s=nbytes / ref_s / 1e9)
    if device.type == "cuda":
        ker_s = timer(kernel)
        bw = nbytes / ker_s
        row.update(kernel_ms=ker_s * 1e3, speedup=ref_s / ker_s, kernel_gb_s=bw / 1e9,
                   pct_of_peak=100 * bw / peak if peak else None)
    return row


def drift_shift_bytes(n: int, x_bytes: int, vdtype: str) -> int:
    """Bytes one drift step moves for n elements: the shard read and written, the velocity read
    (int8: 1 byte a value and an fp32 scale per 256)."""
    from .quant import BLOCK
    v = {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 4 * -(-n // BLOCK)}[vdtype]
    return 2 * x_bytes * n + v


def bench_drift_shift(device, sizes, timer) -> list[dict]:
    """The device path's drift Predict step into a bf16 shard (kernels.drift_shift) against its
    torch ops, with an int8 (the offload presets') and a bf16 velocity."""
    from .quant import CompactBuffer
    peak = peak_bandwidth(device)[0] if device.type == "cuda" else None
    rows = []
    for n in sizes:
        shard = (torch.randn(n, device=device) * 0.02).to(torch.bfloat16)
        for vdtype in ("int8", "bf16"):
            vel = CompactBuffer(n, vdtype, device)
            vel.store(torch.randn(n, device=device), generator=torch.Generator(device=device).manual_seed(0))
            rows.append(_kernel_row({"n": n, "velocity": vdtype}, drift_shift_bytes(n, 2, vdtype),
                                    lambda: kernels.drift_shift_reference(shard, vel, [1e-6]),
                                    lambda: kernels.drift_shift(shard, vel, [1e-6], backend="cupy"),
                                    timer, device, peak))
            del vel
        del shard
    return rows


def bench_held_adam_step(device, sizes, timer) -> list[dict]:
    """A gradient Predict step on the device path into a bf16 shard (kernels.held_adam_step, bf16
    moments: the shard read and written, m and v read, 8 bytes a value) against its torch ops."""
    peak = peak_bandwidth(device)[0] if device.type == "cuda" else None
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, step=10, weight_decay=0.1, decoupled=True, key=1)
    rows = []
    for n in sizes:
        x = (torch.randn(n, device=device) * 0.02).to(torch.bfloat16)
        m = (torch.randn(n, device=device) * 1e-3).to(torch.bfloat16)
        v = (torch.rand(n, device=device) * 1e-6).to(torch.bfloat16)
        rows.append(_kernel_row({"n": n}, 8 * n, lambda: kernels.held_adam_step_reference(x, m, v, **kw),
                                lambda: kernels.held_adam_step(x, m, v, backend="cupy", **kw), timer, device, peak))
        del x, m, v
    return rows


def bench_shard_fold(device, sizes, timer) -> list[dict]:
    """A real step's fold into the int8 drift velocity from bf16 shards (kernels.shard_fold,
    ``memory.fold_source: weights16``: both shards read, the velocity read and written, 6 bytes
    a value and a scale per 256) against its torch ops."""
    from .quant import CompactBuffer
    peak = peak_bandwidth(device)[0] if device.type == "cuda" else None
    kw = dict(lr=1e-4, beta=0.95, first=False, key=1, moments=False)
    rows = []
    for n in sizes:
        before = (torch.randn(n, device=device) * 0.02).to(torch.bfloat16)
        after = (before.float() + torch.randn(n, device=device) * 1e-4).to(torch.bfloat16)
        vel = CompactBuffer(n, "int8", device)
        vel.store(torch.randn(n, device=device), generator=torch.Generator(device=device).manual_seed(0))
        # (both bf16 shards read; the int8 velocity and its scales read and written)
        rows.append(_kernel_row({"n": n}, 4 * n + 2 * drift_shift_bytes(n, 0, "int8"),
                                lambda: kernels.shard_fold_reference(after, before, vel, **kw),
                                lambda: kernels.shard_fold(after, before, vel, backend="cupy", **kw),
                                timer, device, peak))
        del before, after, vel
    return rows


def bench_rssm(device, configs, timer) -> list[dict]:
    from .dynamics.rssm import RSSMEnsemble, RSSMShape
    rows = []
    for E, B, K in configs:
        model = RSSMEnsemble(RSSMShape(members=E, horizon=max(K, 8))).to(device)
        s = model.shape
        h, z = torch.randn(E, B, s.deter, device=device), torch.randn(E, B, s.stoch, device=device)
        a, acts = torch.rand(E, B, s.action, device=device), torch.rand(E, B, K, s.action, device=device)
        with torch.no_grad():
            row = {"members": E, "batch": B, "steps": K,
                   "torch_step_ms": timer(lambda: kernels.rssm_step(model, h, z, a, backend="torch")) * 1e3,
                   "torch_rollout_ms": timer(lambda: kernels.rssm_rollout(model, h, z, acts, backend="torch")) * 1e3}
            if device.type == "cuda":
                row["kernel_step_ms"] = timer(lambda: kernels.rssm_step(model, h, z, a, backend="cupy")) * 1e3
                row["kernel_rollout_ms"] = timer(lambda: kernels.rssm_rollout(model, h, z, acts,
                                                                              backend="cupy")) * 1e3
                row["step_speedup"] = row["torch_step_ms"] / row["kernel_step_ms"]
                row["rollout_speedup"] = row["torch_rollout_ms"] / row["kernel_rollout_ms"]
        rows.append(row)
    return rows


def bench_encoder(device, batches, timer_gpu) -> list[dict]:
    rows = []
    for N in batches:
        g = torch.Generator().manual_seed(N)
        hist = torch.randn(N, 8, 32, dtype=torch.float64, generator=g)
        counts = torch.randint(0, 33, (N, 8), generator=g, dtype=torch.int32)
        row = {"histories": N,
               "torch_cpu_ms": time_cpu(lambda: kernels.window_features(hist, counts, backend="torch")) * 1e3}
        if device.type == "cuda":
            hd, cd = hist.to(device), counts.to(device)
            row["kernel_ms"] = timer_gpu(lambda: kernels.window_features(hd, cd, backend="cupy")) * 1e3
            row["speedup"] = row["torch_cpu_ms"] / row["kernel_ms"]
        rows.append(row)
    return rows


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_tables(res: dict) -> str:
    out = [f"device: {res['device']}", ""]
    gpu = res["kernels_run"]
    out.append("fused predicted update" + (f" (peak bandwidth: {res['peak_bandwidth_source']})" if gpu else
                                          " (torch reference only)"))
    cols = ["n", "lp", "snapshot", "torch_ms"] + (["kernel_ms", "speedup", "kernel_gb_s", "pct_of_peak",
                                                   "pct_of_copy"] if gpu else [])
    out += _table(cols, res["fused_update"])
    out.append("")
    kernel_cols = ["kernel_ms", "speedup", "kernel_gb_s", "pct_of_peak"] if gpu else ["torch_gb_s"]
    for key, first, title in (
            ("drift_shift", ["n", "velocity"], "drift shift (the device path's Predict step into a bf16 shard; bytes: "
                                               "the shard read and written, the velocity read)"),
            ("held_adam_step", ["n"], "held Adam step (a gradient Predict step into a bf16 shard, bf16 moments; "
                                      "bytes: the shard read and written, m and v read)"),
            ("shard_fold", ["n"], "shard fold (a real step's fold into the int8 velocity from bf16 shards; bytes: "
                                  "both shards read, the velocity read and written)")):
        if res.get(key):
            out.append(title)
            out += _table(first + ["torch_ms"] + kernel_cols, res[key])
            out.append("")
    out.append("RSSM step / rollout")
    cols = ["members", "batch", "steps", "torch_step_ms", "torch_rollout_ms"] + (
        ["kernel_step_ms", "kernel_rollout_ms", "step_speedup", "rollout_speedup"] if gpu else [])
    out += _table(cols, res["rssm"])
    out.append("")
    out.append("encoder window features (the torch reference is a CPU function)")
    cols = ["histories", "torch_cpu_ms"] + (["kernel_ms", "speedup"] if gpu else [])
    out += _table(cols, res["encoder"])
    return "\n".join(out)


def _table(cols: list[str], rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ds-hybrid kernel-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--json", type=Path, metavar="PATH", help=f"result file (default: {DEFAULT_JSON}; with "
                                                              f"--cpu-reference {DEFAULT_CPU_JSON})")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="no GPU: time only the torch references on the CPU")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 gives stable times on a shared machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    gpu_ok = torch.cuda.is_available() and kernels.cupy_available()
    if not gpu_ok and not args.cpu_reference:
        why = "torch sees no CUDA device" if not torch.cuda.is_available() else "CuPy does not import"
        print(f"ds-hybrid kernel-bench: needs a CUDA GPU with CuPy ({why}). Run it on a GPU machine with "
              f"cupy-cuda12x (or cupy-cuda13x) installed, or pass --cpu-reference to time the torch "
              f"references on this CPU only.", file=sys.stderr)
        raise SystemExit(2)
    if gpu_ok:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False
        timer = time_cuda
        sizes = [2 ** 20, 2 ** 24] if args.quick else [2 ** 20, 2 ** 24, 2 ** 26, 2 ** 28]
        rssm_cfgs = [(3, 1, 8)] if args.quick else [(3, 1, 8), (3, 1, 16), (5, 4, 8), (8, 16, 16)]
        encoder_batches = [1, 64]
        name = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}, CuPy {kernels.import_cupy().__version__})"
    else:
        device, timer = torch.device("cpu"), time_cpu
        sizes = [2 ** 18] if args.quick else [2 ** 20, 2 ** 22]
        rssm_cfgs = [(3, 1, 8)] if args.quick else [(3, 1, 8), (8, 16, 16)]
        encoder_batches = [1] if args.quick else [1, 64]
        name = f"CPU only: {platform.machine()}, {torch.get_num_threads()} threads (torch references; kernels not run)"
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None   # other work on the machine
    t0 = time.time()
    fused, peak_src = bench_fused_update(device, sizes, timer)
    res = {"device": name, "kernels_run": gpu_ok, "torch": torch.__version__, "peak_bandwidth_source": peak_src,
           "load_average_1min_at_start": load,
           "fused_update": fused, "drift_shift": bench_drift_shift(device, sizes, timer),
           "held_adam_step": bench_held_adam_step(device, sizes, timer),
           "shard_fold": bench_shard_fold(device, sizes, timer),
           "rssm": bench_rssm(device, rssm_cfgs, timer),
           "encoder": bench_encoder(device, encoder_batches, time_cuda if gpu_ok else time_cpu),
           "goals": {"fused_update_pct_of_peak": 80, "rollout_speedup": 3}}
    res["seconds"] = round(time.time() - t0, 1)
    print(format_tables(res))
    path = args.json or (DEFAULT_JSON if gpu_ok else DEFAULT_CPU_JSON)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {path} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
