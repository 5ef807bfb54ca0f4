#!/usr/bin/env bash
# What storing the drift velocity in bf16 or int8 does to validation loss (issue 5's 8-bit path):
# the default job (tiny-cpu preset, 600 steps) with Predict steps all along the schedule
# (predict_lr_fraction 1, so the velocity is used as much as possible), seeds 1-3, fp32 / bf16 / int8.
# ~12 minutes on 2 CPU cores. Memory: see `ds-hybrid memory-bench` (velocity bytes per variant).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin}
OUT=${OUT:-runs/velocity-dtype}
mkdir -p "$OUT"
for seed in 1 2 3; do
  for dtype in fp32 bf16 int8; do
    [ -f "$OUT/$dtype-s$seed/summary.json" ] && continue
    $PY/ds-hybrid train --seed $seed --set predict_lr_fraction=1 --set memory.velocity_dtype=$dtype \
      --out "$OUT/$dtype-s$seed" --no-progress --no-plot > "$OUT/$dtype-s$seed.log" 2>&1
  done
done
$PY/ds-hybrid compare "$OUT"/fp32-s*/ "$OUT"/bf16-s*/ "$OUT"/int8-s*/ --json "${JSON:-docs/results/velocity-dtype.json}"
