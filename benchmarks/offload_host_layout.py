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
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_7B_PARAMS = 6_738_415_616   # ds_hybrid.models' llama-7b (Llama-2-7B's shape)

# zero_optimization of each layout, on top of the 7b-24gb preset's section.
LAYOUTS = {
    "z2-offload": {"stage": 2, "offload_param": None},
    "z3-offload": {"stage": 3, "offload_param": None},
    "z3-offload-param": {"stage": 3},   # the 7b-24gb preset as it is
}

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
    out["fp32 masters"] = sum(_nbytes(t) for t in masters)
    out["fp32 gradient of the masters"] = sum(_nbytes(t.grad) for t in masters if t.grad is not None)
    return {k: v for k, v in out.items() if v}


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


def run_one(layout: str, hybrid: bool, hidden: int, layers: int, steps: int, gas: int = 1) -> dict:
    """Train one layout a few steps in this process and count its buffers."""
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
    cfg["hybrid_predict"]["enabled"] = hybrid
    cfg["hybrid_predict"]["warmup_steps"] = 1
    # The path a GPU machine takes ("auto" there): Predict steps on the 16-bit shards, no snapshot of
    # the masters. (On the CPU accelerator "auto" takes the host path, which keeps one.)
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
    st = engine.statistics()
    hybrid_bytes = {k: int(st[k]) for k in ("velocity_bytes", "device_velocity_bytes", "snapshot_bytes")
                    if hybrid and st.get(k)}
    return {"layout": layout, "hybrid": hybrid, "params": params, "stage": zero["stage"], "gas": gas,
            "offload_param": "offload_param" in zero, "buffers": buffers, "hybrid_buffers": hybrid_bytes,
            "rss_peak_above_start": peak - base,
            "ru_maxrss_above_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}


def summarise(r: dict) -> dict:
    """Bytes per parameter: DeepSpeed's host buffers, what lives on the GPU, the hybrid's host
    additions, DeepSpeed's estimate, and llama-7b's host need at these bytes per parameter."""
    p = r["params"]
    host = sum(v for k, v in r["buffers"].items() if WHERE_ON_GPU_MACHINE[k] == "host") / p
    gpu = sum(v for k, v in r["buffers"].items() if WHERE_ON_GPU_MACHINE[k] == "gpu") / p
    # The hybrid's velocity is beside the masters, in host memory (its GPU copy, where the shards
    # are on a GPU, is device memory); the snapshot is in host memory with offload_optimizer.
    extra = (r["hybrid_buffers"].get("velocity_bytes", 0) + r["hybrid_buffers"].get("snapshot_bytes", 0)) / p
    est = deepspeed_estimate(r["stage"], r["offload_param"], p)
    return {"host_bytes_per_param": round(host, 3), "gpu_bytes_per_param": round(gpu, 3),
            "hybrid_host_bytes_per_param": round(extra, 3), "deepspeed_estimate_bytes_per_param": round(est, 3),
            "counted_over_rss_peak": round((host + gpu + extra) * p / r["rss_peak_above_start"], 3),
            "llama7b_host_gib": round((host + extra) * LLAMA_7B_PARAMS / 2**30, 1),
            "llama7b_deepspeed_estimate_gib": round(est * LLAMA_7B_PARAMS / 2**30, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| layout | gradient accumulation | arm | DeepSpeed host B/param (counted) | DeepSpeed's estimate B/param (no 1.5x) | "
             "hybrid adds B/param | on the GPU B/param | llama-7b host GiB (counted) | llama-7b by DeepSpeed's estimate GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['layout']} | {r.get('gas', 1)} | {'hybrid' if r['hybrid'] else 'plain'} | {s['host_bytes_per_param']} | "
                     f"{s['deepspeed_estimate_bytes_per_param']} | {s['hybrid_host_bytes_per_param']} | "
                     f"{s['gpu_bytes_per_param']} | {s['llama7b_host_gib']} | {s['llama7b_deepspeed_estimate_gib']} |")
    return "\n".join(lines)


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
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--one", nargs=2, metavar=("LAYOUT", "HYBRID"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1] == "1", args.hidden, args.layers, args.steps,
                                             args.gas[0])))
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
                                       "--steps", str(args.steps), "--gas", str(gas)],
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
