#!/usr/bin/env bash
# Install ds_hybrid into a virtual environment (default .venv, or $VENV).
#
#   bash launch/install.sh          # the package: torch, deepspeed, transformers, ...
#   bash launch/install.sh --dev    # plus pytest, tensorboard and accelerate (HF Trainer), for the tests
#
# torch goes in first, and only where none is installed: a bare `torch` requirement
# would otherwise pull the newest CUDA build (GBs). Set TORCH_SPEC to choose another
# build (for example a CUDA one on a GPU machine); the default is the CPU wheel
# torch==2.13.0 this project is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS=""
[ "${1:-}" = "--dev" ] && EXTRAS="[dev]"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install -q -e ".${EXTRAS}"
if ! ldconfig -p 2>/dev/null | grep -q "libaio\.so"; then
    echo "note: libaio not found; NVMe offload (ZeRO-Infinity) needs it (Debian/Ubuntu: apt-get install libaio-dev)"
fi
if ! command -v numactl >/dev/null; then
    echo "note: numactl not found; DeepSpeed's launcher needs it for --bind_cores_to_rank (the offload bench starts its runs that way; Debian/Ubuntu: apt-get install numactl)"
fi
"$PY" -c "import ds_hybrid, deepspeed, torch; print(f'ds_hybrid {ds_hybrid.__version__} installed in $VENV (torch {torch.__version__}, deepspeed {deepspeed.__version__})')"
