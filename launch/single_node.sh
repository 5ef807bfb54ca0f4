#!/usr/bin/env bash
# One node, N GPUs: the deepspeed launcher starts N ranks of the main job (ds_hybrid.train).
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: launch/single_node.sh [--dry-run] [--master-port PORT] NUM_GPUS [TRAIN_ARGS...]

Start NUM_GPUS ranks of the main job on this node with DeepSpeed's launcher:
    deepspeed --num_gpus NUM_GPUS --master_port PORT --module ds_hybrid.train TRAIN_ARGS...
Everything after NUM_GPUS goes to ds_hybrid.train (ds-hybrid train --help lists it).
Each rank reads its own shard of the training stream; rank 0 writes the outputs.

options (before NUM_GPUS):
  --dry-run           print the command instead of running it
  --master-port PORT  rendezvous port (default: $MASTER_PORT, else 29500)
  -h, --help          show this text

example:
  launch/single_node.sh 8 --config gpt2-124m --steps 2000 --save-dir runs/ckpt --save-every 200
USAGE
}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEEPSPEED="$ROOT/.venv/bin/deepspeed"
[ -x "$DEEPSPEED" ] || DEEPSPEED="deepspeed"   # not installed by launch/install.sh: use the one on PATH
DRY_RUN=0
PORT="${MASTER_PORT:-29500}"
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --master-port) PORT="${2:?--master-port needs a value}"; shift 2 ;;
        --) shift; break ;;
        -*) echo "single_node.sh: unknown option '$1' (script options go before NUM_GPUS)" >&2; usage >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then usage >&2; exit 2; fi
N="$1"; shift
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "single_node.sh: NUM_GPUS must be a positive integer (got '$N')" >&2; exit 2
fi

cmd=("$DEEPSPEED" --num_gpus "$N" --master_port "$PORT" --module ds_hybrid.train "$@")
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
