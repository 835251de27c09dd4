#!/usr/bin/env bash
# The GPU check: one command on a GPU host, within GPU_CHECK_BUDGET_S (540 s) in all. It
#   1. finds a CUDA build of torch (this checkout's .venv, else the host's python3, else installs
#      one) and Leto (installed, else this checkout's src/ on PYTHONPATH; wheels carried in ./.whl
#      install to a folder on PYTHONPATH, for a host that reaches no registry),
#   2. runs the recovery tests on CUDA (every test picks the GPU when there is one: a worker
#      SIGKILLed in three phases, two nodes of a 2+2 stripe lost, a shrink with no shadow left
#      (the resharded path), digests exact against a failure-free CUDA run; ranks share the one
#      GPU over gloo with host copies, NCCL where each rank has a GPU),
#   3. measures device-to-host bandwidth (pinned on a side stream, pageable, and through
#      `HostStaging`), `leto bench overhead` (one round, no persistence calibration run) and
#      `leto bench recovery` (Leto alone: a worker SIGKILL and a node loss) on CUDA with a model
#      that keeps the GPU busy (gpt2),
# and writes its JSON and logs to $OUT (docs/results/ when OUT is unset) as it goes, each step
# under its own timeout, so a step that fails or hangs leaves the others' results.
# GPU_CHECK_CPU=1 runs the same steps on the CPU (the script's own check where no GPU is; the
# bandwidth step is skipped) and GPU_CHECK_MODEL picks the benches' model (tiny for that check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-docs/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
END=$((START + ${GPU_CHECK_BUDGET_S:-540}))
MODEL=${GPU_CHECK_MODEL:-gpt2}
LOG=$OUT/gpu-check.log
RUNS=$(mktemp -d /tmp/leto-gpu-runs.XXXXXX)
exec 3>&1  # the script's own lines, whatever a step's output is redirected to
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS: exact digests
say() { echo "[gpu-check +$(($(date +%s) - START))s] $*" | tee -a "$LOG" >&3; }
# the timeout of a step: its cap, or what is left of the budget less a reserve for later steps
limit() { local left=$((END - $(date +%s) - ${2:-0})); echo $((left < $1 ? (left > 5 ? left : 5) : $1)); }
status=0
step() {  # step NAME CAP RESERVE CMD...: run CMD under its timeout, log its exit status and time
  local name=$1 cap=$2 reserve=$3 t0=$SECONDS rc
  shift 3
  local lim
  lim=$(limit "$cap" "$reserve")
  say "$name: start (timeout ${lim}s)"
  timeout -k 10 "$lim" "$@" 3>&-
  rc=$?
  [ $rc -eq 0 ] || status=1
  say "$name: exit $rc after $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' (timed out)')"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader \
    2>&1 | sed 's/^/  still on the GPU: /' | tee -a "$LOG" >&3
  return $rc
}
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
  cuda_ok() { "$1" -c 'import torch' 2>/dev/null; }
else
  cuda_ok() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
fi

: > "$LOG"
say "host: $(uname -srm), $(nproc) CPUs, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB memory"}')"
command -v nvidia-smi > /dev/null && nvidia-smi >> "$LOG" 2>&1
PY=${GPU_CHECK_PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && cuda_ok .venv/bin/python; then
    PY=$ROOT/.venv/bin/python
  elif cuda_ok python3; then  # the host's own CUDA torch
    PY=$(command -v python3)
  else
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} scripts/install.sh >> "$LOG" 2>&1  # the default index's wheel is CUDA
    PY=$ROOT/.venv/bin/python
  fi
