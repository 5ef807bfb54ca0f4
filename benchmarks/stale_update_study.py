"""What a CPU-side optimizer step running behind the GPU costs in loss, and whether a predicted update covers it.

Issue 15's "CPU window": under ZeRO-Offload the optimizer step runs on the CPU. Run asynchronously (ZeRO-Offload's
delayed parameter update, ZenFlow's asynchronous CPU updates) the GPU's next forward and backward start before the
step's result is back, so their gradient is taken at weights that miss the last ``delay`` updates, and is then
applied to the up-to-date masters. The hybrid's drift velocity (the running average of past updates per unit LR,
``predictor.direction: drift``) could stand in for the missing updates: the GPU would take its gradient at the
stale weights plus ``lr x v`` for each missing step. This study measures both against the synchronous step, in
plain PyTorch (the loss does not depend on where the step runs, only on which weights the gradient is taken at):

* ``sync``:  AdamW as DeepSpeed runs it: every gradient taken at the current weights;
* ``stale``: from step ``--start`` on, the gradient of step t is taken at the masters after update t - delay
  (the missing updates are the ones the CPU is still computing) and applied to the current masters;
* ``cover``: the same, with the weights the gradient is taken at moved by ``lr_j x v`` for each missing step j,
  ``v`` the drift velocity folded from the updates already back (the last ``delay`` are not), at the engine's
  ``drift_beta`` (0.95);
* ``cover-last``: the same with ``beta`` 0: ``v`` is the last update that is back, per unit LR.

Same model, data and schedule as ``direction_study.py`` (the ``tiny-cpu`` preset: GPT-2 0.84M, 16 x 128 bytes of
the Python standard library's source, AdamW, warmup + cosine, clipping 1.0).

    .venv/bin/python benchmarks/stale_update_study.py --lrs 2e-3 1e-3 --json docs/results/stale-update-study.json
    (about 35 min on 2 cores)

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from direction_study import add_flat, schedule, setup  # noqa: E402
from ds_hybrid.data import val_batches  # noqa: E402


@torch.no_grad()
def set_flat(params: list, vec: torch.Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        p.copy_(vec[off:off + n].view_as(p))
        off += n


MODES = {"sync": None, "stale": None, "cover": 0.95, "cover-last": 0.0}   # mode: the cover velocity's beta


def train(seed: int, lr: float, steps: int, mode: str, delay: int, start: int) -> dict:
    """One run. ``mode``: one of ``MODES`` (see the module docstring)."""
    beta = MODES[mode]   # None: no cover, so no velocity to keep
    model, params, opt, stream, val_data = setup(seed, lr)
    vb = val_batches(val_data, 128, 16, max_batches=16)
    lr_at = schedule(lr, steps)
    flat = lambda: torch.cat([p.detach().flatten() for p in params])  # noqa: E731
    masters = collections.deque(maxlen=delay + 1)    # masters[-1]: now; masters[0]: `delay` updates ago
    velocities = collections.deque(maxlen=delay + 1)  # the velocity after each of the same updates
    vel = None
    cover_norms = []
    t0 = time.perf_counter()
    for t in range(steps):
        lr_t = lr_at(t)
        for g in opt.param_groups:
            g["lr"] = lr_t
        now = flat()
        masters.append(now)
        if beta is not None:
            velocities.append(None if vel is None else vel.clone())
        behind = mode != "sync" and t >= start and len(masters) == delay + 1
        if behind:
            # The GPU's weights: the masters without the last `delay` updates (still on the CPU).
            set_flat(params, masters[0])
            if beta is not None and velocities[0] is not None:
                # what the GPU knows: the velocity as of those masters, one lr_j x v per missing step
                missing = sum(lr_at(j) for j in range(t - delay, t))
                add_flat(params, velocities[0], missing)
                cover_norms.append(float(((flat() - now).norm() / (masters[0] - now).norm()).item()))
        loss = model(**next(stream)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if behind:
            set_flat(params, now)   # the gradient goes to the current masters
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if beta is not None and lr_t > 0:
            delta = (flat() - now) / lr_t
            vel = delta if vel is None else vel.mul_(beta).add_(delta, alpha=1 - beta)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val = sum(float(model(**b).loss) for b in vb) / len(vb)
    return {"seed": seed, "lr": lr, "steps": steps, "mode": mode, "delay": delay if mode != "sync" else 0,
            "start": start, "val_loss": val, "train_seconds": seconds,
            # how far the covered weights are from the masters, over how far the stale ones are (1: no help)
            "cover_residual_mean": statistics.mean(cover_norms) if cover_norms else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3], help="peak learning rates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--delays", type=int, nargs="+", default=[1], help="updates the GPU's weights are behind")
    p.add_argument("--start", type=int, default=50, help="first step run behind (ZeRO-Offload's DPU starts late too)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rows = []
    for lr in args.lrs:
        for seed in args.seeds:
            base = train(seed, lr, args.steps, "sync", 0, args.start)
            rows.append({**base, "gap": 0.0})
            print(f"lr {lr:g} seed {seed} sync: val {base['val_loss']:.4f}", flush=True)
            for delay in args.delays:
                for mode in ("stale", "cover", "cover-last"):
                    r = train(seed, lr, args.steps, mode, delay, args.start)
                    r["gap"] = r["val_loss"] - base["val_loss"]
                    rows.append(r)
                    extra = (f", covered weights {r['cover_residual_mean']:.2f}x as far from the masters"
                             if r["cover_residual_mean"] is not None else "")
                    print(f"lr {lr:g} seed {seed} {mode} delay {delay}: val {r['val_loss']:.4f} "
                          f"({r['gap']:+.4f}{extra})", flush=True)
    lines = ["| peak lr | mode | delay | val loss (mean) | gap to sync (mean ± sd) | per seed | covered / stale distance |",
             "|---|---|---|---|---|---|---|"]
    summary = []
    for lr in args.lrs:
        for mode in MODES:
            delays = [0] if mode == "sync" else args.delays
            for delay in delays:
                rs = [r for r in rows if r["lr"] == lr and r["mode"] == mode and r["delay"] == delay]
                gaps = [r["gap"] for r in rs]
                res = [r["cover_residual_mean"] for r in rs if r["cover_residual_mean"] is not None]
                agg = {"lr": lr, "mode": mode, "delay": delay, "runs": len(rs),
                       "val": statistics.mean(r["val_loss"] for r in rs), "gap_mean": statistics.mean(gaps),
                       "gap_sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0, "gaps": gaps,
                       "cover_residual": statistics.mean(res) if res else None}
                summary.append(agg)
                lines.append(f"| {lr:g} | {mode} | {delay} | {agg['val']:.4f} | {agg['gap_mean']:+.4f} ± "
                             f"{agg['gap_sd']:.4f} | {', '.join(f'{g:+.4f}' for g in gaps)} | "
                             + (f"{agg['cover_residual']:.2f}" if res else "-") + " |")
    table = "\n".join(lines)
    result = {"command": "benchmarks/stale_update_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.time() - t0, 1),
              "setup": {"model": "gpt2-tiny", "batch": "16 x 128", "steps": args.steps, "start": args.start,
                        "drift_beta": 0.95, "threads": args.threads},
              "rows": rows, "summary": summary, "table_markdown": table}
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
