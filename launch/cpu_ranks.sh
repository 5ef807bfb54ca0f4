#!/usr/bin/env bash
# N CPU ranks on this machine: the deepspeed launcher on DeepSpeed's CPU accelerator (gloo).
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: launch/cpu_ranks.sh [--dry-run] [--master-port PORT] NUM_RANKS [TRAIN_ARGS...]

Start NUM_RANKS CPU ranks of the main job on this machine (no GPU needed):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=T deepspeed --num_gpus NUM_RANKS --master_port PORT \
        --module ds_hybrid.train TRAIN_ARGS...
DeepSpeed's CPU accelerator runs the ranks over gloo; --num_gpus counts ranks here.
T is $OMP_NUM_THREADS when set, else the CPU count divided by NUM_RANKS (at least 1):
ranks that each use every core slow each other down by orders of magnitude.
Everything after NUM_RANKS goes to ds_hybrid.train (ds-hybrid train --help lists it).

options (before NUM_RANKS):
  --dry-run           print the command instead of running it
  --master-port PORT  rendezvous port (default: $MASTER_PORT, else a free port)
  -h, --help          show this text

example:
  launch/cpu_ranks.sh 2 --steps 300 --save-dir runs/ckpt --save-every 50
USAGE
}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEEPSPEED="$ROOT/.venv/bin/deepspeed"
PYTHON="$ROOT/.venv/bin/python"
[ -x "$DEEPSPEED" ] || DEEPSPEED="deepspeed"
[ -x "$PYTHON" ] || PYTHON="python3"
DRY_RUN=0
PORT="${MASTER_PORT:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --master-port) PORT="${2:?--master-port needs a value}"; shift 2 ;;
        --) shift; break ;;
        -*) echo "cpu_ranks.sh: unknown option '$1' (script options go before NUM_RANKS)" >&2; usage >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then usage >&2; exit 2; fi
N="$1"; shift
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "cpu_ranks.sh: NUM_RANKS must be a positive integer (got '$N')" >&2; exit 2
fi
if [ -z "$PORT" ]; then  # a free port: other jobs on a shared machine may hold 29500
    PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))}"

cmd=(env DS_ACCELERATOR=cpu OMP_NUM_THREADS="$THREADS" "$DEEPSPEED" --num_gpus "$N" --master_port "$PORT"
     --module ds_hybrid.train "$@")
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
