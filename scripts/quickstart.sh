#!/usr/bin/env bash
# Install posttrain into .venv (if needed) and run the quickstart: build the embedded tiny model,
# measure it on held-out arithmetic, fine-tune it with SFT on a small labelled pool, continue SFT as a
# control, improve it with GRPO from a verifier, and print the before/after table.
# Extra arguments are passed to `posttrain quickstart` (for example output_dir=runs/qs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/posttrain quickstart "$@"
