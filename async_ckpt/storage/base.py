"""The storage interface every backend implements.

A :class:`Storage` is one checkpoint root; every path is relative to it and uses ``/``. The one
promise that makes commits safe is in :meth:`Storage.open_write`: a file is visible under its
final name only once it is complete (and durable, where the backend can say so).
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import urllib.parse
import uuid
from typing import Any, BinaryIO, Callable, Iterator

from async_ckpt.errors import StorageError

logger = logging.getLogger("async_ckpt")


#: Bytes per read when a file is streamed through Python (copies, checksums).
IO_CHUNK = 8 * 1024 * 1024

#: Streams that take lent buffers (``write_borrowed``) copy smaller ones: not worth writes of their own.
LEND_MIN = 1024 * 1024
#: Name prefix of the file :meth:`Storage.probe` writes at a root and removes (``gc`` removes one a killed
#: process left).
PROBE_PREFIX = ".async_ckpt-probe-"

#: Called with the number of bytes just transferred (for progress bars).
Progress = Callable[[int], None]

_MADV_WIPEONFORK = 18  # Linux 4.14+ (not in Python's mmap module before 3.12): a forked child sees zeros
_HUGE_PAGE = 2 * 1024 * 1024  # x86-64's transparent huge page; smaller mappings are not worth advising


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (part of the stable ABI since Python 3.11)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def anonymous_memory(length: int) -> mmap.mmap:
    """A new anonymous mapping of ``length`` bytes for staging and ``O_DIRECT`` writes: page-aligned, as
    ``O_DIRECT`` needs; private, zeroed in forked children, on transparent huge pages where the kernel has
    them.

    Private, not shared (Python's default): shared anonymous memory is shmem, which ``MADV_DONTNEED`` does
    not give back to the system (trimming the staging reserve freed nothing) and which gets no huge pages
    unless shmem's own setting allows them (off by default). A private mapping is copy-on-write shared with
    a forked child (a DataLoader worker): the next copy into it would then copy every page, and the child
    would hold the old pages for its whole life; so a child gets zeros here instead (``MADV_WIPEONFORK``,
    Linux 4.14+), and shares no page with this process. (A range pinned for CUDA is left out of a child
    altogether: :func:`~async_ckpt.host_memory.register`.)

    Huge pages: from 4 KiB pages every page is a segment of its own in a block request, and a virtio disk
    takes at most 254 segments a request (about 1 MiB); from 2 MiB pages a request carries up to the
    device's largest, so the same bytes take a fraction of the requests, each of which costs CPU to submit
    and complete, the hypervisor's included. On the development VM, 1 GiB written from huge pages went
    1.2-1.7x faster, and the CPU time the hypervisor took from the busy guest for it (steal) was 0.5-0.7x
    (benchmarks/RESULTS.md, "Huge pages"). Where the kernel refuses a piece of advice the mapping works
    without it."""
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = [_MADV_WIPEONFORK] + ([mmap.MADV_HUGEPAGE] if length >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
                                   else [])
    for option in advice:
        try:
            mapping.madvise(option)
        except OSError as exc:  # EINVAL: an older kernel, or one built without transparent huge pages
            logger.debug("madvise(%d) refused for an anonymous mapping: %s", option, exc)
    return mapping


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``os.pwrite`` of all of ``view`` at ``offset``: one call may write less (Linux writes at most 2 GiB
    less a page per call, and a filling disk may take part of a write before it refuses the rest)."""
    written = 0
    while written < view.nbytes:
        written += os.pwrite(fd, view[written:], offset + written)


def write_all(stream: Any, view: memoryview) -> None:
    """``stream.write`` of all of ``view``: a raw file object writes short as ``os.write`` does (a filling
    disk, a file size limit), and says so only in the count it returns. A stream that returns ``None``
    (a buffered one of fsspec's) took all of it; one that takes nothing is an error, not an endless loop."""
    written = 0
    while written < view.nbytes:
        n = stream.write(view[written:])
        if n == 0:
            raise OSError(errno.EIO, f"a write took none of {view.nbytes - written} bytes")
        written += view.nbytes - written if n is None else n


def buffer_address(data: object) -> int:
    """Memory address of a buffer's first byte, read-only buffers included (torch.save hands its
    records over as read-only memoryviews, which ``ctypes.c_char.from_buffer`` refuses)."""
    view = _PyBuffer()
    if _get_buffer(data, ctypes.byref(view), 0) != 0:
        raise TypeError(f"{type(data).__name__} does not expose a buffer")
    try:
        return view.buf or 0
    finally:
        _release_buffer(ctypes.byref(view))


def redacted(url: str) -> str:
    """``url`` with its password and query string replaced by ``***``."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or (parts.password is None and not parts.query):
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{netloc.rsplit('@', 1)[1]}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", parts.fragment))


class Storage(abc.ABC):
    """One checkpoint root on some filesystem or object store."""

    #: ``"tmpfs"`` or ``"ramfs"`` where the root is a folder in memory (local storage on Linux): a write
    #: there is work for the CPU, not for a device.
    memory_filesystem: str | None = None
    #: ``True`` where lent memory is written with no copy only if its address is aligned like its file
    #: offset (``O_DIRECT`` to a device): there a snapshot placed for it saves a copy, so even a save that
    #: training waits out is staged. Elsewhere (a memory filesystem, buffered files, object-store parts)
    #: the write copies the bytes from wherever they are.
    aligned_lending: bool = False

    def __init__(self, url: str) -> None:
        #: As shown in logs, errors, handles and reports: without a password or query string the URL may
        #: carry (``ftp://user:secret@host/...``, a signed token), which open the root but are no name of it.
        self.url = redacted(url)
        #: Held across what follows a commit here (``latest``, bookkeeping, retention): a rank's writer and
        #: drainer may commit at one root at once, and one's check of ``latest`` must not interleave with the
        #: other's write of it (``latest`` would move back to an older save, perhaps one retention deleted).
        self.after_commit_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abc.abstractmethod
    def open_write(self, relpath: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A writable stream that publishes ``relpath`` atomically when the block exits cleanly.

        If the block raises, nothing appears under ``relpath`` and partial data is removed.
        """

    @abc.abstractmethod
    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of a (small) file; ``FileNotFoundError`` if it does not exist."""

    @abc.abstractmethod
    def exists(self, relpath: str) -> bool: ...

    @abc.abstractmethod
    def size(self, relpath: str) -> int: ...

    @abc.abstractmethod
    def list_dir(self, relpath: str = "") -> list[str]:
        """Names (not paths) of the direct children of a folder; empty if it does not exist."""

    @abc.abstractmethod
    def delete(self, relpath: str, *, recursive: bool = False) -> None:
        """Remove a file (or a folder with ``recursive``); a missing path is not an error."""

    @abc.abstractmethod
    def get_file(self, relpath: str, local_path: str, *, progress: Progress | None = None,
                 resume: bool = False) -> None:
        """Copy ``relpath`` to a local file.

        ``progress(n)`` is called as bytes arrive. With ``resume``, what an interrupted earlier
        call already wrote to ``local_path`` is kept and only the rest is fetched. Raises
        :class:`~async_ckpt.errors.MissingFileError` where ``relpath`` does not exist.
        """

    def local_dir(self) -> str | None:
        """The root as a local folder, when DeepSpeed can read it in place; else ``None``."""
        return None

    def close(self) -> None:
        """Stop what the backend started for transfers (threads, connections); it stays usable."""

    @property
    def upload_buffer_peak_bytes(self) -> int:
        """Most memory the uploader has held for parts in flight (0 where files are written in place)."""
        return 0

    def write_bytes(self, relpath: str, data: bytes) -> None:
        """Atomically publish a small file."""
        with self.open_write(relpath) as stream:
            write_all(stream, memoryview(data))

    def open_read(self, relpath: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A readable binary stream (used to verify checksums without a download)."""
        raise NotImplementedError

    def probe(self) -> None:
        """Check, cheaply and before any save, that the root can be written and read back.

        Raises :class:`StorageError` naming the URL and the likely fix.
        """
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            self.write_bytes(name, b"ok")
            if self.read_bytes(name) != b"ok":
                raise OSError("the probe file read back different bytes")
        except Exception as exc:  # every backend raises its own exception types
            raise StorageError(
                f"cannot write checkpoints to {self.url}: {type(exc).__name__}: {exc}. "
                "Check that the path or bucket exists, is writable by this user, and that "
                "storage_options (endpoint, credentials) are right."
            ) from exc
        finally:
            with contextlib.suppress(Exception):
                self.delete(name)

    def iter_files(self, relpath: str) -> Iterator[str]:
        """Every file below a folder, as paths relative to the root."""
        for name in self.list_dir(relpath):
            child = f"{relpath}/{name}" if relpath else name
            if self.is_dir(child):
                yield from self.iter_files(child)
            else:
                yield child

    @abc.abstractmethod
    def is_dir(self, relpath: str) -> bool: ...

    @abc.abstractmethod
    def modified(self, relpath: str) -> float:
        """Last modification time of a file, as a Unix timestamp."""

    def list_incomplete_uploads(self) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads under the root: ``(path relative to the root, upload id, started)``;
        none for files."""
        return []

    def last_part_uploaded(self, relpath: str, upload_id: str) -> float:
        """When the newest part of an unfinished upload was uploaded (Unix time; 0.0 if none; now where the
        store will not tell, or the upload ended since it was listed): one still uploading parts is alive
        however long ago it began."""
        return 0.0

    def abort_upload(self, relpath: str, upload_id: str) -> None:
        raise NotImplementedError
