#!/usr/bin/env bash
# The project's tests, cheapest tier first (tests/conftest.py's TIERS: the
# repository's structure, format, metrics, store, writer, copier, history,
# reader, mount, CLI, security and fuzzing, end to end, faults, torture,
# Spark, SQLite's own suite, the benchmark's smoke test). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test: run 'bash scripts/setup.sh' first" >&2; exit 2; }
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
