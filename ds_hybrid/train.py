"""The main job: ``ds-hybrid train`` / ``python -m ds_hybrid.train``.

With no arguments it trains a small GPT-2-style model (built from a
``transformers`` config, random init) on the default corpus (the Python standard
library's source, byte level) with ``ds_configs/tiny-cpu.json`` on the CPU, and
writes ``summary.json``, ``steps.jsonl`` and ``loss.png`` to ``--out``.

Runs under the ``deepspeed`` launcher as well (``deepspeed --num_gpus N -m
ds_hybrid.train --config ...``): each rank reads its own shard of the training
stream, and rank 0 prints and writes the outputs.

The loop below is the whole of training: one ``engine.train_step`` per optimizer
step, validation every ``--eval-every`` steps (its time is not counted in the
step times).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = REPO_ROOT / "ds_configs"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-hybrid train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="tiny-cpu",
                   help="a ds_config JSON path, or the name of a preset in ds_configs/")
    p.add_argument("--data", default=None,
                   help="a text file or a directory of them (default: the Python standard library's source)")
    p.add_argument("--model", default="gpt2-tiny", help="a named model size or a transformers config JSON")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps to train")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--seed", type=int, default=1234, help="seed for weights and data order")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N optimizer steps")
    p.add_argument("--val-batches", type=int, default=16, help="validation batches per evaluation")
    p.add_argument("--max-corpus-bytes", type=int, default=8_000_000, help="cap on corpus bytes read")
    p.add_argument("--out", default="runs/train", help="output directory (summary.json, steps.jsonl, loss.png)")
    p.add_argument("--lr", type=float, default=None,
                   help="override the peak learning rate (optimizer lr and the scheduler's max lr)")
    p.add_argument("--baseline", action="store_true",
                   help="train with hybrid_predict.enabled=false (plain DeepSpeed) for comparison")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    # The deepspeed launcher passes --local_rank; torchrun sets LOCAL_RANK.
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help=argparse.SUPPRESS)
    return p


def resolve_config(name_or_path: str) -> tuple[dict, Path]:
    """A ds_config dict from a path or a preset name; the error names ``--config``."""
    from .engine import load_ds_config
    path = Path(name_or_path)
    if not path.is_file():
        preset = PRESET_DIR / (name_or_path if name_or_path.endswith(".json") else f"{name_or_path}.json")
        if preset.is_file():
            path = preset
        else:
            known = sorted(q.stem for q in PRESET_DIR.glob("*.json")) if PRESET_DIR.is_dir() else []
            raise SystemExit(f"--config: '{name_or_path}' is neither a file nor a preset (presets: {known})")
    return load_ds_config(path), path


def apply_run_length(ds_config: dict, steps: int) -> None:
    """Stretch a step-based LR schedule to the run length, so a shorter or longer run
    still decays fully (an explicit, printed change of the config)."""
    sched = ds_config.get("scheduler") or {}
    params = sched.get("params") or {}
    if "total_num_steps" in params and params["total_num_steps"] != steps:
        params["total_num_steps"] = steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(steps // 10, 1))


def apply_lr(ds_config: dict, lr: float) -> None:
    """Set the peak learning rate wherever the ds_config holds it."""
    if lr <= 0:
        raise SystemExit(f"--lr: must be positive (got {lr})")
    ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
    params = (ds_config.get("scheduler") or {}).get("params") or {}
    for key in ("warmup_max_lr", "max_lr"):
        if key in params:
            params[key] = lr


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ensure_distributed_env() -> None:
    """Without a launcher, make this process rank 0 of 1 on a free local port."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def quiet_logs(verbose: bool) -> None:
    if verbose:
        return
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    import transformers
    transformers.logging.set_verbosity_error()


