"""Read at interpreter start-up by every Python process that has this folder on its PYTHONPATH (the test puts it
there for torchrun and its ranks). With POSTTRAIN_PICKLED_WORKERS set to a file path, every recipe's workers are
seen through pickle (tests/pickled_workers.py) and each process appends the names it asked of them to that file,
one JSON list per process, when it exits."""

import atexit
import json
import os
import sys

_record = os.environ.get("POSTTRAIN_PICKLED_WORKERS")
if _record:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for pickled_workers
    import pickled_workers

    _calls = pickled_workers.pickle_every_worker()

    @atexit.register
    def _write_calls() -> None:
        if _calls:
            with open(_record, "a") as file:
                file.write(json.dumps(sorted(set(_calls))) + "\n")
