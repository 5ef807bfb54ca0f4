"""``ds-hybrid bench``: time to a target validation loss on a budget frontier, hybrid against plain DeepSpeed.

One invocation runs, on the same model, data, seeds and machine:

1. plain DeepSpeed (``hybrid_predict.enabled: false``) at each learning-rate multiplier of a
   sweep at the full budget on the first seed (the sweep is extended while its best is at an
   edge); the best final validation loss picks the LR every run then uses, and where other LRs
   are within ``SWEEP_TIE`` of it, they all run on every seed and the best mean picks;
2. for every seed and every step budget (fractions of the suite's steps, each with its own full
   warmup-cosine schedule), one run of each system ("arm"): plain DeepSpeed and the hybrid
   variants, interleaved, so that machine noise hits them alike;
3. a profile of every step kind (a plain step, a hybrid real step, partial steps, Predict steps)
   in one process, which turns each run's steps into Full-step equivalents.

``cpu-finetune`` first pre-trains a model on the default corpus (cached between invocations)
and every run starts from it, on a second corpus.

The scoring is ``ds_hybrid.frontier``: each system's least time to reach a loss at any
budget, over plain DeepSpeed's. Targets: plain DeepSpeed's final validation loss at the full
budget (per seed), and 1% and 2% above it. Each run is a ``python -m ds_hybrid.train``
subprocess; the analysis reads only what they wrote. Outputs in ``--out``: ``result.json``,
``result.md``, ``frontier.png``; ``--readme`` copies them to ``docs/results/`` and rewrites the
suite's section of ``docs/benchmarks.md`` and its headline line in ``README.md`` (an offload suite's: the
README's offload table); ``--from-json`` does that again from a saved
result without running anything.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from . import bench_launch
from . import bench_report as report
from . import frontier as fr
from .bench_suites import SUITES, Suite
from .compare import load_run

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"target": 0.0, "target+1%": 0.01, "target+2%": 0.02}
SWEEP_TIE = 0.01   # LRs whose final loss on the sweep's seed is within 1% of the best's are run on every seed


@dataclass(frozen=True)
class Arm:
    """One system the bench runs at every budget."""

    name: str
    doc: str
    hybrid: dict | str | None    # the hybrid_predict section; None: plain DeepSpeed; "preset": the preset's own
    budgets: tuple[float, ...] | None = None   # None: every budget of the suite
    # Another system's baseline (ZenFlow) tunes its own LR, as plain DeepSpeed's is tuned: swept at the
    # full budget on the first seed around plain's best. The hybrid's arms keep plain's LR, so that a
    # predicted step is never credited with what a better LR would have done.
    own_lr: bool = False


# Predicted steps everywhere they are allowed, so the frontier shows what they are worth.
_WHOLE = {"enabled": True, "warmup_steps": 50, "full_steps": 4, "min_predict_steps": 2, "max_predict_steps": 2,
          "confidence_threshold": 0.0, "predict_lr_fraction": 1.0, "correction_steps": 0, "check": "next_step",
          "predictor": {"direction": "drift", "drift_beta": 0.95, "step_scale": 1.0, "max_step_scale": 1.0},
          "divergence": {"rel_tolerance": 0.02, "z_threshold": 3.0, "max_loss_ratio": 1.5},
          "dynamics": {"progress_every": 0}}
# Predict steps that take their own gradient: 3 after every real step from step 50 (the study's
# 1 : 3, each worth a real step in loss; they pay where the optimizer step is dear: ZeRO-Offload).
_GRADIENT = {"enabled": True, "warmup_steps": 50, "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3,
             "confidence_threshold": 0.0, "predict_lr_fraction": 1.0, "correction_steps": 0, "check": "next_step",
             "predictor": {"direction": "gradient"},
             "divergence": {"rel_tolerance": 0.02, "z_threshold": 3.0, "max_loss_ratio": 1.5},
             "dynamics": {"progress_every": 0}}
_GROUPS = {"enabled": True, "warmup_steps": 50, "full_steps": 8, "whole_model": False, "predict_lr_fraction": 1.0,
           "predictor": {"direction": "drift", "drift_beta": 0.95},
           "group_predict": {"enabled": True, "refresh_every": 4, "min_gain": 0.05},
           "dynamics": {"progress_every": 0}}


def _with(base: dict, **changes: Any) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in changes.items():
        node = out
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# Budgets: plain DeepSpeed's frontier below the full budget is what the looser targets are read
# from; a hybrid run with 1/3 of its steps predicted has fewer real steps than plain DeepSpeed at
# the same budget, so its arms also run longer budgets (it may reach the target only there).
# Plain DeepSpeed runs those longer budgets too: a longer schedule's curve crosses the full
# budget's final loss before its end, 3-9% sooner than that budget on cpu-small
# (benchmarks/predict_sweep.py's `plain` variant), and without them the hybrid's ratio was
# flattered by 0.05 (docs/predicted-steps.md).
_PLAIN_BUDGETS = (0.75, 0.875, 1.0, 1.25, 1.5, 2.0)   # (2.0: only where a suite lists it)
_HYBRID_BUDGETS = (1.0, 1.25, 1.5)

ARMS: dict[str, Arm] = {a.name: a for a in [
    Arm("baseline", "plain DeepSpeed (`hybrid_predict.enabled: false`), LR-tuned", None, budgets=_PLAIN_BUDGETS),
    Arm("predict", "whole-model drift Predict runs (2 after every 4 real steps from step 50), checked by the "
        "next real step's forward (`check: next_step`)", _WHOLE, budgets=_HYBRID_BUDGETS),
    Arm("predict-skip", "its control: the same runs with `predictor.direction: none` (Predict steps advance the "
        "schedule and move nothing)", _with(_WHOLE, predictor__direction="none"), budgets=(1.0, 1.25)),
    Arm("predict-gradient", "whole-model Predict runs whose steps take their own gradient (`predictor.direction: "
        "gradient`: Adam's step with the second moment held, the run's first moment handed to the optimizer when "
        "kept; 3 after every real step from step 50), checked by the next real step's forward", _GRADIENT,
        budgets=_HYBRID_BUDGETS),
    Arm("predict-gradient-half", "the same, each Predict step's gradient from half of its batch "
        "(`predictor.gradient_batch_fraction: 0.5`: half a real step's forward and backward)",
        _with(_GRADIENT, predictor__gradient_batch_fraction=0.5), budgets=_HYBRID_BUDGETS),
    # A quarter of the batch, 7 after every real step: grad_step_study's best worth per cost (at its
    # batch 64, 1 : 7, each worth 0.48 +- 0.02 of a real step). Its real steps are 1 in 8, so it may
    # reach plain's final loss only past plain's budget: it runs up to twice that.
    Arm("predict-gradient-quarter", "each Predict step's gradient from a quarter of its batch "
        "(`predictor.gradient_batch_fraction: 0.25`), 7 after every real step from step 50",
        _with(_GRADIENT, predictor__gradient_batch_fraction=0.25, min_predict_steps=7, max_predict_steps=7),
        budgets=(1.0, 1.5, 2.0)),
    # The same share, 15 after every real step, up to 3x plain's budget: grad_step_study's first setting to
    # reach plain AdamW's final loss (batch 64, 3 seeds, a 3x schedule) in under 0.6x plain's time by the
    # H200's timers (docs/memory.md, "Toward plain's final loss"). Its real steps are 1 in 16. (4x where a
    # suite lists it: on offload-b64 one seed of three ended 0.85% above plain's final loss at 3x.)
    Arm("predict-gradient-quarter-15", "each Predict step's gradient from a quarter of its batch, 15 after every "
        "real step from step 50, up to 3x plain's budget (4x on `offload-b64`)",
        _with(_GRADIENT, predictor__gradient_batch_fraction=0.25, min_predict_steps=15, max_predict_steps=15),
        budgets=(1.0, 2.0, 3.0, 4.0)),
    Arm("groups", "layer-group Predict chosen by the planner (`group_predict`), no whole-model runs", _GROUPS,
        budgets=(1.0,)),
    Arm("groups-pinned", "the lower 2 of 4 layer groups predicted on 3 of every 4 Full steps",
        _with(_GROUPS, group_predict__pinned=2), budgets=(1.0,)),
    Arm("groups-freeze", "its control: the same steps with the predicted groups frozen (`step_scale: 0`)",
        _with(_GROUPS, group_predict__pinned=2, group_predict__step_scale=0.0), budgets=(1.0,)),
    Arm("default", "the preset's own `hybrid_predict` section as shipped (the no-argument `ds-hybrid train`)",
        "preset", budgets=(1.0,)),
]}


# ZenFlow: plain DeepSpeed with its own asynchronous CPU updates (the offload suite's comparator).
# Its tutorial's settings but for the selection: "auto" means once per epoch of DeepSpeed's own
# data loader, and without one (this loop feeds its batches) DeepSpeed never re-selects; so the
# important columns are re-selected every 100 steps, from a top 10%, with the CPU step in line.
# A 60-step check (gpt2-tiny, seed 1, offload suite's config): the tutorial's settings ended at
# 3.22 in 211 ms/step, these at 3.02 in 151 ms/step (plain ZeRO-Offload 2.79, 172 ms/step).
_ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step", "select_interval": 100,
            "full_warm_up_rounds": 0, "overlap_step": False}
ARMS["zenflow"] = Arm("zenflow", "DeepSpeed's ZenFlow (`zero_optimization.zenflow`: top 10% of columns updated "
                      "every step, re-selected every 100, the rest every 4 on the CPU)",
                      {"__ds__": {"zero_optimization": {"zenflow": _ZENFLOW}}}, budgets=_PLAIN_BUDGETS, own_lr=True)
# ZenFlow as its tutorial recommends it beside a GPU: each CPU step overlapped with the next steps'
# forward and backward (`overlap_step: true`, the CPU step in a process of its own), the offload-gpu
# suite's. On the 2-core CPU that process takes a core from the training one: 120 steps of the
# offload suite's config (gpt2-tiny, seed 1) took 132 ms/step and ended at 2.666 in line, 109 ms/step
# and 2.641 without, so the CPU suites keep the CPU step in line.
ARMS["zenflow-overlap"] = Arm("zenflow-overlap", "DeepSpeed's ZenFlow as `zenflow`, each CPU step overlapped with "
                              "the next steps' forward and backward (its tutorial's `overlap_step: true`)",
                              {"__ds__": {"zero_optimization": {"zenflow": dict(_ZENFLOW, overlap_step=True)}}},
                              budgets=_PLAIN_BUDGETS, own_lr=True)

QUICK = dict(model="gpt2-test", steps=40, seq_len=32, seeds=(1, 2), lr_multipliers=(1.0, 2.0), eval_every=10,
             val_batches=2, budgets=(0.75, 1.0, 1.25))
# A quick run is too short for the arms' warmup: predict early so every path runs.
QUICK_HYBRID = {"warmup_steps": 6}


def resolve_data(data: str | None) -> str | None:
    """The corpus path a suite names: ``transformers-source`` is the installed ``transformers``
    package's folder (present wherever ds_hybrid is)."""
    if data == "transformers-source":
        import transformers
        return str(Path(transformers.__file__).parent)
    return data


