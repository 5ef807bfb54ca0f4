"""How far and how often: the whole-model drift Predict run's knobs, swept on ``cpu-small``
against the bench's own plain DeepSpeed frontier; and the default preset, re-measured.

The bench's ``predict`` arm takes 2 drift steps after every 4 real ones, at a step scale of at
most 1, each run checked by the next real step's forward. Each variant here changes that arm's
``hybrid_predict`` section in one way (``VARIANTS``): a predicted step that goes further
(``predictor.step_scale`` / ``max_step_scale``) or Predict runs twice as often
(``full_steps``); ``default`` is the preset's own section as shipped (the bench's ``default``
arm), and ``default-every-24`` the preset as it was before its Predict runs were made half as frequent. Everything else is the bench's: model, corpus, tuned LR (the
sweep's 2e-3), seeds, warmup-cosine schedule per budget, evaluation.

Scored against the committed bench result (``--result``, default
``docs/results/cpu-small.json``): its targets per seed, its plain DeepSpeed runs' validation
curves in Full-step equivalents (budgets 0.75, 0.875, 1) and its step-kind profile, which costs
every step of these runs too. So every figure is in Full-step equivalents (machine noise
cannot move them; seconds from this script would come from another sitting than plain
DeepSpeed's). Per variant and seed:

* ``gap_pct`` and ``equivalents_ratio``: its final loss against plain DeepSpeed's at the full budget
  (the target) and its equivalents against that run's (the default's bar);
* ``own_loss_ratio``: the run's equivalents over plain DeepSpeed's frontier time to the run's
  own final loss (under 1: it got there sooner than plain DeepSpeed could);
* the frontier ratio at each bench target over the variant's budgets (``None``: not reached).

The ``plain`` variant is plain DeepSpeed itself at budgets longer than the bench's: its runs join
the committed plain DeepSpeed frontier that every variant is scored on (a longer schedule's
curve can cross the full budget's final loss before its end).

    .venv/bin/python benchmarks/predict_sweep.py --json docs/results/predict-sweep.json

Runs go to ``--out`` (default ``/tmp/predict-sweep``), made by the bench's own runner; a finished
run with the same config and arguments is reused (as ``ds-hybrid bench --reuse``). ``--jobs 2``
runs two at a time with one thread each unless ``OMP_NUM_THREADS`` says otherwise (losses do not
depend on it: the runs are deterministic). ``--budgets predict=1.25,1.5,2`` runs a variant at other
budget fractions than its own. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_hybrid import frontier as fr  # noqa: E402
from ds_hybrid.arguments import resolve_config  # noqa: E402
from ds_hybrid.bench import Run, Runner, pretrained, resolve_data  # noqa: E402
from ds_hybrid.bench_arms import ARMS, deep_merge, with_changes  # noqa: E402
from ds_hybrid.bench_profile import cost_of, profile_steps  # noqa: E402
from ds_hybrid.bench_suites import SUITES  # noqa: E402

# name -> (what it changes, the section it starts from: the bench's `predict` arm or the preset's
# own, changes to that section, budgets)
VARIANTS: dict[str, tuple[str, str, dict, tuple[float, ...]]] = {
    "predict": ("the bench's arm: 2 drift steps after every 4 real ones from step 50, scale <= 1", "predict", {},
                (1.25, 1.375, 1.5, 1.75, 2.0)),
    "scale-3": ("each predicted step goes up to 3x as far (step_scale 3, max_step_scale 3)", "predict",
                {"predictor__step_scale": 3.0, "predictor__max_step_scale": 3.0}, (1.25, 1.5)),
    "dense": ("2 drift steps after every 2 real ones (half the steps predicted)", "predict", {"full_steps": 2},
              (1.5, 1.75)),
    # Plain DeepSpeed at budgets longer than the bench's: the hybrid's arms run up to 2x the steps, so
    # plain DeepSpeed gets them too; its rows join the committed frontier that every variant is scored on.
    "plain": ("plain DeepSpeed (the bench's baseline: `hybrid_predict.enabled: false`, its tuned LR) at longer "
              "budgets, added to its frontier", "plain", {}, (1.125, 1.25, 1.375, 1.5)),
    # The committed plain DeepSpeed run at the full budget, again: the same final loss says these runs
    # start where the bench's did (the same pre-trained weights, data and code path).
    "plain-check": ("plain DeepSpeed at the full budget, re-run: its final loss against the committed run's", "plain",
                    {}, (1.0,)),
    "default": ("the preset's own section as shipped (the no-argument `ds-hybrid train`): a Predict run after every "
                "48 real steps", "preset", {}, (1.0,)),
    "default-every-24": ("the same with a run after every 24 real steps (the preset until 2026-11-24, which the "
                         "bench's `default` arm measured)", "preset", {"full_steps": 24}, (1.0,)),
}


def section_of(name: str, preset: dict) -> dict | None:
    """A variant's ``hybrid_predict`` section (``None``: plain DeepSpeed)."""
    _, base, changes, _ = VARIANTS[name]
    if base == "plain":
        return None
    return with_changes(ARMS["predict"].hybrid if base == "predict" else preset["hybrid_predict"], **changes)


