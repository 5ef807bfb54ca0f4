"""``ds-hybrid compare RUN_DIR...``: a table of finished ``ds-hybrid train`` runs.

Reads each run's ``summary.json``, prints one row per run and, for runs that
differ only in seed, the mean and spread per configuration (hybrid on / off).
``--json PATH`` writes the same figures. Nothing is measured here: every number
comes from the runs' own summaries.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def load_run(path: Path) -> dict:
    f = path / "summary.json" if path.is_dir() else path
    if not f.is_file():
        raise SystemExit(f"compare: no summary.json in {path}")
    s = read_summary(f)
    st = s["statistics"]
    steps = sum(st["steps_per_phase"].values())
    ms = st["mean_step_seconds"]
    real = [k for k in ("warmup", "full", "correct") if ms.get(k)]
    real_ms = (sum(st["seconds_per_phase"][k] for k in real) /
               sum(st["steps_per_phase"][k] for k in real) * 1e3) if real else None
    hybrid = bool(s["ds_config"].get("hybrid_predict", {}).get("enabled", False))
    run_dir = path if path.is_dir() else path.parent
    return {
        "val_curve": val_against_time(run_dir, s["val_points"]),
        "val_points": [tuple(v) for v in s["val_points"]],
        "step_kinds": step_kinds(run_dir, hybrid, hybrid and bool(
            s["ds_config"]["hybrid_predict"].get("group_predict", {}).get("enabled", False)),
            s["ds_config"].get("hybrid_predict", {}).get("predictor", {}).get("gradient_batch_fraction", 1.0),
            s["ds_config"].get("hybrid_predict", {}).get("predictor", {}).get("direction", "drift")),
        "run": str(path),
        "hybrid": hybrid,
        "seed": s["args"]["seed"],
        "steps": steps,
        "final_val_loss": s["final_val_loss"],
        "predicted_pct": 100.0 * st["steps_per_phase"]["predict"] / steps if steps else 0.0,
        "rolled_back": st["predict_rolled_back"],
        "accepted": st["predict_accepted"],
        "backward_skipped_pct": st["backward_skipped_pct"],
        "real_step_ms": real_ms,
        "predict_step_ms": ms["predict"] * 1e3 if ms.get("predict") else None,
        "train_seconds": s["train_seconds_excluding_eval"],
        "peak_rss_mb": s.get("peak_rss_mb"),
        "gpu_peak_allocated_mb": s.get("gpu_peak_allocated_mb"),
        "tokens_per_step": s["args"]["seq_len"] * s["ds_config"].get("train_micro_batch_size_per_gpu", 1)
        * s["ds_config"].get("gradient_accumulation_steps", 1) * s.get("world_size", 1),
        "gas": s["ds_config"].get("gradient_accumulation_steps", 1),
        "statistics": st,
    }


SUMMARY_KEYS = ("args", "ds_config", "statistics", "val_points", "final_val_loss", "train_seconds_excluding_eval")


def read_summary(f: Path) -> dict:
    """A ``ds-hybrid train`` summary.json; any other file exits naming it and what it lacks."""
    try:
        s = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"compare: {f} is not a ds-hybrid train summary.json (not JSON: {err})") from None
    missing = [k for k in SUMMARY_KEYS if k not in s] if isinstance(s, dict) else list(SUMMARY_KEYS)
    if missing:
        raise SystemExit(f"compare: {f} is not a ds-hybrid train summary.json (no {', '.join(missing)})")
    return s


def val_against_time(run_dir: Path, val_points: list) -> list[tuple[float, float]]:
    """(training seconds so far, validation loss) at each evaluation, from steps.jsonl."""
    f = run_dir / "steps.jsonl"
    if not f.is_file():
        return []
    cum = [0.0]
    for line in f.read_text().splitlines():
        cum.append(cum[-1] + json.loads(line)["step_time_s"])
    return [(cum[min(step, len(cum) - 1)], loss) for step, loss in val_points]


def step_kinds(run_dir: Path, hybrid: bool, groups: bool = False, gradient_fraction: float = 1.0,
               direction: str = "drift") -> list[str]:
    """What each step of a run was, for costing it from a profile: ``plain`` (a real step of
    plain DeepSpeed), ``real`` (a hybrid real step, with its bookkeeping; ``real_idle`` without it,
    ``hybrid_predict.lazy_bookkeeping``; ``real_groups`` with layer-group Predict on, whose planner
    also observes every whole step; ``real_gradient`` where ``predictor.direction`` is gradient:
    no velocity to fold, no direction to probe), ``partial_K`` (K lower
    layer groups predicted), ``predict`` / ``predict_verified`` (a whole-model Predict step without
    / with its verification forward; ``predict_gradient`` / ``predict_gradient_verified`` where it
    took its own gradient, ``predictor.direction: gradient``; ``predict_gradient_fF`` from the share F
    of its batch, ``predictor.gradient_batch_fraction``); ``+run`` on the first Predict step of each
    run (a gradient run copies the optimizer's moments in and hands its first moment back; beside
    a GPU a drift run copies the velocity there);
    ``+forward`` where a rejected check ran a forward again; ``+commit`` on the real step after a kept
    drift run (on the device path its masters catch up there)."""
    gradient_kind = "predict_gradient" + (f"_f{gradient_fraction:g}" if gradient_fraction != 1.0 else "")
    f = run_dir / "steps.jsonl"
    if not f.is_file():
        return []
    out, prev = [], None
    for line in f.read_text().splitlines():
        r = json.loads(line)
        phase = r.get("phase")
        if phase == "predict":
            kind = (gradient_kind if r.get("backward_ran") else "predict") + ("_verified" if r.get("verified") else "")
            kind += "+run" if prev is None or not prev.startswith("predict") else ""
        elif phase == "partial":
            kind = f"partial_{r.get('predicted_groups', 0)}"
        else:
            kind = ("real_groups" if groups else "real_idle" if r.get("bookkeeping") is False
                    else "real_gradient" if direction == "gradient" else "real") if hybrid else "plain"
            drift_run = prev is not None and prev.startswith("predict") and not prev.startswith("predict_gradient")
            kind += "+commit" if kind in ("real", "real_groups") and drift_run and r.get("checked") is not False else ""
        out.append(kind + ("+forward" if r.get("checked") is False else ""))
        prev = kind
    return out


_FRACTION = re.compile(r"predict_gradient_f([0-9.]+(?:e-?[0-9]+)?)")


def backward_share(kind: str) -> float:
    """The share of its batch whose gradient a step of ``kind`` (``step_kinds``) took: the share F
    of a ``predict_gradient_fF`` step, none for a drift Predict step (its forward, where it runs
    one, is a check), the whole for a real step, a ``predict_gradient`` step and a partial step
    (the layer groups it trains take the whole batch's gradient)."""
    if kind.startswith("predict_gradient"):
        m = _FRACTION.match(kind)
        return float(m.group(1)) if m else 1.0
    return 0.0 if kind.startswith("predict") else 1.0


def interp_curve(curve: list[tuple[float, float]], t: float) -> float | None:
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return None


def paired(rows: list[dict]) -> list[dict]:
    """Hybrid against baseline runs of the same seed: equal steps and equal wall time."""
    out = []
    for h in (r for r in rows if r["hybrid"]):
        base = next((b for b in rows if not b["hybrid"] and b["seed"] == h["seed"] and b["steps"] == h["steps"]), None)
        if base is None:
            continue
        out.append({"seed": h["seed"], "hybrid_val": h["final_val_loss"], "baseline_val": base["final_val_loss"],
                    "baseline_val_at_hybrid_time": interp_curve(base["val_curve"], h["train_seconds"]),
                    "time_ratio": h["train_seconds"] / base["train_seconds"]})
    return out


COLUMNS = [("final_val_loss", "val loss", "{:.4f}"), ("predicted_pct", "predicted %", "{:.1f}"),
           ("accepted", "accepted", "{:d}"), ("rolled_back", "rolled back", "{:d}"),
           ("real_step_ms", "real ms/step", "{:.1f}"), ("predict_step_ms", "predict ms/step", "{:.1f}"),
           ("train_seconds", "train s", "{:.1f}")]


def _fmt(fmt: str, v) -> str:
    if v is None:
        return "-"
    return fmt.format(int(v)) if fmt == "{:d}" else fmt.format(v)


def markdown(rows: list[dict]) -> str:
    head = "| run | hybrid | seed | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for r in rows:
        lines.append(f"| {Path(r['run']).name} | {'on' if r['hybrid'] else 'off'} | {r['seed']} | "
                     + " | ".join(_fmt(f, r[k]) for k, _, f in COLUMNS) + " |")
    groups = aggregate(rows)
    if groups:
        lines += ["", "| configuration | hybrid | runs | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
                  "|" + "---|" * (3 + len(COLUMNS))]
        for g in groups:
            cells = []
            for k, _, f in COLUMNS:
                m, sd = g[k]
                cells.append("-" if m is None else f"{_fmt('{:.4f}' if k == 'final_val_loss' else '{:.1f}', m)}"
                             f" ± {_fmt('{:.4f}' if k == 'final_val_loss' else '{:.1f}', sd)}")
            lines.append(f"| {g['config']} | {'on' if g['hybrid'] else 'off'} | {g['runs']} | " + " | ".join(cells) + " |")
    pairs = paired(rows)
    if pairs:
        lines += ["", "| seed | hybrid val loss | baseline val loss (same steps) | baseline val loss at hybrid's "
                  "wall time | hybrid time / baseline time |", "|---|---|---|---|---|"]
        for p in pairs:
            lines.append(f"| {p['seed']} | {p['hybrid_val']:.4f} | {p['baseline_val']:.4f} | "
                         f"{_fmt('{:.4f}', p['baseline_val_at_hybrid_time'])} | {p['time_ratio']:.3f} |")
    return "\n".join(lines)


def config_name(run: str) -> str:
    """A run folder's name without its seed suffix (``int8-s2`` -> ``int8``): runs that differ
    only in seed share it."""
    return re.sub(r"[-_]s\d+$", "", Path(run).name)


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds, per configuration (run name without its seed)."""
    out = []
    for name in dict.fromkeys(config_name(r["run"]) for r in rows):
        group = [r for r in rows if config_name(r["run"]) == name]
        if len(group) < 2:
            continue
        g = {"config": name, "hybrid": group[0]["hybrid"], "runs": len(group)}
        for k, _, _ in COLUMNS:
            vals = [r[k] for r in group if r[k] is not None]
            g[k] = (statistics.mean(vals), statistics.stdev(vals)) if len(vals) >= 2 else (None, None)
        out.append(g)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ds-hybrid compare", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (or summary.json files) of ds-hybrid train")
    p.add_argument("--json", help="also write the rows and aggregates to this JSON file")
    args = p.parse_args(argv)
    rows = [load_run(Path(r)) for r in args.runs]
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "aggregate": aggregate(rows), "paired": paired(rows)},
                                              indent=2))
