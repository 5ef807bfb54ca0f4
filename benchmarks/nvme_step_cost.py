"""What a gradient (or drift) Predict step costs under ZeRO-Infinity's NVMe optimizer offload, and
what the host path would cost instead, in plain DeepSpeed steps of the same layout.

ZeRO 3 with ``offload_optimizer: nvme`` (the masters and Adam state swapped to NVMe a sub-group
at a time; the 16-bit parameters in memory), ``tiny-cpu``'s optimizer and schedule, one process,
four engines built from the same weights, each with its own swap folder, stepped round robin on
the same batches so that the machine's drift falls on all of them alike:

* ``plain``: plain DeepSpeed (the hybrid's engine with ``hybrid_predict.enabled: false``);
* ``device``: the hybrid, ``predictor.direction: gradient`` on the device path
  (``memory.offload_predict: auto`` takes it here: the masters swap); the real step before a run
  makes the run's copies of the moments inside its DeepSpeed step (``memory.gradient_prefetch``);
* ``device-noprefetch``: the same with ``memory.gradient_prefetch: false``: the run's first step
  swaps every sub-group in (and out) for those copies;
* ``host``: the same on the host path (``offload_predict: host``: each Predict step moves the
  masters, so swaps every sub-group in and out);
* ``plain-cpu``: plain DeepSpeed with ``offload_optimizer: cpu``: what the swap adds to a step.
* ``drift``: the hybrid with the drift direction (an int8 velocity, no backward) on the device
  path, the 7b-24gb-nvme preset's section: its Predict steps swap nothing, a kept run's commit
  goes into DeepSpeed's step (``zero_access.StepJobs``), and so does each real step's fold
  (``memory.fold_in_step``, ``swap_fold.py``);
* ``drift-after``: the same with ``memory.fold_in_step: false``: the fold after DeepSpeed's step,
  which swaps every sub-group in again to read the masters and moments it left;
* ``drift-host``: the drift direction on the host path (``offload_predict: host``): each Predict
  step adds to the masters (every sub-group swapped in and out) and propagates them (again), and
  each run starts with a snapshot of the masters in host memory.

``--params-on nvme``: the 16-bit parameters on NVMe too (``offload_param: nvme``, ``max_in_cpu: 0``:
the 50b-24gb-nvme preset's layout; ``plain-cpu`` keeps its optimizer in host memory and its
parameters on NVMe), where the device path reads each sub-group's 16-bit partitions from the drive
at a Predict step and writes them back, in bf16 (as the preset), for either direction (the gradient
step's Adam step there, from the run's moments beside them). DeepSpeed swaps a parameter of
1 MiB and up only, so use a model with matrices that big: ``--model llama-tiny --model-set hidden_size=384
intermediate_size=1536 num_hidden_layers=2``.

The hybrid engines run 1 real step and 3 Predict steps in turn (``check: next_step``, every run
kept). Each step is timed whole (``train_step``) and booked by kind: a real step after a run
(DeepSpeed's step plus the run's commit), a run's first Predict step (its copies of the moments)
and its later ones. DeepSpeed's swapper is counted too: sub-groups swapped in per step kind. A
kind's cost is its mean time over ``plain``'s mean time in the same sitting; ``--sittings``
repeats the whole measurement on fresh engines (other batches) for the spread.

    .venv/bin/python benchmarks/nvme_step_cost.py --out runs/nvme-step-cost [--micro-batch 16]
        [--steps 40] [--sittings 3] [--model gpt2-tiny] [--seq-len 128] [--batch-fraction 1.0]
        [--swap-dir DIR] [--engines plain device device-noprefetch host plain-cpu drift drift-after drift-host]
        [--params-on memory|nvme] [--model-set KEY=VALUE ...]

Writes ``<out>/nvme_step_cost.json`` and prints a table. Times are this machine's (DeepSpeed's
CPU accelerator here): ratios only; a GPU's are owed (docs/offload.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

AIO = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
ENGINES = ("plain", "device", "device-noprefetch", "host", "plain-cpu", "drift", "drift-after", "drift-host")


def _config(name: str, swap: str, micro: int, fraction: float, params_on: str = "memory") -> dict:
    from ds_hybrid.arguments import resolve_config
    cfg, _ = resolve_config("tiny-cpu")
    cfg["train_micro_batch_size_per_gpu"] = micro
    device = "cpu" if name == "plain-cpu" else "nvme"
    cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": device, **(
        {"nvme_path": swap} if device == "nvme" else {})}}
    if device == "nvme" or params_on == "nvme":
        cfg["aio"] = dict(AIO)
    if params_on == "nvme":   # (all of them: 50b-24gb-nvme's max_in_cpu; buffers for the bench's models)
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0,
                                                     "buffer_count": 6, "buffer_size": 2_000_000}
        # bf16 as the preset (with fp32 weights on CPU DeepSpeed 0.19.8 swaps a parameter in as bf16
        # and the forward's matmul fails on the mixed dtypes)
        cfg["bf16"] = {"enabled": True}
    if name.startswith("plain"):
        cfg["hybrid_predict"] = dict(cfg["hybrid_predict"], enabled=False)
        return cfg
    drift = name.startswith("drift")
    cfg["hybrid_predict"] = {
        "enabled": True, "warmup_steps": 4, "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3,
        "confidence_threshold": 0.0, "correction_steps": 0, "check": "next_step",
        # (every run kept: the costs of a kept run's steps are what is measured here)
        "divergence": {"rel_tolerance": 10.0, "z_threshold": 1e6, "max_loss_ratio": 1e6},
        "predictor": ({"direction": "drift"} if drift else
                      {"direction": "gradient", "gradient_batch_fraction": fraction}),
        "memory": ({"velocity_dtype": "int8", "offload_predict": "host" if name == "drift-host" else "auto",
                    "fold_in_step": name != "drift-after"} if drift
                   else {"offload_predict": "host"} if name == "host"
                   else {"offload_predict": "auto", "gradient_prefetch": name == "device"}),
        "dynamics": {"progress_every": 0}}
    return cfg


def sitting(args, seed: int, swap_root: Path) -> dict:
    """One sitting: fresh engines, ``args.steps`` round-robin steps each; per engine and step kind
    the step times (s) and the sub-groups swapped in."""
    import torch
    import ds_hybrid
    from ds_hybrid.data import ByteDataset, train_batches
    from ds_hybrid.models import build_model

    engines = {}
    for name in args.engines:
        torch.manual_seed(0)
        model = build_model(args.model, vocab_size=256, seq_len=args.seq_len, **args.model_overrides)
        cfg = _config(name, str(swap_root / f"swap-{seed}-{name}"), args.micro_batch, args.batch_fraction,
                      args.params_on)
        engines[name] = ds_hybrid.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    swaps = {name: [0] for name in engines}
    for name, eng in engines.items():
        opt = eng.optimizer
        if getattr(opt, "swap_optimizer", False):
            swap_in = opt._optimizer_states_and_gradient_swap_in

            def counted(*a, _in=swap_in, _n=swaps[name], **k):
                _n[0] += 1
                return _in(*a, **k)
            opt._optimizer_states_and_gradient_swap_in = counted
    train, _ = ByteDataset.load(None).split(seq_len=args.seq_len)
    stream = train_batches(train, args.seq_len, args.micro_batch, seed=seed)
    out = {name: {} for name in engines}
    warm = 8   # (Adam state exists, the hybrid past its warmup and one whole cycle)
    device = next(iter(engines.values())).device
    last = {name: None for name in engines}   # each engine's phase at its previous step
    for k in range(warm + args.steps):
        batch = [{key: v.to(device) for key, v in next(stream).items()}]
        for name, eng in engines.items():
            phase_before = eng.phase.value
            first = phase_before == "predict" and last[name] != "predict"
            swaps[name][0] = 0
            t0 = time.perf_counter()
            eng.train_step(batch)
            dt = time.perf_counter() - t0
            after_run = phase_before != "predict" and last[name] == "predict"
            last[name] = phase_before
            if k < warm:
                continue
            kind = ("predict_first" if first else "predict") if phase_before == "predict" else (
                "real_after_run" if after_run else "real")
            row = out[name].setdefault(kind, {"seconds": [], "swapped_in": []})
            row["seconds"].append(dt)
            row["swapped_in"].append(swaps[name][0])
    for name, eng in engines.items():
        st = eng.statistics() if not name.startswith("plain") else {}
        if st:
            out[name]["_accepted"] = st.get("predict_accepted")
            out[name]["_rolled_back"] = st.get("predict_rolled_back")
            out[name]["_offload_predict"] = st.get("offload_predict")
    engines.clear()
    for name in args.engines:   # (a sitting's NVMe state is not kept: about 16 GB an engine at 1B)
        shutil.rmtree(swap_root / f"swap-{seed}-{name}", ignore_errors=True)
    return out


def summarize(sittings: list[dict]) -> dict:
    """Per engine and kind: mean seconds, cost over the same sitting's plain NVMe step (mean and
    std over sittings) and the sub-groups swapped in per step."""
    table: dict = {}
    for name in sittings[0]:
        kinds = sorted({k for s in sittings for k in s[name] if not k.startswith("_")})
        for kind in kinds:
            costs = [statistics.fmean(s[name][kind]["seconds"]) / statistics.fmean(s["plain"]["real"]["seconds"])
                     for s in sittings if kind in s[name]]
            swapped = [n for s in sittings if kind in s[name] for n in s[name][kind]["swapped_in"]]
            table[f"{name}:{kind}"] = {
                "cost_mean": statistics.fmean(costs), "cost_std": statistics.stdev(costs) if len(costs) > 1 else 0.0,
                "ms_mean": 1000 * statistics.fmean(x for s in sittings if kind in s[name]
                                                   for x in s[name][kind]["seconds"]),
                "swapped_in_per_step": statistics.fmean(swapped) if swapped else 0.0,
                "steps": len(swapped)}
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder: the JSON (and the swap folders, unless --swap-dir)")
    p.add_argument("--swap-dir", default=None, help="where the NVMe engines swap (default: under --out)")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences a step (tiny-cpu's 16)")
    p.add_argument("--batch-fraction", type=float, default=1.0, help="predictor.gradient_batch_fraction")
    p.add_argument("--steps", type=int, default=40, help="timed steps per engine and sitting")
    p.add_argument("--sittings", type=int, default=3)
    p.add_argument("--params-on", choices=["memory", "nvme"], default="memory",
                   help="the 16-bit parameters: in memory (7b-24gb-nvme's layout) or on NVMe (50b-24gb-nvme's)")
    p.add_argument("--model-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="the model config's own keys (integers), e.g. hidden_size=384")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                   help="which engines to build (plain, the unit, always); fewer for a model whose swap fills the disk")
    args = p.parse_args(argv)
    if "plain" not in args.engines:
        p.error("--engines: plain is the unit every cost is read in; keep it")
    try:
        args.model_overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.model_set)}
    except ValueError:
        p.error(f"--model-set: KEY=VALUE with an integer value each, got {args.model_set}")
    from ds_hybrid.dist_env import ensure_distributed_env
    from ds_hybrid.train import quiet_logs
    ensure_distributed_env()
    quiet_logs(False)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    swap_root = Path(args.swap_dir) if args.swap_dir else root
    sittings = [sitting(args, seed, swap_root) for seed in range(1, args.sittings + 1)]
    result = {"command": "benchmarks/nvme_step_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "settings": vars(args), "machine": f"{os.uname().machine}, {len(os.sched_getaffinity(0))} cores",
              "summary": summarize(sittings), "sittings": sittings}
    (root / "nvme_step_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| engine: step kind | ms | cost (plain NVMe step = 1) | sub-groups swapped in a step | steps |")
    print("|---|---|---|---|---|")
    for key, row in result["summary"].items():
        print(f"| {key} | {row['ms_mean']:.1f} | {row['cost_mean']:.3f} ± {row['cost_std']:.3f} | "
              f"{row['swapped_in_per_step']:.1f} | {row['steps']} |")
    return result


if __name__ == "__main__":
    main()
