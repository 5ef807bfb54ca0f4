"""How far the bench's step-kind profile moves between sittings, against its standard errors.

Takes a finished ``ds-hybrid bench`` suite (its result JSON and the run directories it names) and
profiles its step kinds several times, one profile after another in the same session: every kind
the layout has (``--order all``) or only those the suite's runs took (``needed``,
``bench_profile.kinds_needed``, what the bench times since 2026-11-30). Beside them, what the runs
themselves measured, one at a time: each hybrid arm's Predict and real step over plain
DeepSpeed's real step in the same seed's full-budget run.

    python benchmarks/profile_sittings.py --result docs/results/offload-b64.json \\
        --order all needed needed --json docs/results/profile-sittings-offload-b64.json

Run it alone on a quiet machine (each profile of ``offload-b64`` takes 6-7 min on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ds_hybrid import bench, bench_launch, bench_profile
from ds_hybrid.compare import load_run


def in_run_costs(result: dict) -> dict:
    """Per hybrid arm: its Predict and real steps' ms over plain DeepSpeed's real step, per run."""
    runs = result["runs"]
    plain = {seed: by_b["1"]["real_step_ms"] for seed, by_b in runs["baseline"].items() if "1" in by_b}
    out = {}
    for arm, by_seed in runs.items():
        if arm == "baseline":
            continue
        pred, real = [], []
        for seed, by_b in by_seed.items():
            for row in by_b.values():
                if seed in plain and row.get("predict_step_ms"):
                    pred.append(row["predict_step_ms"] / plain[seed])
                if seed in plain and row.get("real_step_ms"):
                    real.append(row["real_step_ms"] / plain[seed])
        if pred:
            out[arm] = {"predict_over_plain_real": pred, "real_over_plain_real": real}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", required=True, help="a bench result JSON whose run directories are on this machine")
    p.add_argument("--order", nargs="+", default=["all", "needed", "needed"], choices=["all", "needed"],
                   help="the profiles to take, in order: every kind, or the suite's runs' kinds")
    p.add_argument("--reps", type=int, default=bench_profile.PROFILE_REPS, help="rounds per profile")
    p.add_argument("--json", required=True, help="where to write the result")
    args = p.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    name = result["suite"]["name"]
    suite = bench.SUITES[name]
    missing = [r["run"] for by_s in result["runs"].values() for by_b in by_s.values() for r in by_b.values()
               if not Path(r["run"]).is_dir()]
    if missing:
        raise SystemExit(f"--result: {len(missing)} of its run directories are not here (first: {missing[0]}); "
                         f"run `ds-hybrid bench --suite {name} --reuse` first")
    rows = {arm: {s: {b: load_run(Path(r["run"])) for b, r in by_b.items()} for s, by_b in by_s.items()}
            for arm, by_s in result["runs"].items()}
    needed = bench_profile.kinds_needed(rows)
    ds_arms = bench_profile.feature_lrs(result["suite"]["arms"], result)
    data = bench.resolve_data(result.get("data") or suite.data)
    profiles = []
    for which in args.order:
        t0 = time.perf_counter()
        prof = bench_profile.profile_steps(suite, result["best_lr"], data, result.get("init"), reps=args.reps,
                                           ds_arms=ds_arms, kinds=None if which == "all" else needed)
        profiles.append({"kinds": which, "wall_seconds": time.perf_counter() - t0, "reps": prof["reps"],
                         "cost": prof["cost"], "cost_se": prof["cost_se"]})
        print(f"profile {len(profiles)} ({which}, {len(prof['cost'])} kinds): {profiles[-1]['wall_seconds']:.0f} s",
              flush=True)
    out = {"command": "python benchmarks/profile_sittings.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "suite": name, "result": args.result, "date": time.strftime("%Y-%m-%d %H:%M"), "host": bench_launch.host(),
           "needed": sorted(needed), "profiles": profiles, "in_runs": in_run_costs(result)}
    Path(args.json).write_text(json.dumps(out, indent=1))
    kinds = [k for k in profiles[0]["cost"] if all(k in q["cost"] for q in profiles)]
    print("\n| step kind | " + " | ".join(f"profile {i + 1} ({q['kinds']})" for i, q in enumerate(profiles)) + " |")
    print("|---|" + "---|" * len(profiles))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{q['cost'][k]:.3f} ± {q['cost_se'][k] or 0:.4f}" for q in profiles) + " |")
    for arm, c in out["in_runs"].items():
        pr = c["predict_over_plain_real"]
        print(f"\nin the runs, `{arm}`: Predict step {min(pr):.3f}-{max(pr):.3f} of plain's real step "
              f"(mean {statistics.mean(pr):.3f}, {len(pr)} runs)")
    return out


if __name__ == "__main__":
    main()
