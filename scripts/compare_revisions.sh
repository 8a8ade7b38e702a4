#!/usr/bin/env bash
# Run the same benchmark commands on two checkouts in turns (A, B, A, B, ...) and keep every
# output, so a regression shows against the base measured in the same run on the same machine.
#
#   bash scripts/compare_revisions.sh BASE_DIR NEW_DIR ROUNDS OUT_DIR 'cmd 1' 'cmd 2' ...
#
# Each command runs from the checkout's root with that checkout's src first on PYTHONPATH,
# e.g. 'python benchmarks/bench_stream.py --quick'. Outputs: OUT_DIR/<n>-<base|new>-<round>.txt.
set -euo pipefail
base=$1 new=$2 rounds=$3 out=$4
shift 4
mkdir -p "$out"
n=0
for cmd in "$@"; do
    n=$((n + 1))
    for r in $(seq 1 "$rounds"); do
        for side in base new; do
            dir=$base
            [ "$side" = new ] && dir=$new
            echo "== [$n/$#] $side round $r: $cmd" >&2
            (cd "$dir" && PYTHONPATH=src timeout 900 bash -c "$cmd") >"$out/$n-$side-$r.txt" 2>&1 ||
                echo "   (exit $?)" >&2
        done
    done
done
