"""``ds-hybrid memory-bench``: host memory per phase on the CPU, plain DeepSpeed (Full) against Predict.

For each model, one ``python -m ds_hybrid.train`` subprocess per variant on the ``tiny-cpu`` preset
(ZeRO 1, fp32, DeepSpeed's CPU accelerator): ``full`` is plain DeepSpeed (``--baseline``: every step
a Full step); the others run the phase cycle with a short warmup and no confidence threshold, so a
short run reaches Predict steps, with the Predict direction and velocity storage of ``VARIANTS``.
The memory profiler (``ds_hybrid.memory.profiler``) records each step's peak RSS; the table gives,
per run and phase, the peak and the mean per-step peak **above the RSS the process had before the
model was built** (interpreter, libraries, corpus).

    ds-hybrid memory-bench                      # gpt2-tiny and gpt2-124m (~86M at vocabulary 256)
    ds-hybrid memory-bench --models gpt2-tiny --variants full drift-int8 --json runs/memory-bench/result.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .planner import REPO_ROOT, _child_env


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


# name -> hybrid_predict settings over the preset's (None: plain DeepSpeed, every step Full).
VARIANTS: dict[str, dict | None] = {
    "full": None,
    "adam": {"predictor": {"direction": "adam"}},
    "drift-fp32": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "fp32"}},
    "drift-bf16": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "bf16"}},
    "drift-int8": {"predictor": {"direction": "drift"}, "memory": {"velocity_dtype": "int8"}},
}
DEFAULT_VARIANTS = ("full", "adam", "drift-fp32", "drift-int8")


def run_config(micro_batch: int, steps: int, variant: dict | None = None) -> dict:
    """tiny-cpu with the given micro batch and a phase cycle short enough for a few steps."""
    from ..bench import deep_merge
    from ..train import resolve_config
    cfg, _ = resolve_config("tiny-cpu")
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["hybrid_predict"].update({"warmup_steps": max(2, steps // 8), "full_steps": 2, "min_predict_steps": 2,
                                  "max_predict_steps": 4, "verify_every": 1, "correction_steps": 1,
                                  "confidence_threshold": 0.0, "predict_lr_fraction": 1.0})
    cfg["hybrid_predict"] = deep_merge(cfg["hybrid_predict"], variant or {})
    return cfg


def run_one(model: BenchModel, kind: str, out: Path, live: bool = False) -> dict:
    """One training subprocess for variant ``kind``; returns its summary.json."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "ds_config.json"
    cfg_path.write_text(json.dumps(run_config(model.micro_batch, model.steps, VARIANTS[kind]), indent=2))
    cmd = [sys.executable, "-m", "ds_hybrid.train", "--config", str(cfg_path), "--model", model.name,
           "--steps", str(model.steps), "--seq-len", str(model.seq_len), "--eval-every", str(model.steps),
           "--val-batches", "1", "--out", str(out), "--no-progress"]
    if VARIANTS[kind] is None:
        cmd.append("--baseline")
    with open(out / "train.log", "w") as log:
        proc = subprocess.run(cmd, stdout=None if live else log, stderr=subprocess.STDOUT, env=_child_env())
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
                     "mean_step_ms": None if r["step_time_mean_s"] is None else r["step_time_mean_s"] * 1e3})
    return rows


