#!/usr/bin/env bash
# The GPU check (issue 16): one command on a GPU host, under 8 minutes in all. It
#   1. finds or installs a CUDA build of torch and Leto,
#   2. runs the recovery tests on CUDA (every test picks the GPU when there is one: a worker
#      SIGKILLed in any phase, a node lost, digests exact against a failure-free CUDA run;
#      ranks share the one GPU over gloo with host copies, NCCL where each rank has a GPU),
#   3. measures device-to-host bandwidth (pinned, side stream) and `leto bench overhead` and
#      `leto bench recovery` on CUDA with a model that keeps the GPU busy (gpt2),
# and writes its JSON and logs to $OUT (docs/results/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results}
mkdir -p "$OUT"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS: exact digests
cuda_ok() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=.venv/bin/python
if ! { [ -x "$PY" ] && cuda_ok "$PY"; }; then
  if cuda_ok python3; then  # the host's own CUDA torch: a venv on top of it
    python3 -m venv --system-site-packages .venv-gpu && PY=.venv-gpu/bin/python
    "$PY" -m pip install -q -e '.[dev]' || "$PY" -m pip install -q --no-deps -e .
  else
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} scripts/install.sh  # the default index's wheel is a CUDA build
  fi
fi
cuda_ok "$PY" || { echo "gpu-check: no CUDA device visible to torch" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# the corpus: prepared here (it downloads from Debian's registry), or carried in as ./leto-data
# (`LETO_DATA_DIR`) to a host that reaches nothing outside
[ -d leto-data ] && export LETO_DATA_DIR=${LETO_DATA_DIR:-$PWD/leto-data}
"$PY" -c 'from leto.training.corpus import load_tokens; load_tokens()' 2>/dev/null \
  || "$PY" -m leto.cli data prepare || { echo "gpu-check: no corpus (carry ~/.cache/leto as ./leto-data)" >&2; exit 1; }
LETO="$PY -m leto.cli"
status=0

timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_staging.py tests/test_sharded_optimizer.py \
  tests/test_recovery.py -k "staging or sharded or whole_node or (any_phase and (1-update-auto or 3-grads-on))" \
  > "$OUT/gpu-tests.log" 2>&1 || status=1
tail -3 "$OUT/gpu-tests.log"

timeout 60 "$PY" - > "$OUT/gpu-d2h.json" <<'PY' || status=1
import json, time, torch
dev = torch.device("cuda")
src = torch.randn(64 << 20, device=dev)            # 256 MiB
dst = torch.empty(src.numel() * 4, dtype=torch.uint8, pin_memory=True)
side = torch.cuda.Stream()
for _ in range(2):
    with torch.cuda.stream(side):
        dst.copy_(src.view(torch.uint8), non_blocking=True)
    side.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    with torch.cuda.stream(side):
        dst.copy_(src.view(torch.uint8), non_blocking=True)
    side.synchronize()
dt = (time.perf_counter() - t0) / 10
print(json.dumps({"d2h_pinned_side_stream_gbps": round(dst.numel() / dt / 1e9, 2), "bytes": dst.numel(),
                  "device": torch.cuda.get_device_name()}))
PY

timeout 150 $LETO bench overhead --json --model gpt2 --workers 2 --rounds 2 --steps 8 --curve none --rss off \
  > "$OUT/overhead-gpu.json" 2> "$OUT/overhead-gpu.log" || status=1
timeout 100 $LETO bench recovery --json --model gpt2 --workers 2 --trials 1 --steps 12 \
  > "$OUT/recovery-gpu.json" 2> "$OUT/recovery-gpu.log" || status=1
ls -l "$OUT"
exit $status
