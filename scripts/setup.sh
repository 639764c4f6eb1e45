#!/usr/bin/env bash
# Create or update .venv with posttrain installed in editable mode.
#
#   bash scripts/setup.sh            # runtime dependencies only
#   bash scripts/setup.sh test       # plus the test extras (comma-separate several: test,bench)
#
# Idempotent: when pyproject.toml and the requested extras have not changed since the last
# successful run, it returns in well under a second.
#
# PyTorch: without an NVIDIA GPU the pinned CPU build (torch==$TORCH_VERSION) is installed
# first, so that no dependency pulls a multi-GB CUDA build. Set POSTTRAIN_TORCH_INDEX to a
# wheel index (for example PyTorch's CPU index) to take torch from there instead.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
EXTRAS="${1:-}"
TORCH_VERSION="${POSTTRAIN_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

stamp_file="$VENV/.posttrain-setup-stamp"
stamp="$(cat pyproject.toml | sha256sum | cut -c1-16) extras=$EXTRAS gpu=$has_gpu torch=$TORCH_VERSION"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
  exit 0
fi

if [ "$has_gpu" = 0 ] && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "[setup] installing the CPU build of torch==$TORCH_VERSION"
  if [ -n "${POSTTRAIN_TORCH_INDEX:-}" ]; then
    "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url "$POSTTRAIN_TORCH_INDEX"
  else
    "${PIP[@]}" install "torch==$TORCH_VERSION" 2> >(grep -v "^WARNING: Location" >&2)
  fi
fi

target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
echo "[setup] installing posttrain${EXTRAS:+ with extras [$EXTRAS]} (editable)"
"${PIP[@]}" install -e "$target" 2> >(grep -v "^WARNING: Location" >&2)
echo "$stamp" > "$stamp_file"
echo "[setup] ready: $VENV"
