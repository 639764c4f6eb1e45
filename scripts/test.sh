#!/usr/bin/env bash
# Install posttrain with its test extras into .venv (if needed) and run the default test suite.
#   bash scripts/test.sh              # default suite (under 15 minutes on 2 CPU cores)
#   bash scripts/test.sh --slow       # only the slow tests
#   bash scripts/test.sh -k config    # any further arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh test
if [ "${1:-}" = "--slow" ]; then
  shift
  exec .venv/bin/python -m pytest -m slow "$@"
fi
exec .venv/bin/python -m pytest "$@"
