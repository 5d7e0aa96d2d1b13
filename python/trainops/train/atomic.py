"""Atomic saves (checkpoints, training artifacts): each file is written into a temporary
file beside its target, flushed to disk (fsync), then renamed over the target (and the
folder fsync'ed), so a save that fails at any point leaves the previous file as it was.

- The target is the path with its symlinks resolved: a save through a symlink writes the
  file it points to and the link stays a link.
- A target that exists and is not a regular file (a directory, a FIFO, a device, a
  socket) is refused with an :class:`OSError` naming it: a rename would replace the
  special file with a regular one (``/dev/null`` as root).
- The temporary file is ``.<name>.<12 hex digits>.tmp``, held under an exclusive
  ``flock`` while it is written. A save first removes the temporary files of earlier saves
  of the same target that nobody holds (a save interrupted by a crash or a kill): a
  temporary file another process is still writing is locked and stays.
- Every :class:`OSError` (a full disk, a file-size limit, a missing folder, ...) is raised
  with its errno, naming the target; the temporary file is removed.

The Rust trainer (``crates/trainops-trainer/src/checkpoint.rs``) saves the same way (the
same temporary names and the same ``flock``, so the two clean up after each other)."""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from typing import Iterable, Sequence

try:
    import fcntl
except ImportError:  # no flock on this platform: no lock, leftovers are only ignored
    fcntl = None

__all__ = ["not_regular", "resolve_target", "write_files"]

# The temporary names of this writer (.<name>.<hex>.tmp) and of the Rust trainer's
# earlier ones (.<name>.<pid>.<hex>.tmp).
_TEMP_TAIL = re.compile(r"[0-9a-f]+(\.[0-9a-f]+)?\.tmp")
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def resolve_target(path, what: str) -> tuple[str, int | None]:
    """``(the file a save to path writes, its permission bits or None when it does not
    exist yet)``: ``path`` with every symlink resolved. :class:`OSError` (errno EISDIR for
    a directory, EINVAL for other special files) when it exists and is not a regular
    file."""
    path = os.fspath(path)
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    except OSError as exc:  # a symlink loop, a folder we may not search, ...
        raise type(exc)(exc.errno, f"{what}: cannot save to {path!r}: {exc.strerror}",
                        path) from None
    found = not_regular(st.st_mode)
    if found:
        code, kind = found
        via = f" (through the symlink {path!r})" if target != os.path.abspath(path) else ""
        raise OSError(code, f"{what}: {target!r}{via} is {kind}, not a regular file: a "
                            "save would replace it; save to a regular file", path)
    return target, stat.S_IMODE(st.st_mode)


def not_regular(mode: int) -> tuple[int, str] | None:
    """``(errno, what it is in words)`` of a file of ``mode`` that is not a regular file
    (EISDIR for a directory, EINVAL for the others), None for a regular file: the one
    check of saves (:func:`resolve_target`) and reads (``checkpoint_file.refuse_special``)."""
    if stat.S_ISREG(mode):
        return None
    kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
    return (errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL), kind


def _lock(fd: int, wait: bool) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


def remove_leftovers(folder: str, name: str, legacy: Sequence[str] = ()) -> None:
    """Removes the temporary files earlier saves of ``folder/name`` left (interrupted: no
    process holds their lock), and the files ``legacy`` names (temporary names of older
    versions) when they are regular files nobody holds."""
    prefix = f".{name}."
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for e in entries:
        ours = e.name.startswith(prefix) and _TEMP_TAIL.fullmatch(e.name[len(prefix):])
        if not (ours or e.name in legacy):
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |
                         getattr(os, "O_CLOEXEC", 0))
        except OSError:  # a symlink, gone meanwhile, ...
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and fcntl is not None and _lock(fd, False):
                os.unlink(e.path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _create_temp(folder: str, name: str) -> tuple[str, int]:
    """A new temporary file beside ``name``, created and locked: ``(path, fd)``."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, flags, 0o666)
        _lock(fd, True)
        if os.fstat(fd).st_nlink > 0:
            return tmp, fd
        # Another save's clean-up removed it between its creation and the lock: again.
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _oserror(exc: OSError, what: str, path: str) -> OSError:
    """``exc`` again (same class and errno) naming the target ``path``."""
    return type(exc)(exc.errno, f"{what}: cannot write {path!r}: {exc.strerror} (the "
                                "previous file, if any, is unchanged)", path)


def write_files(files: Sequence[tuple[str, Iterable]], what: str,
                legacy: Sequence[Sequence[str]] = ()) -> None:
    """Writes each ``(path, chunks)`` of ``files`` (chunks: bytes-like objects written in
    order) atomically, all or nothing as far as a file system allows: every target is
    checked first (:func:`resolve_target`), every temporary file written and fsync'ed,
    then all are renamed over their targets. A failure before the renames removes the
    temporary files and leaves every target as it was. ``what`` names the caller in
    messages; ``legacy[i]``: older temporary names of the ``i``-th file to remove."""
    targets = [resolve_target(p, what) for p, _ in files]
    for i, (target, _) in enumerate(targets):
        remove_leftovers(os.path.dirname(target), os.path.basename(target),
                         legacy[i] if i < len(legacy) else ())
    temps: list[tuple[str, int]] = []
    try:
        for (target, mode), (path, chunks) in zip(targets, files):
            try:
                tmp, fd = _create_temp(os.path.dirname(target), os.path.basename(target))
                temps.append((tmp, fd))
                for chunk in chunks:
                    _write_all(fd, chunk)
                os.fsync(fd)
                if mode is not None and hasattr(os, "fchmod"):  # the file it replaces
                    os.fchmod(fd, mode)  # keeps its permissions
            except OSError as exc:
                raise _oserror(exc, what, os.fspath(path)) from None
        for (target, _), (tmp, _), (path, _) in zip(targets, temps, files):
            try:
                os.replace(tmp, target)
            except OSError as exc:
                raise _oserror(exc, what, os.fspath(path)) from None
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    finally:
        for _, fd in temps:
            os.close(fd)
    for folder in sorted({os.path.dirname(t) for t, _ in targets}):
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    """Makes the renames in ``folder`` durable (skipped where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
