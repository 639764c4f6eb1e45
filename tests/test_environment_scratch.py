"""An environment worker's scratch folder (posttrain.distributed.scratch): a worker killed with SIGKILL leaves a
program running in a session of its own and a temporary folder; cleaning up after it stops that program, and only
that one, and removes the folder. No Ray: the worker is a plain process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.distributed import scratch

WORKER = textwrap.dedent("""
    import subprocess, sys, tempfile, time
    from pathlib import Path
    from posttrain.distributed import scratch

    scratch.claim(Path(sys.argv[1]))
    program = subprocess.Popen(["sleep", "600"], start_new_session=True)  # as a desktop's X server is started
    print(program.pid, tempfile.mkdtemp(prefix="episode-"), flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="processes are found through /proc (Linux)")
def test_cleaning_up_after_a_killed_worker_stops_its_orphaned_programs_and_removes_its_folder(tmp_path):
    folder = tmp_path / "worker-0"
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)  # not the worker's: must survive
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(folder)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pid, episode = worker.stdout.readline().split()
        pid = int(pid)
        assert Path(episode).parent == folder / "tmp" and Path(episode).is_dir()  # temporary folders land there
        token = (folder / scratch.OWNER_FILE).read_text()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        assert scratch._running(pid)  # the killed worker's program outlives it
        assert scratch.processes_of(json.loads(token)["token"]) == [pid]

        cleanup = scratch.clean_up(folder)
        assert cleanup == scratch.Cleanup((pid,), True)
        assert not scratch._running(pid) and not folder.exists()
        assert stranger.poll() is None  # nothing without the worker's token is touched
        assert scratch.clean_up(folder) == scratch.Cleanup((), False)  # nothing left to do
    finally:
        for process in (stranger, worker):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
