"""``ds-hybrid memory-bench``: memory per phase, plain DeepSpeed (Full) against Predict.

For each model, one ``python -m ds_hybrid.train`` subprocess per variant on a preset (``tiny-cpu``
by default: ZeRO 1, fp32, DeepSpeed's CPU accelerator; ``--preset gpt2-124m`` or ``1b-16gb`` on a
GPU): ``full`` is plain DeepSpeed (``--baseline``: every step a Full step); the others run the
phase cycle with a short warmup and no confidence threshold, so a short run reaches Predict
steps, with the Predict direction and velocity storage of ``VARIANTS``. The memory profiler
(``ds_hybrid.memory.profiler``) records each step's peak RSS and, on a GPU, the allocator's peak
(reset every step); the tables give, per run and phase, the host peak **above the RSS the
process had before the model was built** (interpreter, libraries, corpus) and the GPU peak.
On a GPU each run is also set beside the planner's GPU estimate for it.

    ds-hybrid memory-bench                      # gpt2-tiny and gpt2-124m (~86M at vocabulary 256), CPU:
                                                # runs/memory-bench/result.json
    ds-hybrid memory-bench --models gpt2-tiny --variants full drift-int8 --out runs/mb-tiny
    ds-hybrid memory-bench --json docs/results/memory-cpu.json     # the CPU tables in docs/memory.md
    ds-hybrid memory-bench --preset gpt2-124m --models gpt2-124m --seq-len 1024 --micro-batch 16 \
        --steps 30 --variants full adam drift-fp32 drift-int8 drift-int8-park --json docs/results/memory-gpu.json
    ds-hybrid memory-bench --preset 1b-16gb --models llama-1b --gpu-mem-cap 16GB ...   # a 16 GB card
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..arguments import HelpFormatter, resolve_config
from ..dist_env import child_env
from .profiler import ALLOC_COUNTS


@dataclass(frozen=True)
class BenchModel:
    name: str
    steps: int
    micro_batch: int
    seq_len: int = 128


DEFAULT_MODELS = {
    "gpt2-tiny": BenchModel("gpt2-tiny", steps=40, micro_batch=16),
    # 86M parameters at vocabulary 256; one sequence per step keeps a step at a few seconds on 2 cores.
    "gpt2-124m": BenchModel("gpt2-124m", steps=12, micro_batch=1),
    "gpt2-test": BenchModel("gpt2-test", steps=16, micro_batch=4),
}


def _gradient_run(offload_predict: str = "device", memory: dict | None = None, **predictor) -> dict:
    """A variant of Predict steps that take their own gradient, 1 real : 3 of them, each run checked
    by the next real step; ``predictor`` and ``memory`` add to its sections. Adam's second moment
    held unless a variant says otherwise: the GPU records made before ``auto`` held it, and at the
    presets' ``betas[1]`` 0.95 ``auto`` would update it; so a variant's name says what it runs."""
    return {"predictor": {"direction": "gradient", "gradient_second_moment": "held", **predictor},
            "memory": {"offload_predict": offload_predict, **(memory or {})},
            "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3, "correction_steps": 0,
            "check": "next_step"}


# name -> hybrid_predict settings over the preset's (None: plain DeepSpeed, every step Full).
VARIANTS: dict[str, dict | None] = {
    "full": None,
    "adam": {"predictor": {"direction": "adam"}},
    "drift-fp32": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "fp32"}},
    "drift-bf16": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "bf16"}},
    "drift-int8": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "int8"}},
    # Adam moments leave the accelerator for each drift Predict run (a no-op where they live in
    # host memory already: the CPU accelerator, offload_optimizer).
    "drift-int8-park": {"predictor": {"direction": "drift"},
                        "memory": {"velocity_dtype": "int8", "park_optimizer_states": True}},
    # ... with DeepSpeed's synchronous offload_states / reload_states instead of the overlapped copies.
    "drift-int8-park-ds": {"predictor": {"direction": "drift"},
                           "memory": {"velocity_dtype": "int8", "park_optimizer_states": True,
                                      "park_overlap": False}},
    # Under offload_optimizer: the host path (masters moved every Predict step, a snapshot of them
    # for each run and before each real step) against the device path (the 16-bit shards moved,
    # the masters caught up once per kept run, the fold read back from the Adam state: no copy).
    "drift-int8-host": {"predictor": {"direction": "drift"},
                        "memory": {"velocity_dtype": "int8", "offload_predict": "host", "fold_source": "snapshot"}},
    "drift-int8-device": {"predictor": {"direction": "drift"},
                          "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                     "fold_source": "optimizer_state"}},
    # ... its runs checked by the next real step's forward instead of a verification forward per
    # Predict step (check: next_step): a Predict step is then the velocity's step into the shards alone.
    # (with the fold during the run, memory.fold_during_run: the run takes the velocity from before
    # the last real step's fold, which runs meanwhile)
    "drift-int8-device-next": {"predictor": {"direction": "drift"},
                               "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                          "fold_source": "optimizer_state", "fold_overlap": True,
                                          "fold_during_run": True},
                               "check": "next_step", "correction_steps": 0},
    # ... with the real step before a run waiting for its own fold, which otherwise runs behind the
    # next real step (memory.fold_overlap; auto takes fold_in_step below instead).
    "drift-int8-device-next-behind": {"predictor": {"direction": "drift"},
                                      "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                                 "fold_source": "optimizer_state", "fold_during_run": False,
                                                 "fold_in_step": False, "fold_overlap": True},
                                      "check": "next_step", "correction_steps": 0},
    # ... with the fold, and a kept run's commit, inside DeepSpeed's CPU Adam step, one pass
    # (memory.fold_in_step, what auto takes): no host thread beside the next forward and backward.
    "drift-int8-device-next-fused": {"predictor": {"direction": "drift"},
                                     "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                                "fold_source": "optimizer_state", "fold_in_step": True},
                                     "check": "next_step", "correction_steps": 0},
    # ... with the velocity in bf16 or fp32: no int8 quantisation (nor its noise) in the fold inside the step,
    # which on DeepSpeed's CPU accelerator made that pass 2.58x DeepSpeed's step alone against 1.54x (bf16)
    # and 1.37x (fp32) (benchmarks/fold_in_step.py --velocity, docs/results/fold-in-step-velocity.json);
    # 2 or 4 bytes a parameter beside the GPU's weights, not 1.
    **{f"drift-{d}-device-next-fused": {"predictor": {"direction": "drift"},
                                        "memory": {"velocity_dtype": d, "offload_predict": "device",
                                                   "fold_source": "optimizer_state", "fold_in_step": True},
                                        "check": "next_step", "correction_steps": 0} for d in ("bf16", "fp32")},
    # ... with the fold from the 16-bit shards' difference on the GPU (memory.fold_source: weights16):
    # no host pass after DeepSpeed's step, the velocity kept beside the shards (no upload), a kept
    # run's commit brought down from it behind the next forward and backward; the real step that
    # commits a run takes no fold.
    "drift-int8-device-next-w16": {"predictor": {"direction": "drift"},
                                   "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                              "fold_source": "weights16"},
                                   "check": "next_step", "correction_steps": 0},
    # ... with its host passes inline instead of on host threads behind the next forward and
    # backward, and apart from DeepSpeed's step (auto is the step's one pass): a kept run's commit
    # into the masters, and each real step's fold into the velocity.
    "drift-int8-device-inline": {"predictor": {"direction": "drift"},
                                 "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                            "fold_source": "optimizer_state", "commit_overlap": False,
                                            "fold_overlap": False, "fold_in_step": False}},
    # ... with the torch ops instead of kernels/host_fold.cpp for its passes over host memory: the
    # fold, the update of a 16-bit partition kept in host memory (ZeRO 3 offload_param: cpu), the commit.
    "drift-int8-device-torch": {"predictor": {"direction": "drift"},
                                "memory": {"velocity_dtype": "int8", "offload_predict": "device",
                                           "fold_source": "optimizer_state", "host_kernels": "torch"}},
    # Predict steps that take their own gradient (1 real : 3 of them, checked by the next real step),
    # under offload_optimizer on the host path (the masters moved, the gradient brought to them)
    # and on the device path (the run beside the 16-bit weights on the GPU, the masters caught up
    # once per kept run).
    "grad-host": _gradient_run("host"),
    "grad-device": _gradient_run(),
    # ... with its backward recomputing the checkpointed blocks as a real step's does, or never
    # (predictor.gradient_checkpointing true / false; grad-device's auto keeps their activations where they fit).
    **{f"grad-device-{name}": _gradient_run(gradient_checkpointing=setting)
       for name, setting in (("recompute", True), ("plain", False))},
    # ... each Predict step's gradient from half, a quarter or an eighth of its batch
    # (predictor.gradient_batch_fraction; under accumulation its first micro-batches: at 1b-16gb's 8, an
    # eighth is one): that share of its forwards and backwards, where those are a real step's dear part too.
    **{f"grad-device-{name}": _gradient_run(gradient_batch_fraction=fraction)
       for name, fraction in (("half", 0.5), ("quarter", 0.25), ("eighth", 0.125))},
    # ... half with Adam's second moment updated by each Predict gradient (predictor.gradient_second_moment:
    # updated; the offload-preset-fp32 suite's setting, which reached plain ZeRO-Offload's final loss on the
    # CPU): what the copy of v and its fold add to the GPU's Predict step, against grad-device-half.
    "grad-device-half-updated": _gradient_run(gradient_batch_fraction=0.5, gradient_second_moment="updated"),
    # ... an eighth with its backward recomputing the checkpointed blocks whatever auto would decide
    # (auto kept their activations at llama-1b's one micro-batch, near the 16 GB cap).
    "grad-device-eighth-recompute": _gradient_run(gradient_batch_fraction=0.125, gradient_checkpointing=True),
    # ... with no host thread beside the real step's backward: the next run's moments copied at its
    # first step instead of behind the real step before it (memory.gradient_prefetch: false), and
    # with them a kept run's commit inline before the backward (memory.commit_overlap: false).
    # Against grad-device: what those threads cost the real step (its backward was 410 ms against
    # plain's 349 on an H200) and what copying at the run's start costs its first Predict step.
    **{f"grad-device-{name}": _gradient_run(memory=memory)
       for name, memory in (("noprefetch", {"gradient_prefetch": False}),
                            ("inline", {"gradient_prefetch": False, "commit_overlap": False}),
                            # ... the real step before each run leaving DeepSpeed's CPU Adam step to a
                            # host thread behind the run, the GPU taking the same step (cpu_step_behind)
                            ("behind", {"cpu_step_behind": True}))},
    # ... with the run's moments in bf16 (what auto takes beside a GPU with bf16 weights; on the CPU
    # accelerator auto takes fp32), or in about a byte or half a byte a parameter with no gradient held
    # (memory.gradient_state_dtype: int8-factored, int4-factored: ds_hybrid/compact_moments.py).
    **{f"grad-device-{name}": _gradient_run(memory={"gradient_state_dtype": dtype})
       for name, dtype in (("bf16", "bf16"), ("int8f", "int8-factored"), ("int4f", "int4-factored"))},
    # ... int4-factored with a kept run's commit behind the next real step's forward and backward on a side
    # stream (memory.commit_overlap: true; auto keeps a compact run's commit inline): what that takes off the
    # real step, and what its state held through the backward adds to the peak.
    "grad-device-int4f-behind": _gradient_run(memory={"gradient_state_dtype": "int4-factored", "commit_overlap": True}),
    # ... int4-factored with the real step before each run leaving DeepSpeed's CPU Adam step behind the run
    # (memory.cpu_step_behind): the cover builds the compact state and folds the step's gradient into it, the
    # one extra copy over a run's start (the 7B route's real step without its CPU step).
    "grad-device-int4f-cpubehind": _gradient_run(memory={"gradient_state_dtype": "int4-factored",
                                                         "cpu_step_behind": True}),
    # Per-phase precision: the Predict forwards under bf16 autocast (with --precision fp32).
    "drift-int8-autocast": {"predictor": {"direction": "drift"},
                            "memory": {"velocity_dtype": "int8", "predict_autocast": "bf16"}},
    # The RSSM predictor on the CPU, and on the GPU with its kernels (dynamics.device).
    "rssm-cpu": {"predictor": {"type": "rssm", "direction": "drift"}, "memory": {"velocity_dtype": "int8"},
                 "dynamics": {"device": "cpu", "min_observations": 8}},
    "rssm-cuda": {"predictor": {"type": "rssm", "direction": "drift"}, "memory": {"velocity_dtype": "int8"},
                  "dynamics": {"device": "cuda", "min_observations": 8}},
}
PRECISIONS = ("preset", "fp32", "bf16", "fp16")
DEFAULT_VARIANTS = ("full", "adam", "drift-fp32", "drift-int8")


def run_config(micro_batch: int, steps: int, variant: dict | None = None, preset: str = "tiny-cpu",
               grad_accum: int = 1, precision: str = "preset", wall_clock: bool = False) -> dict:
    """``preset`` with the given micro batch and accumulation and a phase cycle short enough for a
    few steps; ``precision`` other than ``preset`` replaces its bf16 / fp16 sections; ``wall_clock``
    turns on DeepSpeed's ``wall_clock_breakdown`` (the engine books it per phase)."""
    from ..bench import deep_merge
    cfg, _ = resolve_config(preset, "--preset")
    if precision != "preset":
        cfg["bf16"] = {"enabled": precision == "bf16"}
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16} if precision == "fp16" else {"enabled": False}
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg.pop("train_batch_size", None)   # follows from the two above
    if wall_clock:
        cfg["wall_clock_breakdown"] = True
    cfg["hybrid_predict"].update({"warmup_steps": max(2, steps // 8), "full_steps": 2, "min_predict_steps": 2,
                                  "max_predict_steps": 4, "verify_every": 1, "correction_steps": 1,
                                  "confidence_threshold": 0.0, "predict_lr_fraction": 1.0})
    cfg["hybrid_predict"] = deep_merge(cfg["hybrid_predict"], variant or {})
    return cfg


def run_one(model: BenchModel, kind: str, out: Path, live: bool = False, preset: str = "tiny-cpu",
            grad_accum: int = 1, gpu_mem_cap: str | None = None, precision: str = "preset",
            wall_clock: bool = False, timeout_s: float | None = None, op_profile: str | None = None) -> dict:
    """One training subprocess for variant ``kind``; returns its summary.json. ``timeout_s``: the
    run is killed after that long and counts as failed (the next variants still run).
    ``op_profile``: ``ds-hybrid train --op-profile`` for the run."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "ds_config.json"
    cfg = run_config(model.micro_batch, model.steps, VARIANTS[kind], preset, grad_accum, precision, wall_clock)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    cmd = [sys.executable, "-m", "ds_hybrid.train", "--config", str(cfg_path), "--model", model.name,
           "--steps", str(model.steps), "--seq-len", str(model.seq_len), "--eval-every", str(model.steps),
           "--val-batches", "1", "--out", str(out), "--no-progress"]
    if gpu_mem_cap:
        cmd += ["--gpu-mem-cap", gpu_mem_cap]
    if op_profile:
        cmd += ["--op-profile", op_profile]
    if VARIANTS[kind] is None:
        # (its first steps booked as the hybrid runs' Warmup is, so that no Full mean has the slow first ones)
        cmd += ["--baseline", "--profile-warmup", str(cfg["hybrid_predict"]["warmup_steps"])]
    with open(out / "train.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=None if live else log, stderr=subprocess.STDOUT, env=child_env(),
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"memory-bench run {model.name}/{kind} did not finish in --run-timeout "
                               f"{timeout_s:g} s; see {out / 'train.log'}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"memory-bench run {model.name}/{kind} failed (exit {proc.returncode}); "
                           f"see {out / 'train.log'}")
    return json.loads((out / "summary.json").read_text())


def rows_from_summary(model: str, kind: str, summary: dict) -> list[dict]:
    """Per-phase rows (MB above the pre-model baseline) from a run's summary.json."""
    mem = summary["memory"]
    base = mem["baseline_rss_mb"]
    rows = []
    for phase, r in mem["phases"].items():
        rows.append({"model": model, "run": kind, "phase": phase, "steps": r["steps"],
                     "peak_above_baseline_mb": r["rss_peak_mb"] - base,
                     "mean_peak_above_baseline_mb": r["rss_peak_mean_mb"] - base,
                     "mean_end_of_step_above_baseline_mb": r["rss_mean_mb"] - base,
                     "mean_step_ms": None if r["step_time_mean_s"] is None else r["step_time_mean_s"] * 1e3,
                     # the CUDA allocator's per-step peak and what it holds at the step's end (None on CPU)
                     "gpu_peak_mb": r.get("gpu_peak_allocated_max_mb"),
                     "gpu_end_of_step_mb": r.get("gpu_allocated_max_mb"),
                     "gpu_reserved_mb": r.get("gpu_reserved_max_mb"),
                     # torch's pinned host allocator at its peak (None where torch gave no figure)
                     "pinned_host_peak_mb": r.get("pinned_host_peak_mb") if mem.get("pinned_read", True) else None,
                     # the CUDA allocator's cudaMalloc / cudaFree calls and retries, per step of the phase (None on CPU)
                     "gpu_driver_calls_per_step": [r[k] / r["steps"] for k in ALLOC_COUNTS]
                     if all(k in r for k in ALLOC_COUNTS) else None})
    return rows


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def format_table(rows: list[dict], runs: list[dict]) -> str:
    gpu = any(r.get("gpu_peak_mb") is not None for r in rows)
    head = ("| model | run | phase | steps | peak RSS above baseline MB | mean per-step peak MB | "
            "mean end-of-step MB | ms/step |")
    if gpu:
        head += (" GPU peak MB | GPU peak / full's Full | GPU end-of-step MB | GPU reserved MB | pinned host peak MB |"
                 " cudaMalloc / cudaFree / retries per step |")
    lines = [head, "|" + "---|" * head.count(" |")]
    full_peak = {r["model"]: r["gpu_peak_mb"] for r in rows
                 if r["run"] == "full" and r["phase"] == "full" and r.get("gpu_peak_mb")}
    for r in rows:
        ms = "-" if r["mean_step_ms"] is None else f"{r['mean_step_ms']:.0f}"
        line = (f"| {r['model']} | {r['run']} | {r['phase']} | {r['steps']} | {r['peak_above_baseline_mb']:.1f} | "
                f"{r['mean_peak_above_baseline_mb']:.1f} | {r['mean_end_of_step_above_baseline_mb']:.1f} | {ms} |")
        if gpu:
            ref = full_peak.get(r["model"])
            ratio = "-" if not ref or r.get("gpu_peak_mb") is None else f"{r['gpu_peak_mb'] / ref:.2f}"
            calls = r.get("gpu_driver_calls_per_step")
            line += (f" {_mb(r.get('gpu_peak_mb'))} | {ratio} | {_mb(r.get('gpu_end_of_step_mb'))} | "
                     f"{_mb(r.get('gpu_reserved_mb'))} | {_mb(r.get('pinned_host_peak_mb'))} | "
                     f"{'-' if calls is None else ' / '.join(f'{c:.1f}' for c in calls)} |")
        lines.append(line)
    lines += ["", "| model | run | parameters | baseline RSS MB | set-up peak above baseline MB | snapshot MB | "
              "velocity MB | profiler cost |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        frac = r["profiler_overhead_fraction"]
        mb = lambda b: "-" if not b else f"{b / 2**20:.1f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['run']} | {r['parameters'] / 1e6:.2f}M | {r['baseline_rss_mb']:.0f} | "
                     f"{r['setup_peak_above_baseline_mb']:.1f} | {mb(r.get('snapshot_bytes'))} | "
                     f"{mb(r.get('velocity_bytes'))} | {'-' if frac is None else f'{frac:.4%} of step time'} |")
    if any(r.get("gpu_peak_mb") is not None for r in runs):
        lines += ["", "| model | run | GPU cap | allocator peak MB | device used MB (NVML) | planner's GPU estimate MB "
                  "| estimate / device used | tokens/s in Full steps | val loss |", "|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            est, used = r.get("planner_gpu_mb"), r.get("gpu_device_used_mb")
            ratio = "-" if not est or not used else f"{est / used:.2f}"
            cap = "-" if not r.get("gpu_mem_cap_bytes") else f"{r['gpu_mem_cap_bytes'] / 1e9:.0f} GB"
            tps, loss = r.get("full_tokens_per_second"), r.get("final_val_loss")
            lines.append(f"| {r['model']} | {r['run']} | {cap} | {_mb(r.get('gpu_peak_mb'))} | {_mb(used)} | {_mb(est)} | "
                         f"{ratio} | {'-' if tps is None else f'{tps:,.0f}'} | {'-' if loss is None else f'{loss:.3f}'} |")
    if any(r.get("predictor_ms_per_step") is not None for r in runs):
        lines += ["", "| model | run | moment parking | predictor device | predictor ms per step | kernel launches | "
                  "gradient Predict steps recomputing / not | "
                  "profiler ms per record (host / CUDA / NVML) | hybrid bookkeeping ms per step of its phase |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            pm = r.get("predictor_ms_per_step")
            launches = ", ".join(f"{k} {v}" for k, v in sorted((r.get("kernel_launches") or {}).items())) or "-"
            parts = r.get("profiler_ms_per_record") or {}
            prof = " / ".join(f"{parts[k]:.2f}" for k in ("host", "cuda", "nvml") if k in parts) or "-"
            rec = (r.get("gradient_recompute") or {}).get("steps")
            rec = "-" if not rec else f"{rec['recomputed']} / {rec['plain']}"
            lines.append(f"| {r['model']} | {r['run']} | {r.get('moment_parking') or '-'} | "
                         f"{r.get('predictor_device') or '-'} | {'-' if pm is None else f'{pm:.2f}'} | {launches} | "
                         f"{rec} | {prof} | {', '.join(f'{k} {v:.1f}' for k, v in (r.get('bookkeeping_ms') or {}).items()) or '-'} |")
    lines += wall_clock_table(rows, runs)
    return "\n".join(lines)


def wall_clock_table(rows: list[dict], runs: list[dict]) -> list[str]:
    """``--wall-clock``: DeepSpeed's forward, backward (its own part and the gradient reduction, which under
    ZeRO-Offload includes the copies to the host) and optimizer-step timers per phase, ms per step, beside the
    whole step. The forward and the backward's own part over the whole step is what a Predict step that took its
    gradient on the device and skipped the rest would cost, before its own update and copies. The real steps whose
    first forward checked a predicted update come again after the phases, by the check's outcome ("checked, kept",
    "checked, rolled back": its forward ran twice): the rest of their phase's mean is the steady real step."""
    if not any(r.get("wall_clock_ms") for r in runs):
        return []
    whole = {(r["model"], r["run"], r["phase"]): r["mean_step_ms"] for r in rows}
    lines = ["", "| model | run | phase | steps | forward ms | backward ms (own + reduction) | optimizer step ms | "
             "whole step ms | (forward + backward's own) / whole |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        clock = dict(r.get("wall_clock_ms") or {})
        # The real steps that checked a predicted update, by outcome (WallClockBreakdown.summary), after the phases
        for outcome, wc in (clock.pop("checks", None) or {}).items():
            clock[f"checked, {outcome.replace('_', ' ')}"] = wc
            whole[(r["model"], r["run"], f"checked, {outcome.replace('_', ' ')}")] = wc["mean_ms"].get("whole")
        for phase, wc in clock.items():
            if phase == "real":   # the real phases together; each is listed on its own
                continue
            t, step_ms = wc["mean_ms"], whole.get((r["model"], r["run"], phase))
            share = "-" if not step_ms else f"{(t['fwd'] + t['bwd_inner']) / step_ms:.2f}"
            # A gradient Predict step's forward and backward go around DeepSpeed's timers (through
            # engine.module): the bookkeeping's `gradient` timer has them instead.
            own = (r.get("bookkeeping_ms") or {}).get("gradient") if phase == "predict" else None
            if own is not None and step_ms:
                share = f"{own / step_ms:.2f} (its own forward and backward: {own:.1f} ms, not DeepSpeed's timers)"
            lines.append(f"| {r['model']} | {r['run']} | {phase} | {wc['steps']} | {t['fwd']:.1f} | {t['bwd']:.1f} "
                         f"({t['bwd_inner']:.1f} + {t['bwd_allreduce']:.1f}) | {t['step']:.1f} | "
                         f"{'-' if step_ms is None else f'{step_ms:.1f}'} | {share} |")
    return lines


def device_used_mb(per_phase: dict) -> float | None:
    """NVML's used memory on the device, highest over the phases: the allocator's reserve plus
    the CUDA context and library workspaces, i.e. what the planner estimates (one process on
    the GPU)."""
    used = [p.get("gpu_device_used_max_mb") for p in per_phase.values()]
    used = [u for u in used if u is not None]
    return max(used) if used else None


def retable(path: Path) -> dict:
    """``--retable``: re-derive the per-run GPU figures of a saved result from its per-phase
    records (results written before a column existed) and rewrite its tables."""
    result = json.loads(path.read_text())
    for r in result["runs"]:
        if r.get("gpu_peak_mb") is not None and r.get("gpu_device_used_mb") is None:
            r["gpu_device_used_mb"] = device_used_mb(r["per_phase"])
    result["table_markdown"] = format_table(result["rows"], result["runs"])
    result["retabled"] = "per-run figures re-derived from the per-phase records by ds-hybrid memory-bench --retable"
    path.write_text(json.dumps(result, indent=2))
    print(result["table_markdown"])
    return result


def planner_gpu_mb(cfg: dict, model: str, seq_len: int, micro_batch: int) -> tuple[float | None, dict | None]:
    """The planner's GPU estimate (MB) for one bench run's config, and its items."""
    from .planner import estimate, model_shape, preset_spec
    try:
        est = estimate(model_shape(model, vocab_size=256), preset_spec(cfg, "bench run"), 1, 1, seq_len, micro_batch)
    except Exception as err:  # noqa: BLE001 - a model the planner cannot count: report, do not fail the bench
        return None, {"error": f"{type(err).__name__}: {err}"}
    return est.gpu_bytes / 2**20, {i.what: i.bytes / 2**20 for i in est.items if i.where == "gpu"}


def predictor_figures(summary: dict) -> dict:
    """A hybrid run's predictor cost per step, where it ran, the kernels it launched, how the
    moments were parked, and the profiler's cost per record split host / CUDA / NVML (ms)."""
    st = summary["statistics"]
    if "predictor_seconds" not in st:
        return {}
    steps = sum(st["steps_per_phase"].values())
    mem = summary["memory"]
    records = max(mem.get("steps_recorded") or steps, 1)
    parts = mem.get("overhead_parts_s") or {}
    return {"predictor_ms_per_step": 1e3 * st["predictor_seconds"] / steps if steps else None,
            "predictor_device": st.get("predictor_device"), "kernel_launches": st.get("kernel_launches"),
            "moment_parking": st.get("moment_parking"),
            # gradient runs whose moments were copied behind the step before them, and copies dropped as stale
            "gradient_prefetch": [st["gradient_prefetched_runs"], st["gradient_prefetch_stale"]]
            if "gradient_prefetched_runs" in st else None,
            # ZeRO 3's gradient shares queued into host memory: ms per Predict step waited for a buffer / the last adds
            "gradient_share_wait_ms": {k: 1e3 * v / max(st["steps_per_phase"].get("predict", 0), 1)
                                       for k, v in st["gradient_share_wait_seconds"].items()}
            if "gradient_share_wait_seconds" in st else None,
            # predictor.gradient_checkpointing: Predict steps that recomputed the checkpointed blocks or not, and why
            "gradient_recompute": st.get("gradient_recompute"),
            "profiler_ms_per_record": {k: 1e3 * v / records for k, v in parts.items()},
            # the hybrid's work on the masters, ms per step of the phase it runs in
            "bookkeeping_ms": _bookkeeping_ms(st)}


# Timed inside real steps: ms per real step (velocity_hold: memory.fold_during_run's copy of the
# velocity for the next run, at the end of the real step before it). The rest (the Predict step's own
# work, the velocity's upload at a run's first Predict step, a rollback) is given per Predict step.
REAL_STEP_PARTS = ("capture", "fold", "stash", "compare", "commit", "commit_wait", "fold_wait", "velocity_hold")


def _bookkeeping_ms(st: dict) -> dict:
    """ms per real step (``REAL_STEP_PARTS``) or per Predict step (the rest)."""
    n = st["steps_per_phase"]
    real = sum(v for k, v in n.items() if k != "predict")
    per = dict.fromkeys(REAL_STEP_PARTS, real)
    return {k: 1e3 * v / max(per.get(k, n.get("predict", 0)), 1) for k, v in (st.get("bookkeeping_seconds") or {}).items()}


def step_log(run_dir: Path) -> list[list] | None:
    """A run's steps, one ``[step, phase, ms, checked, cudaMalloc calls, alloc retries]`` each
    (``checked``: the step's first forward kept (true) or rolled back (false) a predicted update;
    the allocator's calls None on CPU), from its steps.jsonl and memory.csv: which real steps were
    the slow ones, where a phase's mean cannot say."""
    steps = run_dir / "steps.jsonl"
    if not steps.is_file():
        return None
    alloc: dict[int, tuple] = {}
    mem = run_dir / "memory.csv"
    if mem.is_file():
        with open(mem, newline="") as f:
            for row in csv.DictReader(f):
                n = lambda k: int(float(row[k])) if row.get(k) not in (None, "") else None  # noqa: E731
                alloc[int(row["step"])] = (n("gpu_device_allocs"), n("gpu_alloc_retries"))
    out = []
    for line in steps.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        ms = r.get("step_time_s")
        out.append([r["step"], r["phase"], None if ms is None else round(ms * 1e3, 2), r.get("checked"),
                    *alloc.get(r["step"], (None, None))])
    return out


def _gpu_name(runs: list[dict]) -> str | None:
    """The GPU the runs trained on, as they say it. (Not asked here: torch would create a CUDA
    context in this process, and every later run's NVML device figure would include it.)"""
    return next((r["gpu"] for r in runs if r.get("gpu")), None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="ds-hybrid memory-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "gpt2-124m"],
                   help=f"models to run (known step budgets: {', '.join(DEFAULT_MODELS)}; others get 20 steps)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS),
                   metavar="VARIANT", help=f"runs per model, of: {', '.join(sorted(VARIANTS))} (full: plain DeepSpeed)")
    p.add_argument("--steps", type=int, default=None, help="override every model's step budget")
    p.add_argument("--micro-batch", type=int, default=None, help="override every model's micro batch")
    p.add_argument("--seq-len", type=int, default=None, help="override every model's sequence length (128)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps per optimizer step")
    p.add_argument("--preset", default="tiny-cpu",
                   help="the ds_config preset the runs start from (gpt2-124m, 1b-16gb on a GPU)")
    p.add_argument("--precision", default="preset", choices=PRECISIONS,
                   help="replace the preset's bf16 / fp16 sections (fp16 on a GPU only)")
    p.add_argument("--gpu-mem-cap", default=None, metavar="SIZE",
                   help="cap each run's CUDA allocator (ds-hybrid train --gpu-mem-cap), e.g. 16GB")
    p.add_argument("--out", default="runs/memory-bench", help="run folders go here")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the result here; the hybrid runs' memory.png are copied next to it (default: "
                        "--out's result.json)")
    p.add_argument("--wall-clock", action="store_true",
                   help="time DeepSpeed's forward, backward and optimizer step per phase (wall_clock_breakdown; "
                        "its timers synchronise the device, in every run alike)")
    p.add_argument("--op-profile", default=None, metavar="FIRST:LAST",
                   help="each run's operators over steps FIRST to LAST (ds-hybrid train --op-profile), into its "
                        "record; the step times then include the profiler's cost; tabulate with "
                        "python -m ds_hybrid.step_profile JSON --against full")
    p.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a run still going after this long and go on with the next (it is listed as failed)")
    p.add_argument("--live", action="store_true", help="show the runs' output")
    p.add_argument("--retable", type=Path, default=None, metavar="JSON",
                   help="run nothing: re-derive a saved result's per-run figures and rewrite its tables")
    args = p.parse_args(argv)
    if args.retable is not None:
        if not args.retable.is_file():
            raise SystemExit(f"--retable: no such file {args.retable}")
        return retable(args.retable)
    if args.steps is not None and args.steps < 4:
        raise SystemExit(f"--steps: must be at least 4, for a warmup and a Predict run (got {args.steps})")
    if args.run_timeout is not None and args.run_timeout <= 0:
        raise SystemExit(f"--run-timeout: must be more than 0 seconds (got {args.run_timeout:g})")
    for flag in ("micro_batch", "seq_len", "grad_accum"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be at least 1 (got {v})")
    resolve_config(args.preset, "--preset")   # a bad --preset fails before any run
    start = time.time()
    out = Path(args.out)
    jp = Path(args.json) if args.json else out / "result.json"
    rows, runs, failed = [], [], []
    for name in args.models:
        spec = DEFAULT_MODELS.get(name, BenchModel(name, steps=20, micro_batch=4))
        spec = BenchModel(spec.name, args.steps or spec.steps, args.micro_batch or spec.micro_batch,
                          args.seq_len or spec.seq_len)
        if args.op_profile:   # (refused before any run starts)
            from ..step_profile import parse_range
            parse_range(args.op_profile, spec.steps)
        for kind in args.variants:
            print(f"memory-bench: {name} {kind} ({spec.steps} steps, micro batch {spec.micro_batch} x "
                  f"{spec.seq_len})", flush=True)
            try:
                summary = run_one(spec, kind, out / f"{name}-{kind}", args.live, args.preset, args.grad_accum,
                                  args.gpu_mem_cap, args.precision, args.wall_clock, args.run_timeout,
                                  args.op_profile)
            except RuntimeError as e:
                # One run's failure (an out-of-memory under a cap, say) must not cost the others' figures:
                # it is recorded with its log's tail and the next variant runs.
                log = out / f"{name}-{kind}" / "train.log"
                tail = log.read_text(errors="replace").splitlines()[-40:] if log.is_file() else []
                print(f"memory-bench: {e}\n" + "\n".join(tail[-10:]), flush=True)
                failed.append({"model": name, "run": kind, "error": str(e), "log_tail": tail})
                _write_result(jp, argv, args, start, rows, runs, failed, complete=False)
                continue
            mem = summary["memory"]
            rows += rows_from_summary(name, kind, summary)
            gpu = {}
            if mem.get("process_peak_gpu_allocated_mb"):
                est, items = planner_gpu_mb(summary["ds_config"], name, spec.seq_len, spec.micro_batch)
                full = mem["phases"].get("full") or {}
                tokens = spec.micro_batch * args.grad_accum * spec.seq_len
                gpu = {"gpu_peak_mb": mem["process_peak_gpu_allocated_mb"],
                       "gpu_device_used_mb": device_used_mb(mem["phases"]), "gpu_mem_cap_bytes":
                       summary.get("gpu_mem_cap_bytes"), "planner_gpu_mb": est, "planner_gpu_items_mb": items,
                       "full_tokens_per_second": tokens / full["step_time_mean_s"]
                       if full.get("step_time_mean_s") else None,
                       "final_val_loss": summary["final_val_loss"]}
            runs.append({"model": name, "run": kind, "gpu": (summary.get("host") or {}).get("gpu"),
                         "parameters": summary["parameters"], "steps": spec.steps,
                         "micro_batch": spec.micro_batch, "seq_len": spec.seq_len,
                         "baseline_rss_mb": mem["baseline_rss_mb"],
                         "setup_peak_above_baseline_mb": mem["setup_peak_rss_mb"] - mem["baseline_rss_mb"],
                         "process_peak_rss_mb": mem["process_peak_rss_mb"],
                         "profiler_overhead_fraction": mem["overhead_fraction"],
                         "profiler_us_per_step": mem["overhead_us_per_step"],
                         "steps_per_phase": summary["statistics"]["steps_per_phase"],
                         "snapshot_bytes": summary["statistics"].get("snapshot_bytes"),
                         "velocity_bytes": summary["statistics"].get("velocity_bytes"),
                         "wall_clock_ms": summary["statistics"].get("wall_clock_breakdown"),
                         **predictor_figures(summary),
                         "per_phase": mem["phases"], "spikes": mem["spikes"], "out": str(out / f"{name}-{kind}"),
                         "step_log": step_log(out / f"{name}-{kind}"),
                         "accelerator": summary["host"]["accelerator"], **gpu,
                         # (--op-profile: those steps ran under torch.profiler, their step times with its cost)
                         **({"op_profile_steps": summary["op_profile"]["steps"], "op_profile": summary["op_profile"]}
                            if summary.get("op_profile") else {})})
            _write_result(jp, argv, args, start, rows, runs, failed, complete=False)   # kept if a later run is cut off
    result = _write_result(jp, argv, args, start, rows, runs, failed, complete=True)
    print(result["table_markdown"])
    for r in runs:
        png = Path(r["out"]) / "memory.png"
        if r["run"] != "full" and png.is_file():
            shutil.copyfile(png, jp.parent / f"{jp.stem}-{r['model']}-{r['run']}.png")
    print(f"wrote {jp} ({result['seconds']:.0f} s)")
    if failed:
        raise SystemExit(f"memory-bench: {len(failed)} run(s) failed: "
                         + ", ".join(f"{f['model']}/{f['run']}" for f in failed) + f" (their log tails are in {jp})")
    return result


def _write_result(jp: Path, argv: list[str] | None, args: argparse.Namespace, start: float, rows: list, runs: list,
                  failed: list, complete: bool) -> dict:
    """Writes the result so far: after every run, so that a bench cut off by a time limit keeps what it ran."""
    table = format_table(rows, runs)
    result = {"command": "ds-hybrid memory-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "preset": args.preset, "precision": args.precision, "grad_accum": args.grad_accum,
              "gpu_mem_cap": args.gpu_mem_cap,
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "gpu": _gpu_name(runs)},
              "seconds": round(time.time() - start, 1),
              "measure": "per-step peak RSS (VmHWM reset every step) minus the RSS before the model was built; "
                         "on a GPU also torch.cuda.max_memory_allocated, reset every step",
              "complete": complete, "failed": failed,
              "rows": rows, "runs": runs, "table_markdown": table}
    jp.parent.mkdir(parents=True, exist_ok=True)
    jp.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
