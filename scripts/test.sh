#!/usr/bin/env bash
# The whole test suite: install (test, benchmark and peer extras: the benchmarks smoke-run in
# pytest, and tests/peers runs DeepSpeed's, Megatron-LM's and TransferQueue's own code beside
# meshfeed), lint, format check, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0" -e ".[test,bench,peers]"
# TransferQueue's samplers are plain Python files; its controller's dependencies (a ZMQ and
# Hydra stack) are not needed by the tests, which load the sampler modules directly.
python -m pip install --quiet --no-deps "transferqueue==0.1.11"
python -m ruff check --output-format concise .
python -m ruff format --check .
python -m mypy
python -m pytest -q "$@"
