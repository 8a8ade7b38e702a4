#!/usr/bin/env bash
# The whole test suite: install (test and benchmark extras: the benchmarks smoke-run in pytest),
# lint, format check, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0" -e ".[test,bench]"
python -m ruff check --output-format concise .
python -m ruff format --check .
python -m mypy
python -m pytest -q "$@"
