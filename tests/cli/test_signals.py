"""``mixprec train`` stopped by a signal sent to its main process alone (a job scheduler,
``kill -INT <pid>``, an IDE's stop button) or to its whole process group (Ctrl-C): the worker
process that trains goes too, one line says so, and the exit status is 128 + the signal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

# Long enough never to finish within a test; synthetic data trains an epoch in well under 1 s.
TRAIN = ["train", "--data", "synthetic", "--epochs", "100000", "--compare", "none",
         "--policy", "float32"]  # fmt: skip
STARTUP_S = 90  # a deadline for the worker's first epoch on a loaded machine, not a sleep
STOP_S = 10  # the stop must be prompt
POLL_S = 0.05


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while the folder was listed
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()


def _sigint_as_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("signum", "group", "status"),
    [
        (signal.SIGINT, False, 130),
        (signal.SIGTERM, False, 143),
        (signal.SIGKILL, False, -signal.SIGKILL),
        (signal.SIGINT, True, 130),
    ],
    ids=["SIGINT", "SIGTERM", "SIGKILL", "SIGINT-to-group"],
)
def test_a_signal_stops_the_worker_and_exits_promptly(tmp_path, signum, group, status):
    out, err = tmp_path / "out", tmp_path / "err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the epoch lines arrive as printed
    with out.open("w") as stdout, err.open("w") as stderr:
        main = subprocess.Popen(
            [sys.executable, "-m", "mixprec", *TRAIN], stdout=stdout, stderr=stderr, env=env,
            start_new_session=True,  # its own group: the test can clean up whatever it leaves
            # SIGINT as a terminal gives it: a suite run in the background of a script
            # inherits it ignored, and Python then never raises KeyboardInterrupt.
            preexec_fn=_sigint_as_default,
        )  # fmt: skip
    try:
        # The worker has started training once it prints its first epoch line.
        assert _wait_for(lambda: "epoch 1/" in out.read_text(), STARTUP_S), err.read_text()
        children = _children(main.pid)
        assert children, "no worker process"
        if group:
            os.killpg(main.pid, signum)
        else:
            os.kill(main.pid, signum)
        start = time.monotonic()
        try:
            returncode = main.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S} s after {signum.name}")
        seconds = time.monotonic() - start
        assert returncode == status, err.read_text()
        if signum != signal.SIGKILL:
            assert err.read_text().splitlines()[-1].startswith("mixprec train: interrupted")
            assert "Traceback" not in err.read_text()
        # The worker, and multiprocessing's resource tracker, end with the main process.
        assert _wait_for(lambda: not any(map(_running, children)), STOP_S), (
            f"left running: {[pid for pid in children if _running(pid)]}"
        )
        assert seconds < STOP_S
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of it left
            os.killpg(main.pid, signal.SIGKILL)
        main.wait()
