#!/usr/bin/env bash
# Install posttrain with its test extras into .venv (if needed) and run the default test suite.
#   bash scripts/test.sh              # default suite (under 15 minutes on 2 CPU cores)
#   bash scripts/test.sh --slow       # only the slow tests (installs Chromium for one when root with apt-get)
#   bash scripts/test.sh -k config    # any further arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh test
if [ "${1:-}" = "--slow" ]; then
  shift
  # The report's rendering test drives headless Chromium (it skips, saying why, without one).
  if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing Chromium for the report's rendering test: apt-get install -y chromium"
      apt-get install -y chromium || { apt-get update && apt-get install -y chromium; } \
        || echo "could not install Chromium; the report's rendering test will be skipped" >&2
    else
      echo "no Chromium: the report's rendering test will be skipped (Debian/Ubuntu: sudo apt-get install -y chromium)" >&2
    fi
  fi
  exec .venv/bin/python -m pytest -m slow "$@"
fi
exec .venv/bin/python -m pytest "$@"
