"""``ds-hybrid bench``: time to a target validation loss on a budget frontier, hybrid against plain DeepSpeed.

One invocation runs, on the same model, data, seeds and machine:

1. plain DeepSpeed (``hybrid_predict.enabled: false``) at each learning-rate multiplier of a
   sweep at the full budget on the first seed (the sweep is extended while its best is at an
   edge); the best final validation loss picks the LR every run then uses, and where other LRs
   are within ``SWEEP_TIE`` of it, they all run on every seed and the best mean picks;
2. for every seed and every step budget (fractions of the suite's steps, each with its own full
   warmup-cosine schedule), one run of each system ("arm"): plain DeepSpeed and the hybrid
   variants, interleaved, so that machine noise hits them alike;
3. a profile of every step kind the runs took (a plain step, a hybrid real step, partial steps,
   Predict steps) in one process, which turns each run's steps into Full-step equivalents
   (``bench_profile``).

The systems are ``bench_arms``'s, the suites ``bench_suites``'s.

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
from .bench_arms import ARMS, Arm, arm_config, deep_merge
from .arguments import REPO_ROOT
from .bench_launch import host
from .bench_profile import PROFILE_REPS, eq_curve, feature_lrs, kinds_needed, own_kind, profile_steps, shifted_profile
from .bench_suites import SUITES, Suite
from .compare import backward_share, load_run
from .dist_env import child_env

TARGETS = {"target": 0.0, "target+1%": 0.01, "target+2%": 0.02}
SWEEP_TIE = 0.01   # LRs whose final loss on the sweep's seed is within 1% of the best's are run on every seed



QUICK = dict(model="gpt2-test", steps=40, seq_len=32, seeds=(1, 2), lr_multipliers=(1.0, 2.0), eval_every=10,
             val_batches=2, budgets=(0.75, 1.0, 1.25))


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

def on_changed_config(arm: str) -> bool:
    """Whether an arm's runs ran a hybrid on a changed DeepSpeed config (``Arm.ds_changes``), whose
    kinds the suite's profile did not time (``elsewhere_profiles`` times them)."""
    return arm in ARMS and bool(ARMS[arm].ds_changes)


def arm_profile(profile: dict | None, arm: str) -> dict | None:
    """The profile an arm's steps are priced from: the suite's, or for a hybrid arm on a changed
    DeepSpeed config the one timed on that config (its kinds in the suite's plain steps; None where
    there is none: that arm's Full-step equivalents are left out, not priced at the suite's)."""
    if not on_changed_config(arm):
        return profile
    return ((profile or {}).get("elsewhere") or {}).get(arm)


def elsewhere_profiles(suite: Suite, raw: dict, data: str | None, out: Path, reuse: bool, reps: int) -> dict:
    """For each DeepSpeed config a hybrid arm changed (``Arm.ds_changes``), a profile of the kinds its
    runs took, timed on that config beside the suite's plain step (``bench_profile.worker``): by arm
    name (arms that share a config share its profile)."""
    by_changes: dict[str, list[str]] = {}
    for arm in raw["rows"]:
        if on_changed_config(arm):
            by_changes.setdefault(json.dumps(ARMS[arm].ds_changes, sort_keys=True), []).append(arm)
    profiles = {}
    for changes, arms in by_changes.items():
        state = out / f"profile-state-{arms[0]}.json"   # (--reuse: goes on from its finished rounds)
        if not reuse:
            state.unlink(missing_ok=True)
        print(f"profiling the step kinds of {', '.join(arms)} on its DeepSpeed config ...", flush=True)
        prof = profile_steps(suite, raw["best_lr"], data, raw["init"], reps=reps, state=state,
                             kinds=kinds_needed({a: raw["rows"][a] for a in arms}), ds_changes=json.loads(changes))
        profiles.update(dict.fromkeys(arms, prof))
    return profiles


