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

``--batch``, ``--model``, ``--seq-len``, ``--device cuda`` and ``--bf16`` run it larger: at 64 sequences a step on
the CPU, and at GPT-2 124M on a GPU (``benchmarks/gpu_run.sh OUT stale124``), where ZeRO-Offload reports its
one-step delay harmless at lower learning rates and larger batches.

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


def train(seed: int, lr: float, steps: int, mode: str, delay: int, start: int, *, batch: int = 16,
          model_name: str = "gpt2-tiny", seq_len: int = 128, device: str = "cpu", bf16: bool = False) -> dict:
    """One run. ``mode``: one of ``MODES`` (see the module docstring). ``bf16``: forward and backward
    under bf16 autocast, the masters and AdamW in fp32 (DeepSpeed's bf16 mixed precision)."""
    beta = MODES[mode]   # None: no cover, so no velocity to keep
    model, params, opt, stream, val_data = setup(seed, lr, batch, model_name, seq_len, device)
    vb = [{k: v.to(device) for k, v in b.items()} for b in val_batches(val_data, seq_len, 16, max_batches=16)]
    autocast = lambda: torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,  # noqa: E731
                                      enabled=bf16)
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
        with autocast():
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
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    with torch.no_grad(), autocast():
        val = sum(float(model(**b).loss) for b in vb) / len(vb)
    return {"seed": seed, "lr": lr, "steps": steps, "batch": batch, "model": model_name, "mode": mode, "delay": delay if mode != "sync" else 0,
            "start": start, "val_loss": val, "train_seconds": seconds,
            # how far the covered weights are from the masters, over how far the stale ones are (1: no help)
            "cover_residual_mean": statistics.mean(cover_norms) if cover_norms else None}


def report(args: argparse.Namespace, argv: list[str] | None, rows: list[dict], seconds: float,
           complete: bool) -> dict:
    """The table and JSON over the runs done so far (``complete`` False while runs are still to come)."""
    lines = ["| peak lr | mode | delay | val loss (mean) | gap to sync (mean ± sd) | per seed | covered / stale distance |",
             "|---|---|---|---|---|---|---|"]
    summary = []
    for lr in args.lrs:
        for mode in ["sync", *args.modes]:
            delays = [0] if mode == "sync" else args.delays
            for delay in delays:
                rs = [r for r in rows if r["lr"] == lr and r["mode"] == mode and r["delay"] == delay]
                if not rs:
                    continue
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
    return {"command": "benchmarks/stale_update_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(seconds, 1), "complete": complete,
            "setup": {"model": args.model, "batch": f"{args.batch} x {args.seq_len}", "steps": args.steps,
                      "start": args.start, "drift_beta": 0.95, "threads": args.threads, "device": args.device,
                      "bf16": args.bf16,
                      "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
            "rows": rows, "summary": summary, "table_markdown": "\n".join(lines)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3], help="peak learning rates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--delays", type=int, nargs="+", default=[1], help="updates the GPU's weights are behind")
    p.add_argument("--start", type=int, default=50, help="first step run behind (ZeRO-Offload's DPU starts late too)")
    p.add_argument("--modes", nargs="*", default=["stale", "cover", "cover-last"],
                   choices=[m for m in MODES if m != "sync"],
                   help="run behind, besides the synchronous run (none: the synchronous run alone, an LR sweep)")
    p.add_argument("--model", default="gpt2-tiny", help="a name from ds_hybrid.models (vocabulary 256)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU stage (benchmarks/gpu_run.sh stale124)")
    p.add_argument("--bf16", action="store_true", help="forward and backward under bf16 autocast (fp32 masters)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--json", default=None, help="written after every run, so a run cut short keeps what it did")
    args = p.parse_args(argv)
    if args.batch < 1 or args.seq_len < 1 or args.steps <= args.start:
        raise SystemExit(f"--batch and --seq-len must be >= 1 and --steps above --start "
                         f"(got {args.batch}, {args.seq_len}, {args.steps}, {args.start})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    torch.set_num_threads(args.threads)
    shape = dict(batch=args.batch, model_name=args.model, seq_len=args.seq_len, device=args.device, bf16=args.bf16)
    t0 = time.time()
    rows: list[dict] = []

    def done(row: dict) -> None:
        rows.append(row)
        if args.json:   # after every run: a study cut off by a time limit keeps the runs it finished
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report(args, argv, rows, time.time() - t0, False), indent=2))

    for lr in args.lrs:
        for seed in args.seeds:
            base = train(seed, lr, args.steps, "sync", 0, args.start, **shape)
            done({**base, "gap": 0.0})
            print(f"lr {lr:g} seed {seed} sync: val {base['val_loss']:.4f} ({base['train_seconds']:.0f} s)",
                  flush=True)
            for delay in args.delays:
                for mode in args.modes:
                    r = train(seed, lr, args.steps, mode, delay, args.start, **shape)
                    r["gap"] = r["val_loss"] - base["val_loss"]
                    done(r)
                    extra = (f", covered weights {r['cover_residual_mean']:.2f}x as far from the masters"
                             if r["cover_residual_mean"] is not None else "")
                    print(f"lr {lr:g} seed {seed} {mode} delay {delay}: val {r['val_loss']:.4f} "
                          f"({r['gap']:+.4f}{extra})", flush=True)
    result = report(args, argv, rows, time.time() - t0, complete=True)
    print(result["table_markdown"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
