"""Serialize one DeepSpeed state dict straight into a storage stream.

``torch.save`` writes its zipfile format record by record and hands each tensor storage to
``write()`` as one buffer, so streaming it through a thin wrapper keeps the file's bytes exactly
what DeepSpeed's Torch engine writes, without a second in-memory copy of the file. The wrapper
computes the size and CRC-32 the manifest records on the way through.
"""

from __future__ import annotations

import zlib
from typing import Any, BinaryIO

import torch

from async_ckpt.manifest import FileEntry
from async_ckpt.storage.base import Storage

_READ_CHUNK = 8 * 1024 * 1024


class ChecksumWriter:
    """Write-only stream that forwards every byte and keeps a running size and CRC-32."""

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        written = 0
        while written < view.nbytes:  # raw file objects may write short
            n = self._sink.write(view[written:])
            written += view.nbytes - written if n is None else n
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        flush = getattr(self._sink, "flush", None)
        if flush is not None:
            flush()


def format_crc(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def write_torch_file(storage: Storage, relpath: str, obj: Any, *, tag_dir: str, rank: int) -> FileEntry:
    """``torch.save(obj)`` to ``relpath`` atomically; the entry's path is relative to ``tag_dir``."""
    with storage.open_write(relpath) as stream:
        writer = ChecksumWriter(stream)
        torch.save(obj, writer)
        writer.flush()
    return FileEntry(path=relpath[len(tag_dir) + 1:], size=writer.size, crc32=format_crc(writer.crc), rank=rank)


def write_bytes_file(storage: Storage, relpath: str, data: bytes, *, tag_dir: str, rank: int) -> FileEntry:
    storage.write_bytes(relpath, data)
    return FileEntry(path=relpath[len(tag_dir) + 1:], size=len(data), crc32=format_crc(zlib.crc32(data)), rank=rank)


def crc32_of_stream(stream: BinaryIO) -> tuple[int, str]:
    """Size and CRC-32 of everything left in ``stream``."""
    crc, size = 0, 0
    while chunk := stream.read(_READ_CHUNK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return size, format_crc(crc)