def profile_band(raw: dict, arm: str, targets: dict, profile: dict) -> dict:
    """The arm's mean ratio in Full-step equivalents at each target with every kind's cost one
    standard error lower and higher, [low, high]: the uncertainty within the profile's rounds, the
    seeds' aside (a floor: profiles of other sittings differ by more, ``PROFILE_REPS``)."""
    base, own, band = raw["rows"]["baseline"], own_kind(arm, profile), {t: [] for t in TARGETS}
    for sign in (-1, 1):
        prof, vals = shifted_profile(profile, sign), {t: [] for t in TARGETS}
        own_prof = shifted_profile(arm_profile(profile, arm), sign)   # (the suite's, or its config's)
        for seed, by_budget in raw["rows"][arm].items():
            if seed not in targets:
                continue
            arm_runs = [{**r, "eq_curve": eq_curve(r, own, own_prof)} for r in by_budget.values()]
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
        # (a hybrid arm on another DeepSpeed config, ARMS' ds_changes: priced from its kinds timed
        # on that config; not at all where the profile has none, not at the suite's)
        prof = arm_profile(profile, arm)
        for by_budget in rows.values():
            for row in by_budget.values():
                row["eq_curve"] = [] if on_changed_config(arm) and prof is None else eq_curve(row, own, prof)
                row["eq_total"] = row["eq_curve"][-1][0] if row["eq_curve"] else None
                # The optimizer steps (the CPU Adam steps under ZeRO-Offload): every step but a Predict step.
                row["opt_curve"] = fr.step_costs_curve(row["val_points"], [0.0 if k.startswith("predict") else 1.0
                                                                           for k in row["step_kinds"]])
                # The sequences whose gradient each step took (its share of the batch): whether the
                # steps to the target were worth more, or only cost less, than plain's per sequence.
                row["seq_curve"] = fr.step_costs_curve(row["val_points"],
                                                       [backward_share(k) for k in row["step_kinds"]])
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
                "sequences": fr.ratios(arm_runs, base_runs, targets, "seq_curve"),
                "full_budget": None if full is None else {
                    "final_val_loss": full["final_val_loss"], "baseline_final_val_loss": bfull["final_val_loss"],
                    "final_gap_pct": 100 * (full["final_val_loss"] - bfull["final_val_loss"]) / bfull["final_val_loss"],
                    "time_ratio": full["train_seconds"] / bfull["train_seconds"],
                    "equivalents_ratio": full["eq_total"] / bfull["eq_total"]
                    if bfull.get("eq_total") and full["eq_total"] is not None else None,
                    "backward_skipped": st.get("backward_skipped", 0),
                    "partial_backward": st.get("partial_backward", 0),
                    "backward_skipped_equivalent": st.get("backward_skipped_equivalent", st.get("backward_skipped", 0)),
                    "steps": full["steps"], "predicted_pct": full["predicted_pct"],
                    "predict_accepted": st.get("predict_accepted"), "predict_rolled_back": st.get("predict_rolled_back"),
                    "predicted_update_rolled_back": st.get("predicted_update_rolled_back", 0),
                    "peak_rss_mb": full.get("peak_rss_mb"), "baseline_peak_rss_mb": bfull.get("peak_rss_mb")},
            }
        agg = {}
        for unit in ("seconds", "equivalents", "optimizer_steps", "sequences"):
            agg[unit] = {}
            for t in TARGETS:
                vals = [p[unit][t]["ratio"] for p in per_seed.values() if unit in p]   # (older results: no such unit)
                agg[unit][t] = dict(fr.mean_spread(vals), reached=sum(v is not None for v in vals), seeds=len(vals))
        if profile and profile.get("cost_se") and (arm_profile(profile, arm) or {}).get("cost_se"):
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
    if args.launcher:
        suite = replace(suite, launcher=args.launcher)
    return suite


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
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
        reps = 3 if args.quick else PROFILE_REPS
        suites_own = {a: rows for a, rows in raw["rows"].items() if not on_changed_config(a)}
        profile = profile_steps(suite, raw["best_lr"], data, raw["init"], reps=reps, ds_arms=ds_arms, state=state,
                                kinds=kinds_needed(suites_own))
        profile["elsewhere"] = elsewhere_profiles(suite, raw, data, out, args.reuse, reps) or None
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


if __name__ == "__main__":
    main()
