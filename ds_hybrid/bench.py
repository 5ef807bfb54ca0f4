"""``ds-hybrid bench``: hybrid training against plain DeepSpeed, to a target validation loss.

One invocation runs, on the same model, data, seeds and hardware, one after the other:

1. the baseline (``hybrid_predict.enabled: false``, i.e. plain DeepSpeed) at each learning-rate
   multiplier of a small sweep, on the first seed; the best final validation loss picks the LR;
2. the baseline at that LR on the other seeds;
3. the hybrid engine at that LR (same schedule) on every seed;
4. suite-specific comparators (``offload``: DeepSpeed's ZenFlow);
5. a profile of one Predict step's parts against a Full step and a forward pass.

Each run is a ``python -m ds_hybrid.train`` subprocess (so peak memory is per run) writing its
own ``summary.json`` / ``steps.jsonl``; the analysis reads only those. Outputs in ``--out``:
``result.json``, ``result.md`` and ``val_vs_time.png``. ``--readme`` copies them to
``docs/results/`` and rewrites the README's section for the suite; ``--from-json`` does that
again from a saved result without running anything.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .compare import interp_curve, load_run

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Suite:
    """A benchmark: model, preset, budget and the comparison it makes."""

    name: str
    doc: str                              # what it answers, shown in the README section
    model: str                            # ds_hybrid.models name or config JSON
    config: str                           # ds_configs preset the runs start from
    steps: int                            # optimizer steps per run (the baseline's budget)
    seq_len: int
    seeds: tuple[int, ...]
    lr_multipliers: tuple[float, ...]     # baseline LR sweep around the preset's LR
    eval_every: int                       # resolution of the validation curve
    val_batches: int
    needs_gpu: bool = False
    overrides: dict = field(default_factory=dict)    # merged into the preset (nested dicts)
    comparators: dict = field(default_factory=dict)  # extra plain runs: name -> overrides
    # The hybrid also runs with its schedule stretched by these factors (its Predict steps
    # are cheap but each moves less than a real one; a user who predicts gives it more steps).
    hybrid_stretch: tuple[float, ...] = (1.5,)


SUITES: dict[str, Suite] = {
    "cpu-small": Suite(
        name="cpu-small",
        doc="GPT-2 0.84M parameters on the Python standard library's source, 2 CPU cores, ZeRO 1 fp32",
        model="gpt2-tiny", config="tiny-cpu", steps=500, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8),
    "gpu-gpt2": Suite(
        name="gpu-gpt2",
        doc="GPT-2 124M (byte-level vocabulary) on one GPU, ZeRO 1 bf16",
        model="gpt2-124m", config="gpt2-124m", steps=2000, seq_len=512, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=100, val_batches=16, needs_gpu=True),
    "offload": Suite(
        name="offload",
        doc="optimizer in CPU memory (ZeRO-Offload): hybrid against ZeRO-Offload and DeepSpeed's ZenFlow",
        model="gpt2-tiny", config="tiny-cpu", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        overrides={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        comparators={"zenflow": {"zero_optimization": {"zenflow": {
            "topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step", "select_interval": 100,
            "full_warm_up_rounds": 0, "overlap_step": False}}}}),
}

QUICK = dict(model="gpt2-test", steps=40, seq_len=32, seeds=(1, 2), lr_multipliers=(1.0, 2.0), eval_every=10,
             val_batches=2)
# A quick run is too short for the presets' warmup: predict early so every path runs.
QUICK_HYBRID = {"hybrid_predict": {"warmup_steps": 8, "full_steps": 4, "predict_lr_fraction": 1.0}}


# --------------------------------------------------------------------------- running

@dataclass
class Run:
    name: str
    kind: str          # baseline | hybrid | a comparator name
    seed: int
    lr: float
    config: dict
    out: Path
    steps: int | None = None  # optimizer steps (and schedule length); None: the suite's


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def reusable(run: Run, suite: Suite, data: str | None) -> bool:
    """``--reuse``: the run folder holds a finished run of exactly this run's config and arguments."""
    try:
        summary = json.loads((run.out / "summary.json").read_text())
        config = json.loads((run.out / "ds_config.json").read_text())
    except (OSError, ValueError):
        return False
    a = summary.get("args", {})
    return (config == json.loads(json.dumps(run.config)) and not summary.get("interrupted")
            and a.get("model") == suite.model and a.get("steps") == (run.steps or suite.steps)
            and a.get("seq_len") == suite.seq_len and a.get("seed") == run.seed and a.get("lr") == run.lr
            and a.get("eval_every") == suite.eval_every and a.get("val_batches") == suite.val_batches
            and a.get("data") == data and bool(a.get("baseline")) == (run.kind != "hybrid"))


