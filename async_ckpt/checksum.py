"""CRC-32 arithmetic: one checksum pass per byte, spread over threads, serving the zip and the manifest.

:func:`crc32` is the package's one CRC-32: ISA-L's (the ``isal`` package), the same checksum as
zlib's at about 5x its speed on one core (10.7 against 1.8 GB/s on the development machine), and
like it without the GIL. The writer checksums every byte it writes, on cores training needs, so its
CPU per byte is mostly this checksum: where the write itself costs little CPU (``O_DIRECT`` from
the staging buffers), ISA-L's cut the writer's CPU per file by two thirds (benchmarks/RESULTS.md).

A torch.save file needs the CRC-32 of every record (the zip format), and the manifest the CRC-32
of the whole file. Computing both over the same gigabytes would cost two passes of CPU, on the
cores training needs. CRC-32 is linear, so the checksum of a concatenation follows from the
checksums of its parts and the length of the second: :func:`crc32_combine` does that in a few
microseconds, whatever the length (polynomial arithmetic modulo the CRC polynomial, the method
zlib's own ``crc32_combine`` uses; Python's zlib module does not expose it). The same property lets
:func:`crc32_in_pieces` checksum a large buffer in pieces on several threads, each piece as soon as
its staging copy is done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from isal import isal_zlib

_POLY = 0xEDB88320  # the CRC-32 polynomial, bit-reflected
_X0 = 1 << 31  # the polynomial x^0 in the reflected representation


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of ``data`` (any bytes-like object) continued from ``value``: ``zlib.crc32``'s result."""
    return isal_zlib.crc32(data, value)


def format_crc(crc: int) -> str:
    """The manifest's spelling of a CRC-32: eight lower-case hex digits."""
    return f"{crc & 0xFFFFFFFF:08x}"


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (both reflected)."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial for k = 0..31 (x^(2^k) repeats with period 32 here)."""
    table = [_X0 >> 1]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_POW_2K = _powers()


def _shift(crc: int, nbytes: int) -> int:
    """``crc`` multiplied by x^(8 * nbytes): the effect of appending ``nbytes`` zero bytes' worth of length."""
    factor, k = _X0, 3  # 8 * nbytes = nbytes << 3
    while nbytes:
        if nbytes & 1:
            factor = _multiply(_X_POW_2K[k & 31], factor)
        nbytes >>= 1
        k += 1
    return _multiply(factor, crc)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _shift(crc1, len2) ^ crc2 if len2 else crc1


def crc32_in_pieces(memory: memoryview, pool: Executor, piece: int,
                    ready: Callable[[int], None] | None = None) -> Callable[[], int]:
    """Start the CRC-32 of ``memory`` on ``pool``, one task per ``piece`` bytes, and return a function that
    waits for the tasks and combines their CRC-32s.

    Each task first calls ``ready(end)`` (the staging copy has reached byte ``end``) where given, so a
    buffer is checksummed piece by piece as its copy goes; :func:`crc32` lets go of the GIL, so
    the pieces run on as many cores as the pool has threads.
    """
    tasks = [(min(piece, memory.nbytes - start), pool.submit(_crc_of_piece, memory, start, piece, ready))
             for start in range(0, memory.nbytes, piece)]
    return combined_crc(tasks)


def combined_crc(pieces: Sequence[tuple[int, Future[int]]]) -> Callable[[], int]:
    """A function that waits for the CRC-32s of consecutive pieces, given as (length, future), and returns the
    CRC-32 of the whole; combined once, however often it is asked for (by the zip's data descriptor and
    central directory, and by the manifest)."""

    @functools.cache
    def result() -> int:
        crc = 0
        for length, task in pieces:
            crc = crc32_combine(crc, task.result(), length)
        return crc

    return result


def _crc_of_piece(memory: memoryview, start: int, piece: int, ready: Callable[[int], None] | None) -> int:
    end = min(start + piece, memory.nbytes)
    if ready is not None:
        ready(end)
    return crc32(memory[start:end])