def score(row: dict, profile: dict) -> dict:
    """The run's validation curve in Full-step equivalents (the bench's costing)."""
    eq = fr.step_costs_curve(row["val_points"], [cost_of(k, profile) for k in row["step_kinds"]])
    st = row["statistics"]
    done = (st.get("predict_accepted") or 0) + (st.get("predict_rolled_back") or 0)
    return {"final_val_loss": row["final_val_loss"], "steps": row["steps"], "eq_curve": eq, "eq_total": eq[-1][0],
            "predicted_pct": row["predicted_pct"],
            "real_steps": row["steps"] - (st["steps_per_phase"].get("predict") or 0),
            "rolled_back_pct": 100.0 * (st.get("predict_rolled_back") or 0) / done if done else 0.0}


def analyse(runs: dict, result: dict) -> dict:
    """Per variant: per seed, each budget's run and the frontier ratios; over seeds, mean and spread."""
    # Plain DeepSpeed's frontier: the committed runs, and this sweep's longer plain runs if any.
    base = {seed: list(by_b.values()) + list(runs.get("plain", {}).get(seed, {}).values())
            for seed, by_b in result["runs"]["baseline"].items()}
    plain_full = {seed: by_b["1"]["eq_curve"][-1][0] for seed, by_b in result["runs"]["baseline"].items()}
    targets = result["analysis"]["targets"]
    out = {}
    for name, by_seed in runs.items():
        per_seed = {}
        for seed, by_budget in by_seed.items():
            rows = list(by_budget.values())
            per_seed[seed] = {
                "budgets": {b: {**{k: v for k, v in r.items() if k != "eq_curve"},
                                "own_loss_ratio": _own_ratio(r, base[seed]),
                                "gap_pct": 100 * (r["final_val_loss"] / targets[seed]["target"] - 1),
                                "equivalents_ratio": r["eq_total"] / plain_full[seed]}
                            for b, r in by_budget.items()},
                "frontier": fr.ratios(rows, base[seed], targets[seed], "eq_curve")}
        budgets = sorted({b for s in per_seed.values() for b in s["budgets"]}, key=float)
        agg = {"budgets": {b: {k: fr.mean_spread([s["budgets"][b][k] for s in per_seed.values() if b in s["budgets"]])
                               for k in ("final_val_loss", "gap_pct", "own_loss_ratio", "equivalents_ratio",
                                         "predicted_pct", "rolled_back_pct", "real_steps")} for b in budgets},
               "frontier": {t: dict(fr.mean_spread([s["frontier"][t]["ratio"] for s in per_seed.values()]),
                                    seeds=len(per_seed))
                            for t in next(iter(per_seed.values()))["frontier"]}}
        out[name] = {"doc": VARIANTS[name][0], "base": VARIANTS[name][1], "changes": VARIANTS[name][2],
                     "per_seed": per_seed, "aggregate": agg}
    return out


def _own_ratio(row: dict, base_rows: list[dict]) -> float | None:
    t = fr.frontier_time(base_rows, row["final_val_loss"], "eq_curve")
    return row["eq_total"] / t if t else None


