"""``ds-hybrid dynamics-eval``: loss-forecast error of the RSSM against naive predictors,
offline, on recorded trajectories (``ds-hybrid train --trajectory FILE``).

    ds-hybrid dynamics-eval --train A.jsonl B.jsonl --test C.jsonl D.jsonl \\
        [--epochs 3] [--json docs/results/dynamics-eval.json] [--save-predictor P.pt]

1. The naive predictors are tuned on the training trajectories, per horizon k:
   last-value persistence, an EMA (rate from a grid) and a least-squares linear
   trend (window from a grid), each extrapolated to step t + k.
2. The RSSM (with everything the engine uses: encoder, Holt base, ensemble) is
   trained on the training trajectories only, then frozen.
3. On every test trajectory it runs causally: at each step with an observed
   loss it forecasts the losses at t + 1..8 (where those steps observed one),
   the residual corrector adapting online from the past only, as in the engine.

Variants reported: the Holt base alone, the RSSM without the corrector, the
RSSM with it, and the RSSM with it conditioned on the target batch's
difficulty (known before that batch's forward; for k > 1 this assumes the
data order is known in advance, as it is for a seeded loader).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import torch

from ..config import HybridPredictConfig
from .encoder import Observation
from .predictor import RSSMPredictor
from .trajectory import read_trajectory

K = 8
EMA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
TREND_GRID = (8, 16, 32, 64, 128)


def _losses(traj: list[Observation]) -> dict[int, float]:
    return {o.step: o.loss for o in traj if o.loss is not None and math.isfinite(o.loss)}


def naive_errors(traj: list[Observation]) -> dict[str, list[list[float]]]:
    """|error| per naive predictor variant and horizon, causally over one trajectory."""
    obs = [(o.step, o.loss) for o in traj if o.loss is not None and math.isfinite(o.loss)]
    by_step = dict(obs)
    out: dict[str, list[list[float]]] = {"persistence": [[] for _ in range(K)]}
    for a in EMA_GRID:
        out[f"ema_{a}"] = [[] for _ in range(K)]
    for w in TREND_GRID:
        out[f"trend_{w}"] = [[] for _ in range(K)]
    ema = {a: None for a in EMA_GRID}
    for i, (step, loss) in enumerate(obs):
        for a in EMA_GRID:
            ema[a] = loss if ema[a] is None else ema[a] + a * (loss - ema[a])
        lines = {}
        for w in TREND_GRID:
            pts = obs[max(0, i + 1 - w): i + 1]
            n = len(pts)
            if n < 3:
                lines[w] = (0.0, loss, step)
                continue
            mx = sum(p[0] for p in pts) / n
            my = sum(p[1] for p in pts) / n
            sxx = sum((p[0] - mx) ** 2 for p in pts)
            slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
            lines[w] = (slope, my, mx)
        for k in range(1, K + 1):
            y = by_step.get(step + k)
            if y is None:
                continue
            out["persistence"][k - 1].append(abs(y - loss))
            for a in EMA_GRID:
                out[f"ema_{a}"][k - 1].append(abs(y - ema[a]))
            for w in TREND_GRID:
                slope, my, mx = lines[w]
                out[f"trend_{w}"][k - 1].append(abs(y - (my + slope * (step + k - mx))))
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def tune_naive(trajs: list[list[Observation]]) -> dict[str, list[str]]:
    """Per horizon, the best EMA rate and trend window on the training trajectories."""
    pooled: dict[str, list[list[float]]] = {}
    for t in trajs:
        for name, per_k in naive_errors(t).items():
            acc = pooled.setdefault(name, [[] for _ in range(K)])
            for k in range(K):
                acc[k].extend(per_k[k])
    best = {"ema": [], "trend": []}
    for k in range(K):
        best["ema"].append(min((n for n in pooled if n.startswith("ema_")), key=lambda n: _mean(pooled[n][k])))
        best["trend"].append(min((n for n in pooled if n.startswith("trend_")), key=lambda n: _mean(pooled[n][k])))
    return best


def _config(difficulty: bool, train_iters: int, seed: int) -> HybridPredictConfig:
    return HybridPredictConfig(predictor={"type": "rssm"},
                               dynamics={"batch_difficulty": difficulty, "train_iters": train_iters, "seed": seed,
                                         "horizon": K})


def _fresh_run(pred: RSSMPredictor, keep: RSSMPredictor | None = None) -> RSSMPredictor:
    """A predictor for a new run that shares the trained model weights."""
    new = RSSMPredictor(pred.cfg)
    src = keep or pred
    new.model.load_state_dict(src.model.state_dict())
    new.opt.load_state_dict(src.opt.state_dict())
    new.trained_rounds = src.trained_rounds
    return new


def train_predictor(trajs: list[list[Observation]], epochs: int, seed: int) -> tuple[RSSMPredictor, float]:
    pred = RSSMPredictor(_config(True, 1, seed))
    t0 = time.perf_counter()
    for _ in range(epochs):
        for traj in trajs:
            run = _fresh_run(pred)
            for o in traj:
                run.observe(o)
            pred.model.load_state_dict(run.model.state_dict())
            pred.opt.load_state_dict(run.opt.state_dict())
            pred.trained_rounds = run.trained_rounds
    return pred, time.perf_counter() - t0


def rssm_errors(trained: RSSMPredictor, traj: list[Observation], difficulty: bool) -> dict[str, list[list[float]]]:
    """|error| of the Holt base, the RSSM, and the RSSM with its corrector, causally."""
    cfg = _config(difficulty, 0, trained.cfg.dynamics.seed)
    pred = RSSMPredictor(cfg)
    pred.model.load_state_dict(trained.model.state_dict())
    pred.trained_rounds = max(trained.trained_rounds, 1)
    by_step = {o.step: o for o in traj}
    out = {n: [[] for _ in range(K)] for n in ("holt", "rssm", "rssm+corrector")}
    for o in traj:
        pred.observe(o)
        if o.loss is None or not math.isfinite(o.loss) or pred.heads is None:
            continue
        s = pred.base.scale or 1.0
        for k in range(1, K + 1):
            tgt = by_step.get(o.step + k)
            if tgt is None or tgt.loss is None or not math.isfinite(tgt.loss):
                continue
            base_k = pred.base.forecast(k)
            mu = float(pred.heads["loss_mean"][:, k - 1].mean())
            out["holt"][k - 1].append(abs(tgt.loss - base_k))
            out["rssm"][k - 1].append(abs(tgt.loss - (base_k + s * mu)))
            corr, _ = pred.predict_loss(o.step + k, tgt.batch_difficulty if difficulty else None)
            out["rssm+corrector"][k - 1].append(abs(tgt.loss - corr))
    return out


def evaluate(train_paths: list[str], test_paths: list[str], epochs: int = 3, seed: int = 0) -> dict:
    train = [read_trajectory(p)[1] for p in train_paths]
    tests = {p: read_trajectory(p)[1] for p in test_paths}
    best = tune_naive(train)
    trained, train_s = train_predictor(train, epochs, seed)
    results = {"train": train_paths, "test": test_paths, "epochs": epochs, "naive_choice": best,
               "train_seconds": train_s, "per_test": {}, "pooled": None}
    pooled: dict[str, list[list[float]]] = {}
    for path, traj in tests.items():
        errs = naive_errors(traj)
        model = rssm_errors(trained, traj, difficulty=False)
        model_d = rssm_errors(trained, traj, difficulty=True)
        rows = _rows(errs, model, model_d, best)
        results["per_test"][path] = rows
        for name, per_k in list(_select(errs, best).items()) + list(model.items()) + \
                [("rssm+corrector+difficulty", model_d["rssm+corrector"])]:
            acc = pooled.setdefault(name, [[] for _ in range(K)])
            for k in range(K):
                acc[k].extend(per_k[k])
    results["pooled"] = _rows_from(pooled)
    results["trained"] = trained
    return results


def _select(errs: dict, best: dict) -> dict[str, list[list[float]]]:
    return {"persistence": errs["persistence"],
            "ema": [errs[best["ema"][k]][k] for k in range(K)],
            "trend": [errs[best["trend"][k]][k] for k in range(K)]}


def _rows(errs, model, model_d, best) -> list[dict]:
    d = _select(errs, best)
    d.update(model)
    d["rssm+corrector+difficulty"] = model_d["rssm+corrector"]
    return _rows_from(d)


def _rows_from(d: dict[str, list[list[float]]]) -> list[dict]:
    rows = []
    for k in range(K):
        r = {"k": k + 1, "n": len(d["persistence"][k])}
        for name, per_k in d.items():
            r[name] = _mean(per_k[k])
        naive = min(r["persistence"], r["ema"], r["trend"])
        r["best_naive"] = naive
        for name in ("holt", "rssm", "rssm+corrector", "rssm+corrector+difficulty"):
            r[f"gain_{name}"] = 1 - r[name] / naive if naive > 0 else float("nan")
        rows.append(r)
    return rows


def format_rows(rows: list[dict]) -> str:
    cols = ["k", "n", "persistence", "ema", "trend", "holt", "rssm", "rssm+corrector", "rssm+corrector+difficulty"]
    head = "| " + " | ".join(cols) + " | vs best naive (corr / corr+diff) |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = [str(r["k"]), str(r["n"])] + [f"{r[c]:.4f}" for c in cols[2:]]
        cells.append(f"{100 * r['gain_rssm+corrector']:+.1f}% / {100 * r['gain_rssm+corrector+difficulty']:+.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- engine runs
def _run_row(run_dir: Path) -> dict:
    summ = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    st = summ["statistics"]
    n = len(steps)
    measured = [(r["step"], r["lr"], r["progress"]) for r in steps if r.get("progress") is not None]
    lrs = sorted(lr for _, lr, _ in measured)

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else None
    cut = (lrs[len(lrs) // 2] if lrs else 0.0)
    acc, rb = st["predict_accepted"], st["predict_rolled_back"]
    det = st.get("predictor_details") or {}
    return {
        "run": str(run_dir), "predictor": st.get("predictor", "plain DeepSpeed"), "seed": summ["args"]["seed"],
        "lr": summ["ds_config"].get("optimizer", {}).get("params", {}).get("lr"),
        "data": summ["args"].get("data") or "stdlib",
        "val_loss": summ["final_val_loss"], "steps": n,
        "predict_pct": 100.0 * st["predict_steps"] / max(n, 1),
        "accept_rate": acc / (acc + rb) if acc + rb else None,
        "backward_skipped_pct": st["backward_skipped_pct"],
        "predictor_cost_fraction": st.get("predictor_cost_fraction"),
        "progress_mean": mean(p for _, _, p in measured),
        "progress_positive_share": mean(float(p > 0) for _, _, p in measured),
        "progress_early": mean(p for s_, _, p in measured if s_ <= n // 2),
        "progress_late": mean(p for s_, _, p in measured if s_ > n // 2),
        "progress_high_lr": mean(p for _, lr, p in measured if lr >= cut),
        "progress_low_lr": mean(p for _, lr, p in measured if lr < cut),
        "progress_n": len(measured),
        "calibration": det.get("calibration"),
        "corrector": det.get("corrector"),
        "train_seconds": summ.get("train_seconds_excluding_eval"),
    }


ENGINE_COLUMNS = ("val_loss", "predict_pct", "accept_rate", "backward_skipped_pct", "predictor_cost_fraction",
                  "progress_mean", "progress_positive_share", "progress_early", "progress_late",
                  "progress_high_lr", "progress_low_lr")


def engine_table(run_dirs: list[str]) -> dict:
    """Per predictor type (and corpus): each column's mean and std over the runs (seeds)."""
    rows = [_run_row(Path(d)) for d in run_dirs]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['predictor']} / {Path(r['data']).name} / lr {r['lr']:g}", []).append(r)
    table = {}
    for name, rs in groups.items():
        agg = {"runs": len(rs), "seeds": [r["seed"] for r in rs]}
        for c in ENGINE_COLUMNS:
            vals = [r[c] for r in rs if r[c] is not None]
            agg[c] = (statistics.fmean(vals), statistics.pstdev(vals) if len(vals) > 1 else 0.0) if vals else None
        calib: dict[str, list] = {}
        for r in rs:
            for row in r["calibration"] or []:
                acc = calib.setdefault(row["confidence"], [0, 0.0])
                if row["steps"]:
                    acc[0] += row["steps"]
                    acc[1] += row["steps"] * row["accepted_share"]
        agg["calibration"] = {k: {"steps": v[0], "accepted_share": v[1] / v[0] if v[0] else None}
                              for k, v in calib.items()}
        table[name] = agg
    return {"runs": rows, "table": table}