def run_train(run: Run, suite: Suite, data: str | None, live: bool, reuse: bool = False) -> dict:
    """Run one training subprocess; return its row from ``compare.load_run``."""
    if reuse and reusable(run, suite, data):
        print(f"      reusing the finished run in {run.out}", flush=True)
        return load_run(run.out)
    run.out.mkdir(parents=True, exist_ok=True)
    cfg_path = run.out / "ds_config.json"
    cfg_path.write_text(json.dumps(run.config, indent=2))
    cmd = [sys.executable, "-m", "ds_hybrid.train", "--config", str(cfg_path), "--model", suite.model,
           "--steps", str(run.steps or suite.steps), "--seq-len", str(suite.seq_len), "--seed", str(run.seed),
           "--lr", repr(run.lr), "--eval-every", str(suite.eval_every), "--val-batches", str(suite.val_batches),
           "--out", str(run.out), "--no-plot"]
    if data:
        cmd += ["--data", data]
    if run.kind != "hybrid":
        cmd.append("--baseline")
    if not live:
        cmd.append("--no-progress")
    with open(run.out / "train.log", "w") as log:
        # The child's progress bar (stderr) shows live on a terminal; its report goes to train.log.
        proc = subprocess.run(cmd, stdout=log, stderr=None if live else subprocess.STDOUT, env=_child_env())
    if proc.returncode != 0:
        tail = (run.out / "train.log").read_text()[-2000:]
        raise RuntimeError(f"bench run {run.name} failed (exit {proc.returncode}); see {run.out / 'train.log'}:\n{tail}")
    return load_run(run.out)


def _child_env() -> dict:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # each child is its own world of 1
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def plan_and_run(suite: Suite, out: Path, data: str | None, live: bool, reuse: bool = False) -> dict:
    from .train import resolve_config
    preset, _ = resolve_config(suite.config)
    base_cfg = deep_merge(preset, suite.overrides)
    base_lr = float(base_cfg["optimizer"]["params"]["lr"])
    rows: dict[str, dict] = {}
    runs_done = 0
    n_runs = (len(suite.lr_multipliers) + (len(suite.seeds) - 1)
              + len(suite.seeds) * (2 + 2 * len(suite.hybrid_stretch) + len(suite.comparators)))
    t_start = time.time()

    def execute(run: Run) -> dict:
        nonlocal runs_done
        runs_done += 1
        print(f"[{runs_done}/{n_runs}] {run.name}: seed {run.seed}, lr {run.lr:g}", flush=True)
        row = run_train(run, suite, data, live, reuse)
        print(f"      val loss {row['final_val_loss']:.4f}, {row['train_seconds']:.1f} s training, "
              f"{row['predicted_pct']:.0f}% predicted, {time.time() - t_start:.0f} s elapsed", flush=True)
        rows[run.name] = row
        return row

    first = suite.seeds[0]
    sweep = {}
    for m in suite.lr_multipliers:
        lr = base_lr * m
        sweep[m] = execute(Run(f"baseline-lr{m:g}-s{first}", "baseline", first, lr, base_cfg,
                               out / f"baseline-lr{m:g}-s{first}"))
    def best_of(sweep: dict) -> float:
        finite = {m: r for m, r in sweep.items() if math.isfinite(r["final_val_loss"])}
        if not finite:
            raise RuntimeError("bench: every baseline of the LR sweep diverged")
        return min(finite, key=lambda m: finite[m]["final_val_loss"])

    # A best LR at the edge of the sweep is not known to be the best: keep doubling (or
    # halving) until it is inside, at most twice. A baseline with an under-tuned LR makes
    # any predicted step look useful (they act much like a larger LR).
    best_m = best_of(sweep)
    for _ in range(2):
        if best_m == max(sweep) and len(sweep) > 1:
            m = best_m * 2
        elif best_m == min(sweep) and len(sweep) > 1:
            m = best_m / 2
        else:
            break
        n_runs += 1
        sweep[m] = execute(Run(f"baseline-lr{m:g}-s{first}", "baseline", first, base_lr * m, base_cfg,
                               out / f"baseline-lr{m:g}-s{first}"))
        best_m = best_of(sweep)
    best_lr = base_lr * best_m
    baselines = {first: sweep[best_m]}
    for seed in suite.seeds[1:]:
        baselines[seed] = execute(Run(f"baseline-s{seed}", "baseline", seed, best_lr, base_cfg,
                                      out / f"baseline-s{seed}"))
    hybrids = {seed: execute(Run(f"hybrid-s{seed}", "hybrid", seed, best_lr, base_cfg, out / f"hybrid-s{seed}"))
               for seed in suite.seeds}
    # Equal compute: plain DeepSpeed with as many real steps as the hybrid ran, on its own
    # (fully decayed) schedule. Reading the long baseline's curve at the hybrid's time
    # instead would compare an annealed run with one still at a high LR.
    equal = {}
    for seed, row in hybrids.items():
        n_real = max(int(round(row["statistics"]["backward_passes"] / row["gas"])), 2 * suite.eval_every)
        equal[seed] = execute(Run(f"baseline-eq-s{seed}", "baseline", seed, best_lr, base_cfg,
                                  out / f"baseline-eq-s{seed}", steps=n_real))
    # The stretched hybrid runs, each with its control: plain DeepSpeed on the same stretched
    # schedule. A longer schedule alone can reach the target sooner (it is still at a higher LR
    # when the short one anneals); only the gap between the two is the predictor's.
    stretched = {}
    for k in suite.hybrid_stretch:
        for kind in ("hybrid", "baseline"):
            name = f"{kind}-x{k:g}"
            stretched[name] = {seed: execute(Run(f"{name}-s{seed}", kind, seed, best_lr, base_cfg,
                                                 out / f"{name}-s{seed}", steps=int(round(suite.steps * k))))
                               for seed in suite.seeds}
    comparators: dict[str, dict[int, dict]] = {}
    for name, extra in suite.comparators.items():
        comparators[name] = {}
        for seed in suite.seeds:
            try:
                comparators[name][seed] = execute(Run(f"{name}-s{seed}", name, seed, best_lr,
                                                      deep_merge(base_cfg, extra), out / f"{name}-s{seed}"))
            except RuntimeError as err:  # e.g. ZenFlow without a GPU: say so, keep the rest
                comparators[name] = {"error": str(err).splitlines()[0]}
                print(f"      {name} did not run: {comparators[name]['error']}", flush=True)
                break
    return {"sweep": {f"{m:g}": _slim(r) for m, r in sorted(sweep.items())}, "best_lr_multiplier": best_m,
            "best_lr": best_lr, "baselines": baselines, "hybrids": hybrids, "comparators": comparators,
            "equal_compute": equal, "stretched": stretched,
            "base_config": base_cfg, "bench_seconds": time.time() - t_start}


