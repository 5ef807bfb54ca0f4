"""A bench result's arms at another learning rate, or with one of their settings changed, seed by
seed, beside the result's own runs.

The bench sweeps plain DeepSpeed's LR on its first seed only and runs every arm at the best. When
two LRs tie on that seed, which one wins decides the other seeds' runs, and an arm whose steps
act unlike plain's (a gradient Predict step holds Adam's second moment) may prefer the other.
This runs the named arms (plain and the gradient arm by default) at ``--lr`` on every seed at the
full budget, exactly as the bench runs them (its configs, model, data, launcher), and sets each
final validation loss beside plain's at the result's swept LR (the bench's baseline) and beside
plain's at ``--lr``. It moves no target: the bench's baseline stays the one it tuned.

``--set KEY=VALUE`` changes a hybrid arm's ``hybrid_predict`` section (``predictor.gradient_second_moment=
updated``) and ``--budget`` picks the budget its runs take (the result's LR where ``--lr`` is not
given): each run then also sits beside the result's own run of that arm and budget, by its final
loss and the first validation step at or under the seed's target (plain's final loss) and 1% above it.

    .venv/bin/python benchmarks/lr_check.py --result docs/results/offload-z3.json --lr 0.002 \
        --json docs/results/offload-z3-lr0.002.json
    .venv/bin/python benchmarks/lr_check.py --result docs/results/offload-b64.json \
        --arms predict-gradient-quarter-15 --budget 3 --set predictor.gradient_second_moment=updated
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
from ds_hybrid import bench_report as report  # noqa: E402
from ds_hybrid.arguments import resolve_config  # noqa: E402
from ds_hybrid.config import ConfigError, apply_overrides, parse_override  # noqa: E402
from ds_hybrid.bench_suites import SUITES  # noqa: E402


def _gap(a: float, b: float) -> float:
    return 100 * (a - b) / b


def _spread(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def first_under(losses: list[float], target: float) -> int | None:
    """The index of the first validation point at or under ``target`` (None: never)."""
    return next((i for i, v in enumerate(losses) if v <= target), None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", required=True, help="a bench result (docs/results/SUITE.json) with plain runs")
    p.add_argument("--lr", type=float, default=None, help="the learning rate to run the arms at (default: the "
                   "result's, plain's swept best)")
    p.add_argument("--arms", nargs="+", default=["baseline", "predict-gradient"], choices=sorted(bench_arms.ARMS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change the hybrid arms' hybrid_predict section (a dotted key); repeatable")
    p.add_argument("--budget", type=float, default=1.0,
                   help="the budget the runs take (a multiple of the suite's steps)")
    p.add_argument("--out", default="runs/bench", help="run folders: OUT/SUITE-lrLR[-KEY-VALUE]/ARM-bB-sSEED")
    p.add_argument("--json", default=None, help="write the table's numbers here")
    args = p.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        raise SystemExit(f"--lr: must be positive (got {args.lr})")
    if not args.budget > 0:
        raise SystemExit(f"--budget: must be positive (got {args.budget})")
    try:
        changes = dict(parse_override(t) for t in args.set)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    if changes and all(bench_arms.ARMS[a].hybrid is None or report.ds_feature(bench_arms.ARMS[a].hybrid)
                       for a in args.arms):
        raise SystemExit("--set: changes a hybrid arm's own hybrid_predict section; none of --arms has one")
    try:
        result = json.loads(Path(args.result).read_text())
        suite = SUITES[result["suite"]["name"]]
        swept = {seed: by_b["1"]["final_val_loss"] for seed, by_b in result["runs"]["baseline"].items()}
        best_lr = float(result["best_lr"])
        init = result.get("init")
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--result {args.result}: not a bench result with plain runs ({err})") from None
    lr = best_lr if args.lr is None else args.lr
    targets = (result.get("analysis") or {}).get("targets") or {}
    # (a result keeps its suite, not the merged config: built again as the bench builds it)
    base_cfg = bench_arms.deep_merge(resolve_config(suite.config)[0], suite.overrides)
    if init and not Path(init).is_file():
        raise SystemExit(f"--result {args.result}: its pre-trained start {init} is gone (run the bench again)")

    out_dir = Path(args.out) / (f"{suite.name}-lr{lr:g}" + "".join(f"-{k}-{v}" for k, v in changes.items()))
    runner = bench.Runner(suite, out_dir, bench.resolve_data(result.get("data") or suite.data), init,
                          live=False, reuse=True)
    runner.total = len(args.arms) * len(swept)
    finals: dict[str, dict[str, float]] = {a: {} for a in args.arms}
    reached: dict[str, dict[str, dict]] = {a: {} for a in args.arms}
    steps = max(int(round(suite.steps * args.budget)), 2 * suite.eval_every)   # (as the bench's run_of)
    for seed in sorted(swept, key=int):
        for name in args.arms:
            cfg, baseline = bench_arms.arm_config(base_cfg, bench_arms.ARMS[name], quick=False)
            cfg["wall_clock_breakdown"] = True   # (as the bench runs every arm)
            if changes and not baseline:
                try:   # (a key or value the section refuses: before any run, naming it)
                    apply_overrides(cfg, args.set)
                except ConfigError as err:
                    raise SystemExit(str(err)) from None
            run_name = f"{name}-b{args.budget:g}-s{seed}"
            row = runner(bench.Run(run_name, name, int(seed), lr, args.budget, cfg, out_dir / run_name, steps,
                                   baseline))
            finals[name][seed] = row["final_val_loss"]
            reached[name][seed] = _beside_own(row, result, name, seed, args.budget, targets.get(seed))

    rows = {}
    for name in args.arms:
        per_seed = {}
        for seed, loss in finals[name].items():
            row = {"final_val_loss": loss, "vs_swept_plain_pct": _gap(loss, swept[seed]), **reached[name][seed]}
            if "baseline" in finals:
                row["vs_plain_same_lr_pct"] = _gap(loss, finals["baseline"][seed])
            per_seed[seed] = row
        m, s = _spread([r["vs_swept_plain_pct"] for r in per_seed.values()])
        rows[name] = {"per_seed": per_seed, "vs_swept_plain_pct_mean": m, "vs_swept_plain_pct_std": s}
        line = f"{name} at lr {lr:g}: {m:+.2f} ± {s:.2f}% from plain at lr {best_lr:g} (the bench's)"
        if "baseline" in finals and name != "baseline":
            m2, s2 = _spread([r["vs_plain_same_lr_pct"] for r in per_seed.values()])
            rows[name].update(vs_plain_same_lr_pct_mean=m2, vs_plain_same_lr_pct_std=s2)
            line += f", {m2:+.2f} ± {s2:.2f}% from plain at lr {lr:g}"
        print(line + "; by seed " + ", ".join(f"{r['vs_swept_plain_pct']:+.2f}" for r in per_seed.values()),
              flush=True)
        for seed, r in per_seed.items():
            if "own_final_val_loss" in r:
                print(f"  seed {seed}: final {r['final_val_loss']:.4f} (the result's run: "
                      f"{r['own_final_val_loss']:.4f}); first under the target at step {r['target_step']} "
                      f"({r['own_target_step']}), 1% above it at {r['target+1%_step']} ({r['own_target+1%_step']})",
                      flush=True)
    out = {"command": "python benchmarks/lr_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "result": args.result, "suite": suite.name, "swept_best_lr": best_lr, "lr": lr, "set": changes,
           "budget": args.budget, "swept_plain_final_val_loss": swept, "arms": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _beside_own(row: dict, result: dict, arm: str, seed: str, budget: float, targets: dict | None) -> dict:
    """A run beside the result's own run of the same arm, seed and budget (where it has one and the
    seed's targets): final losses, and the first validation step at or under the target and 1% above
    it, each. The result keeps its runs' curves against seconds, not steps: its points are read at
    this run's steps (the same suite, so the same validation steps; not where their counts differ)."""
    own = (result["runs"].get(arm, {}).get(seed) or {}).get(f"{budget:g}")
    if not own or not targets or len(own["val_curve"]) != len(row["val_points"]):
        return {}
    out = {"own_final_val_loss": own["final_val_loss"], "own_run": own["run"]}
    for t in ("target", "target+1%"):
        mine, theirs = (first_under([v for _, v in c], targets[t]) for c in (row["val_points"], own["val_curve"]))
        out[f"{t}_step"] = None if mine is None else row["val_points"][mine][0]
        out[f"own_{t}_step"] = None if theirs is None else row["val_points"][theirs][0]
    return out


if __name__ == "__main__":
    main()
