#!/usr/bin/env bash
# The GPU campaign in one call of under 10 minutes, on a machine with one CUDA GPU (an H100 or
# H200: torch with CUDA, nvcc, no network needed), from the repository root:
#
#   bash benchmarks/gpu/run.sh                      # build with CUDA, gpu tests, GPU bench
#   BUDGET=540 bash benchmarks/gpu/run.sh           # seconds for the whole run (default 570)
#   bash benchmarks/gpu/run.sh --steps facts,bench  # some steps only (facts build tests bench)
#
# Steps: facts (GPU, driver, torch, nvcc, cores, memory, disk), build (the extension with CUDA for
# this GPU's architecture; fails the run if the build has no CUDA), tests (the gpu-marked tests,
# and the plan-cache tests on the CUDA build), bench (python -m benchmarks.gpu_bench: 124m, 1.3b
# and the largest state the host allows; blocking as a share of torch.save + fsync, the first
# save, the call per tensor, throughput overhead at a cadence where persist keeps up). Each step
# gets the time left; the bench gets what the others left.
#
# Results: one folder, $OUT/gpu-results when $OUT is set (a device tool brings $OUT back), else
# benchmarks/results/gpu-<date>/: summary.md (what ran, what was skipped and why, the bench's
# table), facts.txt, build.log, tests.log, bench.log, gpu_bench.md, gpu_bench.json. Commit that
# folder.
#
# Python packages the machine lacks (crc32c for the pure-PyTorch path the tests compare with):
# put their wheels in .whl/ (see /work/.library/device/README.md for `pip download`); they are
# installed into /tmp/nebula-site, nothing else is installed.
#
# Without a CUDA GPU the run stops at once with exit status 3 and says why. --allow-cpu runs the
# steps that need no GPU (facts, tests, and the bench's code with a tiny model on the CPU; add
# --no-build to skip compiling), to check this script (tests/bench/test_gpu_campaign.py does).
set -u -o pipefail
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-570}
STEPS=facts,build,tests,bench
ALLOW_CPU=0
for arg in "$@"; do
  case $arg in
    --allow-cpu) ALLOW_CPU=1 ;;
    --no-build) STEPS=${STEPS//build,/} ;;
    --steps=*) STEPS=${arg#--steps=} ;;
    --steps) echo "use --steps=a,b" >&2; exit 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done
[ -f setup.py ] && [ -d nebula_ckpt ] || { echo "run.sh: run it from the repository root" >&2; exit 2; }
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
DEST=${DEST:-${OUT:+$OUT/gpu-results}}
DEST=${DEST:-benchmarks/results/gpu-$(date +%Y-%m-%d)}
mkdir -p "$DEST"
SUMMARY=$DEST/summary.md
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; echo "- [$(( $(date +%s) - T0 )) s] $*" >> "$SUMMARY"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
echo "# GPU campaign, $(date -u +%Y-%m-%dT%H:%MZ)" > "$SUMMARY"
echo "" >> "$SUMMARY"

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nebula-site .whl/*.whl \
    && export PYTHONPATH=/tmp/nebula-site${PYTHONPATH:+:$PYTHONPATH} && say "wheels from .whl/ installed into /tmp/nebula-site"
fi

CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
if [ -z "$CUDA" ]; then
  say "FAILED: $PY cannot import torch (set PYTHON to the interpreter that has it); nothing was run"
  exit 3
fi
if [ "$CUDA" != 1 ]; then
  if [ "$ALLOW_CPU" != 1 ]; then
    say "FAILED: no CUDA GPU here (torch.cuda.is_available() is not True for $PY); nothing was run"
    exit 3
  fi
  say "no CUDA GPU: --allow-cpu, so the GPU steps run their CPU parts only"
fi

if has facts; then
  say "facts"
  { date -u; nvidia-smi 2>&1 | head -20
    $PY -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda)
if torch.cuda.is_available(): print(torch.cuda.get_device_properties(0))"
    nvcc --version 2>&1 | tail -1; echo "cores $(nproc)"; free -g; df -h . /dev/shm; uname -r; uptime
  } > "$DEST/facts.txt" 2>&1
fi

if has build; then
  say "build (the extension, with CUDA for this GPU)"
  ARCH=$($PY -c "import torch; c=torch.cuda.get_device_capability(0); print(f'{c[0]}.{c[1]}')" 2>/dev/null)
  rm -rf build; find nebula_ckpt -name '_C*.so' -delete
  TORCH_CUDA_ARCH_LIST=${ARCH:-} MAX_JOBS=$(nproc) timeout "$(left)" $PY setup.py build_ext --inplace > "$DEST/build.log" 2>&1
  rc=$?
  DESC=$($PY -c "import json, nebula_ckpt.native as n; print(json.dumps(n.describe()))" 2>&1 | tail -1)
  say "build rc=$rc; $DESC"
  if [ "$CUDA" = 1 ] && [[ "$DESC" != *'"cuda": true'* ]]; then
    say "FAILED: the extension was not built with CUDA (see build.log); the bench would measure the wrong path"
    exit 4
  fi
fi

if has tests; then
  say "tests: the gpu-marked tests, and the plan cache's on this build"
  L=$(left); T=$(( L / 3 < 180 ? L / 3 : 180 )); T=$(( T < 60 ? 60 : T ))
  timeout "$T" $PY -m pytest -m gpu tests/native/test_gpu.py tests/native/test_native.py \
    -p no:cacheprovider -q -rfEs --timeout 240 > "$DEST/tests.log" 2>&1
  say "gpu tests: rc=$? $(grep -E '(passed|failed|skipped|error)' "$DEST/tests.log" | tail -1)"
  if [ "$CUDA" = 1 ]; then
    timeout 120 $PY -m pytest tests/save/test_plan_cache.py -p no:cacheprovider -q --timeout 120 >> "$DEST/tests.log" 2>&1
    say "plan cache tests: rc=$? $(tail -1 "$DEST/tests.log")"
  fi
fi

if has bench; then
  B=$(( $(left) - 15 ))
  if [ "$CUDA" = 1 ]; then
    ARGS="--models ${MODELS:-124m,1.3b,largest} --device cuda"
  else
    ARGS="--models tiny --device cpu --reps 1 --quick"
  fi
  say "bench ($ARGS, ${B} s)"
  # shellcheck disable=SC2086
  timeout "$(( B + 10 ))" $PY -m benchmarks.gpu_bench $ARGS --budget-s "$B" --out "$DEST" > "$DEST/bench.log" 2>&1
  say "bench rc=$?"
  [ -f "$DEST/gpu_bench.md" ] && { echo ""; cat "$DEST/gpu_bench.md"; } >> "$SUMMARY"
fi
say "done in $(( $(date +%s) - T0 )) s; results in $DEST"
