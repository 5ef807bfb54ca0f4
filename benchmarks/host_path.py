"""The hybrid's work on fp32 masters in host memory (the ``offload_optimizer`` case), timed.

With ZeRO-Offload the snapshot, the velocity fold after each real step and each drift Predict
step's update run on the host copies of the masters; on llama-1b (970M values, 16 cores) the GPU
run measured fold ~1.0 s and the Predict update ~1.5 s per step
(``docs/results/memory-gpu-1b.json``, ``bookkeeping_ms``). This times the same functions
(``zero_access.capture_weights`` / ``fold_real_update`` / ``apply_velocity_update``, plus the
Adam-direction ``apply_predicted_update``) on one CPU partition of ``--values`` values, best of
``--repeat``, and prints ns per value and each over DeepSpeed's own CPU Adam step on as many
values (what a plain ZeRO-Offload step does on the host). The fold from the Adam state (the
device path's) is timed with the torch ops and with ``kernels/host_fold.cpp``
(``memory.host_kernels``), and so are the host path's Predict update of the masters, the device
path's Predict update of a bf16 partition in host memory (ZeRO 3 with ``offload_param: cpu``) and
a kept run's commit into the masters (4 steps).

    python benchmarks/host_path.py --values 67108864 --repeat 5 --json docs/results/host-fold.json

To compare two versions of the code, run it from each checkout back to back on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import ds_hybrid.zero_access as za
from ds_hybrid import host_kernels
from ds_hybrid.device_predict import DevicePredict


def write_result(script: str, argv: list[str] | None, args, rows: list[dict], table: str, **extra) -> dict:
    """The result these host benchmarks record: the command, the run's size, the machine, the
    commit and the rows with their table; written to ``args.json`` when given."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    result = {"command": f"python benchmarks/{script} " + " ".join(argv or []), "values": args.values,
              "repeat": args.repeat, "threads": torch.get_num_threads(), "commit": commit, **extra,
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows, "table_markdown": table}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _best(fn, repeat: int, setup=None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_adam_step(n: int, repeat: int) -> float:
    """Seconds of DeepSpeed's CPU Adam step (AdamW) on ``n`` values: the real step's own host work
    under ZeRO-Offload, the unit the hybrid's host work is measured against."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    p.grad = torch.randn(n) * 1e-3
    opt.step()
    t = _best(opt.step, repeat)
    del opt, p
    return t


class _OnePartition:
    """The device path's view of a plain optimizer's one partition, with ``shard`` as its 16-bit copy."""

    def __init__(self, shard: torch.Tensor, access: za.MasterAccess):
        self.shard, self.access, self.base = shard, access, access.base

    def group_indices(self):
        return [0]

    def device_shard(self, i):
        return self.shard

    def shard_swapped(self, i):
        return False   # (in memory: not on NVMe)


def measure(n: int, velocity_dtype: str, repeat: int, cpp: bool) -> dict:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    p.grad = torch.randn(n) * 1e-3
    opt.step()   # Adam moments exist
    p.grad = None
    access = za._PlainAccess(opt)
    snap = za.PartitionBuffers("same")
    vel = za.VelocityBuffers(velocity_dtype, seed=0)
    za.capture_weights(access, snap)
    za.fold_real_update(access, snap, vel, [1e-3], 0.9, 1)   # the velocity exists (first fold)
    out = {"capture": _best(lambda: za.capture_weights(access, snap), repeat)}
    out["fold"] = _best(lambda: za.fold_real_update(access, snap, vel, [1e-3], 0.9, 2), repeat,
                        setup=lambda: za.capture_weights(access, snap))
    # the fold the device path runs (memory.fold_source: optimizer_state, no pre-step copy),
    # with the torch ops and (memory.host_kernels) with kernels/host_fold.cpp
    kernels = (False, True) if cpp else (False,)
    for hk in kernels:
        name = "fold_from_state" + ("_cpp" if hk else "")
        out[name] = _best(lambda: za.fold_real_update(access, None, vel, [1e-3], 0.9, 2, moments=False,
                                                      host_kernel=hk), repeat)
    if cpp:
        out["fold_cpp"] = _best(lambda: za.fold_real_update(access, snap, vel, [1e-3], 0.9, 2, host_kernel=True),
                                repeat, setup=lambda: za.capture_weights(access, snap))
    out["velocity_update"] = _best(lambda: za.apply_velocity_update(access, vel, [0.5]), repeat)
    if cpp:
        out["velocity_update_cpp"] = _best(lambda: za.apply_velocity_update(access, vel, [0.5], host_kernel=True),
                                           repeat)
    # the device path where the 16-bit partition is in host memory (ZeRO 3 with offload_param:
    # cpu): one Predict step into the bf16 copy, and a kept run of 4 steps into the masters
    shard = p.detach().to(torch.bfloat16)
    dev = DevicePredict(_OnePartition(shard, access))
    run = [[5e-4]] * 4
    for hk in kernels:
        dev.host_kernel = hk
        tag = "_cpp" if hk else ""
        out["shard_update_bf16" + tag] = _best(lambda: dev._add_to_shards(vel, run[:1]), repeat)
        out["commit_4_steps" + tag] = _best(lambda: dev._add_to_masters(list(access.partitions()), vel.buffers, run), repeat)
    out["adam_update"] = _best(lambda: za.apply_predicted_update(access, [0.5], backend="torch"), repeat)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 26, help="values in the partition (default 2^26)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "int8"], choices=["fp32", "bf16", "int8"],
                    help="velocity storage (memory.velocity_dtype)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-cpp", action="store_true", help="skip kernels/host_fold.cpp (memory.host_kernels: torch)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.values < 1 or args.repeat < 1:
        raise SystemExit("--values and --repeat: must be at least 1")
    cpp = not args.no_cpp
    if cpp:
        host_kernels.load()   # built before anything is timed
    adam = cpu_adam_step(args.values, args.repeat)
    rows = []
    for dt in args.dtypes:
        t = measure(args.values, dt, args.repeat, cpp)
        rows += [{"velocity_dtype": dt, "part": k, "ms": v * 1e3, "ns_per_value": v / args.values * 1e9,
                  "over_cpu_adam": v / adam} for k, v in t.items()]
    head = "| velocity | part | ms | ns per value | over DeepSpeed's CPU Adam step |"
    table = "\n".join([head, "|---|---|---|---|---|",
                       f"| - | DeepSpeed CPU Adam step | {adam * 1e3:.1f} | {adam / args.values * 1e9:.2f} | 1.00x |"] + [
        f"| {r['velocity_dtype']} | {r['part']} | {r['ms']:.1f} | {r['ns_per_value']:.2f} | "
        f"{r['over_cpu_adam']:.2f}x |" for r in rows])
    print(table)
    return write_result("host_path.py", argv, args, rows, table, cpu_adam_ms=adam * 1e3)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
