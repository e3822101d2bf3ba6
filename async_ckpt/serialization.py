"""Serialize one DeepSpeed state dict into storage, recording its size and CRC-32.

``torch.save`` writes its zipfile format record by record and hands each tensor storage to
``write()`` as one buffer, so a file can be streamed through a thin wrapper that computes the
size and CRC-32 the manifest records, without a second copy of the file in memory.

One detail decides whether the bytes equal DeepSpeed's own: ``torch.save`` names the zip records
after the file (``zero_pp_rank_0_mp_rank_00_optim_states/data.pkl``) only when it is given a
path; given a stream it names them ``archive/...``. With ``exact_bytes`` torch.save writes a
local scratch file that carries DeepSpeed's file name, which is then streamed to storage:
byte-for-byte DeepSpeed's file, at the price of writing it twice. (A named pipe instead of the
scratch file would save that write, but torch holds the GIL while it writes the zip's end
records, so a pipe the reader thread has not drained deadlocks the process.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from async_ckpt.manifest import FileEntry
from async_ckpt.storage.base import IO_CHUNK, Storage


class ChecksumWriter:
    """Write-only stream that forwards every byte and keeps a running size and CRC-32.

    The first error the sink raises is kept in ``error``: torch.save's zip writer turns a failing
    ``write()`` into "unexpected pos N vs M", which names neither the errno nor its cause.
    """

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self.size = 0
        self.crc = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        written = 0
        while written < view.nbytes:  # raw file objects may write short
            try:
                n = self._sink.write(view[written:])
            except BaseException as exc:
                self.error = self.error or exc
                raise
            written += view.nbytes - written if n is None else n
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        flush = getattr(self._sink, "flush", None)
        if flush is not None:
            flush()


def format_crc(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def write_torch_file(storage: Storage, relpath: str, obj: Any, *, tag_dir: str, rank: int,
                     scratch_dir: str | None = None) -> FileEntry:
    """``torch.save(obj)`` to ``relpath`` atomically; the entry's path is relative to ``tag_dir``.

    With ``scratch_dir`` (a local folder) the bytes are exactly DeepSpeed's (see the module
    docstring); without it torch.save streams straight into storage.
    """
    if scratch_dir is None:
        with storage.open_write(relpath) as stream:
            writer = ChecksumWriter(stream)
            try:
                torch.save(obj, writer)
            except Exception as torch_error:
                if writer.error is not None:
                    raise writer.error from torch_error  # the storage's own error, not torch's "unexpected pos"
                raise
            writer.flush()
        return FileEntry(path=relpath[len(tag_dir) + 1:], size=writer.size, crc32=format_crc(writer.crc), rank=rank)
    os.makedirs(scratch_dir, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="async_ckpt_scratch_", dir=scratch_dir)
    try:
        local = os.path.join(folder, relpath.rsplit("/", 1)[-1])
        torch.save(obj, local)
        return copy_local_file(storage, relpath, local, tag_dir=tag_dir, rank=rank)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_chunks(storage: Storage, relpath: str, chunks: Iterable[Any], *, tag_dir: str, rank: int) -> FileEntry:
    """Stream ``chunks`` (bytes-like) into ``relpath`` atomically, recording size and CRC-32; the entry's
    path is relative to ``tag_dir``."""
    with storage.open_write(relpath) as stream:
        writer = ChecksumWriter(stream)
        for chunk in chunks:
            writer.write(chunk)
        writer.flush()
    return FileEntry(path=relpath[len(tag_dir) + 1:], size=writer.size, crc32=format_crc(writer.crc), rank=rank)


def copy_local_file(storage: Storage, relpath: str, local_path: str, *, tag_dir: str, rank: int) -> FileEntry:
    """Stream a local file into ``relpath`` atomically, recording its size and CRC-32."""
    with open(local_path, "rb") as src:
        return write_chunks(storage, relpath, iter(lambda: src.read(IO_CHUNK), b""), tag_dir=tag_dir, rank=rank)


def crc32_of_stream(stream: BinaryIO) -> tuple[int, str]:
    """Size and CRC-32 of everything left in ``stream``."""
    crc, size = 0, 0
    while chunk := stream.read(IO_CHUNK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return size, format_crc(crc)