# --------------------------------------------------------------------------- running

@dataclass
class Run:
    name: str
    arm: str
    seed: int
    lr: float
    budget: float
    config: dict
    out: Path
    steps: int
    baseline: bool


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arm_config(base_cfg: dict, arm: Arm, quick: bool) -> tuple[dict, bool]:
    """The ds_config of an arm's runs and whether they run as plain DeepSpeed (``--baseline``)."""
    cfg = json.loads(json.dumps(base_cfg))
    if arm.hybrid is None:
        return cfg, True
    if arm.hybrid == "preset":
        section = cfg.get("hybrid_predict", {})
    elif report.ds_feature(arm.hybrid):    # a DeepSpeed feature, no hybrid
        return deep_merge(cfg, arm.hybrid["__ds__"]), True
    else:
        section = json.loads(json.dumps(arm.hybrid))
    if quick:
        section = dict(section, **QUICK_HYBRID)
        if "full_steps" in section:
            section["full_steps"] = min(section["full_steps"], 4)
    cfg["hybrid_predict"] = section
    return cfg, False


class Runner:
    """Runs training subprocesses for one suite and keeps their rows; with ``jobs`` above 1, that
    many at a time (from threads: ``each``), each bound to a set of cores no other run holds."""

    def __init__(self, suite: Suite, out: Path, data: str | None, init: str | None, live: bool, reuse: bool,
                 jobs: int = 1):
        self.suite, self.out, self.data, self.init, self.live, self.reuse = suite, out, data, init, live, reuse
        self.done, self.total, self.t_start, self.reused = 0, 0, time.time(), 0
        self.gpus: dict[str, Path] = {}   # each GPU the runs trained on (summary.json's host): a run timed on it
        self.jobs = jobs
        self.lock = threading.Lock()   # the counters, the prints and the GPU check, shared by the threads
        self._slots: queue.SimpleQueue | None = None   # the free core sets; a run takes one and gives it back
        if jobs > 1:
            self._slots = queue.SimpleQueue()
            for cores in bench_launch.core_slots(jobs):
                self._slots.put(cores)

    def each(self, fn: Callable[[Any], Any], items: Iterable) -> list:
        """``fn`` of every item, results in the items' order: one after another, or with ``jobs``
        above 1 up to that many at a time. The first error is raised once the runs already going
        have ended; those not yet started never start."""
        items = list(items)
        if self.jobs == 1 or len(items) < 2:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(min(self.jobs, len(items))) as pool:
            futures = [pool.submit(fn, x) for x in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def args_for(self, run: Run) -> list[str]:
        s = self.suite
        cmd = ["--config", str(run.out / "ds_config.json"), "--model", s.model, "--steps", str(run.steps),
               "--seq-len", str(s.seq_len), "--seed", str(run.seed), "--lr", repr(run.lr),
               "--eval-every", str(s.eval_every), "--val-batches", str(s.val_batches), "--out", str(run.out),
               "--no-plot", "--layer-groups", str(s.layer_groups)]
        if self.data:
            cmd += ["--data", self.data]
        if self.init:
            cmd += ["--init", self.init]
        if run.baseline:
            cmd.append("--baseline")
        if not self.live:
            cmd.append("--no-progress")
        return cmd

    def reusable(self, run: Run) -> bool:
        """``--reuse``: the run folder holds a finished run of exactly this run's config and arguments."""
        try:
            summary = json.loads((run.out / "summary.json").read_text())
            config = json.loads((run.out / "ds_config.json").read_text())
            args = json.loads((run.out / "bench_args.json").read_text())
        except (OSError, ValueError):
            return False
        return (config == json.loads(json.dumps(run.config)) and not summary.get("interrupted")
                and [a for a in args if a != "--no-progress"]
                == [a for a in self.args_for(run) if a != "--no-progress"])

    def __call__(self, run: Run) -> dict:
        with self.lock:
            self.done += 1
            print(f"[{self.done}/{self.total}] {run.name}: seed {run.seed}, {run.steps} steps, lr {run.lr:g}",
                  flush=True)
        if self.reuse and self.reusable(run):
            with self.lock:
                print(f"      reusing the finished run in {run.out}", flush=True)
                self.reused += 1
        else:
            run.out.mkdir(parents=True, exist_ok=True)
            (run.out / "ds_config.json").write_text(json.dumps(run.config, indent=2))
            args = self.args_for(run)
            cores = self._slots.get() if self._slots is not None else None
            try:
                with open(run.out / "train.log", "w") as log:
                    launcher = self.suite.launcher
                    proc = subprocess.run(bench_launch.command(launcher, "ds_hybrid.train", args, cores=cores),
                                          stdout=log, stderr=None if self.live else subprocess.STDOUT,
                                          env=bench_launch.threads_env(child_env(), launcher, cores))
            finally:
                if cores is not None:
                    self._slots.put(cores)
            if proc.returncode != 0:
                tail = (run.out / "train.log").read_text()[-2000:]
                raise RuntimeError(f"bench run {run.name} failed (exit {proc.returncode}); see "
                                   f"{run.out / 'train.log'}:\n{tail}")
            (run.out / "bench_args.json").write_text(json.dumps(args))
        row = load_run(run.out)
        row.update(arm=run.arm, budget=run.budget, lr=run.lr)
        with self.lock:
            self._one_gpu(run)
            who = f"{run.name}: " if self.jobs > 1 else ""   # (runs finish out of order)
            print(f"      {who}val loss {row['final_val_loss']:.4f}, {row['train_seconds']:.1f} s training, "
                  f"{row['predicted_pct']:.0f}% predicted, {time.time() - self.t_start:.0f} s elapsed", flush=True)
        return row

    def _one_gpu(self, run: Run) -> None:
        """Every run of a suite on one kind of GPU: a --reuse'd run timed on another card would mix
        their times in one table."""
        gpu = (json.loads((run.out / "summary.json").read_text()).get("host") or {}).get("gpu")
        self.gpus.setdefault(str(gpu), run.out)
        if len(self.gpus) > 1:
            (a, pa), (b, pb) = list(self.gpus.items())[:2]
            raise RuntimeError(f"bench: runs on different GPUs in one suite ({a} in {pa}, {b} in {pb}); "
                               "remove the other card's run folders or run without --reuse")


def child_env() -> dict:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # each child is its own world of 1
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def pretrained(suite: Suite, base_cfg: dict, cache: Path, live: bool) -> str | None:
    """The weights every ``cpu-finetune`` run starts from: plain DeepSpeed on the standard
    library's source for ``pretrain_steps`` at the preset's LR, seed 0. Cached under ``cache``
    by a digest of everything that makes it."""
    if not suite.pretrain_steps:
        return None
    cfg = json.loads(json.dumps(base_cfg))
    key = hashlib.sha256(json.dumps([suite.model, suite.pretrain_steps, suite.seq_len, suite.layer_groups, cfg],
                                    sort_keys=True).encode()).hexdigest()[:12]
    path = cache / f"pretrained-{suite.model}-{suite.pretrain_steps}-{key}.pt"
    if path.is_file():
        print(f"pre-trained weights: {path} (cached)", flush=True)
        return str(path)
    work = cache / f"pretrain-{key}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds_config.json").write_text(json.dumps(cfg, indent=2))
    print(f"pre-training {suite.model} for {suite.pretrain_steps} steps on the standard library's source ...",
          flush=True)
    cmd = [sys.executable, "-m", "ds_hybrid.train", "--config", str(work / "ds_config.json"), "--model",
           suite.model, "--steps", str(suite.pretrain_steps), "--seq-len", str(suite.seq_len), "--seed", "0",
           "--baseline", "--out", str(work), "--no-plot", "--save-model", str(work / "model.pt"), "--eval-every",
           str(max(suite.pretrain_steps // 4, 1)), "--layer-groups", str(suite.layer_groups)]
    if not live:
        cmd.append("--no-progress")
    with open(work / "train.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=None if live else subprocess.STDOUT, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench pre-training failed; see {work / 'train.log'}")
    os.replace(work / "model.pt", path)   # in the cache only once complete: a killed pre-training leaves nothing there
    return str(path)


def plan_and_run(suite: Suite, out: Path, data: str | None, live: bool, reuse: bool, quick: bool,
                 cache: Path, jobs: int = 1) -> dict:
    from .arguments import resolve_config
    preset, _ = resolve_config(suite.config)
    base_cfg = deep_merge(preset, suite.overrides)
    base_lr = float(base_cfg["optimizer"]["params"]["lr"])
    init = pretrained(suite, base_cfg, cache, live)
    runner = Runner(suite, out, data, init, live, reuse, jobs)
    arms = [ARMS[a] for a in suite.arms]
    budgets_of = {a.name: [b for b in suite.budgets
                           if a.budgets is None or b in a.budgets or (suite.budgets_for_all and a.hybrid != "preset")]
                  for a in arms}
    # (an own_lr arm's sweep adds two runs to its full-budget one on the first seed)
    runner.total = len(suite.lr_multipliers) + len(suite.seeds) * sum(len(b) for b in budgets_of.values()) - 1 \
        + 2 * sum(a.own_lr for a in arms)

    def run_of(arm: Arm, seed: int, budget: float, lr: float, name: str | None = None) -> Run:
        cfg, baseline = arm_config(base_cfg, arm, quick)
        steps = max(int(round(suite.steps * budget)), 2 * suite.eval_every)
        # DeepSpeed's own forward / backward / step timers in every run, booked per kind of step
        # (ds_hybrid.wall_clock): where a real step's time goes, read alike for every system.
        cfg["wall_clock_breakdown"] = True
        name = name or f"{arm.name}-b{budget:g}-s{seed}"
        return Run(name, arm.name, seed, lr, budget, cfg, out / name, steps, baseline)

    first = suite.seeds[0]
    sweep, best_m = _lr_sweep(lambda m: runner(run_of(ARMS["baseline"], first, 1.0, base_lr * m,
                                                      f"baseline-lr{m:g}-s{first}")),
                              suite.lr_multipliers, runner, "bench: every baseline of the LR sweep diverged")
    # One seed's sweep can pick an LR that is worse on the others: on offload-z3, x2 beat x1 by
    # 0.1% on the first seed and ended 7-9% above it on the other two (benchmarks/lr_check.py).
    # Every LR within SWEEP_TIE of the first seed's best runs on every seed; the lowest mean
    # final loss picks the LR (its runs are plain DeepSpeed's full-budget runs of those seeds).
    tie_break: dict[float, dict[int, dict]] = {}
    tied = sorted(m for m, r in sweep.items()
                  if math.isfinite(r["final_val_loss"])
                  and r["final_val_loss"] <= sweep[best_m]["final_val_loss"] * (1 + SWEEP_TIE))
    if len(tied) > 1 and len(suite.seeds) > 1:
        runner.total += len(tied) * (len(suite.seeds) - 1) - (len(suite.seeds) - 1)
        pairs = [(m, seed) for m in tied for seed in suite.seeds[1:]]
        done = runner.each(lambda p: runner(run_of(ARMS["baseline"], p[1], 1.0, base_lr * p[0],
                                                   f"baseline-lr{p[0]:g}-s{p[1]}")), pairs)
        for m in tied:
            tie_break[m] = {first: sweep[m]}
        for (m, seed), row in zip(pairs, done):
            tie_break[m][seed] = row

        def mean_loss(m: float) -> float:
            losses = [r["final_val_loss"] for r in tie_break[m].values()]
            return statistics.mean(losses) if all(math.isfinite(x) for x in losses) else math.inf
        best_m = min(tied, key=mean_loss)
        print(f"      tied on seed {first} (within {100 * SWEEP_TIE:g}%): "
              + ", ".join(f"x{m:g} mean {mean_loss(m):.4f}" for m in tied) + f"; x{best_m:g} runs", flush=True)
    best_lr = base_lr * best_m
    rows: dict[str, dict[str, dict[str, dict]]] = {a.name: {} for a in arms}   # arm -> seed -> budget -> row
    rows["baseline"] = {str(seed): {"1": r} for seed, r in tie_break.get(best_m, {first: sweep[best_m]}).items()} \
        if "baseline" in rows else {}
    errors: dict[str, str] = {}
    lr_of = {a.name: best_lr for a in arms}
    own_sweeps: dict[str, dict[float, dict]] = {}
    for arm in (a for a in arms if a.own_lr):
        try:
            own_sweeps[arm.name], m = _own_sweep(arm, best_m, runner, run_of, first, base_lr)
        except RuntimeError as err:   # e.g. ZenFlow without a GPU: say so, go on
            errors[arm.name] = str(err).splitlines()[0]
            print(f"      {arm.name} did not run: {errors[arm.name]}", flush=True)
            continue
        lr_of[arm.name] = base_lr * m
        rows[arm.name][str(first)] = {"1": own_sweeps[arm.name][m]}   # its sweep's best is its full-budget run
    # Interleaved: every budget of every seed runs each system in turn (with --jobs, in that order
    # as slots free up, so that machine noise still hits the systems alike).
    todo = [(arm, seed, budget) for seed in suite.seeds for budget in sorted(suite.budgets, reverse=True)
            for arm in arms if budget in budgets_of[arm.name] and arm.name not in errors
            and not (budget == 1.0 and "1" in rows[arm.name].get(str(seed), {}))]   # (the sweep's best run)

    def attempt(job: tuple[Arm, int, float]) -> dict | None:
        arm, seed, budget = job
        if arm.name in errors:   # an earlier run of it failed: the rest would too
            return None
        try:
            return runner(run_of(arm, seed, budget, lr_of[arm.name]))
        except RuntimeError as err:
            if ARMS[arm.name].hybrid is None:
                raise
            with runner.lock:   # e.g. ZenFlow without a GPU: say so, go on
                errors.setdefault(arm.name, str(err).splitlines()[0])
                print(f"      {arm.name} did not run: {errors[arm.name]}", flush=True)
            return None
    for (arm, seed, budget), row in zip(todo, runner.each(attempt, todo)):
        if row is not None:
            rows[arm.name].setdefault(str(seed), {})[f"{budget:g}"] = row
    return {"sweep": {f"{m:g}": _slim(r) for m, r in sorted(sweep.items())}, "best_lr_multiplier": best_m,
            "sweep_tie_break": {f"{m:g}": {str(seed): r["final_val_loss"] for seed, r in by_seed.items()}
                                for m, by_seed in tie_break.items()},
            "best_lr": best_lr, "own_lr": {name: {"sweep": {f"{m:g}": _slim(r) for m, r in sorted(sw.items())},
                                                  "best_lr": lr_of[name]} for name, sw in own_sweeps.items()},
            "rows": rows, "errors": errors, "base_config": base_cfg, "init": init,
            "bench_seconds": time.time() - runner.t_start, "reused_runs": runner.reused, "jobs": jobs}


def _lr_sweep(run: Callable[[float], dict], multipliers: Iterable[float], runner: "Runner",
              diverged: str) -> tuple[dict[float, dict], float]:
    """An LR sweep at the full budget on the first seed: ``run`` at each multiplier, then past an
    edge while the best is there, at most twice: a best LR at the edge is not known to be the best,
    and a baseline with an under-tuned LR makes any predicted step look useful (they act much like
    a larger LR). Returns the sweep (multiplier -> row) and the best multiplier; ``diverged`` is the
    error where no run of it ended finite."""
    multipliers = list(multipliers)
    sweep = dict(zip(multipliers, runner.each(run, multipliers)))

    def best() -> float:
        finite = {m: r for m, r in sweep.items() if math.isfinite(r["final_val_loss"])}
        if not finite:
            raise RuntimeError(diverged)
        return min(finite, key=lambda m: finite[m]["final_val_loss"])
    m = best()
    for _ in range(2):
        if len(sweep) < 2 or m not in (min(sweep), max(sweep)):
            break
        edge = m * 2 if m == max(sweep) else m / 2
        runner.total += 1
        sweep[edge] = run(edge)
        m = best()
    return sweep, m


def _own_sweep(arm: Arm, best_m: float, runner: "Runner", run_of, seed: int,
               base_lr: float) -> tuple[dict[float, dict], float]:
    """An ``own_lr`` arm's LR sweep (``_lr_sweep``) around plain's best multiplier: half, once and
    twice it. Its run at plain's LR keeps the name of its full-budget run, so a ``--reuse`` of a
    suite run before it had a sweep runs only the new LRs."""
    def run(m: float) -> dict:
        name = f"{arm.name}-b1-s{seed}" if m == best_m else f"{arm.name}-lr{m:g}-s{seed}"
        return runner(run_of(arm, seed, 1.0, base_lr * m, name))
    return _lr_sweep(run, (best_m / 2, best_m, best_m * 2), runner, f"every run of {arm.name}'s LR sweep diverged")


def _slim(row: dict) -> dict:
    return {k: row[k] for k in ("final_val_loss", "train_seconds", "run")}


# --------------------------------------------------------------------------- analysis

# The shares of the batch the profile times a gradient Predict step from, by kind name (another
# share is costed as the whole batch's: ``cost_of``).
GRADIENT_SHARES = {1.0: "predict_gradient", 0.5: "predict_gradient_f0.5", 0.25: "predict_gradient_f0.25"}


def cost_of(kind: str, profile: dict | None) -> float:
    """A step kind's cost in Full-step equivalents (plain DeepSpeed's real step = 1)."""
    if not profile:
        return 1.0
    c = profile["cost"]
    base, *extras = kind.split("+")
    if base not in c and base.startswith("predict_gradient_f"):   # a batch share not measured: the whole batch's
        base = "predict_gradient"
    # a partial prefix (or, in an older profile, real_groups) not measured: a real step
    value = c.get(base, c["real"])
    if "commit" in extras and "real_commit" in c:   # after a kept drift run: its commit (older profiles: in every step)
        value = c["real_commit"] if base == "real" else value + max(0.0, c["real_commit"] - c["real"])
    if "run" in extras:   # a run's first step: its moments or its velocity copied in (older profiles: in every step)
        if f"{base}_run" in c:
            value = c[f"{base}_run"]
        elif base == "predict_verified" and "predict_run" in c:   # (the drift run's copy, timed unverified)
            value += max(0.0, c["predict_run"] - c["predict"])
    return value + (c["forward"] if "forward" in extras else 0.0)


def kinds_needed(rows: dict) -> set[str]:
    """The step kinds a suite's runs took (``compare.step_kinds``) and every kind ``cost_of`` reads
    their costs from: what the profile must time. Plain DeepSpeed's step (the unit), DeepSpeed's own
    engine beside it and the hybrid's real step (``cost_of``'s fallback) always."""
    need = {"plain", "deepspeed", "real"}
    for by_seed in rows.values():
        for by_budget in by_seed.values():
            for row in by_budget.values():
                for kind in set(row["step_kinds"]):
                    base, *extras = kind.split("+")
                    if base.startswith("predict_gradient_f") and base not in GRADIENT_SHARES.values():
                        base = "predict_gradient"   # (a share the profile does not time: the whole batch's)
                    need.add(base)
                    if "run" in extras:
                        need.add(f"{base}_run")
                        if base == "predict_verified":   # (the drift run's copy, timed unverified)
                            need |= {"predict", "predict_run"}
                    if "commit" in extras:
                        need.add("real_commit")
                    if "forward" in extras:
                        need.add("forward")
    return need


def shifted_profile(profile: dict, sign: int) -> dict:
    """The profile with every kind's cost one standard error higher (``sign`` 1) or lower (-1);
    plain DeepSpeed's step, the unit, stays 1."""
    se = profile.get("cost_se") or {}
    return {**profile, "cost": {k: c if k == "plain" else c + sign * (se.get(k) or 0.0)
                                for k, c in profile["cost"].items()}}


def own_kind(arm: str, profile: dict | None) -> str | None:
    """The profiled kind a DeepSpeed feature's runs (ZenFlow: --baseline runs) are costed as: the
    arm's own name where the profile timed it (older profiles cost its steps as plain steps)."""
    feature = arm in ARMS and report.ds_feature(ARMS[arm].hybrid)
    return arm if feature and profile and arm in profile["cost"] else None


def eq_curve(row: dict, own: str | None, profile: dict | None) -> list[tuple[float, float]]:
    """A run's validation curve against its steps' cost in Full-step equivalents."""
    return fr.step_costs_curve(row["val_points"], [cost_of(own if own and k == "plain" else k, profile)
                                                   for k in row["step_kinds"]])


def profile_band(raw: dict, arm: str, targets: dict, profile: dict) -> dict:
    """The arm's mean ratio in Full-step equivalents at each target with every kind's cost one
    standard error lower and higher, [low, high]: the uncertainty within the profile's rounds, the
    seeds' aside (a floor: profiles of other sittings differ by more, ``PROFILE_REPS``)."""
    base, own, band = raw["rows"]["baseline"], own_kind(arm, profile), {t: [] for t in TARGETS}
    for sign in (-1, 1):
        prof, vals = shifted_profile(profile, sign), {t: [] for t in TARGETS}
        for seed, by_budget in raw["rows"][arm].items():
            if seed not in targets:
                continue
            arm_runs = [{**r, "eq_curve": eq_curve(r, own, prof)} for r in by_budget.values()]
            base_runs = [{**r, "eq_curve": eq_curve(r, None, prof)} for r in base[seed].values()]
            for t, v in fr.ratios(arm_runs, base_runs, targets[seed], "eq_curve").items():
                vals[t].append(v["ratio"])
        for t in TARGETS:
            band[t].append(fr.mean_spread(vals[t])["mean"])
    return band


def analyse(raw: dict, profile: dict | None) -> dict:
    """Per arm and seed: frontier ratios against plain DeepSpeed at each target, in seconds and
    in Full-step equivalents (with the profile's own uncertainty where it has one); and the
    full-budget comparison (final gap, time)."""
    base = raw["rows"]["baseline"]
    out: dict[str, Any] = {"targets": {}, "arms": {}}
    for seed, by_budget in base.items():
        full = by_budget.get("1")
        if full is None:
            continue
        out["targets"][seed] = {n: full["final_val_loss"] * (1 + d) for n, d in TARGETS.items()}
    for arm, rows in raw["rows"].items():
        own = own_kind(arm, profile)
        for by_budget in rows.values():
            for row in by_budget.values():
                row["eq_curve"] = eq_curve(row, own, profile)
                row["eq_total"] = row["eq_curve"][-1][0] if row["eq_curve"] else None
                # The optimizer steps (the CPU Adam steps under ZeRO-Offload): every step but a Predict step.
                row["opt_curve"] = fr.step_costs_curve(row["val_points"], [0.0 if k.startswith("predict") else 1.0
                                                                           for k in row["step_kinds"]])
    for arm, by_seed in raw["rows"].items():
        if arm == "baseline":
            continue
        per_seed = {}
        for seed, by_budget in by_seed.items():
            targets = out["targets"].get(seed)
            if not targets:
                continue
            arm_runs, base_runs = list(by_budget.values()), list(base[seed].values())
            full, bfull = by_budget.get("1"), base[seed]["1"]
            st = full["statistics"] if full else {}
            per_seed[seed] = {
                "seconds": fr.ratios(arm_runs, base_runs, targets, "val_curve"),
                "equivalents": fr.ratios(arm_runs, base_runs, targets, "eq_curve"),
                "optimizer_steps": fr.ratios(arm_runs, base_runs, targets, "opt_curve"),
                "full_budget": None if full is None else {
                    "final_val_loss": full["final_val_loss"], "baseline_final_val_loss": bfull["final_val_loss"],
                    "final_gap_pct": 100 * (full["final_val_loss"] - bfull["final_val_loss"]) / bfull["final_val_loss"],
                    "time_ratio": full["train_seconds"] / bfull["train_seconds"],
                    "equivalents_ratio": full["eq_total"] / bfull["eq_total"] if bfull.get("eq_total") else None,
                    "backward_skipped": st.get("backward_skipped", 0),
                    "partial_backward": st.get("partial_backward", 0),
                    "backward_skipped_equivalent": st.get("backward_skipped_equivalent", st.get("backward_skipped", 0)),
                    "steps": full["steps"], "predicted_pct": full["predicted_pct"],
                    "predict_accepted": st.get("predict_accepted"), "predict_rolled_back": st.get("predict_rolled_back"),
                    "predicted_update_rolled_back": st.get("predicted_update_rolled_back", 0),
                    "peak_rss_mb": full.get("peak_rss_mb"), "baseline_peak_rss_mb": bfull.get("peak_rss_mb")},
            }
        agg = {}
        for unit in ("seconds", "equivalents", "optimizer_steps"):
            agg[unit] = {}
            for t in TARGETS:
                vals = [p[unit][t]["ratio"] for p in per_seed.values() if unit in p]   # (older results: no such unit)
                agg[unit][t] = dict(fr.mean_spread(vals), reached=sum(v is not None for v in vals), seeds=len(vals))
        if profile and profile.get("cost_se"):
            agg["equivalents_profile_band"] = profile_band(raw, arm, out["targets"], profile)
        fulls = [p["full_budget"] for p in per_seed.values() if p["full_budget"]]
        agg["full_budget"] = {k: fr.mean_spread([f[k] for f in fulls])
                              for k in ("final_gap_pct", "time_ratio", "equivalents_ratio", "backward_skipped",
                                        "partial_backward", "backward_skipped_equivalent", "predicted_pct",
                                        "peak_rss_mb", "baseline_peak_rss_mb")} if fulls else {}
        out["arms"][arm] = {"per_seed": per_seed, "aggregate": agg}
    out["wall_clock"] = wall_clock(raw["rows"])
    return out


def wall_clock(rows: dict) -> dict:
    """Per system, at the full budget, mean over seeds: DeepSpeed's timers per whole real step
    (``wall_clock_breakdown``, ms), the engine's time per whole real step and per Predict step
    (``train_step``, ms: the timers plus everything around them, the hybrid's bookkeeping
    included), and that real-step time over plain DeepSpeed's in the same seed's run."""
    base = {seed: by_b["1"] for seed, by_b in rows.get("baseline", {}).items() if "1" in by_b}
    out = {}
    for arm, by_seed in rows.items():
        fulls = {seed: by_b["1"] for seed, by_b in by_seed.items() if "1" in by_b}
        timers = [r["statistics"].get("wall_clock_breakdown", {}).get("real") for r in fulls.values()]
        timers = [t["mean_ms"] for t in timers if t]
        if not timers:
            continue
        ratios = [r["real_step_ms"] / base[seed]["real_step_ms"] for seed, r in fulls.items()
                  if seed in base and r.get("real_step_ms") and base[seed].get("real_step_ms")]
        out[arm] = {"seeds": len(timers),
                    "timers_ms": {k: fr.mean_spread([t[k] for t in timers]) for k in timers[0]},
                    "real_step_ms": fr.mean_spread([r["real_step_ms"] for r in fulls.values() if r.get("real_step_ms")]),
                    "predict_step_ms": fr.mean_spread([r["predict_step_ms"] for r in fulls.values()
                                                       if r.get("predict_step_ms")]),
                    "real_step_ratio": fr.mean_spread(ratios)}
    return out


# --------------------------------------------------------------------------- profile

# Step kinds that run plain DeepSpeed's whole forward, backward and step plus the hybrid's work:
# costed by their time over the plain work inside the same steps (_profile_worker).
PAIRED_KINDS = ("real", "real_idle", "real_groups", "real_gradient", "real_commit")
# Rounds of the profile. Two 20-round profiles of the same runs differed by up to 3% in a kind's
# cost: as much as the hybrid's real-step overhead it measures. Twice the rounds halve the variance.
# (Not fewer where the rounds agree: four 40-round profiles of offload-b64 in a row put one kind at
# 0.222-0.241 of a plain step with standard errors of 0.002-0.004, benchmarks/profile_sittings.py: a
# kind's standard error is a floor on how well it is known, not a measure of it.)
PROFILE_REPS = 40
FEATURE_BLOCK = 8   # consecutive steps of a DeepSpeed feature (ZenFlow) per round: two of its update intervals
FEATURE_LEAD = 4    # its untimed steps before them: the block's first boundary waits on an update 4 steps old


def settle_feature(eng, quiet: float = 0.03, limit: float = 10.0) -> float:
    """Untimed, after a DeepSpeed feature's block: wait until ZenFlow's overlapped optimizer
    process (its last update still running, to be waited on at the next update boundary) has
    been idle for ``quiet`` seconds, its CPU time unchanged, so that its update does not run beside
    the next kind's steps. Returns the seconds waited (0.0 where there is no such process)."""
    proc = getattr(getattr(eng, "optimizer", None), "process", None)
    if proc is None or not proc.is_alive():
        return 0.0
    import psutil   # (a DeepSpeed dependency)
    worker, t0 = psutil.Process(proc.pid), time.perf_counter()

    def cpu() -> float:
        t = worker.cpu_times()
        return t.user + t.system
    last = cpu()
    while time.perf_counter() - t0 < limit:
        time.sleep(quiet)
        now = cpu()
        if now == last:
            break
        last = now
    return time.perf_counter() - t0 - quiet


def ratio_se(x: list[float], y: list[float]) -> float | None:
    """The standard error of ``sum(x) / sum(y)``, a ratio of means of paired rounds (the delta
    method: the spread of ``x - R y`` over the rounds); None below two rounds."""
    n = len(x)
    if n < 2 or sum(y) <= 0:
        return None
    r = sum(x) / sum(y)
    return math.sqrt(sum((a - r * b) ** 2 for a, b in zip(x, y)) / (n * (n - 1))) / (sum(y) / n)


def feature_lrs(arms: Iterable[str], result: dict) -> dict[str, float]:
    """The suite's DeepSpeed features (ZenFlow) that ran, each at the LR its runs took: its own
    sweep's best where it has one, else plain DeepSpeed's (``result``: a bench's runs or result)."""
    own = result.get("own_lr") or {}
    return {a: own.get(a, {}).get("best_lr", result["best_lr"]) for a in arms
            if report.ds_feature(ARMS[a].hybrid) and a not in result.get("errors", {})}


def profile_steps(suite: Suite, lr: float, data: str | None, init: str | None, reps: int = PROFILE_REPS,
                  ds_arms: dict[str, float] | None = None, state: Path | None = None,
                  kinds: Iterable[str] | None = None) -> dict:
    """Mean time of each step kind, measured in one process (a subprocess: its own world of 1).
    ``ds_arms``: the suite's DeepSpeed features (ZenFlow) and the LR each runs at, whose steps are
    timed too, each as a kind of its own name: their steps are not plain DeepSpeed's. ``state``:
    a file the rounds' times are kept in after every round, from which a profile cut off (a device
    call's time limit) goes on (``_profile_worker``). ``kinds``: time only these (``kinds_needed``:
    the ones the suite's runs took; None: every kind this layout has), and each of ``ds_arms``."""
    args = ["--profile-worker", suite.name, "--lr", repr(lr), "--reps", str(reps), "--model", suite.model,
            "--seq-len", str(suite.seq_len)]
    if kinds is not None:
        args += ["--kinds", ",".join(sorted(kinds))]
    if state is not None:
        args += ["--profile-state", str(state)]
    for name, arm_lr in (ds_arms or {}).items():
        args += ["--ds-arm", f"{name}={arm_lr!r}"]
    if data:
        args += ["--data", data]
    if init:
        args += ["--init", init]
    # Started as the suite's runs are (the same core binding), so its costs are theirs.
    proc = subprocess.run(bench_launch.command(suite.launcher, "ds_hybrid.bench", args), capture_output=True,
                          text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench profile failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    # The worker prints its result as one JSON line; the launcher logs after it.
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _profile_worker(suite: Suite, lr: float, reps: int, data: str | None, init: str | None,
                    ds_arms: dict[str, float] | None = None, state_path: str | None = None,
                    wanted: set[str] | None = None) -> dict:
    import torch
    from . import initialize
    from .data import ByteDataset, train_batches
    from .engine import default_loss
    from .models import build_model, layer_groups
    from .phases import Phase
    from .dist_env import ensure_distributed_env
    from .arguments import resolve_config
    from .train import apply_lr, load_init_weights, quiet_logs

    ensure_distributed_env()
    quiet_logs(False)
    # (the cores this process was started on: every kind but a DeepSpeed feature's runs on them)
    cores, omp_threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    preset, _ = resolve_config(suite.config)
    cfg = deep_merge(preset, suite.overrides)
    apply_lr(cfg, lr)
    # Layer-group Predict (the partial kinds) needs ZeRO 0-2; on ZeRO 3 the whole-model kinds only.
    groups = int((cfg.get("zero_optimization") or {}).get("stage", 0) or 0) < 3
    if groups:
        cfg["hybrid_predict"] = _with(_GROUPS, whole_model=True, warmup_steps=5, full_steps=10**6,
                                      confidence_threshold=0.0, check="next_step",
                                      group_predict__refresh_every=10**6, group_predict__min_gain=0.0)
    else:
        cfg["hybrid_predict"] = _with(_WHOLE, warmup_steps=5, full_steps=10**6)
    def built(make_engine: Callable, config: dict):   # (every engine from the same weights)
        torch.manual_seed(0)
        m = build_model(suite.model, vocab_size=256, seq_len=suite.seq_len)
        if init:
            load_init_weights(m, init)
        return make_engine(model=m, model_parameters=layer_groups(m, suite.layer_groups), config=config)[0]
    engine = built(initialize, cfg)
    # DeepSpeed's own engine beside it (no ds_hybrid code): how far the unit, the bench's plain
    # DeepSpeed step (the hybrid's engine with the hybrid off: its non-finite guard included), is from it.
    import deepspeed
    plain_cfg = {k: v for k, v in cfg.items() if k != "hybrid_predict"}
    ds_engine = built(deepspeed.initialize, plain_cfg)
    # Each DeepSpeed feature among the arms (ZenFlow), built as its runs are, at its own LR.
    ds_features = {}
    for name, arm_lr in (ds_arms or {}).items():
        feature_cfg = arm_config(plain_cfg, ARMS[name], quick=False)[0]
        apply_lr(feature_cfg, arm_lr)
        ds_features[name] = built(deepspeed.initialize, feature_cfg)
    train, _ = ByteDataset.load(data).split(seq_len=suite.seq_len)
    stream = train_batches(train, suite.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    gas = engine.gradient_accumulation_steps()
    dev = engine.device

    def batches():
        return [{k: v.to(dev) for k, v in next(stream).items()} for _ in range(gas)]

    for _ in range(8):  # Adam state, velocity and the planner's statistics exist
        engine.train_step(batches())

    # Inside every step, the time of plain DeepSpeed's own work (forward, backward, optimizer
    # step; the hybrid's first-forward callback, which holds its capture, taken out): a hybrid
    # real step's overhead is then measured against the plain work of the same step, so the
    # step-to-step noise of the forward and backward (several %) cancels out of it.
    inner = [0.0]

    def time_plain_work(eng) -> None:
        real_step = eng._real_step

        def timed_real_step(batches, loss_fn, on_first_forward=None, cut=None):
            spent = [0.0]

            def callback(loss, batch):
                t0 = time.perf_counter()
                try:
                    return on_first_forward(loss, batch)
                finally:
                    spent[0] += time.perf_counter() - t0
            t0 = time.perf_counter()
            real_step(batches, loss_fn, callback if on_first_forward is not None else None, cut)
            inner[0] += time.perf_counter() - t0 - spent[0]
        eng._real_step = timed_real_step
    time_plain_work(engine)
    ctl = engine.controller
    planner = engine._planner

    def plain():
        engine._real_step(batches(), default_loss)

    def deepspeed_step(eng=ds_engine):
        for b in batches():
            loss = default_loss(eng, b)
            eng.backward(loss)
            eng.step()
        loss.item()

    def full(k: int, with_planner: bool = True, phase: Phase = Phase.FULL):
        ctl.phase, ctl.remaining = phase, 10**6   # (a warmup step this far from its end: an idle one)
        engine._next_groups, engine._check_groups = k, None
        engine._planner = planner if with_planner else None
        try:
            engine.train_step(batches())
        finally:
            engine._planner = planner
        engine._check_groups = None   # each timed step on its own: no check of the last one

    def forward_only():
        with torch.no_grad():
            for b in batches():
                default_loss(engine, b).item()

    def predict(verified: bool):
        engine.hybrid_config.check = "forward" if verified else "next_step"
        engine.hybrid_config.verify_every = 1 if verified else 10**9
        ctl.phase, ctl.horizon, ctl.predict_index = Phase.PREDICT, 10**9, 1   # mid-run: no snapshot
        engine.predictor.accept = lambda observed, step, div, *more: (True, observed)
        engine.train_step(batches())

    # A DeepSpeed feature's steps are timed FEATURE_BLOCK at a time: ZenFlow's CPU step (every
    # update_interval steps, overlapped with the next ones' forward and backward where
    # overlap_step is set) runs as in its runs, not with other kinds' steps hiding its wait.
    # ZenFlow's overlapped step, at its first CPU step, narrows this (training) thread to its share
    # of the cores, the rest its optimizer process's, and sets OMP_NUM_THREADS: its own steps run
    # so, as in its runs, and every other kind's on the cores the profile started with. Its CPU
    # update, submitted at one boundary, is waited on at the next: so each block follows
    # FEATURE_LEAD untimed steps (its first boundary waits on an update as old as in a run), and the
    # last update the block submitted finishes, untimed, before the next kind (``settle_feature``).
    narrowed: dict[str, set[int]] = {}   # (a feature's own cores, as it left them)

    def feature_steps(name: str, eng, steps: int) -> None:
        if name in narrowed:
            os.sched_setaffinity(0, narrowed[name])
        try:
            for _ in range(steps):
                deepspeed_step(eng)
        finally:
            narrowed[name] = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cores)
            if omp_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = omp_threads

    prepare: dict[str, Callable[[], Any]] = {   # untimed, before a kind's timed step: the state it needs
        name: (lambda n=name, e=e: feature_steps(n, e, FEATURE_LEAD)) for name, e in ds_features.items()}
    settled = dict.fromkeys(ds_features, 0.0)   # (untimed, after a feature's block: its last update's tail)
    kinds = {"plain": plain, "deepspeed": deepspeed_step,
             **{name: (lambda n=name, e=e: feature_steps(n, e, FEATURE_BLOCK)) for name, e in ds_features.items()},
             "real": lambda: full(0, with_planner=False),   # the whole-model arms' and the default's real step
             # ... without the predictor's work on the masters (lazy_bookkeeping: early warmup)
             "real_idle": lambda: full(0, with_planner=False, phase=Phase.WARMUP)}
    if groups:
        kinds["real_groups"] = lambda: full(0)   # the layer-group arms' whole step: the planner observes
        for k in range(1, engine._layout.max_prefix + 1):
            kinds[f"partial_{k}"] = lambda k=k: full(k)
    kinds.update(forward=forward_only, predict=lambda: predict(False), predict_verified=lambda: predict(True))
    device, velocity = engine._device_predict, engine._velocity
    if device is not None:
        # On the device path a kept drift run's masters catch up at the next real step (its commit;
        # inside DeepSpeed's CPU Adam step where memory.fold_in_step is on): a run's first real step
        # pays it, the others not. So ``real`` is timed with no run pending (one ended, untimed,
        # before it) and ``real_commit`` right after a drift Predict step; ``compare.step_kinds``
        # marks a real step after a kept drift run ``+commit``.
        prepare["real"] = lambda: full(0, with_planner=False) if device.pending else None
        kinds["real_commit"] = lambda: full(0, with_planner=False)
        prepare["real_commit"] = lambda: predict(False)
    if device is not None and device.upload_due(velocity):
        # Beside a GPU the device path copies the velocity there at a run's first Predict step
        # (a real step's fold changed it), once a run: the drift kinds above are steps in the middle
        # of a run (the copy made, untimed, before them), ``predict_run`` one that begins a run
        # after a real step (untimed), which ``compare.step_kinds``'s ``+run`` costs once a run.
        prepare["predict"] = lambda: device.upload(velocity) if device.upload_due(velocity) else None
        kinds["predict_run"] = lambda: predict(False)
        prepare["predict_run"] = lambda: full(0, with_planner=False)
    try:   # a Predict step that takes its own gradient (predictor.direction: gradient), on this suite's layout
        gradient = engine._make_gradient_predict()
    except ValueError:
        gradient = None
    if gradient is not None:
        # A run of such steps copies the optimizer's moments in at its first step and hands its
        # first moment back (on the device path the masters catch up too) when it is kept: costs
        # of the run, not of each step. So two kinds each: a step in the middle of a run
        # (``predict_gradient``), and a step that begins a run and keeps it (``..._run``), which
        # the first Predict step of each run costs (``compare.step_kinds``'s ``+run``).
        def predict_gradient(fraction: float, whole_run: bool = False):
            engine._gradient, gradient.batch_fraction = gradient, fraction
            try:
                predict(False)
                if whole_run:
                    gradient.commit()
            finally:
                engine._gradient = None

        def in_a_run(fraction: float):   # (untimed: a run going, begun by a step of its own)
            if gradient.m is None:
                predict_gradient(fraction)

        def no_run():                    # (untimed: none going, so that the timed step begins one)
            if gradient.m is not None:
                gradient.discard()
        # ... from the whole batch, half and a quarter of it (the -half and -quarter arms')
        for fraction, name in GRADIENT_SHARES.items():
            kinds[name] = lambda f=fraction: predict_gradient(f)
            prepare[name] = lambda f=fraction: in_a_run(f)
            kinds[f"{name}_run"] = lambda f=fraction: predict_gradient(f, whole_run=True)
            prepare[f"{name}_run"] = no_run
    if gradient is not None and (wanted is None or "real_gradient" in wanted):
        # The gradient arms' real step: no velocity to fold or direction to probe (they move by
        # Adam's own step), so not the drift engine's; one of an engine set up as theirs are.
        grad_cfg = dict(json.loads(json.dumps(cfg)), hybrid_predict=_with(_GRADIENT, warmup_steps=5, full_steps=10**6))
        grad_engine = built(initialize, grad_cfg)
        for _ in range(8):
            grad_engine.train_step(batches())
        time_plain_work(grad_engine)

        def real_gradient():
            grad_engine.controller.phase, grad_engine.controller.remaining = Phase.FULL, 10**6
            grad_engine.train_step(batches())
        kinds["real_gradient"] = real_gradient
    if wanted is not None:
        # Only the kinds the suite's runs took (and DeepSpeed's features): on a GPU's device call
        # every kind timed is time the runs do not get.
        kinds = {k: fn for k, fn in kinds.items() if k in wanted or k in ds_features}
    # Round robin, one step of each kind per round: a slow stretch of the machine (or the allocator
    # warming up) lands on every kind alike instead of on whichever was timed then.
    for name, fn in kinds.items():
        prepare.get(name, lambda: None)()
        fn()  # warm
        if name in ds_features:
            settle_feature(ds_features[name])
    # Each round's time of each kind, and of the plain work inside it: the means and, from the
    # rounds' spread, how well each kind's cost is known.
    sec: dict[str, list[float]] = {k: [] for k in kinds}
    plain_work: dict[str, list[float]] = {k: [] for k in kinds}
    narrowed_kinds = set()   # (kinds timed on fewer cores than the profile started with: none)
    pending_at = dict.fromkeys(kinds, 0)   # (real steps timed with a drift run to commit: real_commit's only)
    # The rounds' sums after every round (``--profile-state``): a profile cut off goes on from the
    # rounds it finished, where the same kinds of the same suite, LRs and machine kind were timed
    # (a device call's time limit; a resumed profile's rounds may come from another machine of the
    # same kind, as runs resumed with --reuse do).
    key = {"suite": suite.name, "model": suite.model, "seq_len": suite.seq_len, "lr": lr, "ds_arms": ds_arms or {},
           "data": data, "init": init, "kinds": list(kinds), "host": host()}
    state = Path(state_path) if state_path else None
    saved = json.loads(state.read_text()) if state is not None and state.is_file() else None
    done = 0
    if saved is not None and saved["key"] == key and "seconds_rounds" in saved:   # (older states: sums only)
        done = saved["rounds"]
    before = done   # (rounds timed in an earlier sitting)
    if before:
        sec, plain_work, pending_at = saved["seconds_rounds"], saved["plain_work_rounds"], saved["pending_at"]
        settled, narrowed_kinds = saved["settled"], set(saved["narrowed_kinds"])
    while done < reps:
        for name, fn in kinds.items():
            prepare.get(name, lambda: None)()
            if os.sched_getaffinity(0) != cores:
                narrowed_kinds.add(name)
            # (the drift engine's real steps: real_gradient's is another engine's, with no drift run)
            if device is not None and device.pending and name != "real_gradient" and (
                    name in PAIRED_KINDS or name.startswith("partial_")):
                pending_at[name] += 1
            inner[0] = 0.0
            t0 = time.perf_counter()
            fn()
            sec[name].append(time.perf_counter() - t0)
            plain_work[name].append(inner[0])
            if name in ds_features:
                settled[name] += settle_feature(ds_features[name])
        done += 1
        if state is not None:
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "rounds": done, "seconds_rounds": sec,
                                       "plain_work_rounds": plain_work, "pending_at": pending_at,
                                       "settled": settled, "narrowed_kinds": sorted(narrowed_kinds)}))
            os.replace(tmp, state)
    # Each kind's cost in plain steps and its standard error: a hybrid real step over the plain work
    # inside it, any other over the same rounds' plain steps.
    pairs = [k for k in PAIRED_KINDS if k in kinds]
    cost, se = {}, {}
    for k in kinds:
        x = [t / (FEATURE_BLOCK if k in ds_features else 1) for t in sec[k]]
        y = plain_work[k] if k in pairs else sec["plain"]
        cost[k] = sum(x) / sum(y) if sum(y) > 0 else float("nan")
        se[k] = 0.0 if k == "plain" else ratio_se(x, y)
    mean = {k: sum(v) / done / (FEATURE_BLOCK if k in ds_features else 1) for k, v in sec.items()}
    layout = engine._layout
    return {"seconds": mean, "cost": cost, "cost_se": se, "reps": done, "rounds_before": before,
            "unpaired_cost": {k: mean[k] / mean["plain"] for k in pairs},
            # the cores every kind ran on, and a DeepSpeed feature's own where it narrowed them
            "cores": len(cores), "feature_cores": {k: len(v) for k, v in narrowed.items()},
            "narrowed_kinds": sorted(narrowed_kinds),
            # a feature's last update, still running after its block: the mean wait, untimed
            "settled_seconds": {k: v / done for k, v in settled.items()},
            "commits_in": {k: n for k, n in pending_at.items() if n},
            "plain_work_seconds": {k: sum(plain_work[k]) / done for k in pairs},
            "layer_groups": layout.names if layout is not None else [],
            "partial_share": {f"partial_{k}": layout.share_below(k) for k in range(1, layout.max_prefix + 1)}
            if layout is not None else {}}


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-hybrid bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="cpu-small", choices=sorted(SUITES), help="which benchmark")
    p.add_argument("--data", default=None, help="corpus: a text file or directory (default: the suite's)")
    p.add_argument("--model", default=None, help="override the suite's model (e.g. llama-tiny, gpt2-deep)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the suite's seeds (at least 3 "
                   "for a reported result)")
    p.add_argument("--steps", type=int, default=None, help="override the suite's full budget (steps)")
    p.add_argument("--arms", nargs="+", default=None, choices=sorted(ARMS),
                   help="override the suite's systems (baseline is always run)")
    p.add_argument("--budgets", type=float, nargs="+", default=None,
                   help="run every system at these budget fractions (1 is always run; the default arm runs 1 "
                        "only)")
    p.add_argument("--quick", action="store_true", help="a CI-sized smoke run (tiny model, few steps, 2 seeds)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench/SUITE)")
    p.add_argument("--cache", default="runs/bench/cache", help="where pre-trained weights are kept between runs")
    p.add_argument("--readme", action="store_true", help="copy the result to docs/results/ and update docs/benchmarks.md and "
                   "the README's headline")
    p.add_argument("--from-json", default=None, help="regenerate table/README from a saved result.json, no runs")
    p.add_argument("--no-profile", action="store_true", help="skip the step-kind profile (no Full-step equivalents)")
    p.add_argument("--launcher", default=None, choices=bench_launch.LAUNCHERS,
                   help="how each run starts: python (its own process) or deepspeed (the launcher with "
                        "--bind_cores_to_rank; needs numactl) (default: the suite's)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each bound to its own equal share of the cores (default 1). Above 1 "
                        "the runs share the machine's memory bandwidth (and GPU): their seconds are not a clean "
                        "time, and the report reads its ratios from the Full-step equivalents (each step kind "
                        "timed alone, in one process)")
    p.add_argument("--reuse", action="store_true",
                   help="keep finished runs in the output directory whose config and arguments match (times "
                        "then come from different sittings; run the bench alone on a quiet machine)")
    # internal: the profile runs in a child process
    p.add_argument("--profile-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=PROFILE_REPS, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ds-arm", action="append", default=[], help=argparse.SUPPRESS)   # NAME=LR
    p.add_argument("--profile-state", default=None, help=argparse.SUPPRESS)   # the rounds' times, to go on from
    p.add_argument("--kinds", default=None, help=argparse.SUPPRESS)   # comma-separated: time only these
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p


