"""Stopping `bertfast embed` cleanly: SIGINT (Ctrl-C) and SIGTERM end the job between shard commits.

Inside `catching()`, either signal raises `Interrupted` (a KeyboardInterrupt, so code that cleans up
after Ctrl-C cleans up after it too) in the main thread, except during a `commit()`: a shard's write,
rename and manifest update finish first and the signal is raised right after. So an interrupted run
leaves only committed shards and a manifest that records them, and `--resume` takes over from there.
SIGKILL cannot be caught; the writer's atomic renames cover it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The job was stopped by a signal; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class _State:
    committing = 0  # nesting depth of commit()
    pending: int | None = None  # a signal that arrived during a commit
    received: int | None = None  # the first signal caught, for the exit status


def _handler(signum, frame):
    _State.received = _State.received or signum
    if _State.committing:
        _State.pending = signum
        return
    raise Interrupted(signum)


def install() -> None:
    """(Re)install the handlers: call again after a library that sets its own (ray.init sets SIGTERM's)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextmanager
def catching():
    """SIGINT/SIGTERM raise `Interrupted` inside the block; the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _State.received = _State.pending = None
    install()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def received() -> int | None:
    """The signal that stopped the job (None when none arrived)."""
    return _State.received


@contextmanager
def commit():
    """A block a signal must not cut: one that arrives meanwhile is raised when the block is done."""
    _State.committing += 1
    try:
        yield
    finally:
        _State.committing -= 1
    if not _State.committing and _State.pending is not None:
        signum, _State.pending = _State.pending, None
        raise Interrupted(signum)
