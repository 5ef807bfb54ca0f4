"""A bench result's arms at another learning rate, seed by seed, beside the result's own runs.

The bench sweeps plain DeepSpeed's LR on its first seed only and runs every arm at the best. When
two LRs tie on that seed, which one wins decides the other seeds' runs, and an arm whose steps
act unlike plain's (a gradient Predict step holds Adam's second moment) may prefer the other.
This runs the named arms (plain and the gradient arm by default) at ``--lr`` on every seed at the
full budget, exactly as the bench runs them (its configs, model, data, launcher), and sets each
final validation loss beside plain's at the result's swept LR (the bench's baseline) and beside
plain's at ``--lr``. It moves no target: the bench's baseline stays the one it tuned.

    .venv/bin/python benchmarks/lr_check.py --result docs/results/offload-z3.json --lr 0.002 \
        --json docs/results/offload-z3-lr0.002.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ds_hybrid import bench, bench_arms  # noqa: E402
from ds_hybrid.arguments import resolve_config  # noqa: E402
from ds_hybrid.bench_suites import SUITES  # noqa: E402


def _gap(a: float, b: float) -> float:
    return 100 * (a - b) / b


def _spread(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", required=True, help="a bench result (docs/results/SUITE.json) with plain runs")
    p.add_argument("--lr", type=float, required=True, help="the learning rate to run the arms at")
    p.add_argument("--arms", nargs="+", default=["baseline", "predict-gradient"], choices=sorted(bench_arms.ARMS))
    p.add_argument("--out", default="runs/bench", help="run folders: OUT/SUITE-lrLR/ARM-b1-sSEED")
    p.add_argument("--json", default=None, help="write the table's numbers here")
    args = p.parse_args(argv)
    if not args.lr > 0:
        raise SystemExit(f"--lr: must be positive (got {args.lr})")
    try:
        result = json.loads(Path(args.result).read_text())
        suite = SUITES[result["suite"]["name"]]
        swept = {seed: by_b["1"]["final_val_loss"] for seed, by_b in result["runs"]["baseline"].items()}
        best_lr = float(result["best_lr"])
        init = result.get("init")
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--result {args.result}: not a bench result with plain runs ({err})") from None
    # (a result keeps its suite, not the merged config: built again as the bench builds it)
    base_cfg = bench_arms.deep_merge(resolve_config(suite.config)[0], suite.overrides)
    if init and not Path(init).is_file():
        raise SystemExit(f"--result {args.result}: its pre-trained start {init} is gone (run the bench again)")

    out_dir = Path(args.out) / f"{suite.name}-lr{args.lr:g}"
    runner = bench.Runner(suite, out_dir, bench.resolve_data(result.get("data") or suite.data), init,
                          live=False, reuse=True)
    runner.total = len(args.arms) * len(swept)
    finals: dict[str, dict[str, float]] = {a: {} for a in args.arms}
    for seed in sorted(swept, key=int):
        for name in args.arms:
            cfg, baseline = bench_arms.arm_config(base_cfg, bench_arms.ARMS[name], quick=False)
            cfg["wall_clock_breakdown"] = True   # (as the bench runs every arm)
            run = bench.Run(f"{name}-b1-s{seed}", name, int(seed), args.lr, 1.0, cfg,
                            out_dir / f"{name}-b1-s{seed}", suite.steps, baseline)
            finals[name][seed] = runner(run)["final_val_loss"]

    rows = {}
    for name in args.arms:
        per_seed = {}
        for seed, loss in finals[name].items():
            row = {"final_val_loss": loss, "vs_swept_plain_pct": _gap(loss, swept[seed])}
            if "baseline" in finals:
                row["vs_plain_same_lr_pct"] = _gap(loss, finals["baseline"][seed])
            per_seed[seed] = row
        m, s = _spread([r["vs_swept_plain_pct"] for r in per_seed.values()])
        rows[name] = {"per_seed": per_seed, "vs_swept_plain_pct_mean": m, "vs_swept_plain_pct_std": s}
        line = f"{name} at lr {args.lr:g}: {m:+.2f} ± {s:.2f}% from plain at lr {best_lr:g} (the bench's)"
        if "baseline" in finals and name != "baseline":
            m2, s2 = _spread([r["vs_plain_same_lr_pct"] for r in per_seed.values()])
            rows[name].update(vs_plain_same_lr_pct_mean=m2, vs_plain_same_lr_pct_std=s2)
            line += f", {m2:+.2f} ± {s2:.2f}% from plain at lr {args.lr:g}"
        print(line + "; by seed " + ", ".join(f"{r['vs_swept_plain_pct']:+.2f}" for r in per_seed.values()),
              flush=True)
    out = {"command": "python benchmarks/lr_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "result": args.result, "suite": suite.name, "swept_best_lr": best_lr, "lr": args.lr,
           "swept_plain_final_val_loss": swept, "arms": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
