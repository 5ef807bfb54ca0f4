"""Immediate progress of a drift step against a real step, measured on a batch neither has seen (plain PyTorch).

The engine measures a Predict step's progress as its batch's loss before the update minus after
it (``dynamics.progress_every``). This probe asks whether that immediate figure tells how much a
drift step is worth. The setup is the ``tiny-cpu`` preset's model, data and schedule at lr 2e-3.
After ``--start`` real AdamW steps it runs cycles of 4 real steps and 2 drift steps, and
measures on fresh batches:

* each real step's progress on a batch other than its own;
* each drift step's progress on the batch it stands for (as the engine does).

Compare with ``benchmarks/direction_study.py``, which gives the same drift steps' effect on the
final validation loss against the same run with them skipped.

    .venv/bin/python benchmarks/progress_probe.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/progress_probe.py --seeds 1 2 3 --json docs/results/progress-probe.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from direction_study import add_flat, schedule, setup  # noqa: E402  (the same model, data and schedule)


def probe(seed: int, lr: float, steps: int, start: int, cycles: int, beta: float = 0.95) -> dict:
    model, params, opt, stream, _ = setup(seed, lr)
    lr_at = schedule(lr, steps)
    flat = lambda: torch.cat([p.detach().flatten() for p in params])  # noqa: E731
    state = {"prev": None, "vel": None}

    def real_step(t: int, batch: dict) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        w = flat()
        if state["prev"] is not None:
            d = (w - state["prev"]) / lr_at(t)
            state["vel"] = d if state["vel"] is None else state["vel"].mul_(beta).add_(d, alpha=1 - beta)
        state["prev"] = w

    @torch.no_grad()
    def batch_loss(batch: dict) -> float:
        return float(model(**batch).loss)

    for t in range(start):
        real_step(t, next(stream))
    real, drift = [], []
    t = start
    for _ in range(cycles):
        for _ in range(4):
            batch, fresh = next(stream), next(stream)
            before = batch_loss(fresh)
            real_step(t, batch)
            real.append(before - batch_loss(fresh))
            t += 1
        for _ in range(2):
            batch = next(stream)
            before = batch_loss(batch)
            add_flat(params, state["vel"], lr_at(t))
            drift.append(before - batch_loss(batch))
            t += 1
        state["prev"] = flat()
    return {"seed": seed, "real": real, "drift": drift}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=600, help="schedule length")
    p.add_argument("--start", type=int, default=300, help="real steps before the probe")
    p.add_argument("--cycles", type=int, default=12, help="cycles of 4 real + 2 drift steps measured")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [probe(s, args.lr, args.steps, args.start, args.cycles) for s in args.seeds]
    out = {"command": "benchmarks/progress_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "runs": runs, "summary": {}}
    print("| step kind | measured | mean progress on a fresh batch | share positive |\n|---|---|---|---|")
    for kind in ("real", "drift"):
        xs = [x for r in runs for x in r[kind]]
        out["summary"][kind] = {"n": len(xs), "mean": statistics.mean(xs),
                                "positive_share": sum(x > 0 for x in xs) / len(xs)}
        print(f"| {kind} | {len(xs)} | {statistics.mean(xs):+.2e} | {out['summary'][kind]['positive_share']:.0%} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
