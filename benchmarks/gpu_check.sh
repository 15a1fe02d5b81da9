#!/usr/bin/env bash
# The GPU check as ONE prepared command, for a machine with a CUDA GPU: the versions, the
# CUDA tests (tests/gpu, marked `cuda`) and benchmarks/gpu.py, each under a time limit.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; ~5 minutes at most
#
# Limits (seconds): GPU_TEST_TIMEOUT (default 360) for the tests, GPU_BENCH_TIMEOUT (240) for
# the benchmark. With $OUT set (the device tool), the whole log is also written to
# $OUT/gpu_check.log. Exit status: 0 when both passed, else the first failure's.
#
# A machine whose Python lacks tensorshare's dependencies (the device image has torch,
# msgpack, numpy and rich, but not Twisted or lz4) takes them as wheels carried in .whl/ at
# the repository root (ignored by git), made once on a machine with pip:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl twisted zope.interface automat constantly hyperlink incremental lz4
#
# and carried with the call (device tool: carry [".whl"]); this script installs them.
set -u
cd "$(dirname "$0")/.."
log="${OUT:-}"
if [ -n "$log" ]; then exec > >(tee "$log/gpu_check.log") 2>&1; fi
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tensorshare-site .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/tensorshare-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
"$py" - <<'PY' || exit 2
import sys, torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
      f"cuda.is_available()={torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, uuid {p.uuid}")
missing = []
for name in ("twisted", "msgpack", "lz4", "numpy", "rich", "pytest", "pytest_timeout"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    print("missing Python packages:", ", ".join(missing), "(carry them as wheels: see the "
          "top of benchmarks/gpu_check.sh)")
    sys.exit(1)
PY
status=0
echo "== the CUDA tests"
timeout "${GPU_TEST_TIMEOUT:-360}" "$py" -m pytest -m cuda tests/gpu -q -rs --timeout 180 \
  -p no:cacheprovider
rc=$?; [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
echo "== benchmarks/gpu.py"
timeout "${GPU_BENCH_TIMEOUT:-240}" "$py" benchmarks/gpu.py --quick
rc=$?; [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
echo "== exit status $status"
exit $status
