#!/usr/bin/env bash
# Driver of the GPU session (run in the repository root of the device machine, $OUT set):
#   bash benchmarks/results/gpu-h100-2026-11-25/run_gpu.sh STEPS...
# STEPS: facts build describe tests broad quick bench (each writes its log under $OUT/w/).
# Python wheels the image lacks (crc32c, zstandard) travel in .whl/.
set -u -o pipefail
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
T0=$(date +%s)
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | tail -2
fi
for step in "$@"; do
  case $step in
  facts)
    say facts
    { date -u; nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv;
      python3 -c "import torch,sys;print('python',sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda);p=torch.cuda.get_device_properties(0);print(p)";
      nvcc --version | tail -2; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)'; free -g; df -h / /dev/shm /tmp; uname -r;
      python3 -m pip list 2>/dev/null | grep -iE '^(torchsnapshot|safetensors|fsspec|psutil|tqdm|zstandard|crc32c|numpy|matplotlib) '; } > "$W/facts.txt" 2>&1
    cat "$W/facts.txt";;
  build)
    say build
    rm -rf build; find nebula_ckpt -name '_C*.so' -delete
    TORCH_CUDA_ARCH_LIST=9.0 timeout 300 python3 setup.py build_ext --inplace > "$W/build.log" 2>&1; rc=$?
    grep -iE "error|warning" "$W/build.log" | grep -v "^\[" | head -40; echo "build rc=$rc"
    readelf -d nebula_ckpt/_C*.so | grep NEEDED; cp nebula_ckpt/_C*.so "$OUT/" 2>/dev/null;;
  diag3)
    say "diag3: a change after enqueue while the copy is held back"
    timeout 60 python3 - <<'PY' 2>&1 | tee "$W/diag3.txt"
import time, torch
from nebula_ckpt import _C
a, b = torch.ones(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")
dst = _C.alloc_host_buffer(a.nbytes + b.nbytes, pinned=True)
print("dst pinned:", dst.is_pinned())
torch.cuda.synchronize()
t = time.perf_counter(); torch.cuda._sleep(int(1e9)); torch.cuda.synchronize(); print("sleep 1e9 cycles: %.3f s" % (time.perf_counter() - t))
for keep in (True, False):
    torch.cuda._sleep(int(1e9))
    t0 = time.perf_counter()
    eng = _C.CopyEngine(2)
    job = eng.enqueue([a, b], dst, [0, a.nbytes])
    t1 = time.perf_counter()
    if not keep:
        del eng
    d0, v0 = job.done(), b._version
    b.add_(1.0)
    t2 = time.perf_counter()
    v1, d1 = b._version, job.done()
    job.wait()
    t3 = time.perf_counter()
    print(f"keep_engine={keep} enqueue {t1-t0:.4f}s done_after_enqueue={d0} version {v0}->{v1} "
          f"done_after_add={d1} add {t2-t1:.4f}s wait {t3-t2:.4f}s modified={job.modified()} seconds={job.seconds():.4f}")
PY
    ;;
  describe)
    say describe
    python3 -c "import json, nebula_ckpt.native as n; print(json.dumps(n.describe()))" 2>&1 | tee "$W/describe.txt";;
  diag)
    say "diag: test_gpu alone, test_native alone, both under cuda-gdb"
    timeout 120 python3 -m pytest tests/test_gpu.py -p no:cacheprovider -q -rA --tb=short > "$W/gpu_only.log" 2>&1
    echo "gpu_only rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$W/gpu_only.log" | tail -20
    grep -B2 -A25 "^_____" "$W/gpu_only.log" | head -80
    for init in "" "torch.zeros(1, device='cuda');"; do
      timeout 60 python3 -X faulthandler -c "import torch; from nebula_ckpt import _C; $init
e = _C.CopyEngine(2)
for bad in (torch.empty(3, device='meta'), torch.eye(3).to_sparse()):
    try:
        e.enqueue([torch.zeros(4), bad], torch.empty(100, dtype=torch.uint8), [0, 16])
    except RuntimeError as x:
        print('raised:', str(x).splitlines()[0])" 2>&1 | tail -12; echo "meta[$init] rc=$?"
    done
    timeout 120 python3 -m pytest tests/test_native.py -p no:cacheprovider -q -rfE --tb=short > "$W/native_only.log" 2>&1
    echo "native_only rc=$?"; tail -5 "$W/native_only.log"
    timeout 150 cuda-gdb -q -batch -ex "set pagination off" -ex "set confirm off" -ex run -ex "bt 40" \
      -ex "info threads" -ex "thread apply all bt 10" --args python3 -m pytest tests/test_gpu.py tests/test_native.py \
      -p no:cacheprovider -q --tb=short -p no:faulthandler > "$W/gdb.log" 2>&1
    echo "gdb rc=$?"; grep -vE "^\[(New|Thread .* exited)" "$W/gdb.log" | tail -90;;
  tests)
    say tests
    timeout ${TESTS_MAX:-$(left)} python3 -m pytest ${TESTS:-tests/test_gpu.py tests/test_native.py tests/test_consistency.py \
      tests/test_roundtrip.py tests/test_paths.py tests/test_copy_race.py} -p no:cacheprovider -q -rfEs --timeout 240 \
      --junitxml="$W/tests.xml" > "$W/tests.log" 2>&1; echo "tests rc=$?"; tail -40 "$W/tests.log";;
  gpu)
    say gpu-marked
    timeout $(( $(left) - ${RESERVE:-0} )) python3 -m pytest tests/test_gpu.py tests/test_native.py -m gpu -p no:cacheprovider -q -rfEs \
      --timeout 240 > "$W/gpu.log" 2>&1; echo "gpu rc=$?"; tail -30 "$W/gpu.log";;
  broad)
    say broad
    timeout $(( $(left) - ${RESERVE:-0} )) python3 -m pytest -m "not slow and not blob" -p no:cacheprovider -q -rfE --timeout 120 \
      --ignore=tests/test_gpu.py --ignore=tests/test_native.py --ignore=tests/test_consistency.py \
      --ignore=tests/test_roundtrip.py --ignore=tests/test_paths.py --ignore=tests/test_copy_race.py \
      --ignore=tests/integrations --ignore=tests/blob > "$W/broad.log" 2>&1; echo "broad rc=$?"; tail -25 "$W/broad.log";;
  quick)
    say quick bench
    timeout $(( $(left) - ${RESERVE:-0} )) python3 -m nebula_ckpt.cli bench --quick --no-plot --out "$W/quick" > "$W/quick.log" 2>&1
    echo "quick rc=$?"; tail -30 "$W/quick.log";;
  bench)
    say bench "${BENCH_ARGS:-}"
    grep -q '"cuda": true' "$W/describe.txt" 2>/dev/null || { echo "no CUDA build: bench skipped"; continue; }
    # shellcheck disable=SC2086
    timeout $(( $(left) - ${RESERVE:-0} )) python3 -m nebula_ckpt.cli bench ${BENCH_ARGS:-} --out "$W/bench" > "$W/bench.log" 2>&1
    echo "bench rc=$?"; tail -40 "$W/bench.log";;
  esac
done
say done
tar czf "$OUT/w.tgz" -C "$OUT" w && rm -rf "$W"
