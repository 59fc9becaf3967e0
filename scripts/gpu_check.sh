#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device (device time is short: everything is
# prepared and tested on CPU first; see tests/test_gpu.py):
#   1. `make test-gpu` (pytest -m cuda tests/test_gpu.py): pinned staging, CUDA RNG per device,
#      fp16 GradScaler / bf16 SIGKILL + restart bitwise, steered verify, 2-process NCCL;
#   2. benchmarks/bench_checkpoint.py --device cuda: the async stall against a device-to-host copy
#      of the same bytes (the figure that matters), plus the durable saves and cold loads;
#   3. the table of training cases (tests/test_cases.py, every tier) with RIPRESA_TEST_DEVICE=cuda.
#
#   scripts/gpu_check.sh                      # all three; results under $OUT (default build/gpu)
#   scripts/gpu_check.sh tests bench          # some of them (each fits in one 10-minute call)
#   PY=python3 PARAMS=12800000 scripts/gpu_check.sh   # another interpreter (a CUDA torch), a smaller state
#
# Exit status: 0 when both ran and passed, 3 when there is no CUDA torch or device here.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
PARAMS=${PARAMS:-120000000}
PAIRS=${PAIRS:-3}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import ripresa' 2>/dev/null; then export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; fi
{ date -u; nvidia-smi 2>&1 | head -25; } > "$OUT/machine.txt"
if ! "$PY" - >>"$OUT/machine.txt" 2>&1 <<'PYEOF'
import sys, torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()} "
      f"devices {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
sys.exit(0 if torch.cuda.is_available() else 3)
PYEOF
then
    tail -3 "$OUT/machine.txt"
    echo "gpu_check: no CUDA device or no CUDA build of torch for $PY; nothing run" >&2
    exit 3
fi
tail -n +2 "$OUT/machine.txt" | grep -v '^$' | tail -5
STEPS=${*:-tests bench cases}
status=0
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
if want tests; then
echo "== tests/test_gpu.py (-m cuda)"
if [ "$PY" = .venv/bin/python ]; then
    timeout "${TEST_TIMEOUT:-480}" make test-gpu 2>&1 | tee "$OUT/test_gpu.log"
else
    timeout "${TEST_TIMEOUT:-480}" "$PY" -m pytest -q -m cuda tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
fi
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
echo "== benchmarks/bench_checkpoint.py --device cuda --params $PARAMS"
timeout "${BENCH_TIMEOUT:-420}" "$PY" benchmarks/bench_checkpoint.py --device cuda --params "$PARAMS" --pairs "$PAIRS" \
    --quiet-timeout 0 --retries 0 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want cases; then
echo "== tests/test_cases.py on the GPU (RIPRESA_TEST_DEVICE=cuda)"
RIPRESA_TEST_DEVICE=cuda timeout "${CASES_TIMEOUT:-540}" "$PY" -m pytest -q -m "slow or not slow" tests/test_cases.py \
    2>&1 | tee "$OUT/test_cases_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_check: exit $status; results in $OUT"
exit $status