def _slim(row: dict) -> dict:
    return {k: row[k] for k in ("final_val_loss", "train_seconds", "run")}


# --------------------------------------------------------------------------- analysis

def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """First training time at which the validation curve reaches ``target`` (interpolated)."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            if v0 <= target or v1 == v0:
                return t0 if v0 <= target else t1
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
    return None


def phase_throughput(row: dict) -> dict:
    """Tokens per second in each phase, from the run's mean step times."""
    mean = row["statistics"]["mean_step_seconds"]
    return {p: (row["tokens_per_step"] / s if s else None) for p, s in mean.items()}


def compare_seed(base: dict, other: dict) -> dict:
    """One seed: the other run against the baseline's final validation loss as the target."""
    target = base["final_val_loss"]
    t_base = time_to_target(base["val_curve"], target)
    t_other = time_to_target(other["val_curve"], target)
    t_equal = min(base["train_seconds"], other["train_seconds"])
    st = other["statistics"]
    return {
        "target_val_loss": target,
        "baseline_time_to_target_s": t_base,
        "time_to_target_s": t_other,
        "time_to_target_ratio": (t_other / t_base) if (t_other is not None and t_base) else None,
        "final_val_loss": other["final_val_loss"],
        "final_val_gap_pct": 100.0 * (other["final_val_loss"] - target) / target,
        "equal_time_s": t_equal,
        "val_at_equal_time": interp_curve(other["val_curve"], t_equal),
        "baseline_val_at_equal_time": interp_curve(base["val_curve"], t_equal),
        "train_seconds": other["train_seconds"],
        "baseline_train_seconds": base["train_seconds"],
        "backward_skipped_pct": st["backward_skipped_pct"],
        "predict_accepted": st["predict_accepted"],
        "predict_rolled_back": st["predict_rolled_back"],
        "peak_rss_mb": other.get("peak_rss_mb"),
        "baseline_peak_rss_mb": base.get("peak_rss_mb"),
        "gpu_peak_mb": other.get("gpu_peak_allocated_mb"),
        "baseline_gpu_peak_mb": base.get("gpu_peak_allocated_mb"),
        "tokens_per_s_by_phase": phase_throughput(other),
        "baseline_tokens_per_s": phase_throughput(base).get("full"),
    }


