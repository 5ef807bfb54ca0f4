"""Do gradient-free predicted steps beat a tuned baseline at equal compute? (plain PyTorch)

A controlled study behind the README's "what a predicted step is worth": the same model,
data and schedule as the ``tiny-cpu`` preset (GPT-2 0.84M, 16 x 128 bytes of the Python
standard library's source, AdamW, warmup + cosine to 0.1x, clipping 1.0), without DeepSpeed
or verification, so that only the direction of the predicted step differs.

A hybrid run takes ``F`` real AdamW steps, then ``H`` predicted steps with no gradient, and
repeats; predicted steps advance the LR schedule, as in the engine. It is compared with plain
AdamW given **as many real steps on its own full schedule** (equal compute: a predicted step
costs nothing here), at each peak learning rate. Directions:

* ``adam``: ``-s * lr * m_hat / (sqrt(v_hat) + eps)`` from the optimizer state, plus decay
  (``predictor.direction: adam``);
* ``drift``: ``s * lr * v``, ``v`` the running average (``beta``) of the real updates per unit
  LR (``predictor.direction: drift``);
* ``skip``: nothing moves; the same run with its predicted steps skipped (they still advance the
  schedule). The gap between a direction and ``skip`` is the progress its predicted steps made.

A predicted step's worth (``worth_of``, with ``skip`` among the directions) is the share of the
loss gap between skipping the predicted steps and making them real that they recover.
``--batch`` sets the sequences per step (the preset's 16): a larger batch gives less noisy real
updates, so a different drift velocity to extrapolate.

    .venv/bin/python benchmarks/direction_study.py --lrs 2e-3            # ~35 min on 2 cores
    .venv/bin/python benchmarks/direction_study.py --lrs 2e-3 --seeds 1 --starts 50 --json /tmp/d.json
    .venv/bin/python benchmarks/direction_study.py --batch 64 --lrs 2e-3 4e-3 --seeds 1 --starts 50 --directions drift skip

Prints a table and writes JSON (default ``docs/results/direction-study.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_hybrid.data import ByteDataset, train_batches, val_batches  # noqa: E402
from ds_hybrid.models import build_model  # noqa: E402


def schedule(lr: float, steps: int):
    """The preset's schedule: 30 linear warmup steps, then cosine to 0.1x over ``steps``."""
    def lr_at(t: int) -> float:
        if t < 30:
            return lr * (t + 1) / 30
        p = min((t - 30) / (steps - 30), 1.0)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    return lr_at


def setup(seed: int, lr: float, batch: int = 16, model: str = "gpt2-tiny", seq_len: int = 128,
          device: str = "cpu"):
    """The preset's model, AdamW and training stream (seeded; ``batch`` sequences a step, the
    preset's 16 unless told), and the validation split. ``model``, ``seq_len`` and ``device``
    change the preset's GPT-2 0.84M at 128 bytes on the CPU (``stale_update_study.py`` at 124M
    on a GPU); the stream's batches are on ``device``."""
    torch.manual_seed(seed)
    train_data, val_data = ByteDataset.load(None).split(0.05, seq_len)
    net = build_model(model, vocab_size=256, seq_len=seq_len).to(device)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    stream = ({k: v.to(device) for k, v in b.items()} for b in train_batches(train_data, seq_len, batch, seed))
    return net, params, opt, stream, val_data


@torch.no_grad()
def add_flat(params: list, vec: torch.Tensor, alpha: float) -> None:
    """Add ``alpha * vec`` (one flat vector over all parameters, in order) to the parameters."""
    off = 0
    for p in params:
        n = p.numel()
        p.add_(vec[off:off + n].view_as(p), alpha=alpha)
        off += n


def fold_velocity(vel: torch.Tensor | None, w: torch.Tensor, prev: torch.Tensor | None, lr: float,
                  beta: float) -> torch.Tensor | None:
    """The drift velocity after a real update from ``prev`` to ``w`` at ``lr``: the running average (``beta``) of
    the real updates per unit LR (``predictor.direction: drift``); unchanged with no previous point or at LR 0."""
    if prev is None or lr <= 0:
        return vel
    delta = (w - prev) / lr
    return delta if vel is None else vel.mul_(beta).add_(delta, alpha=1 - beta)