def format_table(rows: list[dict], runs: list[dict]) -> str:
    lines = ["| model | run | phase | steps | peak RSS above baseline MB | mean per-step peak MB | "
             "mean end-of-step MB | ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "-" if r["mean_step_ms"] is None else f"{r['mean_step_ms']:.0f}"
        lines.append(f"| {r['model']} | {r['run']} | {r['phase']} | {r['steps']} | {r['peak_above_baseline_mb']:.1f} | "
                     f"{r['mean_peak_above_baseline_mb']:.1f} | {r['mean_end_of_step_above_baseline_mb']:.1f} | {ms} |")
    lines += ["", "| model | run | parameters | baseline RSS MB | set-up peak above baseline MB | snapshot MB | "
              "velocity MB | profiler cost |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        frac = r["profiler_overhead_fraction"]
        mb = lambda b: "-" if not b else f"{b / 2**20:.1f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['run']} | {r['parameters'] / 1e6:.2f}M | {r['baseline_rss_mb']:.0f} | "
                     f"{r['setup_peak_above_baseline_mb']:.1f} | {mb(r.get('snapshot_bytes'))} | "
                     f"{mb(r.get('velocity_bytes'))} | {'-' if frac is None else f'{frac:.4%} of step time'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="ds-hybrid memory-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "gpt2-124m"],
                   help=f"models to run (known step budgets: {', '.join(DEFAULT_MODELS)}; others get 20 steps)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS),
                   help="runs per model: full (plain DeepSpeed), adam, drift-fp32, drift-bf16, drift-int8")
    p.add_argument("--steps", type=int, default=None, help="override every model's step budget")
    p.add_argument("--micro-batch", type=int, default=None, help="override every model's micro batch")
    p.add_argument("--out", default="runs/memory-bench", help="run folders go here")
    p.add_argument("--json", default=str(REPO_ROOT / "docs" / "results" / "memory-cpu.json"),
                   help="write the result here (the hybrid runs' memory.png are copied next to it)")
    p.add_argument("--live", action="store_true", help="show the runs' output")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 4:
        raise SystemExit(f"--steps: must be at least 4, for a warmup and a Predict run (got {args.steps})")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise SystemExit(f"--micro-batch: must be at least 1 (got {args.micro_batch})")
    start = time.time()
    out = Path(args.out)
    rows, runs = [], []
    for name in args.models:
        spec = DEFAULT_MODELS.get(name, BenchModel(name, steps=20, micro_batch=4))
        spec = BenchModel(spec.name, args.steps or spec.steps, args.micro_batch or spec.micro_batch, spec.seq_len)
        for kind in args.variants:
            print(f"memory-bench: {name} {kind} ({spec.steps} steps, micro batch {spec.micro_batch} x "
                  f"{spec.seq_len})", flush=True)
            summary = run_one(spec, kind, out / f"{name}-{kind}", args.live)
            mem = summary["memory"]
            rows += rows_from_summary(name, kind, summary)
            runs.append({"model": name, "run": kind, "parameters": summary["parameters"], "steps": spec.steps,
                         "micro_batch": spec.micro_batch, "seq_len": spec.seq_len,
                         "baseline_rss_mb": mem["baseline_rss_mb"],
                         "setup_peak_above_baseline_mb": mem["setup_peak_rss_mb"] - mem["baseline_rss_mb"],
                         "process_peak_rss_mb": mem["process_peak_rss_mb"],
                         "profiler_overhead_fraction": mem["overhead_fraction"],
                         "profiler_us_per_step": mem["overhead_us_per_step"],
                         "steps_per_phase": summary["statistics"]["steps_per_phase"],
                         "snapshot_bytes": summary["statistics"].get("snapshot_bytes"),
                         "velocity_bytes": summary["statistics"].get("velocity_bytes"),
                         "per_phase": mem["phases"], "spikes": mem["spikes"], "out": str(out / f"{name}-{kind}")})
    table = format_table(rows, runs)
    print(table)
    result = {"command": "ds-hybrid memory-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "preset": "tiny-cpu (ZeRO 1, fp32, CPU accelerator)", "date": time.strftime("%Y-%m-%d %H:%M"),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "seconds": round(time.time() - start, 1),
              "measure": "per-step peak RSS (VmHWM reset every step) minus the RSS before the model was built",
              "rows": rows, "runs": runs, "table_markdown": table}
    if args.json:
        jp = Path(args.json)
        jp.parent.mkdir(parents=True, exist_ok=True)
        jp.write_text(json.dumps(result, indent=2))
        for r in runs:
            png = Path(r["out"]) / "memory.png"
            if r["run"] != "full" and png.is_file():
                shutil.copyfile(png, jp.parent / f"{jp.stem}-{r['model']}-{r['run']}.png")
        print(f"wrote {jp} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
