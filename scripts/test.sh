#!/usr/bin/env bash
# The project's tests, cheapest tier first (pytest collects tests/ in name
# order: format, store, writer, copier, reader, ...). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test: run 'bash scripts/setup.sh' first" >&2; exit 2; }
exec .venv/bin/python -m pytest -q -ra "$@"
