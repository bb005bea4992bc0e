"""The worker process of ``mixprec train``: each run trains in a fresh spawned process, so
that its peak memory is its own.

That worker never outlives the command: SIGINT or SIGTERM to the main process alone stops it
(SIGTERM, then SIGKILL after a grace period) before the command exits 130 or 143, and a
worker whose main process is gone (even by SIGKILL) stops itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

# How long a worker sent SIGTERM has to unwind (a checkpoint write removes its temporary
# file) before SIGKILL.
_GRACE_S = 5.0


def in_subprocess(
    run: Callable[[dict[str, Any]], dict[str, Any]], config: dict[str, Any]
) -> dict[str, Any]:
    """``run(config)`` in a fresh spawned process: its result, or its exception
    raised here. However this returns or raises (KeyboardInterrupt, ``Terminated``), the
    worker has ended."""
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    name = f"mixprec-{config['label']}"
    worker = spawn.Process(target=_worker, args=(run, config, send), name=name)
    try:
        worker.start()
        send.close()
        try:
            reply = receive.recv()
        except EOFError:  # it ended without a reply: killed, out of memory
            worker.join()
            raise WorkerEndedError(config["label"], worker.exitcode) from None
        worker.join()
    finally:
        _stop(worker)
        send.close()
        receive.close()
    if reply[0] == "error":
        raise reply[1] from _WorkerTracebackError(reply[2])
    result: dict[str, Any] = reply[1]
    return result


class WorkerEndedError(RuntimeError):
    """A run's process ended without a result: killed by a signal (the kernel's
    out-of-memory killer sends SIGKILL, with no message to recognise) or exited."""

    def __init__(self, label: str, exitcode: int | None) -> None:
        signum = -exitcode if exitcode is not None and exitcode < 0 else None
        if signum:
            how = f"was killed by {_signal_name(signum)}"
        elif exitcode == 128 + signal.SIGTERM:  # the code _exit_on_sigterm exits with
            how = f"was stopped by SIGTERM from outside mixprec (exit status {exitcode})"
        else:
            how = f"exited with status {exitcode}"
        said = f"the {label} run's process {how} before it returned a result"
        if signum == signal.SIGKILL:
            said += (
                " (on Linux the kernel's out-of-memory killer sends SIGKILL when memory runs "
                "out, and `dmesg` says so; a smaller --hidden or --batch-size may fit)"
            )
        super().__init__(said)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stop(worker: multiprocessing.process.BaseProcess) -> None:
    """End ``worker`` unless it has: SIGTERM, which it turns into an exit that lets a
    checkpoint write finish or remove its temporary file (the file itself is replaced
    atomically), then SIGKILL after ``_GRACE_S`` or at a second interrupt."""
    if worker.pid is None or worker.exitcode is not None:
        return
    try:
        worker.terminate()
        worker.join(_GRACE_S)
    finally:
        if worker.exitcode is None:
            worker.kill()
            worker.join()


def _worker(
    run: Callable[[dict[str, Any]], dict[str, Any]],
    config: dict[str, Any],
    send: multiprocessing.connection.Connection,
) -> None:
    """The worker process: one training run, its result or exception sent back.

    SIGINT (Ctrl-C reaches the whole process group) is ignored: the main process handles it
    and stops this one, so the terminal shows one line, not a traceback per process.
    SIGTERM exits through Python, so that ``finally`` and ``except BaseException`` blocks
    run: a checkpoint write in progress removes its temporary file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _exit_with_parent()
    try:
        reply: tuple[Any, ...] = ("ok", run(config))
    except Exception as err:
        reply = ("error", _picklable(err), traceback.format_exc())
    send.send(reply)
    send.close()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _exit_with_parent() -> None:
    """SIGTERM to this process when its parent ends, however it ends (SIGKILL included): a
    daemon thread waits for the end of the pipe that only the parent holds open."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mixprec-parent-watch", daemon=True).start()


def _picklable(err: Exception) -> Exception:
    """``err`` if it pickles (it is raised again in the main process), else its text."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


class _WorkerTracebackError(Exception):
    """The worker's traceback, shown as the cause of the exception raised again here."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'
