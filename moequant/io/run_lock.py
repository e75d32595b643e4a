"""One writer per output directory: an OS advisory lock on `OUTPUT/.moequant.lock`.

Every command that writes an output directory (apply, calibrate, plan, pareto, eval --output)
holds `output_lock(directory)` for its whole run, taken in its library entry point before
anything is written there. A second run into the same directory is refused at once with a
UserError naming the directory and the holder (pid, host, command, start time: the lock file's
text). The lock is `fcntl.flock`, so the kernel drops it when its process dies: a run killed
with SIGKILL leaves at most a stale file, never a held lock, and the next run takes it and resumes.

- Re-entrant within a process (apply's calibrate locks OUTPUT/stats inside apply's lock of
  OUTPUT, and a directory this process already holds is not locked twice).
- A directory inside one that another run holds is refused too: we take a shared lock on every
  ancestor's existing lock file (`calibrate --output runs/x/stats` while `apply` writes runs/x).
- Expert-parallel ranks of one torchrun job are one writer: only rank 0 (env RANK unset or "0")
  takes the lock; the other ranks write only what rank 0's run owns and skip it.
- The file is removed on a clean release (while still held, so no other run can lock an unlinked
  inode unnoticed: a taker checks that the path still names the inode it locked).
- flock is per open file and inherited by forked children: a forked worker that outlives a killed
  parent keeps the directory locked until it exits. NFS without lock support is not covered.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moequant.errors import UserError

LOCK_FILE = ".moequant.lock"
_held: dict[Path, int] = {}  # directory -> fd of the exclusive lock this process holds


def is_writer_rank() -> bool:
    """Rank 0 of a torchrun job, or no torchrun at all: the one process that takes the lock."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _holder_text(command: str) -> str:
    argv0 = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if argv0 in ("moequant", "cli.py", "__main__.py"):
        what = shlex.join(["moequant", *sys.argv[1:]])
    else:  # a library call: name the command and the program that made it
        what = f"moequant {command} from {shlex.join(sys.argv[:1]) or 'python'}"
    what = what if len(what) <= 200 else what[:199] + "…"  # the refusal message quotes it
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": what,
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )


def _describe_holder(fd: int) -> str:
    """'pid 123 on host h, `moequant apply ...`, since ...' from the lock file's text, or a
    general phrase when the holder has not written it yet (or holds a shared lock, which writes none)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        pid, host = int(info["pid"]), str(info["host"])
        alive = host != socket.gethostname() or _alive(pid)
    except (ValueError, KeyError, TypeError, OSError):
        info, alive = None, False
    if not info or not alive:  # no text, or the text of a killed run: the holder is a shared-lock writer inside
        return "another moequant process"
    return f"pid {pid} on {host} (`{info.get('command', '?')}`, since {info.get('since', '?')})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(path: Path, exclusive: bool, create: bool) -> int | None:
    """fd holding flock on `path`, None if `path` does not exist (create=False); raises
    BlockingIOError (the fd's holder description attached) when another process holds it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError as error:
            error.holder = _describe_holder(fd)
            os.close(fd)
            raise
        try:  # a releasing holder unlinks the file: the inode we locked must still be the one at `path`
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _refusal(directory: Path, holder: str, inside: Path | None = None) -> UserError:
    where = (
        f"{directory} is being written by"
        if inside is None
        else f"{directory} is inside {inside}, which is being written by"
    )
    return UserError(f"{where} another moequant run, {holder}; wait for it to finish or choose another --output.")


@contextmanager
def output_lock(directory, command: str) -> Iterator[Path]:
    """Hold the exclusive lock of `directory` (created if missing) for the `with` block."""
    directory = Path(directory).absolute().resolve()
    if not is_writer_rank() or directory in _held:
        yield directory
        return
    shared: list[int] = []
    try:
        for parent in directory.parents:  # runs that hold a directory above this one
            if parent in _held:
                continue
            try:
                fd = _lock(parent / LOCK_FILE, exclusive=False, create=False)
            except BlockingIOError as error:
                raise _refusal(directory, error.holder, inside=parent) from None
            except OSError:  # unreadable lock file of someone else's directory: not ours to judge
                continue
            if fd is not None:
                shared.append(fd)
        made = [p for p in (directory, *directory.parents) if not p.exists()]  # removed again if left empty
        path = directory / LOCK_FILE
        fd = None
        while fd is None:  # None: a releasing run removed the empty directory between our mkdir and open
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd = _lock(path, exclusive=True, create=True)
            except BlockingIOError as error:
                raise _refusal(directory, error.holder) from None
            except OSError as error:  # the first write into the directory: what the OS says of it is the user's to fix
                _remove_made(made)
                raise _unwritable(directory, error) from None
        try:
            os.ftruncate(fd, 0)
            try:
                os.pwrite(fd, _holder_text(command).encode(), 0)
            except OSError as error:  # a full disk
                raise _unwritable(directory, error) from None
            _held[directory] = fd
            yield directory
        finally:
            _held.pop(directory, None)
            try:
                os.unlink(path)  # still held: a taker that opened it before sees the inode gone and retries
            except FileNotFoundError:
                pass
            os.close(fd)
            _remove_made(made)  # a refused run (bad input) leaves no empty output directory behind
    finally:
        for fd in shared:
            os.close(fd)


def _remove_made(made: list[Path]) -> None:
    for p in made:
        try:
            p.rmdir()
        except OSError:
            break


def _unwritable(directory: Path, error: OSError) -> UserError:
    from moequant.errors import path_refusal

    return UserError(
        f"cannot write into {directory}: {path_refusal(error, directory)}; choose a directory you can "
        "write (--output, or --stats for calibration statistics)."
    )


def clear_directory(directory) -> None:
    """Remove everything in `directory` but its lock file (removing a held lock file would let a
    second run lock a fresh one)."""
    for p in Path(directory).iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def is_lock_file(path) -> bool:
    return Path(path).name == LOCK_FILE
