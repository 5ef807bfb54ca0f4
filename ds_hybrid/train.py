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
step times), a checkpoint every ``--save-every`` steps.

Checkpoints and resume: ``--save-dir D`` writes atomic checkpoints (see
``ds_hybrid/checkpoint.py``) every ``--save-every`` steps, at the end, and when
SIGINT (Ctrl-C) or SIGTERM arrives: the loop stops at the next step boundary,
every rank agreeing. ``--resume`` continues from ``D/latest``. The training
stream is a generator seeded per (seed, rank); a resumed run replays it past the
batches already consumed (``steps done x gradient_accumulation_steps`` per rank),
so it reads exactly the batches the uninterrupted run would have read, and the
losses after the resume point are the same bit for bit (CPU, fp32).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from .arguments import HelpFormatter, InputError, find_preset, parse_size, preset_names, resolve_config
from .dist_env import ensure_distributed_env  # noqa: F401  (also imported from here by bench and user scripts)

DEFAULT_CONFIG = "tiny-cpu"
TRAIN_STATE_KEY = "ds_hybrid.train"  # the train loop's state in a checkpoint's client_state
# Arguments a resumed run must share with the run that wrote the checkpoint: they
# decide the model, the data stream and the optimizer's settings.
RESUME_MUST_MATCH = ("config", "data", "model", "seq_len", "seed", "max_corpus_bytes", "lr", "baseline", "init")
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a run stopped by SIGINT


class TrainParser(argparse.ArgumentParser):
    """The help ends with the presets and the named models; the model names are read only when
    the help is printed (``ds_hybrid.models`` imports transformers)."""

    def format_help(self) -> str:
        from .models import known_models
        self.epilog = (f"presets (--config, in ds_configs/): {', '.join(preset_names())}\n"
                       f"models (--model): {', '.join(known_models())}, or a transformers config JSON of a "
                       "causal LM\n\nUnder the deepspeed launcher: deepspeed --num_gpus N --module ds_hybrid.train "
                       "[options]")
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    p = TrainParser(prog="ds-hybrid train", formatter_class=HelpFormatter,
                    description="Train a transformers causal LM with ds_hybrid's PredictiveEngine (DeepSpeed plus "
                                "predicted steps) and write summary.json, steps.jsonl and loss.png to --out.")
    p.add_argument("--config", default=None, metavar="PRESET_OR_PATH",
                   help=f"a ds_config file (JSON or hjson), or a preset name (list below) (default: {DEFAULT_CONFIG})")
    p.add_argument("--deepspeed_config", default=None, metavar="PATH",
                   help="the ds_config file, as DeepSpeed scripts take it (deepspeed.add_config_arguments): the same "
                        "as --config; given both, they must name the same file")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted as DeepSpeed scripts accept it (a flag for user code); no effect: this job always "
                        "trains with DeepSpeed")
    p.add_argument("--data", default=None,
                   help="a text file or a directory of them (default: the Python standard library's source)")
    p.add_argument("--model", default="gpt2-tiny",
                   help="a named model (list below) or a transformers config JSON of a causal LM")
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
    p.add_argument("--predictor", choices=("adam_direction", "rssm"), default=None,
                   help="override hybrid_predict.predictor.type")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set a hybrid_predict key, VALUE read as JSON (else a string); repeatable, e.g. "
                        "--set predictor.direction=drift --set memory.velocity_dtype=int8")
    p.add_argument("--trajectory", default=None,
                   help="record the predictor's observations, one JSON line per step, to this file "
                        "(hybrid_predict.dynamics.trajectory_path; for ds-hybrid dynamics-eval)")
    p.add_argument("--layer-groups", type=int, default=4,
                   help="optimizer param groups per model: embeddings, N-2 bands of transformer blocks, "
                        "and the final norm/head (Predict steps scale each group separately); 1: one group")
    p.add_argument("--init", default=None, metavar="PATH",
                   help="start from these model weights (a state dict written by --save-model), e.g. to "
                        "fine-tune a model pre-trained by an earlier run")
    p.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=None,
                   help="build the model under deepspeed.zero.Init (transformers' HfDeepSpeedConfig): each "
                        "parameter partitioned (in the config's dtype) as its layer is made, so the full fp32 "
                        "model never exists in host memory (default: on with zero_optimization.stage 3; "
                        "ZeRO 3 only)")
    p.add_argument("--save-model", default=None, metavar="PATH",
                   help="write the trained model's weights (a torch state dict) here at the end (rank 0)")
    p.add_argument("--memory-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="record memory every step (ds_hybrid.memory.MemoryProfiler; 0.2-0.3 ms per step on a CPU): "
                        "memory.csv, memory_report.txt, memory.png, and per-phase peaks in summary.json")
    p.add_argument("--profile-warmup", type=int, default=0, metavar="N",
                   help="book the first N steps as 'warmup' in the memory profile and its step times (a plain run "
                        "compared with a hybrid one leaves out the same first steps: first use, state allocation)")
    p.add_argument("--op-profile", default=None, metavar="FIRST:LAST",
                   help="torch.profiler over steps FIRST to LAST, each operator's calls and self CPU / device time "
                        "summed per phase, into op_profile.json (ds_hybrid/step_profile.py; those steps are slower)")
    p.add_argument("--gpu-mem-cap", default=None, metavar="SIZE",
                   help="cap this process's CUDA allocator at SIZE (16GB, 16GiB, ...) with "
                        "torch.cuda.set_per_process_memory_fraction: train as if the GPU were that small; "
                        "an allocation past it fails with CUDA out-of-memory")
    p.add_argument("--pinned-round-mb", type=int, default=64, metavar="MB",
                   help="on a GPU, pinned host blocks above MB MiB are allocated at their size, not rounded up "
                        "to a power of two (torch's pinned_max_round_threshold_mb, set with "
                        "pinned_max_cached_size_mb to the same value; ds_hybrid/pinned.py): DeepSpeed's offload "
                        "buffers then take what they need of host memory; 0 keeps torch's rounding; a "
                        "PYTORCH_ALLOC_CONF that sets either key is kept")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    p.add_argument("--save-dir", default=None,
                   help="write checkpoints here (atomic; DIR/latest names the newest): every --save-every steps, "
                        "at the end, and on Ctrl-C / SIGTERM")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N optimizer steps (0: only at the end and on Ctrl-C / SIGTERM)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --save-dir (from step 0 when it holds none yet)")
    p.add_argument("--no-verify-checkpoint", action="store_true",
                   help="--resume without checking the files' CRC-32s against the manifest, and from a folder with "
                        "no manifest (a plain DeepSpeed checkpoint); sizes and the zip check still apply")
    # The deepspeed launcher passes --local_rank; torchrun sets LOCAL_RANK.
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help=argparse.SUPPRESS)
    return p


