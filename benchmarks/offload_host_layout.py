"""What DeepSpeed keeps in host memory per parameter under ZeRO-Offload, buffer by buffer.

DeepSpeed's estimators (``estimate_zero2/3_model_states_mem_needs``) count 16 bytes per
parameter of host memory for ZeRO 2 with ``offload_optimizer: cpu`` and 18 for ZeRO 3 with
``offload_param: cpu`` too, times a 1.5 safety factor. Whether a 7B model fits a 128 GB host
turns on the real figure, so this counts the buffers DeepSpeed 0.19.8 actually allocates: it
trains a Llama-architecture model a few steps on DeepSpeed's CPU accelerator for each offload
layout, then sums the optimizer's tensors by name (fp32 masters, their gradient buffers, Adam's
moments, the 16-bit copies) and says where each one lives on a GPU machine (read from
DeepSpeed's source: ``stage_1_and_2.py`` and ``stage3.py`` put them on ``self.device``, the CPU,
under ``offload_optimizer``). The counts are exact (bytes over parameters); the process's RSS
beside them is a check that nothing large is missed. With ``--hybrid`` each layout also runs
with the hybrid on (the 7b-24gb preset's section: drift, int8 velocity, the device path a GPU
machine takes) and reports the host bytes it adds; its velocity's copy beside 16-bit shards on a
GPU (the same bytes again, in device memory) is not in the host figure.

    python benchmarks/offload_host_layout.py --json docs/results/offload-host-layout.json

Each layout and arm runs in its own process (about a minute each on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_7B_PARAMS = 6_738_415_616   # ds_hybrid.models' llama-7b (Llama-2-7B's shape)

# zero_optimization of each layout, on top of the 7b-24gb preset's section. The NVMe layouts
# (ZeRO-Infinity) swap into a folder of their own ("nvme_path" is filled in per run) with the
# 50b-24gb-nvme preset's swap settings: the 7b-24gb-nvme preset's layout (the optimizer on NVMe,
# the 16-bit weights in host memory) and the 50b one's (both on NVMe).
NVME_OPTIMIZER = {"device": "nvme", "pin_memory": True, "buffer_count": 4, "fast_init": False}
LAYOUTS = {
    "z2-offload": {"stage": 2, "offload_param": None},
    "z3-offload": {"stage": 3, "offload_param": None},
    "z3-offload-param": {"stage": 3},   # the 7b-24gb preset as it is
    "z3-nvme-optimizer": {"stage": 3, "offload_optimizer": NVME_OPTIMIZER},
    "z3-nvme": {"stage": 3, "offload_optimizer": NVME_OPTIMIZER,
                "offload_param": {"device": "nvme", "pin_memory": True, "buffer_count": 5,
                                  "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}},
}
NVME_AIO = {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True}

# Where each counted buffer lives on a GPU machine under offload_optimizer: cpu (DeepSpeed 0.19.8).
WHERE_ON_GPU_MACHINE = {
    "fp32 masters": "host",
    "fp32 gradient of the masters": "host",
    "Adam moments": "host",
    "16-bit copy for the upload (param_buffer_of_bit16_for_cpu_offload_groups)": "host",
    "16-bit gradient partitions (grad_partitions_flat_buffer)": "host",
    "16-bit weights (param_groups_fp16_flat_cpu_memory)": "host",
    "16-bit weights (bit16_groups_flat)": "gpu",
    "16-bit weights (lp_param_buffer)": "gpu",
    "16-bit gradient accumulation per parameter (accumulated_grads_in_cpu)": "host",
    # ZeRO-Infinity (offload_optimizer: nvme): the masters, moments and their fp32 gradients live on
    # NVMe; in memory, pinned swap buffers sized by the largest optimizer sub-group (and
    # offload_param: nvme's by its buffer_size), and one sub-group's fp32 gradient.
    "fp32 optimizer swap buffers (optimizer_swapper, buffer_count x largest sub-group)": "host",
    "fp32 gradient of one swapped sub-group (initialize_optimizer_states' gradient_buffer)": "host",
    "16-bit weight swap buffers (offload_param: nvme, buffer_count x buffer_size)": "host",
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def _nbytes(t) -> int:
    import torch
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def count_buffers(opt, stage: int) -> dict[str, int]:
    """The optimizer's large tensors by what they hold (views of another counted tensor are not
    counted twice: ZeRO 3's fp16_partitioned_groups_flat are views of its flat buffers)."""
    out = {"Adam moments": sum(_nbytes(v) for st in opt.optimizer.state.values() for v in st.values())}
    if stage < 3:
        masters = opt.single_partition_of_fp32_groups
        out["16-bit copy for the upload (param_buffer_of_bit16_for_cpu_offload_groups)"] = sum(
            _nbytes(t) for t in getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        out["16-bit weights (bit16_groups_flat)"] = sum(_nbytes(t) for t in opt.bit16_groups_flat)
    else:
        masters = opt.fp32_partitioned_groups_flat
        out["16-bit gradient partitions (grad_partitions_flat_buffer)"] = _nbytes(opt.grad_partitions_flat_buffer)
        out["16-bit weights (param_groups_fp16_flat_cpu_memory)"] = sum(
            _nbytes(t) for t in getattr(opt, "param_groups_fp16_flat_cpu_memory", []) if t.numel() > 1)
        out["16-bit weights (lp_param_buffer)"] = _nbytes(getattr(opt, "lp_param_buffer", None))
    # ZeRO 1/2 under offload with gradient_accumulation_steps > 1: one 16-bit buffer per
    # parameter that the micro-batches' gradients gather in (async_accumulate_grad_in_cpu_via_gpu)
    out["16-bit gradient accumulation per parameter (accumulated_grads_in_cpu)"] = sum(
        _nbytes(t) for t in getattr(opt, "accumulated_grads_in_cpu", {}).values())
    swapper = getattr(opt, "optimizer_swapper", None) if stage == 3 else None
    if swapper is not None:   # offload_optimizer: nvme
        out["fp32 optimizer swap buffers (optimizer_swapper, buffer_count x largest sub-group)"] = sum(
            _nbytes(t) for t in swapper.swap_buffer_manager.all_buffers)
        first = next((p for g in opt.fp16_groups for p in g), None)
        param_swapper = getattr(first, "nvme_swapper", None)
        if param_swapper is not None:
            out["16-bit weight swap buffers (offload_param: nvme, buffer_count x buffer_size)"] = \
                _nbytes(param_swapper.buffers)
    out["fp32 masters"] = sum(_nbytes(t) for t in masters)
    # A swapped sub-group's gradient is a view of one buffer shared by them all: counted once.
    grads, shared = 0, {}
    for i, t in enumerate(masters):
        if t.grad is None:
            continue
        if swapper is not None and opt._swappable_optimizer_subgroup(i):
            shared[t.grad.untyped_storage().data_ptr()] = t.grad.untyped_storage().nbytes()
        else:
            grads += _nbytes(t.grad)
    out["fp32 gradient of the masters"] = grads
    out["fp32 gradient of one swapped sub-group (initialize_optimizer_states' gradient_buffer)"] = sum(shared.values())
    return {k: v for k, v in out.items() if v}


def swap_folder_bytes(path: Path) -> int:
    """Bytes in the run's NVMe swap folder (what ZeRO-Infinity keeps on the drive)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def deepspeed_estimate(stage: int, offload_param: bool, params: int) -> float:
    """DeepSpeed's own host estimate for one GPU, without its 1.5 buffer factor."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        cpu, _ = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=True, additional_buffer_factor=1.0)
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        cpu, _, _ = estimate_zero3_model_states_mem_needs(params, 1, 1, 1, cpu_offload=True,
                                                          cpu_offload_params=offload_param, zero_init=True,
                                                          additional_buffer_factor=1.0)
    return cpu / params


def run_one(layout: str, hybrid: bool, hidden: int, layers: int, steps: int, gas: int = 1,
            sub_group_size: int | None = None, swap_dir: str | None = None) -> dict:
    """Train one layout a few steps in this process and count its buffers (an NVMe layout swaps
    into a fresh folder under ``swap_dir``, removed after the count)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import ds_hybrid

    cfg = json.loads((ROOT / "ds_configs" / "7b-24gb.json").read_text())
    cfg["gradient_accumulation_steps"] = gas
    zero = cfg["zero_optimization"]
    for key, value in LAYOUTS[layout].items():
        if value is None:
            zero.pop(key, None)
        else:
            zero[key] = value
    if zero["stage"] < 3:
        for key in [k for k in zero if k.startswith("stage3_") or k == "sub_group_size"]:
            zero.pop(key)
    elif sub_group_size:
        zero["sub_group_size"] = sub_group_size
    swap = None
    if zero["offload_optimizer"]["device"] == "nvme":
        swap = Path(tempfile.mkdtemp(prefix="host-layout-swap-", dir=swap_dir))
        zero["offload_optimizer"] = dict(zero["offload_optimizer"], nvme_path=str(swap))
        if zero.get("offload_param", {}).get("device") == "nvme":
            zero["offload_param"] = dict(zero["offload_param"], nvme_path=str(swap))
        cfg["aio"] = NVME_AIO
    cfg["hybrid_predict"]["enabled"] = hybrid
    cfg["hybrid_predict"]["warmup_steps"] = 1
    # The path a GPU machine takes ("auto" there): Predict steps on the 16-bit shards, no snapshot of
    # the masters. (On the CPU accelerator "auto" takes the host path, which keeps one.)
    # (Not where the 16-bit partitions are on NVMe, whose Predict steps swap them: "auto" there.)
    if zero.get("offload_param", {}).get("device") != "nvme":
        cfg["hybrid_predict"]["memory"]["offload_predict"] = "device"
    base = _rss()
    keep = HfDeepSpeedConfig(cfg) if zero["stage"] == 3 else None   # built under zero.Init, as ds-hybrid train
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=32000,
        max_position_embeddings=256))
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = ds_hybrid.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del keep
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))
    peak = 0
    for _ in range(steps):
        engine.train_step([{"input_ids": ids, "labels": ids}] * gas)
        peak = max(peak, _rss())
    buffers = count_buffers(engine.optimizer, zero["stage"])
    nvme = {}
    if swap is not None:
        opt = engine.optimizer
        nvme = {"nvme_bytes": swap_folder_bytes(swap), "sub_group_numels": [int(n) for n in
                                                                          opt.fp16_partitioned_groups_flat_numel],
                "optimizer_buffer_count": zero["offload_optimizer"]["buffer_count"]}
        shutil.rmtree(swap, ignore_errors=True)
    st = engine.statistics()
    hybrid_bytes = {k: int(st[k]) for k in ("velocity_bytes", "device_velocity_bytes", "snapshot_bytes")
                    if hybrid and st.get(k)}
    return {"layout": layout, "hybrid": hybrid, "params": params, "stage": zero["stage"], "gas": gas,
            "offload_param": "offload_param" in zero, "buffers": buffers, "hybrid_buffers": hybrid_bytes, **nvme,
            "rss_peak_above_start": peak - base,
            "ru_maxrss_above_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}


# The buffers ZeRO-Infinity sizes by its sub-groups and swap settings, not by the parameters.
SWAP_SIZED = ("fp32 optimizer swap buffers (optimizer_swapper, buffer_count x largest sub-group)",
              "fp32 gradient of one swapped sub-group (initialize_optimizer_states' gradient_buffer)",
              "16-bit weight swap buffers (offload_param: nvme, buffer_count x buffer_size)")


def summarise(r: dict) -> dict:
    """Bytes per parameter: DeepSpeed's host buffers, what lives on the GPU, the hybrid's host
    additions, DeepSpeed's estimate, and llama-7b's host need at these bytes per parameter. An
    NVMe layout's swap buffers are counted apart (their size is the largest sub-group's, not a
    parameter count's), with the bytes on the drive."""
    p = r["params"]
    host = sum(v for k, v in r["buffers"].items() if WHERE_ON_GPU_MACHINE[k] == "host" and k not in SWAP_SIZED) / p
    gpu = sum(v for k, v in r["buffers"].items() if WHERE_ON_GPU_MACHINE[k] == "gpu") / p
    # The hybrid's velocity is beside the masters, in host memory (its GPU copy, where the shards
    # are on a GPU, is device memory); the snapshot is in host memory with offload_optimizer.
    extra = (r["hybrid_buffers"].get("velocity_bytes", 0) + r["hybrid_buffers"].get("snapshot_bytes", 0)) / p
    swap = sum(v for k, v in r["buffers"].items() if k in SWAP_SIZED)
    out = {"host_bytes_per_param": round(host, 3), "gpu_bytes_per_param": round(gpu, 3),
           "hybrid_host_bytes_per_param": round(extra, 3),
           "counted_over_rss_peak": round(((host + gpu + extra) * p + swap) / r["rss_peak_above_start"], 3)}
    if "nvme_bytes" in r:   # (DeepSpeed's estimators do not count NVMe layouts)
        largest = max(r["sub_group_numels"])
        return {**out, "swap_buffer_bytes": swap, "largest_sub_group": largest,
                "optimizer_swap_bytes_over_largest_sub_group": round(sum(
                    r["buffers"].get(k, 0) for k in SWAP_SIZED[:2]) / largest, 3),
                "nvme_bytes_per_param": round(r["nvme_bytes"] / p, 3)}
    est = deepspeed_estimate(r["stage"], r["offload_param"], p)
    return {**out, "deepspeed_estimate_bytes_per_param": round(est, 3),
            "llama7b_host_gib": round((host + extra) * LLAMA_7B_PARAMS / 2**30, 1),
            "llama7b_deepspeed_estimate_gib": round(est * LLAMA_7B_PARAMS / 2**30, 1)}


def table(rows: list[dict]) -> str:
    lines = []
    cpu = [r for r in rows if "nvme_bytes" not in r]
    nvme = [r for r in rows if "nvme_bytes" in r]
    if cpu:
        lines += ["| layout | gradient accumulation | arm | DeepSpeed host B/param (counted) | DeepSpeed's estimate B/param (no 1.5x) | "
                  "hybrid adds B/param | on the GPU B/param | llama-7b host GiB (counted) | llama-7b by DeepSpeed's estimate GiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in cpu:
            s = r["summary"]
            lines.append(f"| {r['layout']} | {r.get('gas', 1)} | {'hybrid' if r['hybrid'] else 'plain'} | {s['host_bytes_per_param']} | "
                         f"{s['deepspeed_estimate_bytes_per_param']} | {s['hybrid_host_bytes_per_param']} | "
                         f"{s['gpu_bytes_per_param']} | {s['llama7b_host_gib']} | {s['llama7b_deepspeed_estimate_gib']} |")
    if nvme:
        lines += ["" if cpu else None, "| layout | gradient accumulation | arm | DeepSpeed host B/param (counted, "
                  "without the swap buffers) | swap buffers MiB (counted) | largest sub-group | optimizer swap "
                  "buffers B per element of it | hybrid adds B/param | on NVMe B/param |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in nvme:
            s = r["summary"]
            lines.append(f"| {r['layout']} | {r.get('gas', 1)} | {'hybrid' if r['hybrid'] else 'plain'} | "
                         f"{s['host_bytes_per_param']} | {s['swap_buffer_bytes'] / 2**20:.1f} | "
                         f"{s['largest_sub_group']} | {s['optimizer_swap_bytes_over_largest_sub_group']} | "
                         f"{s['hybrid_host_bytes_per_param']} | {s['nvme_bytes_per_param']} |")
    return "\n".join(x for x in lines if x is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each layout with the hybrid on (default: on)")
    ap.add_argument("--hidden", type=int, default=768, help="model width (default 768: ~134M parameters)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gas", type=int, nargs="+", default=[1],
                    help="gradient_accumulation_steps to count each layout at (default 1; above 1 ZeRO 1/2 "
                         "keep a 16-bit accumulation buffer per parameter in host memory)")
    ap.add_argument("--sub-group-size", type=int, default=None,
                    help="ZeRO 3's sub_group_size (default: the 7b-24gb preset's, 1e9; the NVMe layouts' swap "
                         "buffers are sized by the largest sub-group)")
    ap.add_argument("--swap-dir", default=None,
                    help="where the NVMe layouts' swap folders go (default: the system's temporary folder)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--one", nargs=2, metavar=("LAYOUT", "HYBRID"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1] == "1", args.hidden, args.layers, args.steps,
                                             args.gas[0], args.sub_group_size, args.swap_dir)))
        return 0
    # Each run is rank 0 of 1 on a port of its own (not one this process, or a test, holds).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    rows = []
    for gas in args.gas:
        for layout in args.layouts:
            for hybrid in ([False, True] if args.hybrid else [False]):
                proc = subprocess.run([sys.executable, __file__, "--one", layout, str(int(hybrid)),
                                       "--hidden", str(args.hidden), "--layers", str(args.layers),
                                       "--steps", str(args.steps), "--gas", str(gas),
                                       *(["--sub-group-size", str(args.sub_group_size)] if args.sub_group_size else []),
                                       *(["--swap-dir", args.swap_dir] if args.swap_dir else [])],
                                      capture_output=True, text=True, cwd=ROOT, env=env)
                found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not found:
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                    raise SystemExit(f"{layout} ({'hybrid' if hybrid else 'plain'}, gas {gas}) failed: "
                                     f"rc {proc.returncode}")
                r = json.loads(found[0][len("RESULT "):])
                r["summary"] = summarise(r)
                rows.append(r)
                print(f"{layout} {'hybrid' if hybrid else 'plain'} gas {gas}: {r['summary']}", flush=True)
    print(table(rows))
    if args.json:
        import deepspeed
        import torch
        args.json.write_text(json.dumps({
            "command": "python benchmarks/offload_host_layout.py " + " ".join(argv or sys.argv[1:]),
            "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "where_on_a_gpu_machine": WHERE_ON_GPU_MACHINE, "rows": rows, "table": table(rows)}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
