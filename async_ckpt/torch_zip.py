"""torch.save's zip records with CRC-32s computed by async_ckpt, so torch's own CRC pass leaves the writer thread.

torch.save computes the CRC-32 of every record on the thread that calls it, record after record,
before it writes each one: one core checksums the whole file in sequence (0.3 s per 600 MB on a
busy core of the development machine), and where the bytes are not lent to storage the manifest
needed a second pass of its own. Computed here instead, each byte is checksummed once, for the zip
and the manifest alike, and a large buffer as its staging copy goes (by the copy itself on CPU,
else on several threads). (On
the 2-core development machine this did not shorten time to durable: there the overlapped copy and
the disk are the chain; see benchmarks/RESULTS.md.) With torch's ``compute_crc32`` setting off
(thread-local: only the writer thread's saves see it) torch writes the very same records with
zeros in exactly three places:

- the CRC-32 field of each record's data descriptor (``PK\\x07\\x08``, right after the data);
- the CRC-32 field of each record's central-directory entry;
- the second half of the ``.data/serialization_id`` record: 20 decimal digits that fold, with
  ``c10::hash_combine`` in file order, the CRC-32 field of every write torch makes that begins with
  a descriptor's signature: the descriptors', and also bytes 4-8 of any record's data that happen
  to begin so (torch's stream writer cannot tell them apart).

:class:`CrcFiller` stands between torch.save and the output stream and fills those in. It knows
where a record's data starts and ends from the order of torch's ``write()`` calls (per record: the
local header, the name, the extra field, the data in one call, the descriptor; then the central
directory and the end records, which it holds until ``flush()``), and takes each record's CRC-32
from ``record_crcs`` (the large staging buffers, checksummed by their copies or in parallel pieces
as their copies complete: :func:`~async_ckpt.serialization.checksum_ahead`) or computes it as the
data passes. The
bytes are exactly torch's own: :func:`fills_like_torch` checks that once per process against a
plain torch.save, and where it does not hold (a torch that lays its zip out differently) torch
keeps computing its CRC-32s.
"""

from __future__ import annotations

import functools
import io
import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch
import torch.utils.serialization  # torch.save's settings (compute_crc32)

from async_ckpt.checksum import crc32
from async_ckpt.errors import ZipLayoutError
from async_ckpt.storage.base import buffer_address

logger = logging.getLogger("async_ckpt")

_LOCAL_HEADER = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL_ENTRY = b"PK\x01\x02"
_SERIALIZATION_ID = "/.data/serialization_id"
_MASK64 = (1 << 64) - 1

#: A record's CRC-32: known, or a function that waits for it.
Crc = int | Callable[[], int]


def hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit integers: how torch folds record CRC-32s into the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) & _MASK64


def torch_crc(on: bool) -> Any:
    """Context in which torch.save on this thread computes its CRC-32s (``on``) or writes zeros in their place.

    One patch per value, made once: each patch object torch makes sets a context variable of its
    own in every thread context that enters it, and that context keeps it for its life, so a new
    patch per file grew the writer thread's context by one variable per file (found with
    tracemalloc: about 190 bytes each)."""
    return _CRC_PATCHES[on]


_CRC_PATCHES = {on: torch.utils.serialization.config.patch({"save.compute_crc32": on}) for on in (False, True)}


