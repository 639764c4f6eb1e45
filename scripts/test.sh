#!/usr/bin/env bash
# Install posttrain with its test extras into .venv (if needed) and run the default test suite.
#   bash scripts/test.sh              # default suite (under 15 minutes on 2 CPU cores; installs Xvfb and xdotool
#                                     # for the computer-use tests when root with apt-get)
#   bash scripts/test.sh --slow       # only the slow tests (installs Chromium for the report's browser tests when
#                                     # root with apt-get, and the `browser` extra, playwright, that drives it)
#   bash scripts/test.sh -k config    # any further arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${1:-}" = "--slow" ]; then
  bash scripts/setup.sh test,browser
  shift
  # The report's browser tests drive headless Chromium (they skip, saying why, without one).
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
bash scripts/setup.sh test
# The computer-use tests run an Xvfb desktop driven by xdotool (they skip, saying why, without them).
if ! command -v Xvfb >/dev/null || ! command -v xdotool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Xvfb and xdotool for the computer-use tests: apt-get install -y xvfb xdotool"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y xvfb xdotool || { apt-get update && apt-get install -y xvfb xdotool; } \
      || echo "could not install Xvfb and xdotool; the computer-use tests will be skipped" >&2
  else
    echo "no Xvfb or xdotool: the computer-use tests will be skipped (Debian/Ubuntu: sudo apt-get install -y xvfb xdotool)" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