def mean_spread(values: list[float | None]) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "n": len(vals)}


AGG_KEYS = ["time_to_target_ratio", "final_val_gap_pct", "val_at_equal_time", "baseline_val_at_equal_time",
            "backward_skipped_pct", "predict_accepted", "predict_rolled_back", "peak_rss_mb", "baseline_peak_rss_mb",
            "gpu_peak_mb", "baseline_gpu_peak_mb",
            "train_seconds", "baseline_train_seconds"]


def equal_compute(hybrid: dict, base_eq: dict) -> dict:
    """One seed: the hybrid against plain DeepSpeed with as many real steps (its own schedule)."""
    return {"real_steps": int(round(hybrid["statistics"]["backward_passes"] / hybrid["gas"])),
            "steps": hybrid["steps"], "hybrid_val": hybrid["final_val_loss"],
            "baseline_val": base_eq["final_val_loss"],
            "val_gap_pct": 100.0 * (hybrid["final_val_loss"] - base_eq["final_val_loss"]) / base_eq["final_val_loss"],
            "time_ratio": hybrid["train_seconds"] / base_eq["train_seconds"] if base_eq["train_seconds"] else None}


def analyse(raw: dict) -> dict:
    systems = {"hybrid": raw["hybrids"]}
    systems.update(raw.get("stretched", {}))
    systems.update({k: v for k, v in raw["comparators"].items() if "error" not in v})
    out: dict[str, Any] = {}
    for name, by_seed in systems.items():
        per_seed = {str(s): compare_seed(raw["baselines"][s], row) for s, row in by_seed.items()}
        agg = {k: mean_spread([r[k] for r in per_seed.values()]) for k in AGG_KEYS}
        agg["reached_target"] = sum(r["time_to_target_s"] is not None for r in per_seed.values())
        agg["seeds"] = len(per_seed)
        out[name] = {"per_seed": per_seed, "aggregate": agg}
    if raw.get("equal_compute"):
        per_seed = {str(s): equal_compute(raw["hybrids"][s], row) for s, row in raw["equal_compute"].items()}
        out["hybrid"]["equal_compute"] = {
            "per_seed": per_seed,
            "aggregate": {k: mean_spread([r[k] for r in per_seed.values()])
                          for k in ("real_steps", "hybrid_val", "baseline_val", "val_gap_pct", "time_ratio")}}
    return out


# --------------------------------------------------------------------------- profile

