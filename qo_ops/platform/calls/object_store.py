"""Stored objects: the bytes of temp files under ``QO_OPS_HOME/objects/<storage_path>``.

The store reaches them without ever following a symlink. temp_file_cleanup hashes and
unlinks them. It unlinks an object only while its row's delete is pending in the same
transaction. The demo data writes them (:meth:`ObjectStore.put`).

The store refuses a storage path that is not a plain relative path, or that goes through a
symlinked directory. So it never reads, writes or removes anything outside its root.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from qo_ops.config import load_settings
from qo_ops.db.arrays import text_array
from qo_ops.errors import ClassifiedError

OBJECTS_DIR = "objects"  # this directory under QO_OPS_HOME stands in for the object store


class ObjectStoreError(ClassifiedError):
    """A stored object could not be stored or removed. The batch's transaction is rolled
    back."""

    error_code = "object_store_error"


def objects_root(environ: Mapping[str, str] | None = None) -> Path:
    """The object store: ``QO_OPS_HOME/objects``."""
    env = os.environ if environ is None else environ
    return load_settings(dict(env)).home / OBJECTS_DIR


class ObjectStore:
    """The stored objects under one root, reached without ever following a symlink.

    A storage path is a relative path of plain names. Its directories are opened one
    component at a time from the root with ``O_NOFOLLOW``. The object is then tested, hashed
    and unlinked relative to its directory's descriptor. The demo data writes it the same
    way (:meth:`put`). No path string is resolved twice. So a directory swapped for a
    symlink after a check cannot redirect a read or a removal outside the store.

    A path whose directory is a symlink, or is not a directory, is unsafe (:data:`UNSAFE`).
    A missing directory means the object is gone.

    Directory descriptors are cached for the life of the store, which is one batch step. The
    objects of a batch usually sit in a few directories. So each object costs a stat, an open
    and a read, rather than a full path resolution. :meth:`close` releases the descriptors.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[tuple[str, ...], int | None] = {}

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._dirs.values():
            if fd is not None and fd >= 0:
                os.close(fd)
        self._dirs.clear()

    def _dir(self, parts: tuple[str, ...]) -> int | None:
        """The directory's descriptor, -1 when it does not exist, or None when it is unsafe."""
        if parts in self._dirs:
            return self._dirs[parts]
        fd: int | None
        try:
            if not parts:  # the root itself is configuration, so it may be a symlink
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            else:
                parent = self._dir(parts[:-1])
                if parent is None or parent < 0:
                    return parent
                fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            fd = -1
        except OSError:  # ELOOP (a symlink) or ENOTDIR (a file); these are never followed
            fd = None
        self._dirs[parts] = fd
        return fd

    def locate(self, storage_path: str) -> tuple[int, str] | None:
        """Return (directory descriptor, name), or None when the path would leave the store.

        The descriptor is -1 when the directory is missing."""
        parts = storage_path.split("/")  # only canonical paths, with no "", "." or ".."
        if any(p in _NOT_A_NAME or "\0" in p for p in parts):
            return None
        fd = self._dir(tuple(parts[:-1]))
        return None if fd is None else (fd, parts[-1])

    def sha256(self, storage_path: str) -> tuple[bool, str | None]:
        """Return (safe, checksum).

        The checksum is None when the object is gone. The path is unsafe when it leaves the
        store or the object is not a regular file. An unsafe object is never followed or
        removed."""
        where = self.locate(storage_path)
        if where is None:
            return False, None
        fd, name = where
        if fd < 0:
            return True, None
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return False, None
            obj = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            return True, None
        except OSError:  # it was swapped for a symlink since the stat
            return False, None
        try:
            found = os.fstat(obj)
            if not stat.S_ISREG(found.st_mode):
                return False, None
            return True, _digest(obj, found.st_size)
        finally:
            os.close(obj)

    def exists(self, storage_path: str) -> bool:
        """Whether anything, such as a file or a symlink, is stored at a safe
        ``storage_path``."""
        where = self.locate(storage_path)
        if where is None or where[0] < 0:
            return False
        try:
            os.stat(where[1], dir_fd=where[0], follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def census(self, storage_paths: Iterable[str]) -> tuple[int, int]:
        """Return (stored, unsafe).

        ``stored`` counts the ``storage_paths`` that have anything stored at them. ``unsafe``
        counts those the store refuses because they would leave it."""
        stored = unsafe = 0
        for path in storage_paths:
            if self.locate(path) is None:
                unsafe += 1
            elif self.exists(path):
                stored += 1
        return stored, unsafe

    def count_stored(self, storage_paths: Iterable[str]) -> int:
        """How many of ``storage_paths`` have anything stored at them, as :meth:`exists`
        answers for each path.

        Each path counts as often as it is given. A path that would leave the store counts
        as nothing stored.

        A directory holding many of the paths is listed once, instead of a stat per path.
        The exception is a directory whose size says the listing would read many more
        entries than there are paths to look for (a big directory of live objects). Then
        each path is stat'ed."""
        by_dir: dict[str | None, list[str]] = {}  # None holds the paths without a directory
        for path in storage_paths:
            parent, slash, _ = path.rpartition("/")
            by_dir.setdefault(parent if slash else None, []).append(path)
        found = 0
        for folder, paths in by_dir.items():
            listed = self._listing(folder, len(paths)) if len(paths) >= _LIST_FROM else None
            if listed is None:
                found += sum(1 for path in paths if self.exists(path))
            else:
                found += sum(1 for path in paths if path.rpartition("/")[2] in listed)
        return found

    def _listing(self, folder: str | None, wanted: int) -> frozenset[str] | None:
        """The names in ``folder``, or None when listing it would cost more than ``wanted``
        stats.

        The names are empty when the folder is gone or unsafe, since nothing is stored
        there."""
        parts = () if folder is None else tuple(folder.split("/"))
        if any(p in _NOT_A_NAME or "\0" in p for p in parts):
            return frozenset()
        fd = self._dir(parts)
        if fd is None or fd < 0:
            return frozenset()
        if os.fstat(fd).st_size > _LIST_BYTES_PER_PATH * wanted:
            return None
        return frozenset(os.listdir(fd))  # never "", "." or "..", which are never stored

    def put(self, storage_path: str, data: bytes) -> bool:
        """Store ``data`` at ``storage_path``, creating its directories (never through a
        symlink).

        Return True if the object is new, and False if it replaced one. Raise
        :class:`ObjectStoreError` when the path would leave the store or cannot be
        written."""
        parts = storage_path.split("/")
        if any(p in _NOT_A_NAME or "\0" in p for p in parts):
            raise ObjectStoreError("cannot store an object: its path would leave the store")
        try:
            fd = self._made_dir(tuple(parts[:-1]))
            try:
                obj, new = os.open(parts[-1], _NEW_OBJECT, 0o644, dir_fd=fd), True
            except FileExistsError:  # replace it in place; a symlink there is refused (ELOOP)
                obj, new = os.open(parts[-1], _REPLACE_OBJECT, dir_fd=fd), False
            with os.fdopen(obj, "wb") as f:
                f.write(data)
                f.flush()
                # Cut to size after writing, not to 0 before (O_TRUNC). ext4 flushes a file
                # that was truncated to 0 and rewritten when it is closed, which costs a disk
                # wait per object.
                os.ftruncate(obj, len(data))
        except OSError as exc:
            raise ObjectStoreError(f"cannot store an object: {exc.strerror}") from exc
        return new

    def _made_dir(self, parts: tuple[str, ...]) -> int:
        """The directory's descriptor. The directory and its parents are created when
        missing."""
        fd = self._dir(parts)
        if fd is not None and fd >= 0:
            return fd
        if fd is None:
            raise ObjectStoreError(
                "cannot store an object: a directory on its path is a symlink or a file"
            )
        if not parts:
            self.root.mkdir(parents=True, exist_ok=True)
        else:
            with contextlib.suppress(FileExistsError):  # someone else may have made it
                os.mkdir(parts[-1], dir_fd=self._made_dir(parts[:-1]))
        self._dirs.pop(parts, None)  # it was cached as missing
        made = self._dir(parts)
        if made is None or made < 0:
            raise ObjectStoreError("cannot store an object: its directory cannot be opened")
        return made

    def remove(self, storage_path: str) -> bool:
        """Unlink one object. Return True if it was removed, and False if it was already
        gone.

        Raise :class:`ObjectStoreError` when it cannot be removed or its path became
        unsafe."""
        where = self.locate(storage_path)
        if where is None:
            raise ObjectStoreError("cannot remove a stored object: its path left the store")
        if where[0] < 0:
            return False
        return _remove_object(*where)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_NEW_OBJECT = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_REPLACE_OBJECT = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO gives ENXIO, not a wait
_NOT_A_NAME = frozenset(("", ".", ".."))
# count_stored lists a directory when it has at least _LIST_FROM paths to look for in it. The
# directory's size must also be at most _LIST_BYTES_PER_PATH per path. A directory entry takes
# about 20-40 bytes on ext4, XFS, btrfs and tmpfs.
_LIST_FROM = 32
_LIST_BYTES_PER_PATH = 256


_READ_CHUNK = 64 * 1024  # below malloc's mmap threshold, so a read costs no mmap/munmap


def digest_array(digests: Sequence[str | None]) -> str:
    """Turn digests from :meth:`ObjectStore.sha256` into one array value, bound for
    ``CAST(:shas AS text[])`` (:func:`~qo_ops.db.arrays.text_array`: psycopg dumps a list
    element by element). A None digest means the object was gone. Each is checked to be
    lowercase hex first."""
    for d in digests:
        if d is not None and not _HEX.fullmatch(d):
            raise ValueError("a checksum is not a lowercase hex digest")
    return text_array(digests)


_HEX = re.compile(r"[0-9a-f]*")  # fullmatch: one C call a digest, not one Python call a char


def _digest(fd: int, size: int) -> str:
    """The sha256 of what ``fd`` reads to its end, in reads sized to the object.

    ``size`` comes from the object's fstat. The file is read to its end whatever ``size``
    says. This avoids ``hashlib.file_digest``, which zeroes a 256 KiB buffer per call, more
    than hashing a small object costs."""
    h = hashlib.sha256()
    want = min(size + 1, _READ_CHUNK)
    while chunk := os.read(fd, want):
        h.update(chunk)
    return h.hexdigest()


def _remove_object(dir_fd: int, name: str) -> bool:
    """Unlink ``name`` in the directory ``dir_fd``. For a symlink, this unlinks the symlink
    itself, never its target."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ObjectStoreError(f"cannot remove a stored object: {exc.strerror}") from exc
    return True
