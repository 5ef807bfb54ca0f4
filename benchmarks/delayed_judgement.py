"""Can a per-run delayed judgement tell predicted steps that pay from the skip control?

Replays the per-step records (``steps.jsonl``) of a budget-frontier bench's ``predict`` and
``predict-skip`` runs (the same seeds, batches and schedule; the control's Predict steps move
nothing) through ``ds_hybrid.judgement.DelayedJudgement``, the engine's own judge, in the
engine's order: a run kept by its check opens a judgement, the next ``--steps`` real-step
losses close it against the line through the ``--window`` real-step losses before it.

If the judgement could see what a drift run is worth, the ``predict`` runs' mean effect would
sit below the control's by about what the bench's final losses say they bought. The replay
has no batch-difficulty statistic (``steps.jsonl`` does not record it); the engine fits it as
a second regressor, which takes out part of the batch noise (not all of it: see the table).

    .venv/bin/python benchmarks/delayed_judgement.py /tmp/bench/cpu-small /tmp/bench/cpu-finetune \\
        --json docs/results/delayed-judgement.json

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_hybrid.judgement import DelayedJudgement  # noqa: E402


def difficulties(run_dir: Path, n: int, real: list[bool]) -> list[float | None]:
    """The engine's batch-difficulty statistic of each step's batch, from the run's own batch
    stream (rebuilt from its arguments); the counts learn from real steps' batches only."""
    from ds_hybrid.data import ByteDataset, train_batches
    from ds_hybrid.dynamics.batchstats import BatchDifficulty
    from ds_hybrid.train import build_parser
    args = build_parser().parse_args(json.loads((run_dir / "bench_args.json").read_text()))
    cfg = json.loads((run_dir / "ds_config.json").read_text())
    train, _ = ByteDataset.load(args.data, args.max_corpus_bytes).split(seq_len=args.seq_len)
    stream = train_batches(train, args.seq_len, cfg["train_micro_batch_size_per_gpu"], seed=args.seed)
    gas = cfg.get("gradient_accumulation_steps", 1)
    stat, out = BatchDifficulty(), []
    for i in range(n):
        batches = [next(stream) for _ in range(gas)]
        if real[i]:
            got = stat.measure(batches)
            out.append(got[0] / got[1] if got and got[1] else None)
        else:
            out.append(None)
    return out


def replay(steps_jsonl: Path, steps: int, window: int, difficulty: bool = False, clean: bool = False,
           verdicts: list | None = None) -> DelayedJudgement:
    """``clean=False`` (the bench arms): runs come every few real steps, no window is free of
    them, so every run is judged from the window it has; the skip arm, judged alike, is the
    control. ``clean=True`` is the engine's setting; ``verdicts`` collects ``harmful()`` after
    every step (the engine asks it at each Predict decision)."""
    rows = [json.loads(line) for line in steps_jsonl.read_text().splitlines()]
    judge = DelayedJudgement(steps=steps, window=window, clean=clean)
    diff = (difficulties(steps_jsonl.parent, len(rows), [r["phase"] != "predict" for r in rows])
            if difficulty else [None] * len(rows))
    run = 0
    for i, r in enumerate(rows):
        if r["phase"] == "predict":
            run += 1
            continue
        if run:
            if r.get("checked") is not False:      # the next real step's check kept the run
                judge.run_ended(run)
            run = 0
        if r["phase"] != "partial":
            judge.real_step(r["loss"], diff[i])
        if verdicts is not None:
            verdicts.append(judge.harmful())
    return judge


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_val_loss"]


