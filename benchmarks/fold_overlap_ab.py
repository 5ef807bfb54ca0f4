"""What moving the fold off the real step costs in loss, arm against arm:

* ``behind`` against ``inline`` (``memory.fold_overlap``): the fold runs behind the next real
  step, so the predictor hears of each real step's direction statistics one real step late and
  its step scale and confidence lag the inline fold's by a step. Everything else (the velocity,
  the weights' path given the same decisions) is the inline fold's bit for bit
  (``tests/test_fold_overlap.py``).
* ``during`` against ``behind`` (``memory.fold_during_run``): the real step before a Predict run
  no longer waits for its own fold; the run moves along the velocity from before that fold (one
  real step older) while the fold runs (``tests/test_fold_during_run.py``).
* ``gradient-behind`` against ``gradient`` with ``--bf16`` (``memory.cpu_step_behind``): the bench's
  ``predict-gradient`` arm (3 gradient Predict steps after every real step from step 50), the real
  step before each run covered by the device's own Adam step (its moments in bf16 beside the bf16
  weights, the weights rounded stochastically) while DeepSpeed's CPU step runs behind the run
  (``tests/test_cpu_step_behind.py``). ``gradient-int4f-behind`` against ``gradient-int4f``: the same in
  the compact state (``memory.gradient_state_dtype: int4-factored``), whose cover is not exact: its step
  takes the factored second moment and the 4-bit first.
* ``weights16`` against ``inline`` with ``--bf16`` (``memory.fold_source: weights16``): the
  velocity folded from the 16-bit shards' difference on their device, each real step's update
  then rounded to bf16 twice, and the real step that commits a kept run left out of the average
  (``tests/test_shard_fold.py``). Both arms with bf16 weights, as the offload presets train.

Measured on the ``offload`` bench suite's CPU setup (gpt2-tiny, the ``tiny-cpu`` preset at its
LR, ZeRO 2 with ``offload_optimizer: cpu``, 300 steps of 16 x 128 bytes) with the bench's
``predict`` arm (2 drift steps after every 4 real ones from step 50, checked by the next real
step) on the device-side Predict path with the fold read back from the Adam state and an int8
velocity, as the offload presets ship it beside a GPU. The arms differ in
``memory.fold_overlap`` and ``memory.fold_during_run`` only (``SETTINGS``). On DeepSpeed's CPU
accelerator ``auto`` would keep the fold inline, so the settings are forced.

    .venv/bin/python benchmarks/fold_overlap_ab.py --json docs/results/fold-overlap-cpu.json
    .venv/bin/python benchmarks/fold_overlap_ab.py --arms behind during --json docs/results/fold-during-run-cpu.json
    .venv/bin/python benchmarks/fold_overlap_ab.py --arms inline weights16 --bf16 --seeds 1 2 3 4 5 6 \
        --json docs/results/shard-fold-cpu.json
    .venv/bin/python benchmarks/fold_overlap_ab.py --arms gradient gradient-behind --bf16 --seeds 1 2 3 4 5 6 \
        --json docs/results/cpu-step-behind-cpu.json
    .venv/bin/python benchmarks/fold_overlap_ab.py --arms gradient-int4f gradient-int4f-behind --bf16 \
        --seeds 1 2 3 4 5 6 --json docs/results/cpu-step-behind-int4f-cpu.json

Runs go to ``--out`` (default ``/tmp/fold-overlap-ab``), two at a time with one thread each
(the runs are deterministic: their losses do not depend on timing). The times they report are
taken beside each other and are not a measurement of the overlap; that is a GPU number
(``benchmarks/gpu_run.sh off1b``). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_hybrid.arguments import resolve_config  # noqa: E402
from ds_hybrid.bench_arms import ARMS, deep_merge  # noqa: E402
from ds_hybrid.bench_suites import SUITES  # noqa: E402

MEMORY = {"offload_predict": "device", "fold_source": "optimizer_state", "velocity_dtype": "int8"}
STATS = ("predict_steps", "predict_accepted", "predict_rolled_back", "fold_source", "shard_folds", "fold_overlap", "fold_during_run",
         "fold_background_seconds", "cpu_steps_behind")
# what each arm sets in hybrid_predict.memory
SETTINGS = {"inline": {"fold_overlap": False, "fold_during_run": False},
        "behind": {"fold_overlap": True, "fold_during_run": False},
        "during": {"fold_overlap": True, "fold_during_run": True},
        "weights16": {"fold_source": "weights16", "fold_overlap": False, "fold_during_run": False},
        # the bench's predict-gradient arm on the device path, the real step before each run taking its
        # CPU Adam step at once or behind the run with the GPU's cover (memory.cpu_step_behind)
        "gradient": {"_arm": "predict-gradient"},
        "gradient-behind": {"_arm": "predict-gradient", "cpu_step_behind": True},
        # ... in the compact state (memory.gradient_state_dtype: int4-factored, the 7B route): the cover builds
        # that state and folds the real step's gradient into it, its step from the factored second moment
        "gradient-int4f": {"_arm": "predict-gradient", "gradient_state_dtype": "int4-factored"},
        "gradient-int4f-behind": {"_arm": "predict-gradient", "gradient_state_dtype": "int4-factored",
                                  "cpu_step_behind": True}}


def config(arm: str, bf16: bool = False) -> dict:
    suite = SUITES["offload"]
    cfg, _ = resolve_config(suite.config, "--config")
    cfg = deep_merge(cfg, suite.overrides)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    settings = dict(SETTINGS[arm])
    base = settings.pop("_arm", "predict")
    hybrid = json.loads(json.dumps(ARMS[base].hybrid))
    memory = MEMORY if base == "predict" else {"offload_predict": "device"}
    hybrid["memory"] = dict(memory, **settings)
    cfg["hybrid_predict"] = hybrid
    return cfg


def run(seed: int, arm: str, out: Path, bf16: bool = False) -> dict:
    suite = SUITES["offload"]
    folder = out / f"{arm}{'-bf16' if bf16 else ''}-s{seed}"
    summary = folder / "summary.json"
    if not summary.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cfg_path = folder / "ds_config.json"
        cfg_path.write_text(json.dumps(config(arm, bf16), indent=1))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "ds_hybrid.cli", "train", "--config", str(cfg_path), "--model", suite.model,
               "--steps", str(suite.steps), "--seq-len", str(suite.seq_len), "--seed", str(seed),
               "--eval-every", str(suite.eval_every), "--val-batches", str(suite.val_batches), "--no-plot",
               "--no-progress", "--out", str(folder)]
        with open(folder / "train.log", "w") as log:
            subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    s = json.loads(summary.read_text())
    st = s["statistics"]
    book = st.get("bookkeeping_seconds", {})
    return {"seed": seed, "arm": arm, "final_val_loss": s["final_val_loss"],
            **{k: st.get(k) for k in STATS}, "fold_seconds": book.get("fold", 0.0),
            "fold_wait_seconds": book.get("fold_wait", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default="/tmp/fold-overlap-ab")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--arms", nargs=2, default=["inline", "behind"], choices=list(SETTINGS),
                    help="the reference arm, then the arm measured against it")
    ap.add_argument("--bf16", action="store_true", help="both arms with bf16 weights (the suite's config trains fp32)")
    args = ap.parse_args()
    out = Path(args.out)
    ref, new = args.arms
    jobs = [(seed, arm) for seed in args.seeds for arm in (ref, new)]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda j: run(*j, out, args.bf16), jobs))
    by = {(r["seed"], r["arm"]): r for r in rows}
    deltas = [by[(s, new)]["final_val_loss"] - by[(s, ref)]["final_val_loss"] for s in args.seeds]
    print(f"| seed | {ref}: loss (Predict steps, kept) | {new}: loss (Predict steps, kept) | {new} - {ref} |")
    print("|---|---|---|---|")
    for s, d in zip(args.seeds, deltas):
        a, b = by[(s, ref)], by[(s, new)]
        print(f"| {s} | {a['final_val_loss']:.6f} ({a['predict_steps']}, {a['predict_accepted']}) | "
              f"{b['final_val_loss']:.6f} ({b['predict_steps']}, {b['predict_accepted']}) | {d:+.2e} |")
    spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    print(f"mean difference {statistics.mean(deltas):+.2e} ± {spread:.2e} (sd over {len(deltas)} seeds)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "what": f"{ref} {SETTINGS[ref]} against {new} {SETTINGS[new]} (hybrid_predict.memory), offload suite's CPU "
                    "setup, bench predict arm on the device path (int8 velocity; fold_source optimizer_state unless "
                    f"the arm says otherwise){', bf16 weights' if args.bf16 else ''}",
            "command": "python benchmarks/fold_overlap_ab.py " + " ".join(sys.argv[1:]),
            "arms": [ref, new], f"config_{ref}": config(ref, args.bf16), "runs": rows,
            f"loss_difference_{new}_minus_{ref}": deltas,
            "mean_difference": statistics.mean(deltas), "sd_difference": spread}, indent=1) + "\n")


if __name__ == "__main__":
    main()
