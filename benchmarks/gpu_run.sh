#!/usr/bin/env bash
# GPU validation of issues 5 (memory) and 6 (kernels), on one CUDA GPU with DeepSpeed importable.
# Every number in the README's GPU tables comes from one of these stages; each writes its JSON
# (and log) into OUT.
#
#   bash benchmarks/gpu_run.sh OUT STAGE...
#
# (The memory stages keep their runs and timelines under /tmp and copy the JSON and one PNG: the
# lent machine returns at most 8 files. off1b, grad1b and gradz3 write their JSON into OUT after every
# run, so that a stage cut off by the call's time limit keeps the runs it finished.)
#
# stages:
#   env      nvidia-smi, versions, `ds-hybrid report`
#   ops      build DeepSpeed's FusedAdam and CPU Adam and ds_hybrid's host fold now (they JIT-compile at first use)
#   tests    the GPU-marked tests (kernels against their references, moment parking on CUDA,
#            overlapped parking bit-identical, the RSSM predictor on the GPU against the CPU one,
#            the device path's Predict run and commit under offload_optimizer, the stager's pinned copies;
#            the whole log in OUT/tests.log)
#   kernels  ds-hybrid kernel-bench                          -> OUT/kernels.json
#   attn     ds-hybrid attn-bench on CUDA                    -> OUT/attention-cuda.json
#   mem124   GPT-2 124M (86M at vocabulary 256), gpt2-124m preset, micro batch 16 x 1024:
#            GPU peak per phase, plain DeepSpeed against each Predict variant, moment parking
#            overlapped and DeepSpeed's                      -> OUT/memory-gpu-124m.json
#   prof     the memory profiler's cost per record on CUDA  -> OUT/profiler-cost-cuda.json
#   pred124  the RSSM predictor on the CPU against on the GPU with its kernels (dynamics.device),
#            GPT-2 124M, micro batch 4 x 1024                -> OUT/memory-gpu-predictor.json
#   prec32   fp32 training, with and without bf16 Predict forwards (memory.predict_autocast)
#                                                            -> OUT/memory-gpu-fp32.json
#   prec16   fp16 training (DeepSpeed's loss scaler), plain against adam and drift Predict steps
#                                                            -> OUT/memory-gpu-fp16.json
#   mem1b    llama-1b on the 1b-16gb preset under a 16 GB allocator cap, plain and hybrid
#                                                            -> OUT/memory-gpu-1b.json
#   off1b    the same, the hybrid's host path (masters moved every Predict step, snapshots) against
#            the device path (memory.offload_predict: device, fold_source: optimizer_state), its commit
#            and fold as auto places them (inside DeepSpeed's CPU Adam step since 2026-11-27) and inline: step time
#            per phase, the bookkeeping timers and DeepSpeed's forward / backward / step timers per phase
#            (--wall-clock: what a Predict step that takes its gradient on the GPU would cost)
#                                                            -> OUT/offload-gpu-1b.json
#   grad1b   the same layout: plain ZeRO-Offload against Predict steps that take their own gradient
#            (predictor.direction: gradient, 1 real : 3 Predict) on the device path (the run's Adam moments in
#            bf16 beside the GPU's 16-bit weights, copied there behind the run's first forward and backward, the
#            masters caught up once per kept run), and the drift step's device path checked by the next real step
#            (no forward of its own): -behind, each real step's fold on a host thread behind the next one's
#            forward and backward (the real step before a run waits for its own), against -fused, the fold
#            and a kept run's commit inside DeepSpeed's CPU Adam step, one pass (memory.fold_in_step, auto
#            since this stage measured it the cheaper real step on 2026-11-27): step time
#            per phase, bookkeeping and DeepSpeed's timers (the issue's bar: a Predict step at most 0.1x a plain
#            step, real steps at most 1.05x). GRAD1B_VARIANTS picks others (grad-device-int4f, grad-device-int4f-behind: the
#            compact state, its kept run's commit inline or behind the next real step's backward on a side stream;
#            grad-device-int4f-cpubehind: the compact state with the real step's CPU Adam step behind the run, its
#            cover building the state and folding the step's gradient in;
#            grad-device-behind: the real step's CPU Adam step
#            behind the run, the GPU covering it; grad-device-noprefetch and grad-device-inline: no
#            host thread beside the real step's backward; grad-device-quarter, grad-device-eighth: each Predict
#            step's gradient from that share of the batch, 2 or 1 of 8 micro-batches with GRAD1B_ACCUM=8, whose loss
#            worth the CPU study put at 0.43 and 0.19 of a real step; grad-host, grad-device-half: measured
#            2026-11-26; grad-device-half-updated: half with Adam's second moment updated by each Predict
#            gradient, the offload-preset-fp32 suite's setting (with GRAD1B_ACCUM=8, against grad-device-half);
#            drift-bf16-device-next-fused and drift-fp32-device-next-fused: the fused real step with a velocity
#            that needs no int8 rounding; grad-device-plain and grad-device-recompute: the gradient
#            Predict step's backward never or always recomputing the preset's checkpointed blocks, where
#            grad-device's predictor.gradient_checkpointing auto keeps their activations only if they fit under the
#            cap by its measured peak and the planner's count (its record's gradient_recompute says which);
#            drift-int8-device-next, the fold during the run, and drift-int8-device, verified each
#            step: 2026-11-26 17:50), GRAD1B_ACCUM=8 runs the 1b-16gb preset's own accumulation (a plain step then holds 8
#            forwards and backwards beside its CPU Adam step, about 3.6 s: GRAD1B_STEPS=16 RUN_SECONDS=150 keep
#            three or four variants in one call), GRAD1B_STEPS the steps of each run (24)
#                                                            -> OUT/offload-gpu-1b-grad.json
#   prof1b   the same layout, 16 steps, plain against the drift device path's fused real step (PROF1B_VARIANTS picks
#            others) with torch.profiler over steps 9-16 (ds-hybrid train --op-profile): per phase, each operator's
#            calls and self CPU / CUDA time a step, and per run the operators whose time differs most from plain's
#            Full steps (what a hybrid real step runs that plain's does not: the 86 ms of forward and backward the
#            timers do not explain); the profiled steps' times include the profiler's cost
#                                                            -> OUT/prof-1b.json, OUT/prof-1b.md
#   foldhost the real step's host pass on the lent machine's 16 cores, no GPU work (benchmarks/fold_in_step.py,
#            2^27 values, the arms interleaved): DeepSpeed's CPU Adam step alone and with the drift fold after
#            it and inside it, with an int8 velocity whose stochastic rounding's noise is computed from its
#            table's hash (the default since 2026-11-27 13:20) or read from the table (4 bytes a value: on the
#            2-core CPU the two were within its noise, computing 6% cheaper to 14% dearer over four runs), and
#            bf16 and fp32 velocities: which is the cheaper pass where DeepSpeed's step is bound by memory
#            (about a minute)
#                                                            -> OUT/fold-in-step-host.json
#   gradz3   llama-1b on the 7b-24gb preset's layout (ZeRO 3, optimizer and parameters in pinned CPU memory)
#            under a 24 GB cap, gradient Predict steps on the host and the device path against plain: on ZeRO 3
#            the gradient is laid on this rank's share a parameter at a time (with offload_param, each share
#            queued into host memory and added on a host thread behind the backward since 2026-11-27 10:30:
#            gradient_share_wait_ms in the JSON) and, with offload_param, the
#            run's state and the moved 16-bit partition are in host memory (GRADZ3_VARIANTS picks fewer,
#            GRADZ3_STEPS fewer steps: on 2026-11-26 its gradient run did not finish 24 in 4 minutes)
#                                                            -> OUT/offload-gpu-1b-grad-z3.json
#   offbench the offload-gpu bench suite (GPT-2 124M, ZeRO 2 + pinned CPU Adam, 8 x 256 a step):
#            plain ZeRO-Offload LR-swept, ZenFlow, the hybrid; 3 seeds, every run started by
#            DeepSpeed's launcher bound to its cores (plain python where numactl is missing) with
#            wall_clock_breakdown, OFFBENCH_JOBS (4) runs at a time, each bound to its own quarter of the
#            cores (its ratios then in Full-step equivalents, each step kind timed alone after the runs;
#            OFFBENCH_JOBS=1 for seconds from runs alone). About 25 min of runs one at a time: it stops itself after OFFBENCH_SECONDS
#            (560) or what is left of the call (CALL_SECONDS, 570, less a minute for its tar) and resumes
#            (--reuse) when called again on the same warm machine (OFFBENCH_ARMS, e.g. "predict-gradient
#            zenflow-overlap", runs those systems and plain ZeRO-Offload only); in a later session, unpack
#            offload-gpu-runs.tgz into runs/bench here and name runs/bench/offload-gpu in the call's carry
#                                                            -> OUT/offload-gpu.json/.png, OUT/offload-gpu-runs.tgz
#   train7b llama-7b on the 7b-24gb-z2 preset (ZeRO 2, optimizer in CPU memory, bf16 weights on the
#            GPU, the hybrid's velocity copy there only during a run) under a 24 GB allocator cap,
#            2 x 2048 tokens a step in one micro-batch (with accumulation DeepSpeed keeps a 16-bit buffer
#            per parameter in host memory, 12 GiB at 7B): a hybrid run (Predict from step 4) and plain
#            ZeRO-Offload, 12 steps each, and the planner's estimate beside them. DeepSpeed's pinning
#            stays on only where this torch can stop rounding pinned blocks up to powers of two (torch
#            2.11 cannot: the rounding alone is 19.7 GiB at 7B, over the host; ds_hybrid/pinned.py).
#            (7b-24gb, ZeRO 3 with the parameters offloaded too, needs 125.5 GiB of host memory for
#            DeepSpeed's buffers alone: more than this machine has; docs/results/offload-host-layout.json)
#            TRAIN7B_GRADIENT=int4-factored: the hybrid arm's Predict steps take their own gradient in the
#            compact state (memory.gradient_state_dtype; ds_hybrid/compact_moments.py), not the drift step;
#            with TRAIN7B_CPU_BEHIND=1 also memory.cpu_step_behind (the real step's CPU Adam step behind each run).
#            TRAIN7B_ARMS (default "hybrid plain") runs one arm a call where both do not fit one (the
#            build of 6.5B weights on the CPU, DeepSpeed's CPU Adam build and pageable copies of 13-26 GB a
#            step: a few minutes an arm), TRAIN7B_STEPS (12) the steps of each
#                                    -> OUT/train7b-hybrid.json, OUT/train7b-plain.json, OUT/plan-7b.json, OUT/free.log
#   stale124 the CPU window's cost in loss at GPT-2 124M (benchmarks/stale_update_study.py, plain PyTorch, bf16
#            autocast): the synchronous step against a gradient taken one update behind the masters, bare and
#            covered by the last update; 8 x 256 bytes a step, 600 steps, peak LR 6e-4 and 1.2e-3, 3 seeds. It
#            writes its JSON after every run and stops itself after 560 s
#                                                            -> OUT/stale-update-study-124m.json
#   grad124  what a Predict step that takes its gradient on the GPU is worth at GPT-2 124M
#            (benchmarks/grad_step_study.py, plain PyTorch, bf16 autocast): 1 real : 1 and 1 : 3 Predict steps,
#            skip, drift and adam-carry with the GPU's state in bf16 and its weights rounded stochastically;
#            8 x 256 bytes a step, 600 steps, peak LR 6e-4, 3 seeds; JSON after every run, stopped at 560 s
#                                                            -> OUT/grad-step-study-124m.json
#
# Time limits: each stage that sizes its own timeout takes at most what is left of CALL_SECONDS (570)
# from the script's start; the memory stages kill a run still going after RUN_SECONDS (150; gradz3 200)
# and go on with the next variant. The memory stages' plain run books its first steps as Warmup,
# as the hybrid runs do, so that no Full mean has the slow first steps (ds-hybrid train --profile-warmup).
#
# On the lent machine (no DeepSpeed, no network) the command starts with the wheels of
# ../shared/device/README.md: pip install --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD.
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUT STAGE...}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
# DeepSpeed 0.19.8 cannot parse "9.0a" (which some CUDA images set): build for plain sm_90 unless told
case ${TORCH_CUDA_ARCH_LIST:-} in ""|*a*) export TORCH_CUDA_ARCH_LIST=9.0 ;; esac
export MAX_JOBS=${MAX_JOBS:-16}
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); export CUDA_HOME
fi
PY=${PYTHON:-python3}
DSH="$PY -m ds_hybrid.cli"
status=0
# The call's own limit (the lent machine's is 600 s a command; the documented call wraps this script in
# `timeout -k 5 575`): a stage that sizes its own timeout takes what is left of it, so that what it
# must do after its runs (copy, tar) still happens.
deadline=$(( $(date +%s) + ${CALL_SECONDS:-570} ))
left() { local n=$(( deadline - $(date +%s) - ${1:-0} )); [ "$n" -gt 10 ] && echo "$n" || echo 10; }
smaller() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }
stage_rc() { echo "=== stage $1: rc $2 ($(( $(date +%s) - $3 )) s)"; [ "$2" = 0 ] || status=1; }

