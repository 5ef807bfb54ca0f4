"""Longer runs of gradient Predict steps on the `offload` suite: 1 real step then H Predict steps.

The bench's `predict-gradient` arm takes 3 Predict steps after every real one. This runs the same
arm with H of them (7 and 15 by default) at the suite's full budget, for each seed, with the
suite's model, data, LR (the bench's swept best, read from its result) and launcher, and sets each
final validation loss beside plain ZeRO-Offload's from the same result (same seed, full budget).
A run folder that already holds a finished run of exactly this config is reused.

    .venv/bin/python benchmarks/gradient_horizons.py --result docs/results/offload.json \
        --json docs/results/gradient-horizons.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ds_hybrid import bench_arms, bench_launch  # noqa: E402
from ds_hybrid.arguments import resolve_config  # noqa: E402
from ds_hybrid.bench_suites import SUITES  # noqa: E402
from ds_hybrid.dist_env import child_env  # noqa: E402


def run_config(horizon: int) -> dict:
    """The offload suite's predict-gradient arm with ``horizon`` Predict steps after every real step."""
    suite = SUITES["offload"]
    base = bench_arms.deep_merge(resolve_config(suite.config)[0], suite.overrides)
    hybrid = bench_arms.with_changes(bench_arms.ARMS["predict-gradient"].hybrid,
                                     min_predict_steps=horizon, max_predict_steps=horizon)
    arm = bench_arms.Arm("predict-gradient", "", hybrid)
    cfg, _ = bench_arms.arm_config(base, arm, quick=False)
    cfg["wall_clock_breakdown"] = True   # (as the bench runs every arm)
    return cfg


def run(horizon: int, seed: int, lr: float, out: Path) -> dict:
    suite = SUITES["offload"]
    cfg = run_config(horizon)
    try:
        done = json.loads((out / "ds_config.json").read_text()) == cfg and (out / "summary.json").is_file()
    except (OSError, ValueError):
        done = False
    if not done:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ds_config.json").write_text(json.dumps(cfg, indent=2))
        args = ["--config", str(out / "ds_config.json"), "--model", suite.model, "--steps", str(suite.steps),
                "--seq-len", str(suite.seq_len), "--seed", str(seed), "--lr", repr(lr), "--eval-every",
                str(suite.eval_every), "--val-batches", str(suite.val_batches), "--out", str(out), "--no-plot",
                "--layer-groups", str(suite.layer_groups), "--no-progress"]
        with open(out / "train.log", "w") as log:
            proc = subprocess.run(bench_launch.command(suite.launcher, "ds_hybrid.train", args), stdout=log,
                                  stderr=subprocess.STDOUT, env=child_env())
        if proc.returncode != 0:
            raise SystemExit(f"run {out} failed; see {out / 'train.log'}")
    s = json.loads((out / "summary.json").read_text())
    phases = s["statistics"]["steps_per_phase"]
    return {"final_val_loss": s["final_val_loss"], "steps": sum(phases.values()),
            "optimizer_steps": sum(v for k, v in phases.items() if k != "predict"),
            "predict_accepted": s["statistics"]["predict_accepted"],
            "predict_rolled_back": s["statistics"]["predict_rolled_back"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", default="docs/results/offload.json",
                   help="the offload bench's result: its best LR and plain ZeRO-Offload's final losses")
    p.add_argument("--horizons", type=int, nargs="+", default=[7, 15])
    p.add_argument("--out", default="runs/bench", help="run folders: OUT/offload-hH/predict-gradient-b1-sSEED")
    p.add_argument("--json", default=None, help="write the table's numbers here")
    args = p.parse_args(argv)
    if any(h < 1 for h in args.horizons):
        raise SystemExit(f"--horizons: every horizon must be at least 1 (got {args.horizons})")
    try:
        result = json.loads(Path(args.result).read_text())
        plain = {seed: by_b["1"]["final_val_loss"] for seed, by_b in result["runs"]["baseline"].items()}
        lr = float(result["best_lr"])
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--result {args.result}: not an offload bench result with plain runs ({err})") from None
    rows = {}
    for h in args.horizons:
        per_seed = {}
        for seed in sorted(plain, key=int):
            r = run(h, int(seed), lr, Path(args.out) / f"offload-h{h}" / f"predict-gradient-b1-s{seed}")
            r["plain_final_val_loss"] = plain[seed]
            r["gap_pct"] = 100 * (r["final_val_loss"] - plain[seed]) / plain[seed]
            per_seed[seed] = r
        gaps = [r["gap_pct"] for r in per_seed.values()]
        share = [r["optimizer_steps"] / r["steps"] for r in per_seed.values()]
        rows[str(h)] = {"per_seed": per_seed, "gap_pct_mean": statistics.mean(gaps),
                        "gap_pct_std": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                        "optimizer_step_share": statistics.mean(share)}
        print(f"1 real : {h} gradient Predict steps: final val {statistics.mean(gaps):+.2f} ± "
              f"{rows[str(h)]['gap_pct_std']:.2f}% from plain ZeRO-Offload's, with "
              f"{100 * rows[str(h)]['optimizer_step_share']:.0f}% of its optimizer steps", flush=True)
    out = {"command": "python benchmarks/gradient_horizons.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "result": args.result, "lr": lr, "horizons": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