def config_source(args: argparse.Namespace) -> str:
    """The ds_config to use: ``--config`` or ``--deepspeed_config`` (DeepSpeed's name for it), the
    ``tiny-cpu`` preset when neither is given. Given both, they must name the same file."""
    given = {flag: value for flag, value in (("--config", args.config), ("--deepspeed_config", args.deepspeed_config))
             if value is not None}
    if len(given) == 2:
        try:
            paths = {flag: find_preset(value, flag).resolve() for flag, value in given.items()}
        except InputError as err:
            raise SystemExit(str(err)) from None
        if paths["--config"] != paths["--deepspeed_config"]:
            raise SystemExit(f"--config {args.config!r} and --deepspeed_config {args.deepspeed_config!r} name "
                             f"different ds_configs ({paths['--config']} and {paths['--deepspeed_config']}); "
                             "give one of them")
    return args.config or args.deepspeed_config or DEFAULT_CONFIG


def check_model(name: str, seq_len: int) -> None:
    """An unknown ``--model``, a config JSON that is not a causal LM, or too few positions for
    ``--seq-len`` fail here, before the corpus is read or a model is built."""
    from .models import model_config
    try:
        model_config(name, vocab_size=256, seq_len=seq_len)
    except ValueError as err:
        raise SystemExit(f"--model: {err}") from None


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


