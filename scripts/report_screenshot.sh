#!/usr/bin/env bash
# Regenerate docs/images/report.png: the top of a real run's report.html, rendered by headless Chromium, 1200 px wide.
#   bash scripts/report_screenshot.sh            # first a 60-step GRPO run of the embedded model into
#                                                # runs/report_example (about a minute on 2 CPU cores; the first
#                                                # time also builds its SFT start model, a few minutes more)
#   bash scripts/report_screenshot.sh RUN_DIR    # the report of a run you already have
# Needs Chromium (Debian: apt-get install -y chromium).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "needs Chromium: apt-get install -y chromium (Debian/Ubuntu)" >&2
  exit 1
fi
run_dir=${1:-runs/report_example}
if [ -z "${1:-}" ]; then
  rm -rf "$run_dir"  # this script's own run: start it afresh rather than resume it
  .venv/bin/posttrain grpo --config configs/grpo_arithmetic.yaml output_dir="$run_dir" trainer.max_steps=60 \
    trainer.eval_every=20 trainer.save_every=0 data.max_eval_examples=64 logging.progress=plain
fi
.venv/bin/posttrain report "$run_dir"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# --no-sandbox: Chromium refuses to start as root without it; the page is a local file with no network access.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=3000 \
  --user-data-dir="$scratch/profile" --window-size=1200,1500 --screenshot="$scratch/report.png" \
  "file://$(realpath "$run_dir")/report.html" 2>/dev/null
mkdir -p docs/images
# 64 colours are plenty for text, grid and curves, and keep the PNG a fraction of its full-colour size.
.venv/bin/python - "$scratch/report.png" docs/images/report.png <<'PY'
import sys

from PIL import Image

with Image.open(sys.argv[1]) as image:
    image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(sys.argv[2], optimize=True)
PY
echo "wrote docs/images/report.png ($(du -k docs/images/report.png | cut -f1) KB) from $run_dir/report.html"
