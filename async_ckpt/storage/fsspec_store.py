"""Storage on any fsspec filesystem: the generic backend.

Used for every protocol without a dedicated backend (NFS mounts use :mod:`.local`, S3 uses
:mod:`.s3`). Files are written under a temporary ``.partial`` name and moved into place, so a
reader never sees half a file under a name DeepSpeed's globs match.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import posixpath
import time
import uuid
from typing import BinaryIO, Iterator

import fsspec

from async_ckpt.errors import MissingFileError
from async_ckpt.storage.base import IO_CHUNK, Progress, Storage


#: ``info`` fields that hold a file's last change, and the factor to seconds of a number there: local and
#: memory (``mtime``), S3 (``LastModified``), Azure (``last_modified``), GCS (``updated``, ISO text),
#: WebHDFS (``modificationTime``, milliseconds), then a creation time as a last resort.
_TIME_FIELDS = (("mtime", 1.0), ("LastModified", 1.0), ("last_modified", 1.0), ("updated", 1.0),
                ("modificationTime", 1e-3), ("created", 1.0))


class FsspecStorage(Storage):
    """A checkpoint root on an fsspec filesystem ``fs`` at ``root`` (protocol stripped)."""

    #: Object stores publish an object only when its upload completes, so they write in place.
    writes_in_place: bool = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")

    def full_path(self, relpath: str) -> str:
        return f"{self.root}/{relpath}" if relpath else self.root

    @contextlib.contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        final = self.full_path(relpath)
        parent = posixpath.dirname(final)
        if not self.writes_in_place:
            self.fs.makedirs(parent, exist_ok=True)
        target = final if self.writes_in_place else f"{final}.{uuid.uuid4().hex[:12]}.partial"
        stream = self.fs.open(target, "wb")
        try:
            yield stream
        except BaseException:
            discard = getattr(stream, "discard", None)
            with contextlib.suppress(Exception):
                if discard is None:
                    stream.close()
                else:
                    discard()
                    # fsspec's own discard() does nothing: a buffered file still open would upload what it
                    # holds once freed (its __del__ closes it), after the removal below
                    stream.closed = True
            if not self.writes_in_place:
                with contextlib.suppress(Exception):
                    self.fs.rm(target)
            raise
        if self.writes_in_place:
            stream.close()
            return
        try:  # a failed close or move removes the partial file too
            stream.close()
            self.fs.mv(target, final)
            if self.fs.exists(target):  # WebHDFS answers a rename onto an existing file with false, not an error
                raise OSError(f"{self.url}: moving {target} onto {final} left it in place; the filesystem does "
                              "not replace a file by a rename")
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(target)
            raise

    @contextlib.contextmanager
    def open_read(self, relpath: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.full_path(relpath), "rb") as stream:
            yield stream

    def read_bytes(self, relpath: str) -> bytes:
        return self.fs.cat_file(self.full_path(relpath))

    def exists(self, relpath: str) -> bool:
        path = self.full_path(relpath)
        self.fs.invalidate_cache(posixpath.dirname(path))  # answered from a listing otherwise (gcsfs, adlfs)
        return self.fs.exists(path)

    def size(self, relpath: str) -> int:
        return int(self.fs.size(self.full_path(relpath)))

    def is_dir(self, relpath: str) -> bool:
        return self.fs.isdir(self.full_path(relpath))

    def list_dir(self, relpath: str = "") -> list[str]:
        """The names in the folder, as stored now: the backend's cache of listings is dropped first, as
        the S3 backend turns it off, since the other ranks (other processes) write into the same folders."""
        path = self.full_path(relpath)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        prefix = path.rstrip("/") + "/"
        names = [e.rstrip("/")[len(prefix):] if e.startswith(prefix) else posixpath.basename(e.rstrip("/"))
                 for e in entries]
        return sorted(n for n in names if n)

    def delete(self, relpath: str, *, recursive: bool = False) -> None:
        path = self.full_path(relpath)
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

    def modified(self, relpath: str) -> float:
        """The time of the last change, from whichever field the backend's ``info`` gives it in; where none
        is known, now: gc then takes the file for one being written, never for an abandoned one."""
        info = self.fs.info(self.full_path(relpath))
        for key, scale in _TIME_FIELDS:
            value = info.get(key)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return value.timestamp()
            if isinstance(value, str):
                with contextlib.suppress(ValueError):
                    return datetime.datetime.fromisoformat(value).timestamp()
                continue
            return float(value) * scale
        return time.time()

    def get_file(self, relpath: str, local_path: str, *, progress: Progress | None = None,
                 resume: bool = False) -> None:
        """Sequential copy, so a partial local file is always a valid prefix to resume from."""
        offset = os.path.getsize(local_path) if resume and os.path.exists(local_path) else 0
        try:
            src_file = self.fs.open(self.full_path(relpath), "rb")
        except FileNotFoundError as exc:
            raise MissingFileError(f"{self.url}/{relpath} does not exist") from exc
        with src_file as src, open(local_path, "ab" if offset else "wb") as dst:
            if offset:
                src.seek(offset)
                if progress:
                    progress(offset)
            while chunk := src.read(IO_CHUNK):
                dst.write(chunk)
                if progress:
                    progress(len(chunk))
