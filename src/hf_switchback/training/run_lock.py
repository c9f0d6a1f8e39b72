"""One writer per output directory: the training process holds an advisory lock on <output_dir>/.train.lock.

Two processes writing one output_dir (a resume started while a killed launcher's training child still runs)
delete each other's temporary checkpoints and interleave the log. The lock is an flock on an open file, so the
kernel drops it when its holder exits in any way, kill -9 included: a lock left by a dead process is free to
take, with no pid liveness guessing. The file keeps the holder's pid and host, for the refusal message; it is
never deleted (removing a locked file would let a third process lock a new file beside the old lock).
flock is advisory and local to a host on some network file systems: it guards against the common accident,
not against a determined second writer on another machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket

LOCK_NAME = ".train.lock"


class OutputDirBusy(RuntimeError):
    """Another live process holds the output directory's lock."""


class OutputDirLock:
    """Held from acquire() to release() (or the process's exit). Use as a context manager."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._file = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 (held open: the open file description is the lock)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe(f.read())
            f.close()
            raise OutputDirBusy(
                f"{os.path.dirname(self.path)} is being written by another training process ({holder}): wait "
                "for it to end or stop it (kill -9 of `accelerate launch` leaves its training processes "
                "running), or use another --output_dir"
            ) from None
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)  # a reader must not name a process that no longer writes here
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"