class CrcFiller:
    """Write-only stream for torch.save with ``compute_crc32`` off that writes torch's own bytes to ``sink``.

    ``sink.write(data, crc=...)`` receives each record's data with that record's CRC-32 (an int, or a
    function that waits for it), everything else with ``crc=None``. ``record_crcs`` maps the
    (address, size) of memory whose CRC-32 is computed elsewhere to a function returning it; any
    other record is checksummed here as it passes. The first error is kept in ``error`` (torch
    reports a failed ``write()`` as "unexpected pos", which names neither what failed nor why).
    """

    def __init__(self, sink: Any, record_crcs: Mapping[tuple[int, int], Callable[[], int]] | None = None) -> None:
        self._sink = sink
        self._record_crcs = record_crcs or {}
        self._expect = self._header
        self._names: list[str] = []
        self._crcs: list[Crc] = []
        #: What torch folds into the serialization id, in order: the CRC-32 field of every write that begins
        #: with a descriptor's signature (``ostream_write_func`` in torch's inline_container.cc): each
        #: descriptor's, and bytes 4-8 of a record's data that begin so too. ``None``: data that do not.
        self._folded: list[int | Callable[[], int | None] | None] = []
        self._lengths = (0, 0)  # the current record's name and extra-field lengths
        self._extra_left = 0
        self._described = False
        self._data_size = 0
        self._ambiguous: tuple[memoryview, bytes] | None = None  # what _data could not yet tell from a descriptor
        self._tail = bytearray()
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._expect(view)
        except BaseException as exc:
            self.error = self.error or exc
            raise
        return view.nbytes

    def flush(self) -> None:
        """Fill the central directory's CRC-32s and pass it on with the end records."""
        if not self._tail:
            return
        try:
            tail, self._tail = self._tail, bytearray()
            self._sink.write(self._central_directory(tail), crc=None)
            flush = getattr(self._sink, "flush", None)
            if flush is not None:
                flush()
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _header(self, view: memoryview) -> None:
        if view.nbytes == 30 and view[:4] == _LOCAL_HEADER:
            flags, = struct.unpack_from("<H", view, 6)
            self._described = bool(flags & 0x8)  # sizes and CRC-32 follow the data, in a descriptor
            self._lengths = struct.unpack_from("<HH", view, 26)
            self._expect = self._name
            self._sink.write(view, crc=None)
        else:  # the central directory: everything from here on is held until flush()
            self._expect = self._hold
            self._hold(view)

    def _name(self, view: memoryview) -> None:
        self._check(view.nbytes == self._lengths[0], "a record name", view)
        self._names.append(view.tobytes().decode("utf-8"))
        self._extra_left = self._lengths[1]
        self._sink.write(view, crc=None)
        if self._extra_left:
            self._expect = self._extra
        else:
            self._after_extra()

    def _extra(self, view: memoryview) -> None:
        """The extra field, in one call or several (a zip64 record's sizes, then torch's alignment padding)."""
        self._check(0 < view.nbytes <= self._extra_left, "a record's extra field", view)
        self._sink.write(view, crc=None)
        self._extra_left -= view.nbytes
        if not self._extra_left:
            self._after_extra()

    def _after_extra(self) -> None:
        if self._described:
            self._expect = self._data
        else:  # a record without data (an empty storage): no data, no descriptor, a zero CRC-32
            self._crcs.append(0)
            self._expect = self._header

    def _data(self, view: memoryview) -> None:
        if self._is_descriptor(view, 0):
            # a record described but without data, or 16 or 24 bytes of data that read like its descriptor
            # (an int64 tensor [0x08074B50, 0]): the next write tells, a descriptor of that many bytes or not.
            # Data: passed on as the view (the storage's memory, which the sink may know by its address), still
            # valid then, as torch writes a record's descriptor within the same call; a descriptor: its copy
            # (miniz's, gone by the next record)
            self._ambiguous = (view, bytes(view))
            self._expect = self._after_ambiguous
            return
        self._data_record(view)

    def _after_ambiguous(self, view: memoryview) -> None:
        held, copy = self._ambiguous
        self._ambiguous = None
        if self._is_descriptor(view, held.nbytes):
            self._data_record(held)
            self._descriptor_after_data(view)
        else:
            self._crcs.append(0)
            self._descriptor(memoryview(copy))
            self._header(view)

    def _data_record(self, view: memoryview) -> None:
        crc: Crc
        if self._names[-1].endswith(_SERIALIZATION_ID):
            view = memoryview(self._serialization_id(view.tobytes()))
            crc = crc32(view)
        else:
            known = self._record_crcs.get((buffer_address(view), view.nbytes))
            crc = known if known is not None else crc32(view)
        if isinstance(crc, int):  # data passing through: torch's memory, valid during this call only
            self._folded.append(_descriptor_field(view))
        else:  # a staging buffer, whose copy may still run: read once its CRC-32 is known
            self._folded.append(functools.partial(_descriptor_field, view, crc))
        self._crcs.append(crc)
        self._data_size = view.nbytes
        self._expect = self._descriptor_after_data
        self._sink.write(view, crc=crc)

    def _descriptor_after_data(self, view: memoryview) -> None:
        self._check(self._is_descriptor(view, self._data_size), "a data descriptor", view)
        self._descriptor(view)

    def _descriptor(self, view: memoryview) -> None:
        crc = resolve_crc(self._crcs[-1])
        patched = bytearray(view)
        struct.pack_into("<I", patched, 4, crc)
        self._folded.append(crc)
        self._expect = self._header
        self._sink.write(memoryview(patched), crc=None)

    def _hold(self, view: memoryview) -> None:
        self._tail += view

    def _serialization_id(self, digits: bytes) -> bytes:
        """torch's serialization id with its second half: what :attr:`_folded` lists, folded."""
        self._check(len(digits) == 40 and digits.isdigit(), "a 40-digit serialization id", memoryview(digits))
        folded = 0
        for entry in self._folded:
            value = entry() if callable(entry) else entry
            if value is not None:
                folded = hash_combine(folded, value)
        return digits[:20] + b"%020d" % folded

    def _central_directory(self, tail: bytearray) -> bytearray:
        at = 0
        for index, name in enumerate(self._names):
            self._check(tail[at:at + 4] == _CENTRAL_ENTRY, f"the central-directory entry of {name}",
                        memoryview(tail)[at:at + 4])
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", tail, at + 28)
            self._check(tail[at + 46:at + 46 + name_len].decode("utf-8", "replace") == name,
                        f"the central-directory entry of {name}", memoryview(tail)[at:at + 46 + name_len])
            struct.pack_into("<I", tail, at + 16, resolve_crc(self._crcs[index]))
            at += 46 + name_len + extra_len + comment_len
        self._check(tail[at:at + 4] != _CENTRAL_ENTRY, "the end of the central directory", memoryview(tail)[at:at + 4])
        return tail

    @staticmethod
    def _is_descriptor(view: memoryview, size: int) -> bool:
        if view.nbytes not in (16, 24) or view[:4] != _DESCRIPTOR:
            return False
        return struct.unpack_from("<II" if view.nbytes == 16 else "<QQ", view, 8) == (size, size)

    @staticmethod
    def _check(ok: bool, what: str, view: memoryview) -> None:
        if not ok:
            raise ZipLayoutError(f"torch.save {torch.__version__} wrote {bytes(view[:16])!r}... where async_ckpt "
                                 f"expected {what}; its CRC-32s cannot be filled in. Report this with your torch version")


