#!/usr/bin/env bash
# The whole test suite: install (test, benchmark and peer extras: the benchmarks smoke-run in
# pytest, and tests/peers runs DeepSpeed's, Megatron-LM's and TransferQueue's own code beside
# meshfeed), lint, format check, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch is pinned in the same command: TransferQueue's stack (bench extra) must not move it.
python -m pip install --quiet "torch==2.13.0" -e ".[test,bench,peers]"
python -m ruff check --output-format concise .
python -m ruff format --check .
python -m mypy
python -m pytest -q "$@"
