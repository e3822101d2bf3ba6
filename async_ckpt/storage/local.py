"""Local disk and NFS: fsync'd temporary file, atomic rename, fsync'd folder.

POSIX rename is atomic on local filesystems and on NFS, so a file appears under its final name
only complete; fsync of the file and of its folder makes the data and the name survive a crash.
DeepSpeed reads local checkpoints in place, so resume needs no copy.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import BinaryIO, Iterator

import fsspec

from async_ckpt.storage.fsspec_store import FsspecStorage


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(FsspecStorage):
    """A checkpoint root in a local (or NFS-mounted) folder."""

    def __init__(self, path: str, *, fsync: bool = True) -> None:
        root = os.path.abspath(os.path.expanduser(path))
        super().__init__(fsspec.filesystem("file"), root, root)
        self.fsync = fsync
        self.durable_writes = fsync

    def local_dir(self) -> str:
        return self.root

    @contextlib.contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        final = os.path.join(self.root, *relpath.split("/"))
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{final}.{uuid.uuid4().hex[:12]}.partial"
        # Unbuffered: torch.save hands us whole tensor storages; a userspace buffer only adds a copy.
        stream = open(tmp, "wb", buffering=0)
        try:
            yield stream
            if self.fsync:
                os.fsync(stream.fileno())
        except BaseException:
            stream.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        stream.close()
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(parent)
