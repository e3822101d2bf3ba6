"""Serialize one DeepSpeed state dict into storage, recording its size and CRC-32.

``torch.save`` writes its zipfile format record by record and hands each tensor storage to
``write()`` as one buffer pointing into the storage itself, so a file can be streamed through a
thin wrapper that records the size and CRC-32 the manifest needs, without a copy of the file in
memory. The records stay torch's own (same bytes as any torch.save into a stream); what this
module controls is what happens to them. For a snapshot, whose storages are staging buffers that
outlive the write, the large records are *lent* to storage rather than copied (the local backend
writes them with ``O_DIRECT`` straight from the buffer). Every byte is checksummed once: the
CRC-32s torch.save's zip needs are computed by async_ckpt (:mod:`async_ckpt.torch_zip`), the large
buffers' by their staging copies on CPU (:class:`~async_ckpt.staging.CopyTicket`), else on
:data:`CRC_THREADS` threads, piece by piece as their copies complete (:func:`checksum_ahead`),
and the manifest's CRC-32 of the file is folded from them (:class:`ChecksumWriter`,
:mod:`async_ckpt.checksum`). Measured on the development machine, a 600 MiB optimizer file:
0.12 s of the writer's CPU when lent and placed; 0.20 s where nothing is lent (S3's path), down
from 0.30 s when torch and the manifest each checksummed every byte (benchmarks/RESULTS.md).

One detail decides whether the bytes equal DeepSpeed's own: ``torch.save`` names the zip records
after the file (``zero_pp_rank_0_mp_rank_00_optim_states/data.pkl``) only when it is given a
path; given a stream it names them ``archive/...``. With ``exact_bytes`` torch.save writes a
local scratch file that carries DeepSpeed's file name, which is then streamed to storage:
byte-for-byte DeepSpeed's file, at the price of writing it twice. (A named pipe instead of the
scratch file would save that write, but torch holds the GIL while it writes the zip's end
records, so a pipe the reader thread has not drained deadlocks the process.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from async_ckpt import torch_zip
from async_ckpt.checksum import crc32, crc32_combine, crc32_in_pieces, format_crc
from async_ckpt.manifest import FileEntry
from async_ckpt.staging import COPY_PIECE, StagedFile
from async_ckpt.storage.base import IO_CHUNK, LEND_MIN, Storage, buffer_address, write_all
from async_ckpt.torch_zip import Crc, resolve_crc

#: Threads per file that checksum the large staging buffers their copies did not (:func:`~async_ckpt.checksum.crc32`
#: runs without the GIL).
CRC_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class Lending:
    """Memory the writer may lend to storage instead of copying it, and what became of it.

    ``regions`` are (address, size) ranges that stay valid and unchanged until the file is written
    (the staging buffers). The writer notes in ``placements`` the file offset each lent buffer was
    written at (the staging pool places the next snapshot's buffers to match) and counts the bytes
    lent and, of those, the bytes storage still had to copy (address and offset aligned differently).
    """

    regions: Sequence[tuple[int, int]]
    placements: dict[int, int] = field(default_factory=dict)
    lent_bytes: int = 0
    copied_bytes: int = 0


#: ``await_copy(address, end=None)``: wait until the staging copy into the buffer at ``address`` has
#: reached its byte ``end`` (all of it by default).
AwaitCopy = Callable[..., None]


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    """The tensor storages in ``obj``, each once, in the order torch.save writes their records.

    torch.save numbers the storages in the order its pickler meets them and writes their records in
    that order (torch.serialization's ``_save``, format version 1). A pickling pass without the data
    (storages are persistent ids, nothing of them is read) gives the same order.
    """
    seen: dict[int, torch.UntypedStorage] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage):
                value = value._untyped_storage
            if not isinstance(value, torch.UntypedStorage):
                return None
            seen.setdefault(value._cdata, value)
            return len(seen)

    _Pickler(_Discard(), protocol=2).dump(obj)
    return list(seen.values())


def storage_order(obj: Any) -> list[int]:
    """The data addresses of the host tensor storages in ``obj``, in the order torch.save writes their records;
    storages without bytes are left out (torch writes nothing for them), and so are storages on a device
    (a tensor that an object the snapshot deep-copied holds): torch.save writes a host copy of those, from
    another address, and no staging copy fills them."""
    return list(dict.fromkeys(s.data_ptr() for s in _storages(obj) if s.nbytes() and s.device.type == "cpu"))


def in_place(obj: Any, relpath: str) -> StagedFile | None:
    """``obj`` itself as the file's snapshot, its host storages lent to the writer where they are: for a save
    that training waits out (``synchronous``), whose state does not change until it is written, to storage
    that copies the bytes it writes wherever they are (not :attr:`~async_ckpt.storage.base.Storage.aligned_lending`).
    A snapshot copy would only add a copy per byte; on a memory-backed target, where the write itself is such
    a copy, it made the synchronous save cost training more than stock DeepSpeed's (benchmarks/RESULTS.md, "A
    memory-backed target"). ``None`` where a storage is on a device: the staged copy brings it to the host.
    """
    try:
        storages = _storages(obj)
    except Exception:  # noqa: BLE001 - something that does not pickle: the staged snapshot names it (UsageError)
        return None
    if any(s.device.type != "cpu" for s in storages):
        return None
    regions = sorted({(s.data_ptr(), s.nbytes()) for s in storages if s.nbytes()})
    return StagedFile(relpath=relpath, obj=obj, nbytes=sum(size for _, size in regions), regions=regions,
                      in_place=True, lent_storages=storages)


class _Discard:
    """A stream that keeps nothing."""

    def write(self, data: Any) -> int:
        return len(data)

    def flush(self) -> None:
        """torch.save flushes the stream it wrote to; nothing was kept."""


def record_offsets(obj: Any, regions: Sequence[tuple[int, int]]) -> dict[int, int]:
    """The file offset at which torch.save writes each lendable buffer of ``obj`` (large, in ``regions``): what
    the writer's :class:`Lending` will note as the buffers' placements, found before the file is written.

    The staging pool places a snapshot's unplaced buffers by it, so that the first save after ``wrap()`` lends
    them to ``O_DIRECT`` and writes ahead as later saves do (they are placed by where the previous write put
    them); unplaced, the first save's I/O threads copied every byte into aligned memory. It is torch.save
    itself, with its CRC-32s off, into a stream that keeps nothing: the offsets do not depend on the data,
    and of a tensor's bytes torch then reads only the first four (it compares each record's start with a
    data descriptor's signature), so the buffers of a snapshot whose copies have not run yet can be laid out.
    torch's serialization settings are per thread: this runs on the training thread and the file is written
    on the writer's, so a setting changed on one thread only (``save.storage_alignment``) makes the offsets
    wrong. That costs the first save its copies (and writes ahead written again), never a wrong byte.
    """
    layout = _Layout(regions)
    with torch_zip.torch_crc(False):
        torch.save(obj, layout)
    return layout.offsets


class _Layout(_Discard):
    """A stream that keeps nothing, noting where each lendable buffer (see :func:`record_offsets`) lands."""

    def __init__(self, regions: Sequence[tuple[int, int]]) -> None:
        self._regions = regions
        self.offsets: dict[int, int] = {}
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if _lendable(view, self._regions):
            self.offsets[buffer_address(view)] = self.size
        self.size += view.nbytes
        return view.nbytes


def _lendable(view: memoryview, regions: Sequence[tuple[int, int]]) -> bool:
    """Whether ``view`` is large enough to lend and lies in one of the ``regions`` (address, size)."""
    if view.nbytes < LEND_MIN:
        return False
    start = buffer_address(view)
    return any(lo <= start and start + view.nbytes <= lo + size for lo, size in regions)


class ChecksumWriter:
    """Write-only stream that forwards every byte and keeps a running size and CRC-32.

    ``write(data, crc=...)`` takes the CRC-32 of ``data`` where the caller has it (the records
    :mod:`async_ckpt.torch_zip` hands over, each checksummed once for the zip and the manifest alike:
    an int, or a function that waits for it); other bytes are checksummed here as they pass.
    With a :class:`Lending` and a sink that has ``write_borrowed``, the large tensor records torch.save
    hands over from that memory are lent to the sink instead of copied;
    :func:`~async_ckpt.checksum.crc32_combine` folds the records' CRC-32s into the file's. A lent
    record without a CRC-32 (torch computing its own, see :func:`~async_ckpt.torch_zip.fills_like_torch`)
    is checksummed here at the end.

    With ``await_copy`` (a snapshot whose staging copies may still run), no storage is read before its
    copy is done: the wait for storage *k* happens when the data of storage *k-1* has been handed over
    (torch, where it computes the CRC-32s itself, reads a record before it writes the record's header;
    the order is :func:`storage_order`'s); a storage met out of that order fails the write rather
    than risk bytes read before their copy.

    The first error the sink raises is kept in ``error``: torch.save's zip writer turns a failing
    ``write()`` into "unexpected pos N vs M", which names neither the errno nor its cause.
    """

    def __init__(self, sink: BinaryIO, lending: Lending | None = None, *,
                 await_copy: AwaitCopy | None = None, order: Sequence[int] = ()) -> None:
        self._sink = sink
        self._await_copy = await_copy
        self._order = list(order) if await_copy is not None else []
        self._unwritten = set(self._order)
        self._next = -1  # index in _order of the storage whose record torch.save writes next (-1: none yet)
        self._lending = lending if lending is not None and hasattr(sink, "write_borrowed") else None
        self.size = 0
        self._crc = 0  # CRC-32 and length of the bytes since the last piece set aside
        self._run = 0
        self._pieces: list[tuple[Crc | None, int, memoryview | None]] = []  # in file order, before self._crc
        self.error: BaseException | None = None

    def write(self, data: Any, crc: Crc | None = None) -> int:
        view = memoryview(data).cast("B")
        try:
            if self._next < 0 and self._order:  # the first record (torch pickled the object before it)
                self._next = 0
                self._await_copy(self._order[0])  # type: ignore[misc]
            address = buffer_address(view) if self._unwritten else None
            expected = address in self._unwritten
            if expected and address != self._order[self._next]:
                raise RuntimeError(
                    f"torch.save wrote the storage at {address:#x} out of the order async_ckpt "
                    "predicted; the file is not written. Save with overlap_copy=False and report this")
            lent = self._lendable(view)
            if lent or callable(crc):  # its CRC-32 is taken later: when it is ready, or at the end
                self._pieces += [(self._crc, self._run, None), (crc, view.nbytes, view if crc is None else None)]
                self._crc = self._run = 0
            else:
                self._crc = crc32(view, self._crc) if crc is None else crc32_combine(self._crc, crc, view.nbytes)
                self._run += view.nbytes
            if lent:
                lending, copied = self._lending, getattr(self._sink, "copied_bytes", 0)
                self._sink.write_borrowed(view)  # type: ignore[attr-defined]
                lending.lent_bytes += view.nbytes  # type: ignore[union-attr]
                lending.copied_bytes += getattr(self._sink, "copied_bytes", 0) - copied  # type: ignore[union-attr]
            else:
                write_all(self._sink, view)
            if expected:
                self._unwritten.discard(self._order[self._next])
                self._next += 1
                if self._next < len(self._order):
                    self._await_copy(self._order[self._next])  # type: ignore[misc]
        except BaseException as exc:
            self.error = self.error or exc
            raise
        self.size += view.nbytes
        return view.nbytes

    def write_ahead(self) -> None:
        """Start writing every lent buffer whose file offset the previous save recorded (the sink writes
        each piece of it once its copy reached that piece, while torch.save still hands over the
        records before it), in the order the copies run."""
        if self._lending is None or not hasattr(self._sink, "write_ahead"):
            return
        for address, size in in_copy_order(self._lending.regions, self._order):
            offset = self._lending.placements.get(address)
            if offset is not None:
                ready = functools.partial(self._await_copy, address) if self._await_copy is not None else None
                self._sink.write_ahead((ctypes.c_char * size).from_address(address), offset, ready=ready)

    def _lendable(self, view: memoryview) -> bool:
        """Whether ``view`` lies in lendable memory; if so, its file offset is noted in the placements."""
        if self._lending is None or not _lendable(view, self._lending.regions):
            return False
        self._lending.placements[buffer_address(view)] = self.size
        return True

    @property
    def crc(self) -> int:
        """CRC-32 of everything written so far."""
        crc = 0
        for piece_crc, length, view in self._pieces:
            crc = crc32_combine(crc, crc32(view) if piece_crc is None else resolve_crc(piece_crc), length)
        return crc32_combine(crc, self._crc, self._run)

    def flush(self) -> None:
        flush = getattr(self._sink, "flush", None)
        if flush is not None:
            flush()


def in_copy_order(regions: Sequence[tuple[int, int]], order: Sequence[int]) -> list[tuple[int, int]]:
    """The large ``regions`` (address, size) of a snapshot, those in ``order`` (the storages' copy order)
    first and in it: the order in which their bytes become ready."""
    rank = {address: i for i, address in enumerate(order)}
    return sorted((r for r in regions if r[1] >= LEND_MIN), key=lambda region: rank.get(region[0], len(rank)))


def checksum_ahead(buffers: Sequence[tuple[int, int]], await_copy: AwaitCopy | None, pool: Executor | None,
                   copied: Mapping[int, Callable[[], int]]) -> dict[tuple[int, int], Callable[[], int]]:
    """The records' CRC-32s for :mod:`async_ckpt.torch_zip`, by (address, size), of every large staging
    buffer (address, size; :func:`in_copy_order`'s list): those its copy computes (``copied``, the
    copy ticket's ``crcs``, by address), and the others' started on ``pool``, piece by piece as
    their copies go."""
    crcs = {}
    for address, size in buffers:
        if address in copied:
            crcs[(address, size)] = copied[address]
            continue
        assert pool is not None, "a buffer whose copy does not checksum it needs checksum threads"
        ready = functools.partial(await_copy, address) if await_copy is not None else None
        memory = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        crcs[(address, size)] = crc32_in_pieces(memory, pool, COPY_PIECE, ready)
    return crcs


@contextlib.contextmanager
def _crc_threads(needed: bool) -> Iterator[Executor | None]:
    """Threads for :func:`checksum_ahead`, stopped (queued pieces dropped) when the file is done or failed."""
    if not needed:
        yield None
        return
    pool = ThreadPoolExecutor(max_workers=CRC_THREADS, thread_name_prefix="async_ckpt-crc")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def write_torch_file(storage: Storage, relpath: str, obj: Any, *, tag_dir: str, rank: int,
                     scratch_dir: str | None = None, lending: Lending | None = None,
                     await_copy: AwaitCopy | None = None,
                     copy_crcs: Mapping[int, Callable[[], int]] | None = None) -> FileEntry:
    """``torch.save(obj)`` to ``relpath`` atomically; the entry's path is relative to ``tag_dir``.

    With ``scratch_dir`` (a local folder) the bytes are exactly DeepSpeed's (see the module
    docstring); without it torch.save streams straight into storage, lending it the tensor data
    that lies in the ``lending`` regions (see :class:`ChecksumWriter`). ``await_copy(address, end)``
    waits for the staging copy into the storage at ``address``, if ``obj``'s copies may still run
    (streamed files only: torch.save into a scratch file has no hook between records, so the caller
    waits for every copy first). ``copy_crcs``: the CRC-32s those copies compute, by buffer address
    (the copy ticket's ``crcs``); other lent buffers are checksummed on threads of this write.
    """
    if scratch_dir is None:
        order = storage_order(obj) if await_copy is not None else []
        buffers = in_copy_order(lending.regions, order) if lending is not None else []
        copy_crcs = copy_crcs or {}
        unchecked = [address for address, _ in buffers if address not in copy_crcs]
        with storage.open_write(relpath) as stream, _crc_threads(bool(unchecked)) as pool:
            writer = ChecksumWriter(stream, lending, await_copy=await_copy, order=order)
            record_crcs = checksum_ahead(buffers, await_copy, pool, copy_crcs)
            writer.write_ahead()
            try:
                torch_zip.save(obj, writer, record_crcs)
            except Exception as torch_error:
                if writer.error is not None and writer.error is not torch_error:
                    raise writer.error from torch_error  # the storage's own error, not torch's "unexpected pos"
                raise
            writer.flush()
        return FileEntry(path=relpath[len(tag_dir) + 1:], size=writer.size, crc32=format_crc(writer.crc), rank=rank)
    if await_copy is not None:
        raise ValueError("await_copy applies to streamed files only: wait for the copies before a scratch-file save")
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
        crc = crc32(chunk, crc)
        size += len(chunk)
    return size, format_crc(crc)