def enable_checkpointing(model) -> None:
    """Recompute each transformer block in backward, non-reentrant. transformers renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` (5.2x); take either."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parse_gpu_cap(text: str | None) -> int | None:
    """``--gpu-mem-cap`` in bytes (None: no cap), checked before anything is built."""
    if text is None:
        return None
    try:
        cap = parse_size(text, "--gpu-mem-cap")
    except InputError as err:
        raise SystemExit(str(err)) from None
    if cap <= 0:
        raise SystemExit(f"--gpu-mem-cap: must be more than 0 (got {text!r})")
    return cap


def preflight_plan(ds_config: dict, args: argparse.Namespace, zero_init: bool, gpu_cap: int | None,
                   accelerator: str, say, pinned_round_mb: int = 0) -> dict | None:
    """The planner's estimate for this run (``ds-hybrid plan``'s), before the model is built: a
    warning when it puts the run over this machine's memory (GPU: the ``--gpu-mem-cap`` or the
    card; host: ``MemTotal``), since an out-of-memory host kills the run only after minutes of
    set-up. A warning, not an error: it is an estimate. The summary keeps it beside what the run
    measures. None (and a note) where the planner cannot model the run. ``pinned_round_mb``: the
    pinned rounding this process got (0: torch rounds every block; ``limit_pinned_rounding``)."""
    from .memory import planner
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    world = int(os.environ.get("WORLD_SIZE") or 1)
    gpu_mem = gpu_cap
    if gpu_mem is None and accelerator == "cuda":
        import torch
        gpu_mem = torch.cuda.get_device_properties(args.local_rank % torch.cuda.device_count()).total_memory
    cpu_mem = planner.host_memory_bytes()
    try:
        est = planner.plan_for_run(ds_config, args.model, args.seq_len, zero_init,
                                   "cpu" if accelerator == "cpu" else "cuda", gpu_mem, cpu_mem,
                                   gpus=local, nodes=max(1, world // local), layer_groups=args.layer_groups,
                                   pinned_round_mb=pinned_round_mb)
    except Exception as err:   # (any model or layout it cannot count: the run itself decides)
        say(f"memory plan: none for this run ({type(err).__name__}: {err})")
        return None
    refused = [r for r in est.reasons if r.startswith(planner.ENGINE_REFUSES)]
    if refused:   # (the engine's own rule, read from the planner's view of the setup: not an estimate)
        say(f"WARNING: the memory planner expects the engine to refuse this run: "
            f"{refused[0][len(planner.ENGINE_REFUSES):]}")
    elif not est.fits:
        say(f"WARNING: the memory planner puts this run over the machine's memory: {'; '.join(est.reasons)} "
            f"(an estimate; `ds-hybrid plan --model {args.model}` lists what fits)")
        rounding = sum(i.bytes for i in est.items if i.what.startswith("pinned-memory rounding"))
        if cpu_mem is not None and rounding and est.cpu_bytes - rounding <= cpu_mem:
            say(f"  of which {rounding / 2**30:.1f} GiB is torch rounding each pinned host block up to a power of "
                f"two{'' if pinned_round_mb else ' (this torch cannot limit it)'}: without it the host fits; "
                f"zero_optimization.offload_optimizer.pin_memory: false (slower copies) avoids it")
    return {"gpu_bytes": est.gpu_bytes, "cpu_bytes": est.cpu_bytes, "gpu_mem_bytes": gpu_mem,
            "cpu_mem_bytes": cpu_mem, "fits": est.fits, "reasons": est.reasons,
            "accelerator": "cpu" if accelerator == "cpu" else "cuda"}


def cpu_bf16_note(ds_config: dict, accelerator: str, capability: str) -> str | None:
    """A note when a bf16 config runs on a CPU whose PyTorch kernels stop below AVX-512
    (``torch.backends.cpu.get_cpu_capability()``: "AVX2" or less), where a bf16 step costs several
    fp32 ones (7.65x on an AVX2 EPYC: docs/benchmarks.md, "bf16 on an AVX2 CPU"). The run goes on
    as configured: a note, since its numbers are right, only slow."""
    if accelerator != "cpu" or not (ds_config.get("bf16") or {}).get("enabled"):
        return None
    if capability not in ("AVX2", "NO AVX"):   # (x86 below AVX-512; other kinds of CPU unmeasured)
        return None
    return (f"note: bf16.enabled on a CPU whose PyTorch kernels are {capability} (no AVX-512): bf16 steps here "
            "cost several fp32 ones (docs/benchmarks.md, \"bf16 on an AVX2 CPU\"); bf16.enabled: false trains "
            "in fp32 instead")


def apply_gpu_cap(cap: int, local_rank: int) -> None:
    """Limit the caching allocator on this rank's GPU to ``cap`` bytes, so a bigger card trains
    within a 16 GB card's budget (a real limit: past it, allocation fails). The CUDA context and the libraries' workspaces outside the allocator are
    not counted; the profiler's allocated / peak figures are what the cap bounds."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("--gpu-mem-cap: needs a CUDA GPU (torch sees none)")
    dev = local_rank % torch.cuda.device_count()
    total = torch.cuda.get_device_properties(dev).total_memory
    if cap > total:
        raise SystemExit(f"--gpu-mem-cap: {cap / 2**30:.1f} GiB is more than GPU {dev} has ({total / 2**30:.1f} GiB)")
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    print(f"--gpu-mem-cap: allocator on GPU {dev} capped at {cap / 2**30:.2f} GiB of {total / 2**30:.1f} GiB",
          flush=True)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quiet_logs(verbose: bool) -> None:
    if verbose:
        return
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    import transformers
    transformers.logging.set_verbosity_error()


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """--save-dir / --save-every / --resume errors, before anything is built; an
    existing checkpoint to resume from has its files checked here too."""
    if args.save_every < 0:
        raise SystemExit(f"--save-every: must be 0 or more (got {args.save_every})")
    if args.save_every and not args.save_dir:
        raise SystemExit("--save-every: needs --save-dir")
    if args.resume and not args.save_dir:
        raise SystemExit("--resume: needs --save-dir (the folder holding the checkpoints)")
    if args.save_dir is None:
        return
    save_dir = Path(args.save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise SystemExit(f"--save-dir: {save_dir} exists and is not a directory")
    if args.resume and save_dir.is_dir():
        from .checkpoint import CheckpointError, read_latest, resolve_tag_dir, verify_files
        try:
            tag = read_latest(save_dir, universal=False)
            if tag is not None:
                # Sizes and zip ends, before a model is built; the manifest's presence and the CRC-32s
                # are checked once, by the engine's load (which fails before touching any state).
                verify_files(resolve_tag_dir(save_dir, tag), verify=False, unmanifested_ok=True)
        except CheckpointError as err:
            raise SystemExit(f"--resume: {err}") from None


def run_identity(args: argparse.Namespace) -> dict:
    """The arguments a resumed run must share with the checkpoint's run."""
    return {key: getattr(args, key) for key in RESUME_MUST_MATCH}


def check_same_run(saved: dict, current: dict, where: Path) -> None:
    """Fail naming the flag when a resumed run would read other data or build another model."""
    for key in RESUME_MUST_MATCH:
        if saved.get(key) != current[key]:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"--resume: {where} was trained with {flag} {saved.get(key)!r}, this run has "
                             f"{current[key]!r}; resume with the same {flag} (or use another --save-dir)")