def profile_predict_step(suite: Suite, lr: float, data: str | None, reps: int = 20) -> dict:
    """Where a Predict step's time goes, against a Full step and a forward pass alone.

    Runs in a subprocess (its own single-rank world) and returns mean seconds per part.
    """
    cmd = [sys.executable, "-m", "ds_hybrid.bench", "--profile-worker", suite.name, "--lr", repr(lr),
           "--reps", str(reps), "--model", suite.model, "--seq-len", str(suite.seq_len)]
    if data:
        cmd += ["--data", data]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench profile failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _profile_worker(suite: Suite, lr: float, reps: int, data: str | None) -> dict:
    import torch
    from . import initialize, zero_access as za
    from .data import ByteDataset, train_batches
    from .engine import default_loss
    from .models import build_model
    from .phases import Phase
    from .train import apply_lr, ensure_distributed_env, quiet_logs, resolve_config

    ensure_distributed_env()
    quiet_logs(False)
    preset, _ = resolve_config(suite.config)
    cfg = deep_merge(preset, suite.overrides)
    apply_lr(cfg, lr)
    cfg["hybrid_predict"] = dict(cfg.get("hybrid_predict", {}), enabled=True, warmup_steps=5, full_steps=1,
                                 confidence_threshold=0.0, predict_lr_fraction=1.0)
    torch.manual_seed(0)
    model = build_model(suite.model, vocab_size=256, seq_len=suite.seq_len)
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train, _ = ByteDataset.load(data).split(seq_len=suite.seq_len)
    stream = train_batches(train, suite.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    gas = engine.gradient_accumulation_steps()
    dev = engine.device

    def batches():
        return [{k: v.to(dev) for k, v in next(stream).items()} for _ in range(gas)]

    def timed(fn, n=reps) -> float:
        fn()  # warm
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    for _ in range(6):  # warmup: Adam state exists, the predictor has measurements
        engine.train_step(batches())
    access, snap = engine._masters, engine._snapshot
    scale = max(engine.predictor.step_scale(), 1e-3)
    out = {}
    out["full_step"] = timed(lambda: engine._real_step(batches(), default_loss))
    drift = engine._velocity is not None
    lrs = [float(g["lr"]) for g in access.base.param_groups]
    if drift:  # what a real step adds: stash the masters, fold the update into the velocity
        out["direction_probe"] = timed(lambda: (za.capture_weights(access, snap),
                                                za.fold_real_update(access, snap, engine._velocity, lrs,
                                                                    engine.hybrid_config.predictor.drift_beta, 1)))
    else:
        out["direction_probe"] = timed(lambda: (za.stash_direction(access, snap), za.compare_direction(access, snap)))

    def forward_only():
        with torch.no_grad():
            for b in batches():
                default_loss(engine, b).item()
    out["forward_only"] = timed(forward_only)
    out["snapshot"] = timed(lambda: za.capture_weights(access, snap))
    out["apply_update"] = timed(lambda: za.apply_velocity_update(access, engine._velocity, scale) if drift
                                else za.apply_predicted_update(access, scale))
    out["propagate"] = timed(access.propagate)

    def predict_step(verify: bool):
        ctl = engine.controller
        engine.hybrid_config.verify_every = 1 if verify else 10**9
        ctl.phase, ctl.horizon, ctl.predict_index = Phase.PREDICT, 10**9, 1  # mid-run: no snapshot
        engine.predictor.accept = lambda observed, step, div, *more: (True, observed)
        engine.train_step(batches())
    out["predict_step_verified"] = timed(lambda: predict_step(True))
    out["predict_step_unverified"] = timed(lambda: predict_step(False))
    out["ratios"] = {
        "forward_over_full": out["forward_only"] / out["full_step"],
        "predict_verified_over_full": out["predict_step_verified"] / out["full_step"],
        "predict_unverified_over_full": out["predict_step_unverified"] / out["full_step"],
        "predict_verified_over_forward": out["predict_step_verified"] / out["forward_only"],
        "probe_over_full": out["direction_probe"] / out["full_step"],
    }
    out["predict_breakdown_s"] = {
        "verification forward": out["forward_only"],
        f"predicted update ({'velocity' if drift else 'Adam direction'} + add)": out["apply_update"],
        "propagate to model params": out["propagate"],
        "rest (DeepSpeed step bookkeeping, Python)": max(out["predict_step_verified"] - out["forward_only"]
                                                         - out["apply_update"] - out["propagate"], 0.0),
    }
    out["reps"] = reps
    out["direction"] = "drift" if drift else "adam"
    return out


# --------------------------------------------------------------------------- reports

def _f(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ms(a: dict, fmt="{:.3f}") -> str:
    if a["mean"] is None:
        return "-"
    return f"{fmt.format(a['mean'])} ± {fmt.format(a['std'])}"


def _gpu_cell(g: dict) -> str:
    """The GPU allocator peak, where the runs had a GPU."""
    gpu = g.get("gpu_peak_mb") or {"mean": None}
    if gpu["mean"] is None:
        return ""
    return f"; GPU {_ms(gpu, '{:.0f}')} ({_ms(g['baseline_gpu_peak_mb'], '{:.0f}')})"


def markdown(result: dict) -> str:
    s = result["suite"]
    lines = [f"Suite `{s['name']}`: {s['doc']}; {s['steps']} steps of {s['seq_len']}-byte sequences, seeds "
             f"{', '.join(map(str, s['seeds']))}. Baseline = plain DeepSpeed (`hybrid_predict.enabled: false`) at the best "
             f"of the LR sweep {result['sweep_table']} (x{result['best_lr_multiplier']:g} = lr {result['best_lr']:g}); "
             f"the hybrid run uses the same LR and schedule (`hybrid-xK`: its schedule stretched to K times the steps; "
             f"`baseline-xK`: plain DeepSpeed on that stretched schedule, its control). "
             f"Target = each seed's baseline final validation loss.",
             "",
             "| system | reached target | time to target / baseline | final val gap vs baseline | val loss at equal time "
             "(baseline) | backward skipped | Predict accepted / rolled back | peak RSS MB (baseline) | train s (baseline) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, a in result["analysis"].items():
        g = a["aggregate"]
        lines.append(
            f"| {name} | {g['reached_target']}/{g['seeds']} | {_ms(g['time_to_target_ratio'])} | "
            f"{_ms(g['final_val_gap_pct'], '{:+.2f}')}% | {_ms(g['val_at_equal_time'], '{:.4f}')} "
            f"({_ms(g['baseline_val_at_equal_time'], '{:.4f}')}) | {_ms(g['backward_skipped_pct'], '{:.1f}')}% | "
            f"{_ms(g['predict_accepted'], '{:.0f}')} / {_ms(g['predict_rolled_back'], '{:.0f}')} | "
            f"{_ms(g['peak_rss_mb'], '{:.0f}')} ({_ms(g['baseline_peak_rss_mb'], '{:.0f}')}){_gpu_cell(g)} | "
            f"{_ms(g['train_seconds'], '{:.1f}')} ({_ms(g['baseline_train_seconds'], '{:.1f}')}) |")
    for name, c in result.get("comparator_errors", {}).items():
        lines.append(f"| {name} | did not run: {c} | | | | | | | |")
    eq = result["analysis"]["hybrid"].get("equal_compute")
    if eq:
        a = eq["aggregate"]
        lines += ["", "At equal compute: plain DeepSpeed given as many real (backward) steps as the hybrid ran, on its "
                  "own fully decayed schedule:", "",
                  "| seed | hybrid steps (real) | hybrid final val | baseline val, same real steps | gap | "
                  "hybrid time / baseline time |", "|---|---|---|---|---|---|"]
        for seed, r in eq["per_seed"].items():
            lines.append(f"| {seed} | {r['steps']} ({r['real_steps']}) | {r['hybrid_val']:.4f} | {r['baseline_val']:.4f} "
                         f"| {r['val_gap_pct']:+.2f}% | {_f(r['time_ratio'], '{:.2f}')} |")
        lines.append(f"| mean | | {_ms(a['hybrid_val'], '{:.4f}')} | {_ms(a['baseline_val'], '{:.4f}')} | "
                     f"{_ms(a['val_gap_pct'], '{:+.2f}')}% | {_ms(a['time_ratio'], '{:.2f}')} |")
    for name in [n for n in result["analysis"] if n.startswith("hybrid-x")]:
        control = result["analysis"].get("baseline-" + name[len("hybrid-"):])
        if not control:
            continue
        lines += ["", f"`{name}` against its control on the same stretched schedule (time to each seed's target; a "
                  "ratio under 1 is the predictor's own gain):", "",
                  f"| seed | {name} time to target s | control time to target s | ratio | {name} final val | "
                  "control final val |", "|---|---|---|---|---|---|"]
        for seed, r in result["analysis"][name]["per_seed"].items():
            c = control["per_seed"].get(seed, {})
            t, tc = r["time_to_target_s"], c.get("time_to_target_s")
            lines.append(f"| {seed} | {_f(t, '{:.1f}')} | {_f(tc, '{:.1f}')} | "
                         f"{_f(t / tc if t is not None and tc else None, '{:.3f}')} | {r['final_val_loss']:.4f} | "
                         f"{_f(c.get('final_val_loss'), '{:.4f}')} |")
    lines += ["", "Per seed (hybrid):", "",
              "| seed | target | baseline time to target s | hybrid time to target s | hybrid final val | "
              "tokens/s full / predict / correct (baseline) |", "|---|---|---|---|---|---|"]
    for seed, r in result["analysis"]["hybrid"]["per_seed"].items():
        tps = r["tokens_per_s_by_phase"]
        lines.append(f"| {seed} | {r['target_val_loss']:.4f} | {_f(r['baseline_time_to_target_s'], '{:.1f}')} | "
                     f"{_f(r['time_to_target_s'], '{:.1f}')} | {r['final_val_loss']:.4f} | "
                     f"{_f(tps.get('full'), '{:.0f}')} / {_f(tps.get('predict'), '{:.0f}')} / "
                     f"{_f(tps.get('correct'), '{:.0f}')} ({_f(r['baseline_tokens_per_s'], '{:.0f}')}) |")
    p = result.get("profile")
    if p:
        rt = p["ratios"]
        lines += ["", f"Predict step profile (mean of {p['reps']} repetitions, ms): Full step "
                  f"{p['full_step'] * 1e3:.1f}, forward alone {p['forward_only'] * 1e3:.1f} "
                  f"({rt['forward_over_full']:.2f}x Full), Predict step verified {p['predict_step_verified'] * 1e3:.1f} "
                  f"({rt['predict_verified_over_full']:.2f}x Full, {rt['predict_verified_over_forward']:.2f}x forward), "
                  f"unverified {p['predict_step_unverified'] * 1e3:.1f} ({rt['predict_unverified_over_full']:.2f}x Full); "
                  f"the {p.get('direction', 'adam')} bookkeeping on real steps costs {rt['probe_over_full']:.2f}x a "
                  f"Full step.", "",
                  "| part of a verified Predict step | ms | share |", "|---|---|---|"]
        total = sum(p["predict_breakdown_s"].values())
        for part, sec in p["predict_breakdown_s"].items():
            lines.append(f"| {part} | {sec * 1e3:.2f} | {100 * sec / total:.0f}% |")
    return "\n".join(lines)


def plot(raw: dict, analysis: dict, path: Path, title: str) -> None:
    """Validation loss against training time for every system, hybrid phases shaded (first seed)."""
    import json as _json
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from .plotting import PHASE_COLOURS

    fig = Figure(figsize=(10, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = {"baseline": "black", "hybrid": "tab:green", "zenflow": "tab:purple", "baseline-eq": "grey"}
    groups = {"baseline": raw["baselines"], "hybrid": raw["hybrids"], **raw.get("stretched", {})}
    if raw.get("equal_compute"):
        groups["baseline-eq"] = raw["equal_compute"]
    groups.update({k: v for k, v in raw["comparators"].items() if "error" not in v})
    for name, by_seed in groups.items():
        for i, (seed, row) in enumerate(sorted(by_seed.items(), key=lambda kv: str(kv[0]))):
            ts, vs = zip(*row["val_curve"])
            colour = colours.get(name) or ("tab:olive" if name.startswith("hybrid-x") else
                                           "tab:brown" if name.startswith("baseline-x") else "tab:blue")
            ax.plot(ts, vs, color=colour, alpha=0.9 if i == 0 else 0.35, lw=1.5,
                    label=f"{name}" if i == 0 else None)
    first = sorted(raw["hybrids"], key=str)[0]
    steps = [_json.loads(line) for line in (Path(raw["hybrids"][first]["run"]) / "steps.jsonl").read_text().splitlines()]
    t, start, phase = 0.0, 0.0, steps[0]["phase"] if steps else None
    seen = set()
    for rec in steps + [{"phase": None, "step_time_s": 0.0}]:
        if rec["phase"] != phase:
            ax.axvspan(start, t, color=PHASE_COLOURS.get(phase, "white"), alpha=0.18, lw=0,
                       label=f"hybrid {phase} (seed {first})" if phase not in seen else None)
            seen.add(phase)
            start, phase = t, rec["phase"]
        t += rec["step_time_s"]
    targets = [r["target_val_loss"] for r in analysis["hybrid"]["per_seed"].values()]
    ax.axhline(statistics.mean(targets), color="grey", ls="--", lw=1, label="target (baseline final, mean)")
    lo = min(min(v for _, v in r["val_curve"]) for g in groups.values() for r in g.values())
    ax.set_ylim(lo - 0.05, lo + 1.0)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


README_MARK = "<!-- bench:{name}:{end} -->"


def readme_section(result: dict, json_rel: str, png_rel: str) -> str:
    s = result["suite"]
    cmd = f"ds-hybrid bench --suite {s['name']}" + (" --quick" if result.get("quick") else "") + " --readme"
    return "\n".join([
        f"### `{s['name']}`", "",
        f"Command: `.venv/bin/{cmd}` (took {result['bench_seconds'] / 60:.1f} min on {result['host']}). "
        f"Source of every number below: [`{json_rel}`]({json_rel}); regenerate this section with "
        f"`.venv/bin/ds-hybrid bench --from-json {json_rel} --readme`.", "",
        markdown(result), "",
        f"![validation loss against training time]({png_rel})",
    ])


def update_readme(result: dict, readme: Path = REPO_ROOT / "README.md") -> Path:
    """Copy the result into docs/results/ and rewrite the README section between the suite's markers."""
    name = result["suite"]["name"]
    dest = REPO_ROOT / "docs" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    json_path, png_path = dest / f"{name}.json", dest / f"{name}.png"
    if Path(result["json_path"]).resolve() != json_path.resolve():
        shutil.copyfile(result["json_path"], json_path)
    if result.get("png_path") and Path(result["png_path"]).is_file() \
            and Path(result["png_path"]).resolve() != png_path.resolve():
        shutil.copyfile(result["png_path"], png_path)
    section = readme_section(result, f"docs/results/{name}.json", f"docs/results/{name}.png")
    text = readme.read_text()
    start, end = README_MARK.format(name=name, end="start"), README_MARK.format(name=name, end="end")
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no markers {start} ... {end} for suite {name}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{section}\n{end}{tail}")
    return readme


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-hybrid bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="cpu-small", choices=sorted(SUITES), help="which benchmark")
    p.add_argument("--data", default=None, help="corpus: a text file or directory (default: stdlib source)")
    p.add_argument("--model", default=None, help="override the suite's model (e.g. llama-tiny, gpt2-tiny)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the suite's seeds (at least 3)")
    p.add_argument("--steps", type=int, default=None, help="override the suite's step budget")
    p.add_argument("--quick", action="store_true", help="a CI-sized smoke run (tiny model, few steps, 2 seeds)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench/SUITE)")
    p.add_argument("--readme", action="store_true", help="copy the result to docs/results/ and update README.md")
    p.add_argument("--from-json", default=None, help="regenerate table/README from a saved result.json, no runs")
    p.add_argument("--no-profile", action="store_true", help="skip the Predict-step profile")
    p.add_argument("--reuse", action="store_true",
                   help="keep finished runs in the output directory whose config and arguments match (times "
                        "then come from different sittings; run the bench alone on a quiet machine)")
    # internal: the profile runs in a child process
    p.add_argument("--profile-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    return p


def resolve_suite(args) -> Suite:
    suite = SUITES[args.suite]
    if args.quick:
        suite = replace(suite, **QUICK, overrides=deep_merge(suite.overrides, QUICK_HYBRID))
    if args.model:
        suite = replace(suite, model=args.model)
    if args.seeds:
        if len(args.seeds) < 2:
            raise SystemExit("--seeds: give at least 2 seeds (3 for a reported result)")
        suite = replace(suite, seeds=tuple(args.seeds))
    if args.steps:
        if args.steps < 2 * suite.eval_every:
            raise SystemExit(f"--steps: at least {2 * suite.eval_every} (two evaluations of the curve)")
        suite = replace(suite, steps=args.steps)
    if getattr(args, "seq_len", None):
        suite = replace(suite, seq_len=args.seq_len)
    return suite


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.profile_worker:
        suite = resolve_suite(argparse.Namespace(**{**vars(args), "suite": args.profile_worker, "quick": False}))
        print(json.dumps(_profile_worker(suite, args.lr, args.reps, args.data)))
        return None
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result["json_path"] = args.from_json
        png = Path(args.from_json).with_suffix(".png")
        result["png_path"] = str(png) if png.is_file() else result.get("png_path")
        print(markdown(result))
        if args.readme:
            print(f"updated {update_readme(result)}")
        return result

    suite = resolve_suite(args)
    if suite.needs_gpu:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"--suite {suite.name}: needs a CUDA GPU (this machine has none)")
    out = Path(args.out or f"runs/bench/{suite.name}" + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    live = sys.stderr.isatty()
    print(f"ds-hybrid bench {suite.name}: {suite.doc}", flush=True)
    raw = plan_and_run(suite, out, args.data, live, args.reuse)
    analysis = analyse(raw)
    profile = None
    if not args.no_profile:
        print("profiling one Predict step ...", flush=True)
        profile = profile_predict_step(suite, raw["best_lr"], args.data, reps=5 if args.quick else 20)
    import platform
    result = {
        "suite": {**asdict(suite), "seeds": list(suite.seeds), "lr_multipliers": list(suite.lr_multipliers)},
        "quick": args.quick, "data": args.data,
        "sweep": raw["sweep"], "sweep_table": ", ".join(f"x{m}: {r['final_val_loss']:.4f}"
                                                        for m, r in raw["sweep"].items()),
        "best_lr_multiplier": raw["best_lr_multiplier"], "best_lr": raw["best_lr"],
        "analysis": analysis, "profile": profile, "bench_seconds": raw["bench_seconds"],
        "comparator_errors": {k: v["error"] for k, v in raw["comparators"].items() if "error" in v},
        "host": f"{platform.machine()} {os.cpu_count()} CPU cores" + _gpu_name(),
        "runs": {"baselines": {str(k): _slim(v) for k, v in raw["baselines"].items()},
                 "hybrids": {str(k): _slim(v) for k, v in raw["hybrids"].items()}},
    }
    json_path, png_path, md_path = out / "result.json", out / "val_vs_time.png", out / "result.md"
    plot(raw, analysis, png_path, f"{suite.name}: validation loss against training time")
    result["json_path"], result["png_path"] = str(json_path), str(png_path)
    json_path.write_text(json.dumps(result, indent=2))
    md_path.write_text(markdown(result) + "\n")
    print(markdown(result))
    print(f"wrote {json_path}, {md_path}, {png_path}")
    if args.readme:
        print(f"updated {update_readme(result)}")
    return result


def _gpu_name() -> str:
    try:
        import torch
        return f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    except Exception:
        return ""


if __name__ == "__main__":
    main()
