"""The bench's step-kind profile: each kind of step timed alone, in plain DeepSpeed steps, and a
run's cost in Full-step equivalents read from it.

A run's seconds depend on what else the machine did meanwhile (``--jobs``: other runs beside
it); its steps' kinds (``compare.step_kinds``: a plain step, a hybrid real step, a partial step,
a drift or gradient Predict step, a run's first step, a commit) do not. ``profile_steps`` times
every kind a suite's runs took, round robin in one process started as the runs are
(``python -m ds_hybrid.bench_profile``, ``worker``), each over the same rounds' plain steps or the
plain work inside it; ``cost_of`` turns a run's step kinds into its cost.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from . import bench_launch
from . import bench_report as report
from . import frontier as fr
from .bench_arms import ARMS, GRADIENT, GROUPS, WHOLE, arm_config, deep_merge, with_changes
from .bench_suites import SUITES, Suite
from .dist_env import child_env


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


# Step kinds that run plain DeepSpeed's whole forward, backward and step plus the hybrid's work:
# costed by their time over the plain work inside the same steps (worker).
PAIRED_KINDS = ("real", "real_idle", "real_groups", "real_gradient", "real_commit")
# Rounds of the profile. Two 20-round profiles of the same runs differed by up to 3% in a kind's
# cost: as much as the hybrid's real-step overhead it measures. Twice the rounds halve the variance.
# (Not fewer where the rounds agree: four 40-round profiles of offload-b64 in a row put one kind at
# 0.222-0.241 of a plain step with standard errors of 0.002-0.004, benchmarks/profile_sittings.py: a
# kind's standard error is a floor on how well it is known, not a measure of it.)
PROFILE_REPS = 40
FEATURE_BLOCK = 8   # consecutive steps of a DeepSpeed feature (ZenFlow) per round: two of its update intervals
FEATURE_LEAD = 4    # its untimed steps before them: the block's first boundary waits on an update 4 steps old


def settle_feature(eng, quiet: float = 0.1, poll: float = 0.02, limit: float = 10.0) -> float:
    """Untimed, after a DeepSpeed feature's block: wait until ZenFlow's overlapped optimizer
    process (its last update still running, to be waited on at the next update boundary) has
    been idle for ``quiet`` seconds, its CPU time unchanged at every ``poll`` in between, so that
    its update does not run beside the next kind's steps. (``quiet`` spans several of the kernel's
    10 ms ticks and polls: on a loaded machine a busy process can go a tick or three unscheduled,
    which a single 30 ms look took for idle.) Returns the seconds waited (0.0 where there is no
    such process)."""
    proc = getattr(getattr(eng, "optimizer", None), "process", None)
    if proc is None or not proc.is_alive():
        return 0.0
    import psutil   # (a DeepSpeed dependency)
    worker, t0 = psutil.Process(proc.pid), time.perf_counter()

    def cpu() -> float:
        t = worker.cpu_times()
        return t.user + t.system
    last, changed = cpu(), t0
    while time.perf_counter() - t0 < limit:
        time.sleep(poll)
        now = cpu()
        if now != last:
            last, changed = now, time.perf_counter()
        elif time.perf_counter() - changed >= quiet:
            break
    return max(0.0, changed - t0)


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
                  kinds: Iterable[str] | None = None, ds_changes: dict | None = None) -> dict:
    """Mean time of each step kind, measured in one process (a subprocess: its own world of 1).
    ``ds_arms``: the suite's DeepSpeed features (ZenFlow) and the LR each runs at, whose steps are
    timed too, each as a kind of its own name: their steps are not plain DeepSpeed's. ``state``:
    a file the rounds' times are kept in after every round, from which a profile cut off (a device
    call's time limit) goes on (``worker``). ``kinds``: time only these (``kinds_needed``:
    the ones the suite's runs took; None: every kind this layout has), and each of ``ds_arms``.
    ``ds_changes``: the kinds of a hybrid arm that runs on a changed DeepSpeed config
    (``Arm.ds_changes``), timed on that config, each costed in the suite's plain steps (``worker``)."""
    args = ["--suite", suite.name, "--lr", repr(lr), "--reps", str(reps), "--model", suite.model,
            "--seq-len", str(suite.seq_len)]
    if kinds is not None:
        args += ["--kinds", ",".join(sorted(kinds))]
    if ds_changes:
        args += ["--ds-changes", json.dumps(ds_changes, sort_keys=True)]
    if state is not None:
        args += ["--profile-state", str(state)]
    for name, arm_lr in (ds_arms or {}).items():
        args += ["--ds-arm", f"{name}={arm_lr!r}"]
    if data:
        args += ["--data", data]
    if init:
        args += ["--init", init]
    # Started as the suite's runs are (the same core binding), so its costs are theirs.
    proc = subprocess.run(bench_launch.command(suite.launcher, "ds_hybrid.bench_profile", args), capture_output=True,
                          text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench profile failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    # The worker prints its result as one JSON line; the launcher logs after it.
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def worker(suite: Suite, lr: float, reps: int, data: str | None, init: str | None,
           ds_arms: dict[str, float] | None = None, state_path: str | None = None,
           wanted: set[str] | None = None, ds_changes: dict | None = None) -> dict:
    """Times each step kind, round robin (``profile_steps``). With ``ds_changes`` every engine is
    built on the suite's config with those changes (a hybrid arm's own, ``Arm.ds_changes``), and
    one more, the suite's own plain step (kind ``suite_plain``), is the unit its kinds are costed
    in, timed in the same rounds: so that a run on the changed config is priced in the same plain
    steps as the suite's other runs (its ``plain`` is then the changed config's plain step)."""
    import torch
    from . import initialize
    from .data import ByteDataset, train_batches
    from .engine import default_loss
    from .grad_recompute import Recompute
    from .models import build_model, layer_groups
    from .phases import Phase
    from .dist_env import ensure_distributed_env
    from .arguments import resolve_config
    from .train import apply_lr, enable_checkpointing, load_init_weights, quiet_logs

    ensure_distributed_env()
    quiet_logs(False)
    # (the cores this process was started on: every kind but a DeepSpeed feature's runs on them)
    cores, omp_threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    preset, _ = resolve_config(suite.config)
    suite_cfg = deep_merge(preset, suite.overrides)
    apply_lr(suite_cfg, lr)
    cfg = deep_merge(suite_cfg, ds_changes) if ds_changes else suite_cfg
    runs_section = json.loads(json.dumps(cfg.get("hybrid_predict", {})))   # (the section a --baseline run turns off)
    # Layer-group Predict (the partial kinds) needs ZeRO 0-2; on ZeRO 3 the whole-model kinds only.
    groups = int((cfg.get("zero_optimization") or {}).get("stage", 0) or 0) < 3
    if groups:
        cfg["hybrid_predict"] = with_changes(GROUPS, whole_model=True, warmup_steps=5, full_steps=10**6,
                                             confidence_threshold=0.0, check="next_step",
                                             group_predict__refresh_every=10**6, group_predict__min_gain=0.0)
    else:
        cfg["hybrid_predict"] = with_changes(WHOLE, warmup_steps=5, full_steps=10**6)
    def built(make_engine: Callable, config: dict):   # (every engine from the same weights)
        torch.manual_seed(0)
        m = build_model(suite.model, vocab_size=256, seq_len=suite.seq_len)
        if init:
            load_init_weights(m, init)
        if "activation_checkpointing" in config:   # (as train builds its runs' models: each block recomputed)
            enable_checkpointing(m)
        return make_engine(model=m, model_parameters=layer_groups(m, suite.layer_groups), config=config)[0]
    engine = built(initialize, cfg)
    # On a changed config (ds_changes): the suite's own plain step beside its kinds, the unit they are costed in
    unit_engine = built(initialize, dict(suite_cfg, hybrid_predict=cfg["hybrid_predict"])) if ds_changes else None
    # DeepSpeed's own engine beside it (no ds_hybrid code): how far the unit, the bench's plain
    # DeepSpeed step (the hybrid's engine with the hybrid off: its non-finite guard included), is from it.
    import deepspeed
    plain_cfg = {k: v for k, v in cfg.items() if k != "hybrid_predict"}
    ds_engine = built(deepspeed.initialize, plain_cfg)
    # Each DeepSpeed feature among the arms (ZenFlow, plain without the recompute), built as its runs
    # are (``train --baseline``: the hybrid's engine with its section turned off, stepped by
    # ``train_step``; DeepSpeed's own engine, the ``deepspeed`` kind, was 2-3% faster on offload-preset-fp32),
    # at its own LR.
    ds_features = {}
    for name, arm_lr in (ds_arms or {}).items():
        feature_cfg = arm_config(dict(plain_cfg, hybrid_predict=dict(runs_section, enabled=False)), ARMS[name],
                                 quick=False)[0]
        apply_lr(feature_cfg, arm_lr)
        ds_features[name] = built(initialize, feature_cfg)
    # The micro-batches of one of its steps: the accumulation (8 on offload-preset-fp32 without the
    # recompute), except under ZenFlow, which makes every micro-batch a step (``batches_per_step``).
    feature_gas = {name: e.batches_per_step() for name, e in ds_features.items()}
    train, _ = ByteDataset.load(data).split(seq_len=suite.seq_len)
    stream = train_batches(train, suite.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    gas = engine.gradient_accumulation_steps()
    dev = engine.device

    def batches():
        return [{k: v.to(dev) for k, v in next(stream).items()} for _ in range(gas)]

    # A feature's steps take the suite's batch at its own micro-batch size, one optimizer step a
    # micro-batch (ZenFlow: the whole batch in one, as arm_config builds its runs).
    feature_streams = {name: train_batches(train, suite.seq_len, e.train_micro_batch_size_per_gpu(), seed=0)
                       for name, e in ds_features.items()}

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
                eng.train_step([{k: v.to(dev) for k, v in next(feature_streams[name]).items()}
                                for _ in range(feature_gas[name])])
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
             **({"suite_plain": lambda: unit_engine._real_step(batches(), default_loss)} if unit_engine else {}),
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
        # its backward recomputes the checkpointed blocks or not as the runs' does
        # (predictor.gradient_checkpointing, set up as the engine sets up its own)
        gradient.recompute = Recompute(engine.hybrid_config.predictor.gradient_checkpointing, engine.module,
                                       engine._max_over_ranks)
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
        grad_cfg = dict(json.loads(json.dumps(cfg)), hybrid_predict=with_changes(GRADIENT, warmup_steps=5, full_steps=10**6))
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
        kinds = {k: fn for k, fn in kinds.items() if k in wanted or k in ds_features or k == "suite_plain"}
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
           "data": data, "init": init, "kinds": list(kinds), "host": bench_launch.host(),
           **({"ds_changes": ds_changes} if ds_changes else {}),
           # (the features' steps timed on the engine their runs took; older states: DeepSpeed's own)
           **({"ds_arms_engine": "ds_hybrid"} if ds_arms else {})}
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
    # inside it, any other over the same rounds' plain steps. On a changed config, in the suite's
    # plain steps: a real step's over the plain work inside it times the changed config's plain step
    # over the suite's (the two errors combined as independent: the delta method's first order).
    unit = "suite_plain" if unit_engine else "plain"
    pairs = [k for k in PAIRED_KINDS if k in kinds]
    cost, se = {}, {}
    for k in kinds:
        x = [t / (FEATURE_BLOCK if k in ds_features else 1) for t in sec[k]]
        y = plain_work[k] if k in pairs else sec[unit]
        cost[k] = sum(x) / sum(y) if sum(y) > 0 else float("nan")
        se[k] = 0.0 if k == unit else ratio_se(x, y)
    if unit_engine:
        for k in pairs:
            a, sa, b, sb = cost[k], se[k], cost["plain"], se["plain"]
            cost[k] = a * b
            se[k] = math.hypot(a * sb, b * sa) if sa is not None and sb is not None else None
    mean = {k: sum(v) / done / (FEATURE_BLOCK if k in ds_features else 1) for k, v in sec.items()}
    layout = engine._layout
    return {"seconds": mean, "cost": cost, "cost_se": se, "reps": done, "rounds_before": before,
            "ds_changes": ds_changes or None,
            "unpaired_cost": {k: mean[k] / mean[unit] for k in pairs},
            # the cores every kind ran on, and a DeepSpeed feature's own where it narrowed them
            "cores": len(cores), "feature_cores": {k: len(v) for k, v in narrowed.items()},
            "feature_engine": "ds_hybrid",   # (the features' steps on the engine their runs took: train_step)
            "narrowed_kinds": sorted(narrowed_kinds),
            # a feature's last update, still running after its block: the mean wait, untimed
            "settled_seconds": {k: v / done for k, v in settled.items()},
            # the sequences a feature's optimizer step took (the suite's batch: ZenFlow's in one micro-batch)
            "feature_batch": {k: e.train_micro_batch_size_per_gpu() * feature_gas[k] for k, e in ds_features.items()},
            "batch": engine.train_micro_batch_size_per_gpu() * gas,
            # the gradient Predict steps' recompute decisions (predictor.gradient_checkpointing), as a run reports them
            "gradient_recompute": gradient.recompute.statistics() if gradient is not None else None,
            "commits_in": {k: n for k, n in pending_at.items() if n},
            "plain_work_seconds": {k: sum(plain_work[k]) / done for k in pairs},
            "layer_groups": layout.names if layout is not None else [],
            "partial_share": {f"partial_{k}": layout.share_below(k) for k in range(1, layout.max_prefix + 1)}
            if layout is not None else {}}


def main(argv: list[str] | None = None) -> None:
    """The profile's own process (``profile_steps`` starts it): prints the profile as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m ds_hybrid.bench_profile", description=main.__doc__)
    p.add_argument("--suite", required=True, choices=sorted(SUITES), help="the suite whose steps are timed")
    p.add_argument("--model", required=True, help="its model (the suite's, or the bench's --model)")
    p.add_argument("--seq-len", type=int, required=True, help="its sequence length")
    p.add_argument("--lr", type=float, required=True, help="the LR plain DeepSpeed's runs took")
    p.add_argument("--reps", type=int, default=PROFILE_REPS, help="rounds")
    p.add_argument("--data", default=None, help="the corpus the runs read")
    p.add_argument("--init", default=None, help="the weights the runs started from")
    p.add_argument("--ds-arm", action="append", default=[], help="NAME=LR: a DeepSpeed feature's steps, at its LR")
    p.add_argument("--profile-state", default=None, help="the rounds' times, kept after every round, to go on from")
    p.add_argument("--kinds", default=None, help="comma-separated: time only these kinds")
    p.add_argument("--ds-changes", default=None, type=json.loads,
                   help="JSON: changes to the suite's DeepSpeed config (a hybrid arm's ds_changes; null removes a key)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # (the launcher's)
    args = p.parse_args(argv)
    suite = replace(SUITES[args.suite], model=args.model, seq_len=args.seq_len)
    ds_arms = {name: float(lr) for name, lr in (a.split("=", 1) for a in args.ds_arm)}
    wanted = set(args.kinds.split(",")) if args.kinds else None
    print(json.dumps(worker(suite, args.lr, args.reps, args.data, args.init, ds_arms, args.profile_state, wanted,
                            args.ds_changes)))


if __name__ == "__main__":
    main()
