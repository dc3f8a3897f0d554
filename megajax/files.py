"""Files megajax writes: a kill at any moment leaves either the old content or the new, never
a truncated file; JSON-lines logs read back even when a kill cut their last line short; and
one training run at a time per workdir."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from megajax.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no workdir lock
    fcntl = None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`
    (rename is atomic on POSIX and Windows file systems). A `path` that is a device, FIFO or
    terminal (`--out /dev/stdout`, `/dev/null`) is written in place: a rename would replace the
    node itself (for root, /dev/null with a file). Through a symbolic link, its target is
    replaced and the link kept."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        with open(path, "wb") as f:
            f.write(payload)
        return
    path = Path(os.path.realpath(path)) if path.is_symlink() else path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        with naming(path):
            raise


def is_temporary(path: Path) -> bool:
    """A file write_atomic was writing when its process was killed: never a result."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(".tmp")


@contextlib.contextmanager
def naming(path: Path):
    """An OSError raised by writing to an open file (a full disk, `ulimit -f`'s "File too large")
    names no file, and the one line a user reads would not say which: it is given `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def text_lines(text: str) -> list[str]:
    """A text file's lines as the file has them: ended by "\n" (or "\r\n"), never by the other
    characters str.splitlines also takes for line ends (U+2028, U+2029, U+0085, \\v, \\f,
    \\x1c-\\x1e), which a JSON string may hold raw: a JSON line split there is no longer JSON."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_jsonl(path: Path) -> list[dict]:
    return parse_jsonl(Path(path).read_text(encoding="utf-8", errors="replace"))


def parse_jsonl(text: str) -> list[dict]:
    """The records of a JSON-lines text. A line that does not parse is one a kill cut short
    while it was being appended: it is skipped, not fatal."""
    records = []
    for line in text_lines(text):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


# The descriptors of the locks this process holds. A forked child (a megajax-prepare pool
# worker) would share each lock's open file, and a lock is released only when every descriptor
# of it is closed: a worker outliving its killed parent by a moment would keep the directory
# locked. So a child closes its copies at once (the parent's lock is untouched).
_HELD_LOCKS: set[int] = set()


def _drop_inherited_locks():
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class WorkdirLock:
    """An exclusive lock on the workdir itself (flock on the directory: no lock file to go
    stale). The operating system releases it when the process ends, however it ends, so a
    crashed or killed run never leaves the workdir locked. Training runs and megajax-prepare
    take the same lock: either may be the one holding it."""

    def __init__(self, workdir: Path, busy: str | None = None, what: str = "the workdir"):
        self.workdir, self.what = Path(workdir), what
        self.fd = None
        self.created = False
        self.busy = busy or (
            f"another megajax process holds {self.workdir} (a run training there, or a "
            "megajax-prepare writing to it); wait for it to finish (or stop it), or give this one "
            "another --workdir"
        )

    def __enter__(self):
        self.created = not self.workdir.exists()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot use {self.workdir} as {self.what}: {e.strerror}") from None
        if not os.access(self.workdir, os.W_OK | os.X_OK):
            raise UserError(f"cannot use {self.workdir} as {self.what}: not writable")
        if fcntl is None:
            return self
        self.fd = os.open(self.workdir, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise UserError(self.busy) from None
        _HELD_LOCKS.add(self.fd)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            _HELD_LOCKS.discard(self.fd)
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
        if self.created:  # a run refused after the lock leaves no empty workdir behind
            with contextlib.suppress(OSError):
                self.workdir.rmdir()


def check_new_directory(path: Path, what: str = "output") -> Path:
    """`path` may be created: it does not exist, or is an empty directory. Never overwrite."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(
            f"{path} already exists and is not empty: choose a new {what} directory (megajax does "
            "not overwrite it)"
        )
    return path


# The staged directories of blocks still running (tmp -> [final path, tmp's inode once made]),
# and the outputs this process has put in place: what a signal's line may say was written.
_STAGED: dict[Path, list] = {}
_WRITTEN: list[Path] = []


@contextlib.contextmanager
def staged_directory(path: Path, what: str = "output"):
    """Yield a temporary directory beside `path`; when the block succeeds it becomes `path` in
    one rename, so a reader (or a kill) never sees half of it. On failure it is removed; a
    program that ends without unwinding (a signal: errors.exit_now) calls abandon_staged first."""
    path = check_new_directory(path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(path)
    tmp = path.parent / f".{path.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.partial"
    _STAGED[tmp] = [path, None]  # before it exists: a signal between the two still finds it
    tmp.mkdir()
    _STAGED[tmp][1] = tmp.stat().st_ino
    try:
        yield tmp
        check_new_directory(path, what)  # someone may have made it meanwhile
        try:
            if path.exists():
                path.rmdir()
            os.replace(tmp, path)
        except OSError:  # ... even between that check and the rename
            raise UserError(
                f"{path} was created by another process meanwhile: nothing of this run was written "
                "there"
            ) from None
        _WRITTEN.append(path)
    finally:
        _STAGED.pop(tmp, None)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def abandon_staged() -> list[Path]:
    """Remove the staged directories still being written (see staged_directory); return the
    outputs already in place, including one renamed an instant ago (its inode is the staged
    directory's), so that the line a signal prints never denies an output that exists."""
    written = list(_WRITTEN)
    for tmp, (path, inode) in list(_STAGED.items()):
        if tmp.exists():
            remove_until_gone(tmp)
        elif inode is not None and path not in written and _inode(path) == inode:
            written.append(path)
    return written


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def remove_until_gone(path: Path, patience: float = 10.0, settle: float = 0.25):
    """Remove a directory that background writers (tensorstore's threads) may still be writing
    into, and so make again: until it stays away for `settle` seconds, or `patience` runs out."""
    deadline = time.monotonic() + patience
    while path.exists():
        shutil.rmtree(path, ignore_errors=True)
        if time.monotonic() > deadline:
            return
        time.sleep(settle)


_HOST = socket.gethostname().replace("-", "_").replace(".", "_")


def _remove_abandoned(path: Path):
    """Staged copies of `path` left by processes of this host that died (SIGKILL, or a writer
    thread that outran abandon_staged): their names say which process made them."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.{_HOST}-*-*.partial"):
        pid = tmp.name[len(path.name) + len(_HOST) + 3 :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but belongs to someone else
        return True
    return True
