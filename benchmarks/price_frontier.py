"""A finished bench suite's frontier ratios with its step kinds priced at given costs.

``ds-hybrid bench`` prices every step in Full-step equivalents from a profile of the step kinds
taken on the machine that ran it. On this CPU a ZeRO-Offload suite's gradient Predict step from a
quarter of the batch costs 0.22 of a plain step (its forward and backward are most of a step
there); beside a GPU, where a plain step's dear part is the CPU Adam step and the PCIe copies it
skips, the H200's timers put it near 0.12 (docs/memory.md). This reads the runs a bench left in
its output directory and scores them by the bench's own rule (``ds_hybrid.frontier``: a system's
least cost to reach each target at any budget over plain DeepSpeed's least, crossings
interpolated) with each kind of step priced as told. The curves are measured; the prices are
whatever ``--cost`` says: arithmetic, labelled as such in the JSON and the table.

    python benchmarks/price_frontier.py runs/bench/offload-b64 --cost plain=1 real=1.01 \\
        predict_gradient_f0.25=0.12 forward=0.12 --json docs/results/offload-b64-priced.json

Every kind of step in the runs needs a price (``ds_hybrid.compare.step_kinds`` names them; a
rejected check's extra forward is ``+forward``, priced ``forward``); a missing one is refused
naming it. Giving the profile's own costs reproduces the bench's Full-step-equivalent ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_hybrid import frontier as fr
from ds_hybrid.bench import TARGETS
from ds_hybrid.compare import load_run


def kind_cost(kind: str, costs: dict[str, float]) -> float:
    base, _, extra = kind.partition("+")
    if base not in costs or (extra and "forward" not in costs):
        missing = base if base not in costs else "forward"
        raise SystemExit(f"price_frontier: --cost gives no price for the step kind {missing!r}")
    return costs[base] + (costs["forward"] if extra else 0.0)


def price(rows: dict[str, dict[str, dict[str, dict]]], costs: dict[str, float]) -> dict:
    """``rows``: arm -> seed -> budget -> run (``val_points``, ``step_kinds``,
    ``final_val_loss``; plain DeepSpeed's arm is ``baseline``, its budget ``"1"`` the target's
    run). Per arm and seed, each target's priced frontier ratio and, where reached, the real and
    Predict steps its crossing run had taken by the validation point at or after the crossing."""
    base = rows["baseline"]
    out: dict = {}
    curves = {}
    for arm, by_seed in rows.items():
        for seed, by_budget in by_seed.items():
            for b, run in by_budget.items():
                curves[arm, seed, b] = fr.step_costs_curve(run["val_points"],
                                                          [kind_cost(k, costs) for k in run["step_kinds"]])
    for arm, by_seed in rows.items():
        if arm == "baseline":
            continue
        per_seed = {}
        for seed, by_budget in by_seed.items():
            if "1" not in base.get(seed, {}):
                continue
            final = base[seed]["1"]["final_val_loss"]
            arm_runs = [{"c": curves[arm, seed, b]} for b in by_budget]
            base_runs = [{"c": curves["baseline", seed, b]} for b in base[seed]]
            ratios = {}
            for name, d in TARGETS.items():
                r = fr.ratios(arm_runs, base_runs, {name: final * (1 + d)}, "c")[name]
                r["steps"] = _steps_at(by_budget, final * (1 + d))
                ratios[name] = r
            per_seed[seed] = ratios
        agg = {}
        for name in TARGETS:
            vals = [p[name]["ratio"] for p in per_seed.values()]
            agg[name] = dict(fr.mean_spread(vals), reached=sum(v is not None for v in vals), seeds=len(vals))
        out[arm] = {"per_seed": per_seed, "aggregate": agg}
    return out


def _steps_at(by_budget: dict, target: float) -> dict | None:
    """The fewest steps at which one of the arm's runs' validation points reaches ``target``,
    with the real and Predict steps among them."""
    best = None
    for run in by_budget.values():
        step = next((s for s, v in run["val_points"] if s > 0 and v <= target), None)
        if step is not None and (best is None or step < best["step"]):
            kinds = run["step_kinds"][:step]
            predicted = sum(k.startswith("predict") for k in kinds)
            best = {"step": step, "real": step - predicted, "predicted": predicted}
    return best


def table(result: dict, costs: dict[str, float]) -> str:
    priced = ", ".join(f"{k} {v:g}" for k, v in costs.items())
    lines = [f"Priced (arithmetic on measured curves): {priced} plain DeepSpeed steps.", "",
             "| system | " + " | ".join(TARGETS) + " |", "|---|" + "---|" * len(TARGETS)]
    for arm, a in result.items():
        cells = []
        for name in TARGETS:
            g = a["aggregate"][name]
            cells.append("not reached" if not g["reached"] else
                         f"{g['mean']:.3f} ± {g['std']:.3f}x ({g['reached']} of {g['seeds']} seeds)")
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_rows(out_dir: Path) -> dict:
    """The runs of a bench output directory as ``price`` reads them: arm -> seed -> budget, plain
    DeepSpeed's full-budget run the LR sweep's best (``result.json``'s ``best_lr_multiplier``)."""
    res = json.loads((out_dir / "result.json").read_text())
    best = res["best_lr_multiplier"]
    rows: dict = {}
    for arm, by_seed in res["runs"].items():
        for seed, by_budget in by_seed.items():
            for b, run in by_budget.items():
                path = Path(run["run"])
                if not path.is_dir():   # (the result names its runs by where the bench ran)
                    path = out_dir / path.name
                rows.setdefault(arm, {}).setdefault(seed, {})[b] = load_run(path)
    first = str(res["suite"]["seeds"][0])
    if "1" not in rows.get("baseline", {}).get(first, {}):
        rows.setdefault("baseline", {}).setdefault(first, {})["1"] = load_run(out_dir / f"baseline-lr{best:g}-s{first}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="price_frontier.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="a finished `ds-hybrid bench --out` directory (result.json and its runs)")
    p.add_argument("--cost", nargs="+", required=True, metavar="KIND=COST",
                   help="each step kind's price in plain DeepSpeed steps (plain, real, predict_gradient_f0.25, forward, ...)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    costs = {}
    for item in args.cost:
        kind, eq, value = item.partition("=")
        try:
            costs[kind] = float(value)
        except ValueError:
            raise SystemExit(f"price_frontier: --cost {item!r}: give KIND=COST, COST a number") from None
        if not eq or costs[kind] < 0:
            raise SystemExit(f"price_frontier: --cost {item!r}: give KIND=COST, COST >= 0")
    if not (args.out_dir / "result.json").is_file():
        raise SystemExit(f"price_frontier: {args.out_dir}: no result.json (a finished `ds-hybrid bench --out` directory)")
    result = price(load_rows(args.out_dir), costs)
    md = table(result, costs)
    print(md)
    out = {"command": " ".join(["python", "benchmarks/price_frontier.py", *(argv if argv is not None else sys.argv[1:])]),
           "arithmetic": "measured validation curves, step kinds priced at --cost (not timed)",
           "costs": costs, "arms": result, "table_markdown": md}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