def skip_batches(stream: Any, n: int) -> None:
    """Advance the training stream past ``n`` batches. It is a generator seeded per
    (seed, rank), so replaying it is how a resumed run reaches its position; a batch
    costs one index gather, far less than a training step."""
    for _ in range(n):
        next(stream)


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM ask the training loop to stop at the next step
    boundary. A second SIGINT interrupts at once (the previous handler is back).
    Use as a context manager: the previous handlers are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        # Python lets only the main thread install handlers (a loop run from another thread stops by itself).
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, self._previous[signum])

    def agreed(self, device: Any) -> bool:
        """Collective when there are several ranks: stop if any rank received a signal,
        so every rank leaves the loop after the same step."""
        import torch
        import torch.distributed as dist
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


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
    if args.profile_warmup < 0:
        raise SystemExit(f"--profile-warmup: must be 0 or more (got {args.profile_warmup})")
    from .step_profile import StepProfiler, parse_range
    op_range = parse_range(args.op_profile, args.steps) if args.op_profile else None

    # Everything that can be wrong with the input fails here, before a model is built.
    check_checkpoint_flags(args)
    flag = "--deepspeed_config" if args.config is None and args.deepspeed_config else "--config"
    args.config = config_source(args)   # one name from here on (a resumed run checks it)
    ds_config, config_path = resolve_config(args.config, flag)
    from .config import ConfigError, apply_overrides, parse_hybrid_config, refused_before_deepspeed
    if args.baseline:
        ds_config.setdefault("hybrid_predict", {})["enabled"] = False
    try:
        hybrid = parse_hybrid_config(ds_config)
    except ConfigError as err:
        raise SystemExit(f"{config_path}: {err}") from None
    apply_run_length(ds_config, args.steps)
    if args.lr is not None:
        apply_lr(ds_config, args.lr)
    if args.overrides:
        try:
            apply_overrides(ds_config, args.overrides)
        except ConfigError as err:
            raise SystemExit(str(err)) from None
    if args.predictor or args.trajectory:
        section = ds_config.setdefault("hybrid_predict", {"enabled": False})
        if args.predictor:
            section.setdefault("predictor", {})["type"] = args.predictor
        if args.trajectory:
            section.setdefault("dynamics", {})["trajectory_path"] = args.trajectory
        try:
            parse_hybrid_config(ds_config)
        except ConfigError as err:
            raise SystemExit(f"--predictor/--trajectory: {err}") from None
    hybrid = parse_hybrid_config(ds_config)   # (with --set and --predictor applied: what the engine will run)
    config_named = f"{config_path}{' with --set' if args.overrides else ''}"   # (what a config error names)
    refused = refused_before_deepspeed(ds_config, hybrid)   # (initialize's own check, here before any build)
    if refused:
        raise SystemExit(f"{config_named}: {refused}")
    if args.layer_groups < 1:
        raise SystemExit(f"--layer-groups: must be at least 1 (got {args.layer_groups})")
    gpu_cap = parse_gpu_cap(args.gpu_mem_cap)
    if args.pinned_round_mb < 0:
        raise SystemExit(f"--pinned-round-mb: must be 0 (torch's rounding) or more (got {args.pinned_round_mb})")
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if args.zero_init and stage != 3:
        raise SystemExit(f"--zero-init: builds the model partitioned for ZeRO 3, but {config_path.name} has "
                         f"zero_optimization.stage {stage}")
    zero_init = stage == 3 if args.zero_init is None else args.zero_init
    check_model(args.model, args.seq_len)
    from .data import ByteDataset, DataError, train_batches, val_batches
    try:
        train_data, val_data = ByteDataset.load(args.data, args.max_corpus_bytes).split(seq_len=args.seq_len)
    except DataError as err:
        raise SystemExit(f"--data: {err}") from None

    import torch
    import deepspeed
    import ds_hybrid
    from .models import build_model, count_parameters, layer_groups
    from .op_build import check_op_builds, watch_build_locks
    from .plotting import plot_loss_with_phases

    # DeepSpeed compiles some ops on first use, and waits silently on a build lock: say so first.
    say = (lambda line: print(line, flush=True)) if args.local_rank == 0 else (lambda line: None)
    locks = check_op_builds(ds_config, deepspeed.get_accelerator().device_name(), say)
    slow_bf16 = cpu_bf16_note(ds_config, deepspeed.get_accelerator().device_name(),
                              torch.backends.cpu.get_cpu_capability())
    if slow_bf16:
        say(slow_bf16)
    ensure_distributed_env()
    quiet_logs(args.verbose)
    if gpu_cap is not None:
        apply_gpu_cap(gpu_cap, args.local_rank)
    from .pinned import limit_pinned_rounding
    pinned_limits = limit_pinned_rounding(args.pinned_round_mb)   # (before DeepSpeed pins its buffers)
    torch.manual_seed(args.seed)
    from .memory import MemoryProfiler
    profiler = MemoryProfiler() if args.memory_profile else None  # its baseline: everything but the model
    # (after that baseline: what the planner imports to count the model, the build would import anyway)
    plan = preflight_plan(ds_config, args, zero_init, gpu_cap, deepspeed.get_accelerator().device_name(), say,
                          args.pinned_round_mb if pinned_limits else 0)
    # zero.Init through transformers (not a bare deepspeed.zero.Init around the build): transformers
    # then initialises its weights on gathered parameters. Under a bare zero.Init its post-init
    # writes into the empty local shards and the embeddings keep PyTorch's N(0, 1) init.
    hf_zero3 = None   # kept alive to the end: transformers holds it by a weak reference
    if zero_init:
        from transformers.integrations import HfDeepSpeedConfig
        hf_zero3 = HfDeepSpeedConfig(ds_config)
    model = build_model(args.model, vocab_size=256, seq_len=args.seq_len)
    if args.init:
        load_init_weights(model, args.init)
    if "activation_checkpointing" in ds_config:
        # DeepSpeed's section does nothing by itself; its presence means: recompute each layer
        # in backward (transformers' non-reentrant checkpointing; run here on ZeRO 1 and 3).
        enable_checkpointing(model)
    params = layer_groups(model, args.layer_groups) if args.layer_groups > 1 else model.parameters()
    with watch_build_locks(locks, say):
        try:
            engine, _, _, _ = ds_hybrid.initialize(model=model, model_parameters=params, config=ds_config)
        except ConfigError as err:   # (what only the built optimizer shows: the same on every rank)
            raise SystemExit(f"{config_named}: {err}") from None
    rank, world = engine.global_rank, engine.world_size
    is_main = rank == 0
    gas = engine.batches_per_step()   # gradient_accumulation_steps; 1 under ZenFlow (a step per micro-batch)
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
        if hybrid.enabled and not args.baseline and args.steps <= hybrid.warmup_steps:
            print(f"note: hybrid_predict.warmup_steps is {hybrid.warmup_steps}, so a run of {args.steps} steps "
                  "takes no Predict step; run longer or lower warmup_steps", flush=True)

    records: list[dict] = []
    val_points: list[tuple[int, float]] = []
    train_seconds = 0.0
    start = 0
    resumed_from = None
    if args.resume:
        loop, resumed_from = resume_from_checkpoint(engine, args)
        if loop is not None:
            start, records, train_seconds = loop["step"], loop["records"], loop["train_seconds"]
            val_points = [tuple(v) for v in loop["val_points"]]
            skip_batches(stream, loop["batches_per_rank"])
            if is_main:
                print(f"resumed from {resumed_from} (step {start} of {args.steps})", flush=True)
        elif is_main:
            print(f"--resume: no checkpoint in {args.save_dir} yet; starting from step 0", flush=True)
    if not val_points:
        val_points.append((0, validation_loss(engine, val_set)))
    bar = None
    if is_main and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True)
    tokens_per_step = micro_bs * gas * world * args.seq_len
    done, interrupted = start, None
    saved_at, checkpoint = (start, resumed_from) if resumed_from else (None, None)

    def save_checkpoint() -> None:
        nonlocal saved_at, checkpoint
        loop_state = {"step": done, "batches_per_rank": done * gas, "records": records, "val_points": val_points,
                      "train_seconds": train_seconds, "run": run_identity(args), "planned_steps": args.steps}
        tag = f"global_step{engine.global_steps}"
        engine.save_checkpoint(args.save_dir, tag, client_state={TRAIN_STATE_KEY: loop_state})
        saved_at, checkpoint = done, str(Path(args.save_dir) / tag)
        if bar is not None:
            bar.write(f"saved checkpoint {checkpoint}")  # above the progress bar, not into it
        elif is_main:
            print(f"saved checkpoint {checkpoint}", flush=True)

    ops = StepProfiler(*op_range, engine.device) if op_range else None
    if profiler is not None:
        profiler.begin()  # set-up peak: model, deepspeed.initialize, step-0 validation
    with StopSignals() as stop:
        for step in range(start + 1, args.steps + 1):
            batches = [to_device(next(stream)) for _ in range(gas)]
            if ops is not None and ops.wants(step):
                ops.start()
            result = engine.train_step(batches)
            if ops is not None and ops.wants(step):
                ops.stop(result.phase)
            done = step
            train_seconds += result.step_time_s
            records.append(result.as_dict())
            if profiler is not None:
                profiler.record(step, "warmup" if step <= args.profile_warmup else result.phase,
                                result.step_time_s)
            if step == args.profile_warmup:
                engine.book_wall_clock_as_warmup()
            if step % args.eval_every == 0 or step == args.steps:
                val_points.append((step, validation_loss(engine, val_set)))
                if profiler is not None:
                    profiler.reset_peak()  # validation's memory is not the next step's
            if bar is not None:
                post = {"phase": result.phase[:4], "conf": f"{result.confidence:.2f}",
                        "tok/s": f"{tokens_per_step / max(result.step_time_s, 1e-9):.0f}",
                        "val": f"{val_points[-1][1]:.3f}"}
                if result.loss is not None:
                    post["loss"] = f"{result.loss:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if args.save_dir and args.save_every and step % args.save_every == 0:
                save_checkpoint()
            if step < args.steps and stop.agreed(device):  # a step boundary every rank reaches
                interrupted = stop.received or "another rank"
                break
        if args.save_dir and saved_at != done:
            save_checkpoint()
    if bar is not None:
        bar.close()
    if interrupted and is_main:
        where = f"; checkpoint {checkpoint}, continue with --resume" if checkpoint else " (no --save-dir: nothing saved)"
        print(f"stopped by {interrupted} after step {done} of {args.steps}{where}", flush=True)

    if args.save_model and not interrupted:
        save_model_weights(engine, args.save_model)
    elif args.save_model and is_main:
        print(f"--save-model: not written (the run stopped after step {done} of {args.steps})", flush=True)
    stats = engine.statistics()
    summary = {
        "args": {k: v for k, v in vars(args).items() if k != "local_rank"},
        "config_file": str(config_path),
        "ds_config": ds_config,
        "model": args.model,
        "parameters": count_parameters(model),
        "zero_init": zero_init,   # built partitioned under deepspeed.zero.Init
        "world_size": world,
        "steps": args.steps,
        "steps_done": done,
        "interrupted": interrupted is not None,
        "resumed_from": resumed_from,
        "checkpoint": checkpoint,
        "final_val_loss": val_points[-1][1],
        "val_points": val_points,
        "train_seconds_excluding_eval": train_seconds,
        "tokens_per_second": tokens_per_step * done / train_seconds if train_seconds else None,
        "statistics": stats,
        # Measured Predict steps: (step, lr, scale, batch loss skipped minus taken).
        "progress_log": list(getattr(engine, "progress_log", [])),
        # The profiler resets the kernel's high-water mark every step; it keeps the process peak.
        "peak_rss_mb": max(peak_rss_mb(), profiler.process_peak_rss_mb if profiler else 0.0),
        # The allocator's peak on this rank's GPU (None on CPU), for the bench's memory column.
        "gpu_mem_cap_bytes": gpu_cap,
        "pinned_allocator": pinned_limits,   # (None: torch's power-of-two rounding; ds_hybrid/pinned.py)
        "plan": plan,   # the planner's estimate for this run, made before it started (ds-hybrid plan)
        "gpu_peak_allocated_mb": ((profiler.process_peak_gpu_allocated_mb if profiler else None)
                                  or ((torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None)),
        "memory": profiler.summary() if profiler else None,
        "op_profile": ops.summary() if ops is not None else None,   # (also op_profile.json)
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "ds_hybrid": ds_hybrid.__version__},
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "accelerator": engine.device.type,
                 "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None},
    }
    if is_main:
        (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if ops is not None:
            (out / "op_profile.json").write_text(json.dumps(summary["op_profile"], indent=2))
        if not args.no_plot:
            plot_loss_with_phases([{"step": r["step"], "phase": r["phase"], "loss": r["loss"],
                                    "rolled_back": r["rolled_back_steps"] > 0} for r in records],
                                  out / "loss.png", val_points=val_points,
                                  title=f"{args.model} on {args.data or 'stdlib source'} ({config_path.name})")
        if profiler is not None:
            profiler.write(out, plot=not args.no_plot, title=f"{args.model}: memory by step ({config_path.name})")
        print(format_summary(summary), flush=True)
        print(f"wrote {out / 'summary.json'}, {out / 'steps.jsonl'}" + ("" if args.no_plot else f", {out / 'loss.png'}"))
    return summary


def load_init_weights(model: Any, path: str) -> None:
    """``--init``: the weights of an earlier run (``--save-model``); an error names the file."""
    import torch
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"--init: no such file: {p}")
    partitioned = [q for q in model.parameters() if hasattr(q, "ds_id")]   # built under zero.Init
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
        if partitioned:
            import deepspeed
            gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)
        else:
            gathered = contextlib.nullcontext()
        with gathered:
            missing, unexpected = model.load_state_dict(state, strict=False)
    except (RuntimeError, OSError, ValueError) as err:   # a corrupt file or another model's shapes
        raise SystemExit(f"--init: {p} does not hold weights of this model: {str(err).splitlines()[0]}") from None
    missing = [k for k in missing if not k.endswith("lm_head.weight")]   # tied to the input embedding
    if missing or unexpected:
        raise SystemExit(f"--init: {p} does not hold weights of this model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")


