#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (torch + numpy + pytest, no extras, maybe
# no network): the gpu tests, the quick suite on that stack, then bench_gpu.py (the GPU loop,
# then the grid) with the time left. Each part has its own time limit, so a slow part cannot
# starve the next one.
#     OUT=/tmp/gpu bash scripts/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
start=$(date +%s)
{
    nvidia-smi -L
    python3 -c "import sys, numpy, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
    echo "cores: $(nproc)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-180}" python3 -m pytest tests/test_gpu.py -v -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/test_gpu.log"
workers=""
python3 -c "import xdist" 2>/dev/null && workers="-n $(( $(nproc) - 2 ))"
timeout "${SUITE_S:-90}" python3 -m pytest -q -rfEs -m "not slow and not gpu" -p no:cacheprovider \
    $workers > "$OUT/suite.log" 2>&1
tail -n 5 "$OUT/suite.log"
timeout 120 python3 benchmarks/bench_pinned_wait.py 2>&1 | tee "$OUT/pinned_wait.md"
left=$(( ${TOTAL_S:-480} - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/bench_gpu.py --out "$OUT/gpu.md" 2>&1 | tee "$OUT/bench.log"
echo "done in $(( $(date +%s) - start )) s"
