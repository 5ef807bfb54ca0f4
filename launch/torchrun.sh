#!/usr/bin/env bash
# One node, N ranks started by torchrun instead of the deepspeed launcher.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: launch/torchrun.sh [--dry-run] NUM_RANKS [TRAIN_ARGS...]

Start NUM_RANKS ranks of the main job on this node with torchrun:
    torchrun --standalone --nproc_per_node NUM_RANKS -m ds_hybrid.train TRAIN_ARGS...
torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous (--standalone: a free
local port); ds_hybrid.train reads them from the environment. On a machine without a
GPU the ranks run on DeepSpeed's CPU accelerator over gloo, one OpenMP thread each
unless OMP_NUM_THREADS is set.
Everything after NUM_RANKS goes to ds_hybrid.train (ds-hybrid train --help lists it).

options (before NUM_RANKS):
  --dry-run    print the command instead of running it
  -h, --help   show this text

example:
  launch/torchrun.sh 4 --config tiny-cpu --steps 300
USAGE
}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCHRUN="$ROOT/.venv/bin/torchrun"
[ -x "$TORCHRUN" ] || TORCHRUN="torchrun"
DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; break ;;
        -*) echo "torchrun.sh: unknown option '$1' (script options go before NUM_RANKS)" >&2; usage >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then usage >&2; exit 2; fi
N="$1"; shift
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: NUM_RANKS must be a positive integer (got '$N')" >&2; exit 2
fi

cmd=("$TORCHRUN" --standalone --nproc_per_node "$N" -m ds_hybrid.train "$@")
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
