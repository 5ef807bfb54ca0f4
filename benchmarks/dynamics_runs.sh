#!/usr/bin/env bash
# Issue 3's measurements, end to end (2-core CPU: about 40 minutes on a quiet machine).
#   1. record trajectories: both predictors, seeds 1-3, stdlib corpus, 600 steps, on
#      benchmarks/tiny-cpu-adam.json (the tiny-cpu preset as it was when these were measured:
#      Adam-direction Predict steps, progress measured on every verification, no LR gate);
#      one run on another text (torch's C++ headers) and one at peak lr 3e-4
#   2. plain DeepSpeed baselines for the same seeds
#   3. the held-out forecast evaluation and the engine table
# Outputs: runs/dyn/ (runs, trajectories), docs/results/dynamics-eval.json, docs/results/dynamics-engine.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin}
OUT=runs/dyn
T=$OUT/traj
mkdir -p "$T"
CFG=benchmarks/tiny-cpu-adam.json
OTHER=$($PY/python -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")

run() {  # name predictor seed [extra args...]
  local name=$1 pred=$2 seed=$3; shift 3
  [ -f "$OUT/$name/summary.json" ] && return 0
  $PY/ds-hybrid train --config $CFG --predictor "$pred" --seed "$seed" --trajectory "$T/$name.jsonl" --out "$OUT/$name" \
    --no-progress "$@" > "$OUT/$name.log" 2>&1
}
for seed in 1 2 3; do
  run stdlib_adam_direction_s$seed adam_direction $seed
  run stdlib_rssm_s$seed rssm $seed
  [ -f "$OUT/baseline_s$seed/summary.json" ] || \
    $PY/ds-hybrid train --config $CFG --baseline --seed $seed --out "$OUT/baseline_s$seed" --no-progress > "$OUT/baseline_s$seed.log" 2>&1
done
run cpp_adam_direction_s1 adam_direction 1 --data "$OTHER"
run lowlr_rssm_s1 rssm 1 --lr 3e-4
run lowlr_adam_direction_s1 adam_direction 1 --lr 3e-4

$PY/ds-hybrid dynamics-eval --train $T/stdlib_adam_direction_s1.jsonl $T/stdlib_adam_direction_s2.jsonl \
    $T/stdlib_rssm_s1.jsonl $T/stdlib_rssm_s2.jsonl \
  --test $T/stdlib_adam_direction_s3.jsonl $T/stdlib_rssm_s3.jsonl $T/cpp_adam_direction_s1.jsonl $T/lowlr_rssm_s1.jsonl \
  --epochs 3 --json docs/results/dynamics-eval.json --save-predictor $OUT/rssm-pretrained.pt
$PY/ds-hybrid dynamics-eval --runs $OUT/baseline_s*/ $OUT/stdlib_*/ $OUT/lowlr_*/ $OUT/cpp_*/ \
  --json docs/results/dynamics-engine.json