for stage in "$@"; do
  t0=$(date +%s)
  echo "=== stage $stage ($(date -u +%H:%M:%S))"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      $PY -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, torch.cuda.get_device_name(0))"
      $DSH report
      stage_rc env $? "$t0" ;;
    ops)
      # (three at once, each in its own process: nvcc on FusedAdam, g++ on CPU Adam and the host fold, each
      # its own extension folder and lock; one after another they took 91-131 s of a 15-minute session)
      $DSH build-ops --ops fused_adam cpu_adam ds_hybrid_host_fold --jobs 3 > "$OUT/ops.log" 2>&1
      rc=$?; grep -v "\[WARNING\]" "$OUT/ops.log" | tail -20
      stage_rc ops $rc "$t0" ;;
    tests)
      timeout -k 20 "$(smaller "${TESTS_SECONDS:-240}" "$(left 20)")" $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py tests/test_drift.py tests/test_dynamics.py \
        tests/test_memory_profiler.py tests/test_device_predict.py tests/test_grad_predict.py tests/test_staging.py \
        tests/test_fold_during_run.py tests/test_host_kernels.py tests/test_pinned.py tests/test_free_velocity_copy.py \
        tests/test_step_fusion.py tests/test_grad_recompute.py tests/test_shard_fold.py tests/test_cpu_step_behind.py \
        tests/test_compact_moments.py -rfEs > "$OUT/tests.log" 2>&1
      rc=$?; tail -25 "$OUT/tests.log"   # (the whole log, failures first in its summary, is in OUT)
      stage_rc tests $rc "$t0" ;;
    kernels)
      $DSH kernel-bench --json "$OUT/kernels.json"
      stage_rc kernels $? "$t0" ;;
    attn)
      $DSH attn-bench --device cuda --models gpt2-tiny,gpt2-124m --seq-lens 128,256,512,1024 --batch 8 \
        --json "$OUT/attention-cuda.json"
      stage_rc attn $? "$t0" ;;
    mem124)
      $DSH memory-bench --preset gpt2-124m --models gpt2-124m --seq-len 1024 --micro-batch 16 --steps 24 \
        --variants full adam drift-fp32 drift-int8 drift-int8-park drift-int8-park-ds --out /tmp/mb124 \
        --json /tmp/res/memory-gpu-124m.json
      rc=$?; cp /tmp/res/memory-gpu-124m.json /tmp/res/memory-gpu-124m-gpt2-124m-drift-int8-park.png "$OUT/"
      stage_rc mem124 $rc "$t0" ;;
    prof)
      $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_memory_profiler.py -rs 2>&1 | tail -5
      $PY benchmarks/profiler_cost.py --records 500 --json "$OUT/profiler-cost-cuda.json"
      stage_rc prof $? "$t0" ;;
    pred124)
      $DSH memory-bench --preset gpt2-124m --models gpt2-124m --seq-len 1024 --micro-batch 4 --steps 40 \
        --variants rssm-cpu rssm-cuda --out /tmp/mbp --json /tmp/res/memory-gpu-predictor.json
      rc=$?; cp /tmp/res/memory-gpu-predictor.json "$OUT/"
      stage_rc pred124 $rc "$t0" ;;
    prec32)
      $DSH memory-bench --preset gpt2-124m --models gpt2-124m --seq-len 1024 --micro-batch 8 --steps 24 \
        --precision fp32 --variants full drift-int8 drift-int8-autocast --out /tmp/mbf32 \
        --json /tmp/res/memory-gpu-fp32.json
      rc=$?; cp /tmp/res/memory-gpu-fp32.json "$OUT/"
      stage_rc prec32 $rc "$t0" ;;
    prec16)
      $DSH memory-bench --preset gpt2-124m --models gpt2-124m --seq-len 1024 --micro-batch 16 --steps 24 \
        --precision fp16 --variants full adam drift-int8 --out /tmp/mbf16 --json /tmp/res/memory-gpu-fp16.json
      rc=$?; cp /tmp/res/memory-gpu-fp16.json "$OUT/"
      stage_rc prec16 $rc "$t0" ;;
    mem1b)
      $DSH memory-bench --preset 1b-16gb --models llama-1b --seq-len 1024 --micro-batch 4 --steps 20 \
        --gpu-mem-cap 16GB --variants full drift-int8 --out /tmp/mb1b --json /tmp/res/memory-gpu-1b.json
      rc=$?; cp /tmp/res/memory-gpu-1b.json /tmp/res/memory-gpu-1b-llama-1b-drift-int8.png "$OUT/"
      stage_rc mem1b $rc "$t0" ;;
    off1b)
      $DSH memory-bench --preset 1b-16gb --models llama-1b --seq-len 1024 --micro-batch 4 --steps 24 \
        --gpu-mem-cap 16GB --variants full drift-int8-host drift-int8-device drift-int8-device-inline --wall-clock \
        --run-timeout "${RUN_SECONDS:-150}" --out /tmp/off1b \
        --json "$OUT/offload-gpu-1b.json"
      rc=$?
      stage_rc off1b $rc "$t0" ;;
    grad1b)
      $DSH memory-bench --preset 1b-16gb --models llama-1b --seq-len 1024 --micro-batch 4 --steps "${GRAD1B_STEPS:-24}" \
        --gpu-mem-cap 16GB --variants ${GRAD1B_VARIANTS:-full drift-int8-device-next-behind drift-int8-device-next-fused grad-device} --wall-clock \
        --run-timeout "${RUN_SECONDS:-150}" \
        --grad-accum "${GRAD1B_ACCUM:-1}" --out /tmp/grad1b \
        --json "$OUT/offload-gpu-1b-grad.json"
      rc=$?
      stage_rc grad1b $rc "$t0" ;;
    prof1b)
      $DSH memory-bench --preset 1b-16gb --models llama-1b --seq-len 1024 --micro-batch 4 --steps 16 \
        --gpu-mem-cap 16GB --variants ${PROF1B_VARIANTS:-full drift-int8-device-next-fused} --grad-accum 1 \
        --op-profile 9:16 --run-timeout "${RUN_SECONDS:-150}" --out /tmp/prof1b --json "$OUT/prof-1b.json"
      rc=$?
      $PY -m ds_hybrid.step_profile "$OUT/prof-1b.json" --against full --top 25 > "$OUT/prof-1b.md" 2>&1
      tail -40 "$OUT/prof-1b.md"
      stage_rc prof1b $rc "$t0" ;;
    foldhost)
      timeout -k 10 "$(smaller 240 "$(left 10)")" $PY benchmarks/fold_in_step.py --values 134217728 --repeat 5 \
        --chunks 20 --velocity int8 bf16 fp32 --no-moments --json "$OUT/fold-in-step-host.json"
      stage_rc foldhost $? "$t0" ;;
    gradz3)
      $DSH memory-bench --preset 7b-24gb --models llama-1b --seq-len 1024 --micro-batch 4 --steps "${GRADZ3_STEPS:-24}" \
        --gpu-mem-cap 24GB --variants ${GRADZ3_VARIANTS:-full grad-device grad-host} --wall-clock --out /tmp/gradz3 \
        --run-timeout "${RUN_SECONDS:-200}" \
        --json "$OUT/offload-gpu-1b-grad-z3.json"
      rc=$?
      stage_rc gradz3 $rc "$t0" ;;
    offbench)
      launcher=python; command -v numactl >/dev/null && launcher=deepspeed
      echo "launcher: $launcher"
      # (what is left of the call, less a minute for the tar: after `ops` in the same call too)
      # (OFFBENCH_ARMS: the suite's systems this call runs, plain DeepSpeed always among them)
      # (OFFBENCH_JOBS runs at a time, each on its share of the cores: the suite's ratios then come from its
      #  Full-step equivalents, each step kind timed alone after the runs; OFFBENCH_JOBS=1 for clean seconds)
      timeout -k 20 "$(smaller "${OFFBENCH_SECONDS:-560}" "$(left 60)")" $DSH bench --suite offload-gpu --launcher "$launcher" \
        ${OFFBENCH_ARMS:+--arms $OFFBENCH_ARMS} --jobs "${OFFBENCH_JOBS:-4}" --out runs/bench/offload-gpu --reuse \
        > "$OUT/offbench.log" 2>&1
      rc=$?; tail -5 "$OUT/offbench.log"
      pkill -f "ds_hybrid.train" 2>/dev/null; pkill -f "deepspeed.launcher" 2>/dev/null  # a run cut off by the timeout
      tar czf "$OUT/offload-gpu-runs.tgz" --exclude="*.pt" -C runs/bench offload-gpu
      if [ -f runs/bench/offload-gpu/result.json ]; then
        cp runs/bench/offload-gpu/result.json "$OUT/offload-gpu.json"; cp runs/bench/offload-gpu/frontier.png "$OUT/offload-gpu.png"
      fi
      stage_rc offbench $rc "$t0" ;;
    train7b)
      # (ds-hybrid train's byte-level data: llama-7b with a 256-entry vocabulary, 6.48B parameters)
      $PY -c "