def validation_loss(engine: Any, batches: list) -> float:
    """Mean loss over the fixed validation batches (the same on every rank)."""
    from .data import evaluate
    was_training = engine.module.training
    engine.eval()
    try:
        return evaluate(lambda b: engine(**{k: v.to(engine.device) for k, v in b.items()}).loss, batches)
    finally:
        engine.train(was_training)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for flag in ("steps", "seq_len", "eval_every", "val_batches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be at least 1 (got {getattr(args, flag)})")

    # Everything that can be wrong with the input fails here, before a model is built.
    ds_config, config_path = resolve_config(args.config)
    from .config import ConfigError, parse_hybrid_config
    if args.baseline:
        ds_config.setdefault("hybrid_predict", {})["enabled"] = False
    try:
        hybrid = parse_hybrid_config(ds_config)
    except ConfigError as err:
        raise SystemExit(f"{config_path}: {err}") from None
    apply_run_length(ds_config, args.steps)
    if args.lr is not None:
        apply_lr(ds_config, args.lr)
    from .data import ByteDataset, DataError, train_batches, val_batches
    try:
        train_data, val_data = ByteDataset.load(args.data, args.max_corpus_bytes).split(seq_len=args.seq_len)
    except DataError as err:
        raise SystemExit(f"--data: {err}") from None

    import torch
    import deepspeed
    import ds_hybrid
    from .models import build_model, count_parameters
    from .plotting import plot_loss_with_phases

    ensure_distributed_env()
    quiet_logs(args.verbose)
    torch.manual_seed(args.seed)
    model = build_model(args.model, vocab_size=256, seq_len=args.seq_len)
    engine, _, _, _ = ds_hybrid.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rank, world = engine.global_rank, engine.world_size
    is_main = rank == 0
    gas = engine.gradient_accumulation_steps()
    micro_bs = engine.train_micro_batch_size_per_gpu()
    stream = train_batches(train_data, args.seq_len, micro_bs, seed=args.seed, rank=rank, world_size=world)
    val_set = val_batches(val_data, args.seq_len, micro_bs, max_batches=args.val_batches)
    device = engine.device

    def to_device(batch: dict) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    out = Path(args.out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        print(f"ds_hybrid train: {args.model} ({count_parameters(model) / 1e6:.2f}M params), "
              f"{len(train_data) / 1e6:.2f}M train / {len(val_data) / 1e6:.2f}M val bytes, "
              f"config {config_path.name}, hybrid {'on' if hybrid.enabled and not args.baseline else 'off'}, "
              f"{world} rank(s), batch {micro_bs}x{gas}x{world}, {args.steps} steps", flush=True)

    records: list[dict] = []
    val_points: list[tuple[int, float]] = [(0, validation_loss(engine, val_set))]
    bar = None
    if is_main and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc="train", dynamic_ncols=True)
    tokens_per_step = micro_bs * gas * world * args.seq_len
    train_seconds = 0.0
    for step in range(1, args.steps + 1):
        batches = [to_device(next(stream)) for _ in range(gas)]
        result = engine.train_step(batches)
        train_seconds += result.step_time_s
        records.append(result.as_dict())
        if step % args.eval_every == 0 or step == args.steps:
            val_points.append((step, validation_loss(engine, val_set)))
        if bar is not None:
            post = {"phase": result.phase[:4], "conf": f"{result.confidence:.2f}",
                    "tok/s": f"{tokens_per_step / max(result.step_time_s, 1e-9):.0f}", "val": f"{val_points[-1][1]:.3f}"}
            if result.loss is not None:
                post["loss"] = f"{result.loss:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()

    stats = engine.statistics()
    summary = {
        "args": {k: v for k, v in vars(args).items() if k != "local_rank"},
        "config_file": str(config_path),
        "ds_config": ds_config,
        "model": args.model,
        "parameters": count_parameters(model),
        "world_size": world,
        "steps": args.steps,
        "final_val_loss": val_points[-1][1],
        "val_points": val_points,
        "train_seconds_excluding_eval": train_seconds,
        "tokens_per_second": tokens_per_step * args.steps / train_seconds if train_seconds else None,
        "statistics": stats,
        "peak_rss_mb": peak_rss_mb(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "ds_hybrid": ds_hybrid.__version__},
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "accelerator": engine.device.type},
    }
    if is_main:
        (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if not args.no_plot:
            plot_loss_with_phases([{"step": r["step"], "phase": r["phase"], "loss": r["loss"],
                                    "rolled_back": r["rolled_back_steps"] > 0} for r in records],
                                  out / "loss.png", val_points=val_points,
                                  title=f"{args.model} on {args.data or 'stdlib source'} ({config_path.name})")
        print(format_summary(summary), flush=True)
        print(f"wrote {out / 'summary.json'}, {out / 'steps.jsonl'}" + ("" if args.no_plot else f", {out / 'loss.png'}"))
    return summary


def format_summary(summary: dict) -> str:
    """The end-of-run table: steps and mean time per phase, skipped backward passes, validation loss."""
    st = summary["statistics"]
    lines = [f"{'phase':<9}{'steps':>7}{'mean ms/step':>14}{'total s':>10}"]
    for phase, n in st["steps_per_phase"].items():
        mean = st["mean_step_seconds"][phase]
        lines.append(f"{phase:<9}{n:>7}{(mean * 1e3 if mean else 0):>14.1f}{st['seconds_per_phase'][phase]:>10.2f}")
    lines.append(f"predict steps accepted {st['predict_accepted']}, rolled back {st['predict_rolled_back']}, "
                 f"verifications {st['verifications']}")
    lines.append(f"backward passes skipped: {st['backward_skipped']} of "
                 f"{st['backward_skipped'] + st['backward_passes']} ({st['backward_skipped_pct']:.1f}%)")
    lines.append(f"validation loss: {summary['final_val_loss']:.4f} after {summary['steps']} steps "
                 f"({summary['train_seconds_excluding_eval']:.1f} s training, eval excluded)")
    return "\n".join(lines)


def run_cli(argv: list[str] | None = None) -> None:
    """Entry point for ``ds-hybrid train`` and ``python -m ds_hybrid.train``."""
    main(argv)
    # Multi-rank CPU (gloo) runs can abort in interpreter teardown after all work is done;
    # leave through a barrier and os._exit so the exit status reflects the run.
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    run_cli()
