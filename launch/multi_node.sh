#!/usr/bin/env bash
# Several nodes: the deepspeed launcher reads a hostfile and starts the main job on each node.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: launch/multi_node.sh [--dry-run] [--master-addr ADDR] [--master-port PORT] [--num-nodes K]
                            [--gpus-per-node G] [--launcher NAME] HOSTFILE [TRAIN_ARGS...]

Start the main job on the nodes listed in HOSTFILE with DeepSpeed's launcher:
    deepspeed --hostfile HOSTFILE --master_addr ADDR --master_port PORT [--num_nodes K]
        [--num_gpus G] [--launcher NAME] --module ds_hybrid.train TRAIN_ARGS...
HOSTFILE has one line per node: "hostname slots=GPUS" (DeepSpeed's format).
Run it on the first node. Every node needs this repository and its .venv at the same
path (a shared file system does it) and, for the default pdsh launcher, passwordless
ssh between nodes. --save-dir must be on a file system all nodes see.
Everything after HOSTFILE goes to ds_hybrid.train (ds-hybrid train --help lists it).

options (before HOSTFILE):
  --dry-run            print the command instead of running it
  --master-addr ADDR   rank 0's address (default: the first host in HOSTFILE)
  --master-port PORT   rendezvous port (default: $MASTER_PORT, else 29500)
  --num-nodes K        use only the first K hosts
  --gpus-per-node G    use only G GPUs per host
  --launcher NAME      pdsh (default), openmpi, mpich, impi, slurm, mvapich
  -h, --help           show this text

example:
  launch/multi_node.sh --launcher pdsh hostfile --config gpt2-124m --steps 2000 --save-dir /shared/ckpt
USAGE
}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEEPSPEED="$ROOT/.venv/bin/deepspeed"
[ -x "$DEEPSPEED" ] || DEEPSPEED="deepspeed"
DRY_RUN=0
ADDR=""
PORT="${MASTER_PORT:-29500}"
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --master-addr) ADDR="${2:?--master-addr needs a value}"; shift 2 ;;
        --master-port) PORT="${2:?--master-port needs a value}"; shift 2 ;;
        --num-nodes) extra+=(--num_nodes "${2:?--num-nodes needs a value}"); shift 2 ;;
        --gpus-per-node) extra+=(--num_gpus "${2:?--gpus-per-node needs a value}"); shift 2 ;;
        --launcher) extra+=(--launcher "${2:?--launcher needs a value}"); shift 2 ;;
        --) shift; break ;;
        -*) echo "multi_node.sh: unknown option '$1' (script options go before HOSTFILE)" >&2; usage >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then usage >&2; exit 2; fi
HOSTFILE="$1"; shift
if [ ! -f "$HOSTFILE" ]; then
    echo "multi_node.sh: hostfile not found: $HOSTFILE" >&2; exit 2
fi
# The first host named in the file (comments and blank lines skipped).
FIRST_HOST="$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")"
if [ -z "$FIRST_HOST" ]; then
    echo "multi_node.sh: hostfile $HOSTFILE lists no hosts (expected lines like 'node1 slots=8')" >&2; exit 2
fi
ADDR="${ADDR:-$FIRST_HOST}"

cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$ADDR" --master_port "$PORT" ${extra[@]+"${extra[@]}"}
     --module ds_hybrid.train "$@")
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