def resolve_suite(args) -> Suite:
    suite = SUITES[args.suite]
    if args.quick:
        suite = replace(suite, **QUICK, pretrain_steps=min(suite.pretrain_steps, 20))
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
    if args.arms:
        suite = replace(suite, arms=tuple(dict.fromkeys(["baseline", *args.arms])))
    if args.budgets:
        bad = [b for b in args.budgets if not 0 < b <= 4]
        if bad:
            raise SystemExit(f"--budgets: fractions of the suite's steps in (0, 4], got {bad}")
        suite = replace(suite, budgets=tuple(sorted(set(args.budgets) | {1.0})), budgets_for_all=True)
    if getattr(args, "seq_len", None):
        suite = replace(suite, seq_len=args.seq_len)
    if getattr(args, "launcher", None):
        suite = replace(suite, launcher=args.launcher)
    return suite


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.profile_worker:
        suite = resolve_suite(argparse.Namespace(**{**vars(args), "suite": args.profile_worker, "quick": False,
                                                    "arms": None, "budgets": None}))
        ds_arms = {name: float(lr) for name, lr in (a.split("=", 1) for a in args.ds_arm)}
        wanted = set(args.kinds.split(",")) if args.kinds else None
        print(json.dumps(_profile_worker(suite, args.lr, args.reps, args.data, args.init, ds_arms,
                                         args.profile_state, wanted)))
        return None
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result["json_path"] = args.from_json
        png = Path(args.from_json).with_suffix(".png")
        result["png_path"] = str(png) if png.is_file() else result.get("png_path")
        print(report.markdown(result))
        if args.readme:
            print("updated", *report.update_readme(result, REPO_ROOT))
        return result

    suite = resolve_suite(args)
    if args.readme and (why := report.not_reportable(suite.seeds, args.quick)):
        raise SystemExit(f"--readme: {why}")   # (before any run, not after them)
    if suite.needs_gpu:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"--suite {suite.name}: needs a CUDA GPU (this machine has none)")
    bench_launch.check(suite.launcher, args.jobs)
    bench_launch.core_slots(args.jobs)   # (refuses more jobs than cores before anything runs)
    data = resolve_data(args.data or suite.data)
    out = Path(args.out or f"runs/bench/{suite.name}" + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    live = sys.stderr.isatty()
    print(f"ds-hybrid bench {suite.name}: {suite.doc}", flush=True)
    raw = plan_and_run(suite, out, data, live, args.reuse, args.quick, Path(args.cache), args.jobs)
    profile = None
    if not args.no_profile:
        print("profiling the step kinds ...", flush=True)
        ds_arms = feature_lrs(suite.arms, raw)
        # (--reuse: a profile cut off goes on from its finished rounds; without it, a new one)
        state = out / "profile-state.json"
        if not args.reuse:
            state.unlink(missing_ok=True)
        profile = profile_steps(suite, raw["best_lr"], data, raw["init"], reps=3 if args.quick else PROFILE_REPS,
                                ds_arms=ds_arms, state=state, kinds=kinds_needed(raw["rows"]))
    analysis = analyse(raw, profile)
    result = {
        "suite": {**asdict(suite), "seeds": list(suite.seeds), "lr_multipliers": list(suite.lr_multipliers),
                  "budgets": list(suite.budgets), "arms": list(suite.arms)},
        "arms": {a: asdict(ARMS[a]) for a in suite.arms},
        "command": "ds-hybrid bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick, "data": data, "init": raw["init"],
        "sweep": raw["sweep"], "best_lr_multiplier": raw["best_lr_multiplier"], "best_lr": raw["best_lr"],
        "sweep_tie_break": raw["sweep_tie_break"], "own_lr": raw["own_lr"], "analysis": analysis, "profile": profile, "bench_seconds": raw["bench_seconds"], "errors": raw["errors"],
        "reused_runs": raw["reused_runs"], "jobs": raw["jobs"],
        "host": host(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": {arm: {seed: {b: report.slim_row(r) for b, r in by_b.items()} for seed, by_b in by_seed.items()}
                 for arm, by_seed in raw["rows"].items()},
    }
    json_path, png_path, md_path = out / "result.json", out / "frontier.png", out / "result.md"
    report.plot(result, png_path)
    result["json_path"], result["png_path"] = str(json_path), str(png_path)
    json_path.write_text(json.dumps(result, indent=2))
    md_path.write_text(report.markdown(result) + "\n")
    print(report.markdown(result))
    print(f"wrote {json_path}, {md_path}, {png_path}")
    if args.readme:
        print("updated", *report.update_readme(result, REPO_ROOT))
    return result


def host() -> str:
    """The machine a result (or a profile's rounds) was timed on: its CPU cores and GPU."""
    try:
        import torch
        gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    except Exception:
        gpu = ""
    return f"{platform.machine()} {os.cpu_count()} CPU cores{gpu}"


if __name__ == "__main__":
    main()
