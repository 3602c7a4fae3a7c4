"""Atomic file writes: a result file is either the old one or the complete new one, never half of either.

Each write goes to a temporary file in the target's own folder (same filesystem, so the rename is atomic), which
then replaces the target with os.replace. Two runs writing the same path concurrently leave one of the two complete
files; a run killed mid-write leaves the old file (and at worst a stray `.NAME.*.tmp` beside it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import IO, Iterator


def _temp_beside(target: str, binary: bool, suffix: str = ".tmp") -> tuple[str, int]:
    folder, name = os.path.split(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) * binary
    while True:
        temp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
        try:
            # Mode 0o666 lets the umask decide, as a plain open() would for a new file.
            return temp, os.open(temp, flags, 0o666)
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """A file object to write `path` through ("w" or "wb"); the target is replaced only when the block succeeds.

    A symlink at `path` keeps pointing where it did: the file it points to is the one replaced.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: expected 'w' or 'wb', got {mode!r}")
    target = os.path.realpath(os.fspath(path))
    binary = mode == "wb"
    temp, fd = _temp_beside(target, binary)
    try:
        try:
            fh = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding=encoding, newline=newline)
        except BaseException:
            os.close(fd)
            raise
        with fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """A temporary file name beside `path` for a writer that wants a name, not a file object (e.g. a library's
    export(path)); it replaces `path` when the block succeeds. `suffix` keeps an extension the writer reads."""
    target = os.path.realpath(os.fspath(path))
    temp, fd = _temp_beside(target, True, suffix)
    os.close(fd)
    try:
        yield temp
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding) as fh:
        fh.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)