def _descriptor_field(view: memoryview, crc: Crc = 0) -> int | None:
    """The CRC-32 field torch reads from data that begin with a descriptor's signature, else ``None``;
    once ``crc`` is known (the data are final then)."""
    resolve_crc(crc)
    return struct.unpack_from("<I", view, 4)[0] if view.nbytes >= 8 and view[:4] == _DESCRIPTOR else None


def resolve_crc(crc: Crc) -> int:
    """A record's CRC-32, waiting for it where it is still being computed."""
    return crc if isinstance(crc, int) else crc()


class _Collect:
    """A sink that keeps what it is given (for :func:`fills_like_torch`)."""

    def __init__(self) -> None:
        self.out = io.BytesIO()

    def write(self, data: Any, crc: Crc | None = None) -> int:
        return self.out.write(data)


@functools.lru_cache(maxsize=None)
def fills_like_torch() -> bool:
    """Whether :class:`CrcFiller` gives this torch's own bytes: checked once per process on a sample
    with every kind of record torch writes (tensors of several dtypes, views sharing a storage, an
    empty storage, plain Python values)."""
    base = torch.arange(4096, dtype=torch.float32)
    sample = {"weights": base, "view": base[100:200], "half": torch.ones(33, dtype=torch.bfloat16),
              "empty": torch.empty(0), "scalar": torch.tensor(7), "meta": {"step": 3, "names": ["a", "b"]}}
    expected = io.BytesIO()
    with torch_crc(True):
        torch.save(sample, expected)
    filled = _Collect()
    try:
        with torch_crc(False):
            filler = CrcFiller(filled)
            torch.save(sample, filler)
    except Exception as exc:
        logger.warning("async_ckpt cannot fill in torch %s's CRC-32s (%s: %s); torch.save computes them on the "
                       "writer thread", torch.__version__, type(exc).__name__, exc)
        return False
    if filled.out.getvalue() != expected.getvalue():
        logger.warning("torch %s lays out its zip records differently from what async_ckpt fills in; torch.save "
                       "computes its CRC-32s on the writer thread", torch.__version__)
        return False
    return True


def save(obj: Any, stream: BinaryIO, record_crcs: Mapping[tuple[int, int], Callable[[], int]] | None = None) -> None:
    """``torch.save(obj, stream)`` with the CRC-32s filled in by :class:`CrcFiller` where :func:`fills_like_torch`;
    ``stream.write(data, crc=...)`` then gets each record's CRC-32 with its data."""
    if not fills_like_torch():
        with torch_crc(True):
            torch.save(obj, stream)
        return
    filler = CrcFiller(stream, record_crcs)
    try:
        with torch_crc(False):
            torch.save(obj, filler)  # which flushes the filler: the central directory goes out
    except Exception as torch_error:
        if filler.error is not None and filler.error is not torch_error:
            raise filler.error from torch_error  # what failed, not torch's "unexpected pos"
        raise