def format_engine_table(table: dict) -> str:
    head = "| predictor / corpus / peak lr | runs | " + " | ".join(ENGINE_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(ENGINE_COLUMNS) + 2)]
    for name, agg in table.items():
        cells = []
        for c in ENGINE_COLUMNS:
            v = agg[c]
            if v is None:
                cells.append("-")
            elif c.startswith("progress") and c != "progress_positive_share":
                cells.append(f"{v[0]:+.2e} ± {v[1]:.1e}")
            else:
                cells.append(f"{v[0]:.4g} ± {v[1]:.2g}")
        lines.append(f"| {name} | {agg['runs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="ds-hybrid dynamics-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", default=None, help="trajectory files the RSSM trains on")
    p.add_argument("--test", nargs="+", default=None, help="held-out trajectory files it is evaluated on")
    p.add_argument("--runs", nargs="+", default=None,
                   help="instead: tabulate finished 'ds-hybrid train' run directories per predictor type "
                        "(acceptance, backward passes skipped, validation loss, predictor cost, progress per "
                        "predicted step early/late and at high/low learning rate, calibration)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training trajectories")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the tables here")
    p.add_argument("--save-predictor", default=None,
                   help="save the trained RSSM (hybrid_predict.dynamics.init_from can start from it)")
    args = p.parse_args(argv)
    if args.runs:
        for d in args.runs:
            if not (Path(d) / "summary.json").is_file():
                raise SystemExit(f"--runs: {d} has no summary.json (not a finished ds-hybrid train run)")
        res = engine_table(args.runs)
        print(format_engine_table(res["table"]))
        for name, agg in res["table"].items():
            if any(v["steps"] for v in agg["calibration"].values()):
                print(f"\ncalibration, {name}: confidence at decision -> Predict steps, share accepted")
                for k, v in agg["calibration"].items():
                    share = "-" if v["accepted_share"] is None else f"{v['accepted_share']:.3f}"
                    print(f"  {k}: {v['steps']} steps, accepted {share}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=2))
            print(f"wrote {args.json}")
        return res
    if not args.train or not args.test:
        raise SystemExit("ds-hybrid dynamics-eval: give --train and --test trajectory files (or --runs RUN_DIR...)")
    for flag, paths in (("--train", args.train), ("--test", args.test)):
        for q in paths:
            if not Path(q).is_file():
                raise SystemExit(f"{flag}: trajectory file not found: {q}")
    overlap = set(map(str, map(Path, args.train))) & set(map(str, map(Path, args.test)))
    if overlap:
        raise SystemExit(f"--test: {sorted(overlap)} also in --train; test trajectories must be held out")
    res = evaluate(args.train, args.test, args.epochs, args.seed)
    trained = res.pop("trained")
    for path, rows in res["per_test"].items():
        print(f"\nheld-out {path}: mean |loss error| by horizon k")
        print(format_rows(rows))
    print("\npooled over the held-out trajectories:")
    print(format_rows(res["pooled"]))
    print(f"\nnaive predictors tuned on the training trajectories: {res['naive_choice']}; "
          f"RSSM training {res['train_seconds']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    if args.save_predictor:
        torch.save({"model": trained.model.state_dict(), "shape": trained.shape.__dict__}, args.save_predictor)
        print(f"wrote {args.save_predictor}")
    return res