def train(seed: int, lr: float, steps: int, direction: str | None, F: int, H: int, scale: float,
          beta: float = 0.95, warm: int = 50, batch: int = 16) -> dict:
    """One run; ``direction=None`` is plain AdamW for ``steps`` real steps."""
    model, params, opt, stream, val_data = setup(seed, lr, batch)
    vb = val_batches(val_data, 128, 16, max_batches=16)
    lr_at = schedule(lr, steps)
    flat = lambda: torch.cat([p.detach().flatten() for p in params])  # noqa: E731
    prev = vel = None
    t = real = since = 0
    t0 = time.perf_counter()
    while t < steps:
        if direction and t >= warm and since >= F:
            with torch.no_grad():
                for j in range(H):
                    step_lr = lr_at(t + j)
                    if direction == "drift":
                        add_flat(params, vel, scale * step_lr)
                    elif direction == "adam":
                        for p in params:
                            st = opt.state[p]
                            k = float(st["step"])
                            m = st["exp_avg"] / (1 - 0.9 ** k)
                            v = st["exp_avg_sq"] / (1 - 0.999 ** k)
                            p.mul_(1 - step_lr * 0.01).add_(m / (v.sqrt() + 1e-8), alpha=-scale * step_lr)
            t, since, prev = t + H, 0, flat()
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        loss = model(**next(stream)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        w = flat()
        vel, prev = fold_velocity(vel, w, prev, lr_at(t), beta), w
        t, real, since = t + 1, real + 1, since + 1
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val = sum(float(model(**b).loss) for b in vb) / len(vb)
    return {"seed": seed, "lr": lr, "steps": steps, "real_steps": real, "direction": direction, "F": F, "H": H,
            "scale": scale, "val_loss": val, "train_seconds": seconds}


def worth_of(row: dict, skipped_val: float | None) -> float | None:
    """What the run's predicted steps recovered of the loss gap between skipping them (the same
    run with its predicted steps moving nothing, ``skipped_val``) and making them real (plain
    AdamW with every step real): 0 no better than skipping, 1 as good as real steps. ``None``
    without a skip run, or where the real steps gained nothing over skipping (no scale)."""
    if skipped_val is None:
        return None
    span = skipped_val - row["full_schedule_val"]
    return (skipped_val - row["val_loss"]) / span if span > 0 else None


def _write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict], t0: float, complete: bool) -> dict:
    """Summary table over the rows so far; written to ``args.json`` when set."""
    lines = ["| peak lr | predicted from step | direction | predicted share | val loss | plain AdamW, same real "
             "steps | gap (mean ± sd) | gap to skipping them (mean ± sd) | plain AdamW, all steps real | "
             "worth: share of skipping's gap to real steps recovered |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    skipped = {(r["lr"], r["start"], r["seed"]): r["val_loss"] for r in rows if r["direction"] == "skip"}
    summary = []
    for lr in args.lrs:
        for start in args.starts:
            for d in args.directions:
                rs = [r for r in rows if r["lr"] == lr and r["direction"] == d and r["start"] == start]
                if not rs:
                    continue
                gaps = [r["gap"] for r in rs]
                agg = {"lr": lr, "start": start, "direction": d, "runs": len(rs),
                       "predicted_share": 1 - rs[0]["real_steps"] / rs[0]["steps"],
                       "val": statistics.mean(r["val_loss"] for r in rs),
                       "equal_compute_val": statistics.mean(r["equal_compute_val"] for r in rs),
                       "full_schedule_val": statistics.mean(r["full_schedule_val"] for r in rs),
                       "gap_mean": statistics.mean(gaps), "gap_sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0}
                vs_skip = [r["val_loss"] - skipped[(lr, start, r["seed"])] for r in rs
                           if (lr, start, r["seed"]) in skipped]
                agg["vs_skip_mean"] = statistics.mean(vs_skip) if vs_skip else None
                agg["vs_skip_sd"] = statistics.stdev(vs_skip) if len(vs_skip) > 1 else 0.0
                worth = [w for w in (worth_of(r, skipped.get((lr, start, r["seed"]))) for r in rs) if w is not None]
                agg["worth_mean"] = statistics.mean(worth) if worth else None
                agg["worth_sd"] = statistics.stdev(worth) if len(worth) > 1 else 0.0
                summary.append(agg)
                lines.append(f"| {lr:g} | {start} | {d} | {agg['predicted_share']:.0%} | {agg['val']:.4f} | "
                             f"{agg['equal_compute_val']:.4f} | {agg['gap_mean']:+.4f} ± {agg['gap_sd']:.4f} | "
                             + ("-" if agg["vs_skip_mean"] is None or d == "skip" else
                                f"{agg['vs_skip_mean']:+.4f} ± {agg['vs_skip_sd']:.4f}")
                             + f" | {agg['full_schedule_val']:.4f} | "
                             + ("-" if agg["worth_mean"] is None else
                                f"{agg['worth_mean']:.2f} ± {agg['worth_sd']:.2f}") + " |")
    table = "\n".join(lines)
    result = {"command": "benchmarks/direction_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "complete": complete, "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.time() - t0, 1),
              "threads": args.threads,
              "setup": {"model": "gpt2-tiny", "batch": f"{args.batch} x 128", "steps": args.steps, "F": args.F, "H": args.H,
                        "adam_scale": args.adam_scale, "drift_beta": args.drift_beta, "starts": args.starts},
              "rows": rows, "summary": summary, "table_markdown": table}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 4e-3], help="peak learning rates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=600, help="schedule length of the hybrid runs")
    p.add_argument("--F", type=int, default=4, help="real steps between predicted runs")
    p.add_argument("--H", type=int, default=2, help="predicted steps per run")
    p.add_argument("--starts", type=int, nargs="+", default=[50, 300],
                   help="step from which predicted runs start (50: right after warmup; 300: the second half, "
                        "as the LR decays)")
    p.add_argument("--directions", nargs="+", default=["adam", "drift", "skip"], choices=["adam", "drift", "skip"],
                   help="skip: the predicted steps move nothing (the same run with those steps skipped)")
    p.add_argument("--adam-scale", type=float, default=0.5, help="scale of the adam direction")
    p.add_argument("--drift-beta", type=float, default=0.95,
                   help="decay of the drift velocity (predictor.drift_beta; 0: the last real update)")
    p.add_argument("--batch", type=int, default=16,
                   help="sequences per step (the preset's 16); a larger batch makes each real update less noisy")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--json", default=str(ROOT / "docs" / "results" / "direction-study.json"))
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch: sequences per step, at least 1 (got {args.batch})")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rows: list[dict] = []
    for lr in args.lrs:
        for seed in args.seeds:
            full = train(seed, lr, args.steps, None, 0, 0, 0.0, batch=args.batch)
            for start in args.starts:
                hybrids = [train(seed, lr, args.steps, d, args.F, args.H, args.adam_scale if d == "adam" else 1.0,
                                 beta=args.drift_beta, warm=start, batch=args.batch) for d in args.directions]
                real = hybrids[0]["real_steps"]
                base = train(seed, lr, real, None, 0, 0, 0.0, batch=args.batch)
                for h in hybrids:
                    rows.append({**h, "start": start, "equal_compute_val": base["val_loss"],
                                 "full_schedule_val": full["val_loss"], "gap": h["val_loss"] - base["val_loss"]})
                    print(f"lr {lr:g} seed {seed} from step {start} {h['direction']:5s}: val {h['val_loss']:.4f} "
                          f"({h['real_steps']} real of {h['steps']}) | plain, {real} steps: {base['val_loss']:.4f} | "
                          f"plain, {args.steps} steps: {full['val_loss']:.4f}", flush=True)
            # Written after every seed, so an interrupted study keeps what it measured.
            _write(args, argv, rows, t0, complete=False)
    result = _write(args, argv, rows, t0, complete=True)
    print(result["table_markdown"])
    if args.json:
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
