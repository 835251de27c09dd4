#!/usr/bin/env bash
# Install Leto into ./.venv and prepare the training corpus. Idempotent.
#   TORCH_SPEC  which torch to install (default torch==2.13.0: the CPU wheel on the dev machines;
#               any torch>=2.4 works, e.g. a CUDA build on GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/leto data prepare
