"""`python -m posttrain RECIPE ...` (what torchrun runs: `torchrun --nproc-per-node N -m posttrain RECIPE ...`)."""

import sys

from posttrain.cli import main

sys.exit(main())