def table(analysis: dict) -> str:
    def ms(d: dict, f: str = "{:.3f}") -> str:
        if not d or d.get("mean") is None:
            return "-"
        return f.format(d["mean"]) + (" ± " + f.format(d["std"]) if d.get("n", 0) > 1 else "") + \
            (f" ({d['n']} seeds)" if d.get("n") not in (None, 3) else "")
    lines = ["| variant | budget | real steps | predicted | rolled back | final val loss | gap to plain DeepSpeed's "
             "final loss | equivalents over plain DeepSpeed's full budget | equivalents over plain DeepSpeed's to "
             "the same loss | frontier ratio: target / +1% / +2% |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in analysis.items():
        front = " / ".join(ms(a["aggregate"]["frontier"][t], "{:.2f}") for t in ("target", "target+1%", "target+2%"))
        for i, (b, agg) in enumerate(a["aggregate"]["budgets"].items()):
            lines.append(f"| {'`' + name + '`' if i == 0 else ''} | {float(b):g} | {ms(agg['real_steps'], '{:.0f}')} | "
                         f"{ms(agg['predicted_pct'], '{:.0f}')}% | {ms(agg['rolled_back_pct'], '{:.0f}')}% | "
                         f"{ms(agg['final_val_loss'], '{:.4f}')} | {ms(agg['gap_pct'], '{:+.2f}')}% | "
                         f"{ms(agg['equivalents_ratio'], '{:.3f}')}x | {_below(agg['own_loss_ratio'])} | "
                         f"{front if i == 0 else ''} |")
    return "\n".join(lines)


def _below(d: dict) -> str:
    """The own-loss ratio, or where no plain DeepSpeed run reached that loss, say so."""
    if d.get("n"):
        return f"{d['mean']:.3f}" + (f" ± {d['std']:.3f}" if d["n"] > 1 else "") + "x" + \
            ("" if d["n"] == 3 else f" ({d['n']} seeds; the others below plain DeepSpeed's best)")
    return "below plain DeepSpeed's best"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", default=str(ROOT / "docs/results/cpu-small.json"),
                   help="the bench result whose plain DeepSpeed frontier, targets and profile score the runs (any "
                        "CPU suite: the runs take its suite, model, data and pre-trained start)")
    p.add_argument("--cache", default="runs/bench/cache", help="where the bench keeps pre-trained weights")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--budgets", nargs="+", default=[], metavar="VARIANT=B,B",
                   help="run a variant at these budget fractions instead of its own (e.g. predict=1.25,1.5,2)")
    p.add_argument("--out", default="/tmp/predict-sweep")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the analysis here")
    p.add_argument("--reprofile", action="store_true",
                   help="profile the step kinds now, with this tree's code, and cost the runs with that profile "
                        "instead of --result's (plain DeepSpeed's steps cost 1 in either; run it on a quiet machine)")
    p.add_argument("--profile", default=None,
                   help="cost the runs with the profile of an earlier sweep's JSON made with --reprofile")
    a = p.parse_args(argv)
    budgets = {name: budgets for name, (_, _, _, budgets) in VARIANTS.items()}
    for item in a.budgets:
        name, _, values = item.partition("=")
        try:
            budgets[name] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise SystemExit(f"--budgets: {item!r} is not VARIANT=B,B,... with numeric fractions") from None
        if name not in VARIANTS or not budgets[name] or not all(0 < b <= 4 for b in budgets[name]):
            raise SystemExit(f"--budgets: {item!r} needs a variant of {list(VARIANTS)} and fractions in (0, 4]")
    result = json.loads(Path(a.result).read_text())
    if result["suite"]["name"] not in SUITES or SUITES[result["suite"]["name"]].needs_gpu or result.get("quick"):
        raise SystemExit(f"--result: {a.result} is not a full CPU bench result")
    missing = [s for s in a.seeds if str(s) not in result["analysis"]["targets"]]
    if missing:
        raise SystemExit(f"--seeds: {missing} not in {a.result}'s seeds {sorted(result['analysis']['targets'])}")
    # The result's suite as it ran (its model), its corpus and its pre-trained start (rebuilt
    # into --cache if missing: plain DeepSpeed from seed 0, the same weights).
    suite = dataclasses.replace(SUITES[result["suite"]["name"]], model=result["suite"]["model"])
    preset, _ = resolve_config(suite.config)
    preset = deep_merge(preset, suite.overrides)
    lr, steps = float(result["best_lr"]), int(result["suite"]["steps"])
    data = resolve_data(suite.data)
    init = pretrained(suite, preset, Path(a.cache), live=False)
    # The bench's own runner: the same arguments as its runs, and --reuse's check of a finished run.
    runner = Runner(suite, Path(a.out), data, init, live=False, reuse=True)
    profile = result["profile"]
    if a.reprofile:   # before any run starts: the machine is quiet
        print("profiling the step kinds ...", flush=True)
        profile = profile_steps(suite, lr, data, init)
        print("step costs:", {k: round(v, 4) for k, v in profile["cost"].items()}, flush=True)
    elif a.profile:
        profile = json.loads(Path(a.profile).read_text())["profile"]
        if not isinstance(profile, dict):
            raise SystemExit(f"--profile: {a.profile} has no profile of its own (it was made without --reprofile)")
    todo = []
    for name in a.variants:
        section = section_of(name, preset)
        # plain DeepSpeed: the preset as the bench's baseline arm runs it (`--baseline`)
        cfg = dict(json.loads(json.dumps(preset)), **({} if section is None else {"hybrid_predict": section}))
        for seed in a.seeds:
            for b in budgets[name]:
                label = f"{name}-b{b:g}-s{seed}"
                todo.append(Run(label, name, seed, lr, b, cfg, Path(a.out) / label, int(round(steps * b)),
                                section is None))
    runner.total = len(todo)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # runs side by side on 2 cores: one thread each
    with ThreadPoolExecutor(max_workers=max(a.jobs, 1)) as pool:
        rows = list(pool.map(runner, todo))
    runs: dict = {}
    for run, row in zip(todo, rows):
        runs.setdefault(run.arm, {}).setdefault(str(run.seed), {})[f"{run.budget:g}"] = score(row, profile)
    analysis = analyse(runs, result)
    for seed, by_b in runs.get("plain-check", {}).items():
        committed = result["runs"]["baseline"][seed]["1"]["final_val_loss"]
        analysis["plain-check"]["per_seed"][seed]["committed_final_val_loss"] = committed
        print(f"plain-check seed {seed}: final val loss {by_b['1']['final_val_loss']!r}, committed {committed!r}")
    print(table(analysis))
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "benchmarks/predict_sweep.py " + " ".join(argv or sys.argv[1:]),
                                            "result": os.path.relpath(a.result, ROOT), "lr": lr,
                                            "profile": profile if a.reprofile else "the result's",
                                            "analysis": analysis}, indent=1))
        print("wrote", a.json)
    return analysis


if __name__ == "__main__":
    main()