import json, os
from ds_hybrid.pinned import can_limit_pinned_rounding
c = json.load(open('ds_configs/7b-24gb-z2.json'))
c['zero_optimization']['offload_optimizer']['pin_memory'] = can_limit_pinned_rounding()
c['hybrid_predict'].update(warmup_steps=4, full_steps=2, min_predict_steps=2, max_predict_steps=2,
                           confidence_threshold=0.0, check='next_step')
state = os.environ.get('TRAIN7B_GRADIENT')
if state:   # (a gradient Predict step in the compact state: memory.gradient_state_dtype)
    c['hybrid_predict']['predictor'] = {'direction': 'gradient'}
    c['hybrid_predict']['memory'] = {'offload_predict': 'device', 'gradient_state_dtype': state,
                                     'cpu_step_behind': os.environ.get('TRAIN7B_CPU_BEHIND') == '1'}
json.dump(c, open('/tmp/7b-short.json', 'w'))
print('train7b: offload_optimizer.pin_memory', c['zero_optimization']['offload_optimizer']['pin_memory'],
      'predictor', c['hybrid_predict']['predictor'])"
      # (the plan for the config as run, and the presets as they are)
      $DSH plan --model llama-7b --vocab-size 256 --gpu-mem 24GB --cpu-mem "$(awk '/MemTotal/ {print $2 * 1024}' /proc/meminfo)" \
        --seq-len 2048 --presets /tmp/7b-short.json 7b-24gb-z2 7b-24gb --json "$OUT/plan-7b.json" | tail -8
      # (host and GPU memory every 2 s beside the runs: an out-of-memory host shows here first)
      (while sleep 2; do echo "$(date +%s) $(free -m | awk '/Mem/ {print $3, $7}')"; done) > "$OUT/free.log" 2>&1 &
      watcher=$!
      rc=0
      arms=$(echo ${TRAIN7B_ARMS:-hybrid plain} | wc -w)
      steps=${TRAIN7B_STEPS:-12}
      for arm in ${TRAIN7B_ARMS:-hybrid plain}; do
        flag=""; [ $arm = plain ] && flag="--baseline"
        # (each arm its share of what is left: a slow hybrid arm must not leave the plain one no time)
        timeout -k 30 "$(smaller 540 $(( $(left 40) / arms )))" $DSH train --config /tmp/7b-short.json --model llama-7b --gpu-mem-cap 24GB --seq-len 2048 \
          --steps "$steps" --eval-every "$steps" --val-batches 1 --no-progress --no-plot --out /tmp/t7b-$arm $flag \
          > "$OUT/train7b-$arm.log" 2>&1 || rc=1
        tail -4 "$OUT/train7b-$arm.log"
        [ -f /tmp/t7b-$arm/summary.json ] && cp /tmp/t7b-$arm/summary.json "$OUT/train7b-$arm.json"
        arms=$(( arms - 1 ))
      done
      kill "$watcher" 2>/dev/null
      stage_rc train7b $rc "$t0" ;;
    stale124)
      timeout -k 20 "$(smaller 560 "$(left 10)")" $PY benchmarks/stale_update_study.py --model gpt2-124m --seq-len 256 --batch 8 --device cuda --bf16 \
        --lrs 6e-4 1.2e-3 --seeds 1 2 3 --modes stale cover-last --json "$OUT/stale-update-study-124m.json" \
        > "$OUT/stale124.log" 2>&1
      rc=$?; tail -12 "$OUT/stale124.log"; stage_rc stale124 $rc "$t0" ;;
    grad124)
      timeout -k 20 "$(smaller 560 "$(left 10)")" $PY benchmarks/grad_step_study.py --model gpt2-124m --seq-len 256 --batch 8 --device cuda --bf16 \
        --lr 6e-4 --seeds 1 2 3 --schedules 1:1 1:3 --modes skip drift adam-carry --state-dtype bf16 \
        --weights bf16-sr --json "$OUT/grad-step-study-124m.json" > "$OUT/grad124.log" 2>&1
      rc=$?; tail -14 "$OUT/grad124.log"; stage_rc grad124 $rc "$t0" ;;
    *) echo "unknown stage $stage (env ops tests kernels attn mem124 prof pred124 prec32 prec16 mem1b off1b grad1b prof1b foldhost gradz3 offbench train7b stale124 grad124)"; status=2 ;;
  esac
done
exit $status
