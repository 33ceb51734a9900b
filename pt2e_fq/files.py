"""Atomic file writes: every file pt2e_fq writes (`.pt2`, `.onnx`, the
demo's reports) goes through `atomic_write`.

The content is written to a temporary file in the target's folder and
renamed onto the target only when it is complete, so a failed write (a full
disk, a writer's exception, an interrupt) never leaves a truncated file and
never destroys a good file already at that path. A failure to write is one
`WriteError` naming the path and the reason.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, os.PathLike]


class WriteError(OSError):
    """A file could not be written; whatever was at its path is unchanged."""


# The longest file name when the file system does not say (Linux, macOS and Windows file systems).
_DEFAULT_NAME_MAX = 255
# What the temporary name adds around the target's name: "." and ".{12 hex digits}.tmp".
_TEMPORARY_AFFIXES = len(".") + len(".") + 12 + len(".tmp")


def _name_max(folder: Path) -> int:
    """The longest file name, in bytes, that `folder` takes."""
    try:
        longest = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or the file system does not say
        return _DEFAULT_NAME_MAX
    return longest if longest > 0 else sys.maxsize  # -1: no limit


def check_writable(path: PathLike) -> Path:
    """The path a file can be written to, with symbolic links resolved (so a
    write replaces the file a link points to, not the link); a WriteError,
    before any work, when it names a folder, its folder is missing or not
    writable, or its file name is longer than the folder takes."""
    target = Path(os.path.realpath(path))
    folder = target.parent
    # First: the file system refuses to even look up a name too long (is_dir raises ENAMETOOLONG).
    length, longest = len(os.fsencode(target.name)), _name_max(folder)
    if length > longest:
        raise WriteError(f"cannot write {os.fspath(path)!r}: the file name is {length} bytes long, the folder "
                         f"takes names of at most {longest} bytes; give a shorter name")
    if target.is_dir():
        raise WriteError(f"cannot write {os.fspath(path)!r}: it is a folder; give a file name")
    if not folder.is_dir():
        raise WriteError(f"cannot write {os.fspath(path)!r}: no folder {str(folder)!r}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {os.fspath(path)!r}: the folder {str(folder)!r} is not writable")
    return target


def _temporary_name(name: str, longest: int) -> str:
    """`.{name}.{12 random hex digits}.tmp`, the name cut short (whole
    characters) so that the whole fits in `longest` bytes: a valid target
    name close to the limit must not make the temporary one invalid."""
    room = max(longest - _TEMPORARY_AFFIXES, 1)
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}.{secrets.token_hex(6)}.tmp"


@contextlib.contextmanager
def atomic_write(path: PathLike) -> Iterator[Path]:
    """Yields a fresh temporary path for the caller to write the whole file
    to; when the block ends without an exception, the file replaces `path`
    (keeping an old file's permissions; a new one gets the umask's). On any
    exception the temporary file is removed and `path` is untouched; an
    OSError from the block or the rename becomes a WriteError.

    A target that exists but is not a regular file (/dev/stdout, a device, a
    FIFO) cannot be replaced by a rename; the complete temporary file, made
    in the system's temporary folder, is copied into it instead."""
    target = check_writable(path)
    special = target.exists() and not target.is_file()
    folder = Path(tempfile.gettempdir()) if special else target.parent
    temporary = folder / _temporary_name(target.name, _name_max(folder))
    created = False
    try:
        # Mode "x": a new file with the umask's permissions (mkstemp's are 0600).
        with open(temporary, "xb"):
            created = True
        yield temporary
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())  # the content is on disk before the name points at it
        if special:
            with open(temporary, "rb") as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
        else:
            if target.exists():
                shutil.copymode(target, temporary)
            os.replace(temporary, target)
    except OSError as e:
        kept = "; the file already there is unchanged" if target.is_file() else ""
        raise WriteError(f"cannot write {os.fspath(path)!r}: {e.strerror or e}{kept}") from e
    finally:
        # Never another's file (the "x" open failed), and never an error of its own: a failed
        # clean-up must not replace the error that got here, nor fail a write that is done.
        if created:
            with contextlib.suppress(OSError):
                temporary.unlink()


def write_bytes(path: PathLike, data: bytes) -> None:
    """Writes `data` to `path` atomically."""
    with atomic_write(path) as temporary:
        temporary.write_bytes(data)


def write_text(path: PathLike, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically."""
    write_bytes(path, text.encode())
