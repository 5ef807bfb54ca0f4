"""A plain step's time with bf16 on and off on this CPU: the same config, model and batches, run
after run in alternation, each run its own process with the machine's cores (what ``ds-hybrid
train``'s bf16 note points at; below AVX-512 PyTorch's bf16 steps cost several fp32 ones).

    python benchmarks/cpu_bf16.py --config benchmarks/offload-preset.json --steps 20 --reps 2 --json OUT.json

Prints a table (mean Full-step ms of each run, the ratio of their means) and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ds_hybrid.dist_env import child_env


def _run(config: Path, steps: int, model: str, out: Path) -> float:
    """One plain run's mean Full-step seconds (``ds-hybrid train --baseline``'s own timer)."""
    subprocess.run([sys.executable, "-m", "ds_hybrid.train", "--config", str(config), "--model", model,
                    "--steps", str(steps), "--eval-every", str(steps), "--val-batches", "1", "--baseline",
                    "--no-plot", "--no-progress", "--no-memory-profile", "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL, env=child_env())   # (a world of its own)
    return json.loads((out / "summary.json").read_text())["statistics"]["mean_step_seconds"]["full"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="benchmarks/offload-preset.json", help="a bf16 ds_config (path)")
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2, help="runs of each, alternating (bf16 first on odd reps)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    if not (cfg.get("bf16") or {}).get("enabled"):
        raise SystemExit(f"--config: {args.config} has no bf16.enabled: true to compare against fp32")
    times: dict[str, list[float]] = {"bf16": [], "fp32": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"bf16": Path(tmp) / "bf16.json", "fp32": Path(tmp) / "fp32.json"}
        paths["bf16"].write_text(json.dumps(cfg))
        paths["fp32"].write_text(json.dumps(dict(cfg, bf16={"enabled": False})))
        for rep in range(args.reps):
            for kind in (("bf16", "fp32") if rep % 2 == 0 else ("fp32", "bf16")):
                times[kind].append(_run(paths[kind], args.steps, args.model, Path(tmp) / f"{kind}-{rep}"))
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    result = {"command": "python benchmarks/cpu_bf16.py " + " ".join(argv or []), "config": args.config,
              "model": args.model, "steps": args.steps, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "host": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "full_step_seconds": times, "bf16_over_fp32": mean["bf16"] / mean["fp32"]}
    lines = ["| precision | Full step, ms (each run) | mean |", "|---|---|---|"]
    lines += [f"| {k} | {', '.join(f'{t * 1e3:.0f}' for t in v)} | {mean[k] * 1e3:.0f} |" for k, v in times.items()]
    lines.append(f"\nbf16 / fp32: {result['bf16_over_fp32']:.2f}x (PyTorch CPU kernels: {result['cpu_capability']})")
    result["table_markdown"] = "\n".join(lines)
    print(result["table_markdown"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