def _stats(xs: list[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "std": sd, "stderr": sd / math.sqrt(n) if n else float("nan")}


def study(bench_dir: Path, steps: int, window: int, difficulty: bool) -> dict:
    arms = {}
    seeds = sorted({p.name.rsplit("-s", 1)[1] for p in bench_dir.glob("predict-b1-s*")})
    for arm in ("predict", "predict-skip"):
        runs, finals = [], {}
        for seed in seeds:
            d = bench_dir / f"{arm}-b1-s{seed}"
            j = replay(d / "steps.jsonl", steps, window, difficulty)
            runs += [e for _, k, e in j.effects if k > 0]
            finals[seed] = final_loss(d)
        # (No placebos here: with a run after every few real steps no stretch is free of runs;
        # the skip arm, judged alike, is the control.)
        arms[arm] = {"runs": _stats(runs), "final_val_loss": finals}
    p, s = arms["predict"], arms["predict-skip"]
    diff = p["runs"]["mean"] - s["runs"]["mean"]
    final_diffs = [p["final_val_loss"][k] - s["final_val_loss"][k] for k in seeds]
    return {"bench": str(bench_dir), "seeds": seeds, "steps": steps, "window": window, "difficulty": difficulty,
            "arms": arms, "judged_difference": diff,
            "judged_difference_stderr": math.hypot(p["runs"]["stderr"], s["runs"]["stderr"]),
            "final_loss_difference": sum(final_diffs) / len(final_diffs), "final_loss_differences": final_diffs}


def default_gate(bench_dir: Path, steps: int, window: int, difficulty: bool) -> dict:
    """The engine's judge (defaults of the ``judge`` section) replayed over the bench's ``default``
    runs: would its verdict have stopped Predict in any of them?"""
    from ds_hybrid.config import JudgeConfig
    jc, out = JudgeConfig(), {}
    for d in sorted(bench_dir.glob("default-b1-s*")):
        verdicts: list = []
        j = replay(d / "steps.jsonl", jc.steps, jc.window, difficulty, clean=True, verdicts=verdicts)
        net, se = j.net_effect()
        out[d.name] = {"judged_runs": j.runs.n, "placebos": j.placebos.n, "net_effect": net, "net_stderr": se,
                       "harmful_at_any_step": any(verdicts)}
    return out


def name(r: dict) -> str:
    return f"{Path(r['bench']).name} ({'index + difficulty' if r['difficulty'] else 'index'})"


def table(results: list[dict]) -> str:
    lines = ["| bench (forecast from) | arm | judged runs | mean effect ± s.e. | std per run | final val loss by seed |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for arm, a in r["arms"].items():
            finals = ", ".join(f"{v:.4f}" for v in a["final_val_loss"].values())
            ru = a["runs"]
            lines.append(f"| {name(r)} | {arm} | {ru['n']} | {ru['mean']:+.4f} ± {ru['stderr']:.4f} | {ru['std']:.4f} "
                         f"| {finals} |")
        lines.append(f"| {name(r)} | **predict − skip** | | **{r['judged_difference']:+.4f} ± "
                     f"{r['judged_difference_stderr']:.4f}** | | **{r['final_loss_difference']:+.4f}** (mean) |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("benches", nargs="+", type=Path, help="bench output folders (ds-hybrid bench --out)")
    p.add_argument("--steps", type=int, default=8, help="real steps after a run that judge it (judge.steps)")
    p.add_argument("--window", type=int, default=16, help="real-step losses the forecast is fitted to (judge.window)")
    p.add_argument("--no-difficulty", action="store_true",
                   help="fit the forecast to the real-step index only (no batch-difficulty regressor)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = [study(b, args.steps, args.window, not args.no_difficulty) for b in args.benches]
    print(table(results))
    for b, r in zip(args.benches, results):
        r["default_gate"] = default_gate(b, args.steps, args.window, not args.no_difficulty)
        for run, g in r["default_gate"].items():
            net = "-" if g["net_effect"] is None else f"{g['net_effect']:+.4f} ± {g['net_stderr']:.4f}"
            print(f"{b.name}/{run}: the engine's judge: {g['judged_runs']} runs, {g['placebos']} placebos, net {net}, "
                  f"{'STOPS' if g['harmful_at_any_step'] else 'never stops'} Predict")
    if args.json:
        args.json.write_text(json.dumps({"command": "benchmarks/delayed_judgement.py " + " ".join(sys.argv[1:]),
                                         "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