def save_model_weights(engine: Any, path: str) -> None:
    """``--save-model``: the model's weights as a torch state dict (gathered on ZeRO 3), on rank 0."""
    import torch
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    if engine.global_rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)


def resume_from_checkpoint(engine: Any, args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """Load the newest checkpoint in --save-dir into the engine; return the train loop's
    saved state and the checkpoint folder ((None, None) when there is no checkpoint yet)."""
    from .checkpoint import CheckpointError
    try:
        load_path, client_state = engine.load_checkpoint(args.save_dir, verify=not args.no_verify_checkpoint)
    except CheckpointError as err:
        raise SystemExit(f"--resume: {err}") from None
    if load_path is None:
        return None, None
    tag_dir = Path(load_path).parent
    loop = client_state.get(TRAIN_STATE_KEY)
    if loop is None:
        raise SystemExit(f"--resume: {load_path} holds no ds-hybrid train loop state (saved by another program)")
    check_same_run(loop["run"], run_identity(args), tag_dir)
    return loop, str(tag_dir)


HELD_BACK = {"lr_gate": "the LR gate (predict_lr_fraction)", "predictor": "the predictor (not confident)",
             "judge": "the delayed judgement"}


def share_line(noise: dict | None) -> str | None:
    """For gradient Predict steps from a share of the batch: the gradient noise scale over the run
    against the share's size, what the noise-scale model (``noise_scale.py``) makes a share step
    worth in real steps, and what one cost of a Full step's time. The model assumes each batch size
    at its own best LR; at the real steps' LR a share far below the noise scale can be worth much
    less (the offload-preset suite: a figure of 0.29 where the runs stalled), so it is a guide and
    says so. None where no share step was paired with a real one."""
    if not noise or not noise.get("pairs") or noise.get("run_share_worth") is None:
        return None
    b_noise, cost = noise.get("run_b_noise_samples"), noise.get("share_step_cost")
    head = f"gradient Predict steps from {noise['share_samples']} of {noise['batch_samples']} sequences, gradient "
    if b_noise == 0.0:
        # The pairs' trace estimate at or below 0: the share steps' gradients came out no larger than the
        # real steps' before them (a 16-of-32 share on the offload-preset config, 2026-12-06). That is
        # no measurement of the noise, and the model's "worth a whole step" from it would be none either.
        text = head + ("noise scale not measured (the share steps' gradients no larger than the real steps' "
                       "over the run), so no worth by the noise-scale model")
    else:
        text = (head + "noise scale " + (f"{b_noise:.0f} sequences" if b_noise is not None
                                         else "past estimating (the noise swamps the signal)")
                + f" over the run: by the noise-scale model each worth {noise['run_share_worth']:.2f} of a real "
                "step (a guide: it assumes an LR suited to the share)")
    if cost:
        text += f", at {cost:.2f} of a Full step's time"
    return text


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
                 f"{st['backward_skipped'] + st['backward_passes']} ({st['backward_skipped_pct']:.1f}%)"
                 + (f"; partial: {st['partial_backward']} (left out {100 * st['partial_backward_share']:.0f}% "
                    "of the parameters each on average)" if st.get("partial_backward") else ""))
    if st.get("idle_steps"):
        lines.append(f"real steps without the predictor's bookkeeping (lazy_bookkeeping): {st['idle_steps']}")
    share = share_line(st.get("gradient_noise_scale"))
    if share:
        lines.append(share)
    if st.get("held_back"):
        lines.append("Predict held back: " + ", ".join(f"{n} steps by {HELD_BACK.get(k, k)}"
                                                       for k, n in st["held_back"].items()))
    lines.append(f"validation loss: {summary['final_val_loss']:.4f} after {summary['val_points'][-1][0]} steps "
                 f"({summary['train_seconds_excluding_eval']:.1f} s training, eval excluded)")
    return "\n".join(lines)


def run_cli(argv: list[str] | None = None) -> None:
    """Entry point for ``ds-hybrid train`` and ``python -m ds_hybrid.train``. Exits with
    130 when SIGINT / SIGTERM stopped the run early (after its checkpoint is written)."""
    summary = main(argv)
    code = INTERRUPTED_EXIT_CODE if summary["interrupted"] else 0
    # Multi-rank CPU (gloo) runs can abort in interpreter teardown after all work is done;
    # leave through a barrier and os._exit so the exit status reflects the run.
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_cli()