fi
cuda_ok "$PY" || { say "no CUDA device visible to torch ($PY)"; exit 1; }
# Leto's own dependencies carried as wheels (a host that reaches no registry)
WHL=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHL/*.whl" > /dev/null; then
  SITE=${GPU_CHECK_SITE:-/tmp/leto-site}
  step wheels 60 0 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/*.whl >> "$LOG" 2>&1
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c 'import leto.cli' 2>/dev/null; then
  if "$PY" -c 'import torch' && PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import leto.cli' 2>/dev/null; then
    export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}  # this checkout, not installed
  else  # a host with a registry: a venv over the host's torch
    python3 -m venv --system-site-packages .venv-gpu && PY=$ROOT/.venv-gpu/bin/python
    "$PY" -m pip install -q -e '.[dev]' >> "$LOG" 2>&1 || "$PY" -m pip install -q --no-deps -e . >> "$LOG" 2>&1
  fi
fi
"$PY" -c 'import leto.cli' >> "$LOG" 2>&1 || { say "Leto does not import with $PY"; exit 1; }
say "python: $PY; PYTHONPATH=${PYTHONPATH:-}"
"$PY" - >> "$LOG" 2>&1 <<'PY'
import os, sys, torch, leto
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "leto from", os.path.dirname(leto.__file__))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print("device", torch.cuda.device_count(), "x", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free)")
print("os.cpu_count", os.cpu_count(), "sched_getaffinity", len(os.sched_getaffinity(0)))
PY
# the corpus: prepared here (it downloads from Debian's registry), or carried in as ./leto-data
[ -d leto-data ] && export LETO_DATA_DIR=${LETO_DATA_DIR:-$ROOT/leto-data}
"$PY" -c 'from leto.training.corpus import load_tokens; load_tokens()' 2>> "$LOG" \
  || "$PY" -m leto.cli data prepare >> "$LOG" 2>&1 || { say "no corpus (carry ~/.cache/leto as ./leto-data)"; exit 1; }

if [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
  step d2h 60 400 "$PY" - > "$OUT/gpu-d2h.json" 2>> "$LOG" <<'PY'
import json, time, torch
from leto.protection.staging import HostStaging
dev = torch.device("cuda")
src = torch.randn(64 << 20, device=dev)  # 256 MiB, random (zeros can copy faster)
nbytes = src.numel() * 4
side = torch.cuda.Stream()
def rate(copy, reps=10):
    for _ in range(2):
        copy()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        copy()
    torch.cuda.synchronize()
    return round(nbytes * reps / (time.perf_counter() - t0) / 1e9, 2)
pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
pageable = torch.empty(nbytes, dtype=torch.uint8)
def on_side(dst):
    with torch.cuda.stream(side):
        dst.copy_(src.view(torch.uint8), non_blocking=True)
    side.synchronize()
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes": nbytes, "reps": 10}
out["d2h_pinned_side_stream_gbps"] = rate(lambda: on_side(pinned))
out["d2h_pageable_gbps"] = rate(lambda: pageable.copy_(src.view(torch.uint8)))
out["h2d_pinned_gbps"] = rate(lambda: src.view(torch.uint8).copy_(pinned, non_blocking=True))
chunk = 64 << 20  # Leto's path: chunk by chunk through HostStaging's two pinned slots
staging, parts = HostStaging(chunk, dev), src.view(torch.uint8).split(chunk)
def staged():
    for i, p in enumerate(parts):
        staging.host(p, i % 2)
out["host_staging_64mib_chunks_gbps"] = rate(staged)
assert bytes(staging.host(parts[-1], 1)[:64]) == parts[-1][:64].cpu().numpy().tobytes()
print(json.dumps(out))
PY
  cat "$OUT/gpu-d2h.json"
fi

step tests 200 250 "$PY" -m pytest -p no:cacheprovider -v --durations=0 tests/test_staging.py \
  tests/test_sharded_optimizer.py tests/test_recovery.py \
  -k "staging or sharded or 2_plus_2 or no_shadow_left or balanced_shrink or (any_phase and (1-update-auto or 3-grads-on or 2-reduce-scatter))" \
  > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"

# `leto bench overhead` without its persistence calibration run: that run and the long persisting
# run it plans (2 checkpoints at Young/Daly's K) do not fit the check's budget; the bench's
# persisting run is then the plain run's length and its persistence figures say they do not count
step overhead 170 120 "$PY" - bench overhead --json --model "$MODEL" --workers 2 --rounds 1 --steps 6 \
  --curve none --rss off > "$OUT/overhead-gpu.json" 2> "$OUT/overhead-gpu.log" <<'PY'
import sys
from leto.bench import overhead
from leto.cli import main
overhead.calibrate_k = lambda *a, **k: None
sys.exit(main(sys.argv[1:]))
PY

# `leto bench recovery` for Leto alone (the restart baselines' runs do not fit the budget)
step recovery 150 0 "$PY" - bench recovery --json --model "$MODEL" --workers 2 --trials 1 --steps 12 \
  --out "$RUNS" > "$OUT/recovery-gpu.json" 2> "$OUT/recovery-gpu.log" <<'PY'
import sys
from leto.bench import recovery
from leto.cli import main
every = recovery.systems_for
recovery.systems_for = lambda failure: [s for s in every(failure) if s.name == recovery.LETO]
sys.exit(main(sys.argv[1:]))
PY
# the recovery runs' own logs and records (small files only), for a failure's diagnosis
(cd "$RUNS" && find . -type f -size -1024k \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \) -print0 \
  | tar -czf "$OUT/recovery-runs.tar.gz" --null -T -) 2>> "$LOG" || true

say "done: exit $status"
for f in gpu-d2h.json overhead-gpu.json recovery-gpu.json; do
  [ -s "$OUT/$f" ] && echo "$f: $(head -c 600 "$OUT/$f")"
done
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -2
ls -l "$OUT"
exit $status
