#!/usr/bin/env bash
# Progress per predicted step in the engine with the default preset (drift steps once the LR has
# decayed below 0.6 of its peak), the simple predictor against the RSSM, seeds 1-3, with the
# progress of every verified Predict step measured (one extra forward each: the same batch's loss
# before the update minus after it). Plus plain DeepSpeed for the validation-loss column.
# ~15 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin}
OUT=${OUT:-runs/progress}
mkdir -p "$OUT"
for seed in 1 2 3; do
  for pred in adam_direction rssm; do
    [ -f "$OUT/${pred}_s$seed/summary.json" ] && continue
    $PY/ds-hybrid train --seed $seed --predictor $pred --set dynamics.progress_every=1 \
      --out "$OUT/${pred}_s$seed" --no-progress --no-plot > "$OUT/${pred}_s$seed.log" 2>&1
  done
  [ -f "$OUT/baseline_s$seed/summary.json" ] || \
    $PY/ds-hybrid train --seed $seed --baseline --out "$OUT/baseline_s$seed" --no-progress --no-plot \
      > "$OUT/baseline_s$seed.log" 2>&1
done
$PY/ds-hybrid dynamics-eval --runs "$OUT"/baseline_s*/ "$OUT"/adam_direction_s*/ "$OUT"/rssm_s*/ \
  --json "${JSON:-docs/results/progress-engine.json}"
