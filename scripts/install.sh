#!/usr/bin/env bash
# Install Leto into ./.venv and prepare the training corpus. Idempotent.
#   TORCH_SPEC  which torch to install (default torch==2.13.0: the CPU wheel on the dev machines;
#               any torch>=2.4 works, e.g. a CUDA build on GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
# etcd (multi-host jobs' control plane, and the tests' namespace cluster) and iproute2 (namespaces)
if ! command -v etcd >/dev/null || ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq etcd-server etcd-client iproute2 >/dev/null; } ||
      echo "install.sh: apt-get could not install etcd-server/iproute2: multi-host jobs and their tests need them" >&2
  else
    echo "install.sh: etcd-server and iproute2 are missing (as root: apt-get install etcd-server etcd-client iproute2)" >&2
  fi
fi
# a C compiler: the keepers' native data plane (src/leto/protection/dataplane.c) is built by the
# package's install; without one the package installs without it (keepers run their Python one)
if ! command -v cc >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; } ||
    echo "install.sh: apt-get could not install gcc: keepers will run their Python data plane" >&2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
# NVIDIA's in-process restart (a benchmark peer, docs/baselines.md): 0.7.0 ships only CPython
# 3.12/3.14 wheels for glibc >= 2.39 and no sdist; its `inprocess` package is pure Python, so the
# wheel's files go into this venv as they are, with the few pure-Python packages it imports.
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! .venv/bin/python -c 'import nvidia_resiliency_ext.inprocess' 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps --upgrade --target "$SITE" --platform manylinux_2_39_x86_64 \
    --python-version 3.12 --only-binary=:all: nvidia-resiliency-ext==0.7.0
  .venv/bin/python -m pip install -q defusedxml httpx pyyaml psutil
fi
.venv/bin/leto data prepare
