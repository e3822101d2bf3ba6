"""Local disk and NFS: fsync'd temporary file, atomic rename, fsync'd folder.

POSIX rename is atomic on local filesystems and on NFS, so a file appears under its final name
only complete; fsync of the file and of its folder makes the data and the name survive a crash.
DeepSpeed reads local checkpoints in place, so resume needs no copy.

Files are written with ``O_DIRECT`` where the filesystem allows it: the bytes go to the device
without first filling the page cache, which measured 4x faster here for checkpoint-sized files
(see benchmarks/RESULTS.md): small writes through aligned bounce buffers, large lent buffers
(staging memory, see :class:`DirectWriter`) straight from where they are. Where ``O_DIRECT`` is
refused (tmpfs before Linux 6.6, some network filesystems) the ordinary buffered path is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import queue
import sys
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Iterator

import fsspec

from async_ckpt.storage.base import LEND_MIN, anonymous_memory, buffer_address as _address, pwrite_all
from async_ckpt.storage.fsspec_store import FsspecStorage

logger = logging.getLogger("async_ckpt")


_NO_FOLDER_FSYNC = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_warned_no_folder_fsync: set[int] = set()  # devices already warned of


def fsync_path(path: str) -> None:
    """fsync a file or a folder by its path (a folder's, for the names in it to survive a crash). A
    filesystem that cannot fsync a folder (some FUSE and virtual-machine shares, older CIFS: EINVAL or
    EOPNOTSUPP) is warned of once and passed over, as databases do: its names are as durable as it makes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        status = os.fstat(fd)
        if exc.errno not in _NO_FOLDER_FSYNC or not stat.S_ISDIR(status.st_mode):
            raise
        if status.st_dev not in _warned_no_folder_fsync:
            _warned_no_folder_fsync.add(status.st_dev)
            logger.warning("the filesystem of %s cannot fsync a folder (%s): a file's name there is as durable as "
                           "that filesystem makes it", path, os.strerror(exc.errno))
    finally:
        os.close(fd)


def make_folders(path: str, *, fsync: bool = True) -> None:
    """``os.makedirs``, then (with ``fsync``) each folder it created made durable in its parent: a new
    tag folder must survive a crash as its files do, and only ``latest``'s write fsyncs the root,
    which not every save makes."""
    created, folder = [], path
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(path, exist_ok=True)
    if fsync:
        for new in reversed(created):
            fsync_path(os.path.dirname(new))


@contextlib.contextmanager
def file_lock(path: str, *, shared: bool = False, create: bool = True, remove: bool = False) -> Iterator[bool]:
    """Hold ``flock`` on the file ``path`` (shared or exclusive) for the block; yield whether it is held.

    Processes on one machine (the ranks of a node) order their work on a folder by it. Where the file
    is missing and ``create`` is false, or the filesystem refuses locks (some network filesystems),
    the block runs without one: callers treat a lock as narrowing a race, never as needed to proceed.
    On NFS, Linux emulates ``flock`` with POSIX locks, which are per process: threads of one process
    do not exclude each other there.

    With ``remove`` (an exclusive lock on one piece of work, such as a file's fetch) the lock file is
    unlinked while still held, so none is left behind. A process that waited on the unlinked file
    finds it no longer at ``path`` once it holds it, and locks the file there now instead. Only on a
    filesystem of one machine (:func:`_locks_node_wide`): on NFS a client's cached name may still
    lead to the unlinked file, and two holders would then run at once; the file stays there."""
    remove = remove and _locks_node_wide(path)
    fd = _locked(path, shared=shared, create=create, remove=remove)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            if remove:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            fcntl.flock(fd, fcntl.LOCK_UN)  # not only by closing: a child forked meanwhile shares the file
            os.close(fd)


_LOCK_ATTEMPTS = 100  # of a removable lock, each lost to a holder that unlinked the file (or its folder)


def _locked(path: str, *, shared: bool, create: bool, remove: bool) -> int | None:
    """The open file ``path``, locked; None where it cannot be (see :func:`file_lock`)."""
    for _ in range(_LOCK_ATTEMPTS if remove else 1):
        fd = None
        try:
            if create:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            # open for writing where the lock is exclusive: NFS emulates flock with POSIX locks, which need it
            fd = os.open(path, (os.O_RDONLY if shared else os.O_RDWR) | (os.O_CREAT if create else 0), 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        except BaseException as exc:  # an interrupt while waiting closes the file too
            if fd is not None:
                os.close(fd)
            if not isinstance(exc, OSError):
                raise
            if remove and create and exc.errno == errno.ENOENT:
                continue  # the folder went with another holder's file between makedirs and open
            if create or exc.errno != errno.ENOENT:
                logger.debug("no lock on %s (%s)", path, exc)
            return None
        try:
            held_at_path = not remove or _is_at(fd, path)
        except OSError as exc:  # ESTALE on NFS, after another client removed it: as gone
            logger.debug("lock file %s: %s", path, exc)
            held_at_path = False
        if held_at_path:
            return fd
        os.close(fd)  # the holder this waited for unlinked it
    logger.debug("no lock on %s (lost to other holders %d times)", path, _LOCK_ATTEMPTS)
    return None


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is the file named ``path`` now."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


_ALIGN = 4096  # block size the bounce buffers are written in before the device's own is known
_BOUNCE_BYTES = 32 * 1024 * 1024
_CHUNK = 32 * 1024 * 1024  # one positioned write of a lent buffer
_IO_THREADS = 2
_dio_alignment: dict[int, int] = {}  # st_dev -> the alignment O_DIRECT needs there


def _write_when_ready(ready: Callable[[int], None] | None, end: int, fd: int, view: memoryview, offset: int) -> None:
    if ready is not None:
        ready(end)
    pwrite_all(fd, view, offset)


def dio_alignment(fd: int) -> int:
    """The memory and file-offset alignment ``O_DIRECT`` needs on ``fd``'s device: 512 where the
    device takes 512-byte blocks, else 4096. Probed once per device with a 512-byte write at offset
    512, which the file's first (4096-byte) block write overwrites."""
    device = os.fstat(fd).st_dev
    if device not in _dio_alignment:
        with anonymous_memory(_ALIGN) as page, memoryview(page) as view:
            try:
                os.pwrite(fd, view[512:1024], 512)
                _dio_alignment[device] = 512
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                _dio_alignment[device] = _ALIGN
    return _dio_alignment[device]


class DirectWriter:
    """Write-only stream over an ``O_DIRECT`` file descriptor, with positioned writes in parallel.

    ``O_DIRECT`` needs aligned memory, offsets and lengths. Small writes (zip headers, pickles)
    are gathered in page-aligned bounce buffers, written out whole; two buffers take turns, so
    one fills while the other is on its way to the device. :meth:`write_borrowed` takes a large
    buffer the caller promises to keep valid and unchanged until :meth:`finish` (a staging
    buffer): its aligned middle goes to the device straight from that memory, in chunks written by
    a few I/O threads at once (``os.pwrite`` releases the GIL), with no copy at all where its
    address is aligned like its file offset, and otherwise through a copy made in the I/O threads
    (``ctypes.memmove`` releases the GIL too). Only the few bytes at either end go through the
    bounce buffer. The last block is zero-padded and the file truncated back to its size on
    :meth:`finish`. An error an I/O thread meets is raised by the next write or by :meth:`finish`.

    ``alignment`` overrides the probed one: 1 where ``O_DIRECT`` writes are buffered writes that take any
    address, offset and length (tmpfs), so that no lent buffer is copied to align it.
    """

    def __init__(self, fd: int, buffer_bytes: int = _BOUNCE_BYTES, *, io_threads: int = _IO_THREADS,
                 alignment: int | None = None) -> None:
        if buffer_bytes <= 0 or buffer_bytes % _ALIGN:
            raise ValueError(f"buffer_bytes must be a positive multiple of {_ALIGN}, got {buffer_bytes}")
        self._fd = fd
        self._io_threads = io_threads
        self._align = dio_alignment(fd) if alignment is None else alignment
        self._capacity = buffer_bytes
        self._buffers = [anonymous_memory(buffer_bytes) for _ in range(2)]
        self._views = [memoryview(b) for b in self._buffers]
        self._buffer_writes: list[Future[None] | None] = [None, None]
        self._current = 0
        self._start = 0  # file offset of the current bounce buffer's first byte
        self._filled = 0
        self._writes: list[Future[None]] = []
        self._ahead: list[tuple[int, int, int, list[Future[None]]]] = []  # offset, length, address, writes
        self._overwritten: list[tuple[int, int]] = []  # offset, length of writes ahead the stream wrote over
        self._scratch: queue.Queue[mmap.mmap] | None = None
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="async_ckpt-direct-io")
        self._ahead_io: ThreadPoolExecutor | None = None  # writes ahead that wait for their buffer's copy
        self.copied_bytes = 0  # lent bytes that needed a copy (address and offset aligned differently)

    @property
    def size(self) -> int:
        return self._start + self._filled

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        total = view.nbytes
        while view.nbytes:
            take = min(self._capacity - self._filled, view.nbytes)
            self._views[self._current][self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._capacity:
                self._flush_buffer()
        return total

    def write_ahead(self, data: object, offset: int, *, ready: Callable[[int], None] | None = None) -> None:
        """Start writing a lent buffer at the file offset it is expected at, before the stream reaches it;
        with ``ready`` (``ready(end)`` returns once the buffer holds its bytes up to ``end``), on I/O
        threads of their own that call it before each piece they write, so that a piece is written as
        soon as its own bytes are there and the stream's writes never queue behind a write ahead still
        waiting for its bytes.

        If :meth:`write_borrowed` later hands over the same memory at the same offset, it is already
        written or on its way (unless another write ahead overlaps it: then it is written again). If
        not, the bytes written ahead are overwritten: every later write first waits for the writes
        ahead it overlaps, and the file's every byte is written again by the stream (anything past
        its end is cut off by :meth:`finish`).
        """
        head, middle = self._split(memoryview(data).cast("B"), offset)  # type: ignore[arg-type]
        body = middle.nbytes
        if body <= 0 or (_address(middle) - offset - head) % self._align:
            return
        if ready is not None and self._ahead_io is None:
            self._ahead_io = ThreadPoolExecutor(max_workers=self._io_threads,
                                                thread_name_prefix="async_ckpt-direct-ahead")
        io = self._io if ready is None else self._ahead_io
        writes = [io.submit(_write_when_ready, ready, head + min(i + _CHUNK, body), self._fd,  # type: ignore[union-attr]
                            middle[i:i + _CHUNK], offset + head + i)
                  for i in range(0, body, _CHUNK)]
        self._writes += writes
        self._ahead.append((offset + head, body, _address(middle), writes))

    def write_borrowed(self, data: object) -> int:
        """Write ``data`` without copying it now; it must stay valid and unchanged until :meth:`finish`."""
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        total = view.nbytes
        head, middle = self._split(view, self.size)
        body = middle.nbytes
        if total < LEND_MIN or body <= 0:
            return self.write(view)
        if head:
            self.write(view[:head])
        if self._filled:
            self._flush_buffer()
        expected = (self._start, body, _address(middle))
        ahead = next((a for a in self._ahead if a[:3] == expected), None)
        if ahead is not None and not self._overlapped(ahead):
            self._ahead.remove(ahead)  # already written where it belongs
        else:  # written anew, once the writes ahead it overlaps are done (a wrong one may land after the right one)
            aligned = _address(middle) % self._align == 0
            if not aligned and self._scratch is None:  # aligned memory for the I/O threads' copies
                self._scratch = queue.Queue()
                for _ in range(self._io_threads):
                    self._scratch.put(anonymous_memory(_CHUNK))
            for offset in range(0, body, _CHUNK):
                chunk = middle[offset:offset + _CHUNK]
                if aligned:
                    self._submit(self._start + offset, chunk.nbytes, pwrite_all, self._fd, chunk, self._start + offset)
                else:
                    self._submit(self._start + offset, chunk.nbytes, self._copy_and_write, chunk, self._start + offset)
            self.copied_bytes += 0 if aligned else body
        self._start += body
        if head + body < total:
            self.write(view[head + body:])
        return total

    def _overlapped(self, ahead: tuple[int, int, int, list[Future[None]]]) -> bool:
        """Whether another write ahead, pending or already written over, overlaps ``ahead``'s range of the
        file: its bytes may have landed after ``ahead``'s."""
        others = [other[:2] for other in self._ahead if other is not ahead] + self._overwritten
        return any(start < ahead[0] + ahead[1] and ahead[0] < start + length for start, length in others)

    def _split(self, view: memoryview, offset: int) -> tuple[int, memoryview]:
        """``view`` written at file ``offset``: the length of its head before the first aligned offset, and
        its aligned middle (whole blocks; what is left after it is the tail)."""
        head = min(-offset % self._align, view.nbytes)
        return head, view[head:head + (view.nbytes - head) // self._align * self._align]

    def flush(self) -> None:
        pass

    def _submit(self, offset: int, length: int, fn: Any, *args: Any) -> Future[None]:
        """Run ``fn(*args)``, a write of ``length`` bytes at ``offset``, on an I/O thread once the writes
        ahead that overlap it are done (theirs were the wrong bytes)."""
        for done in [f for f in self._writes if f.done()]:
            self._writes.remove(done)
            done.result()  # raises what the I/O thread met
        for ahead in [a for a in self._ahead if a[0] < offset + length and offset < a[0] + a[1]]:
            self._ahead.remove(ahead)
            self._overwritten.append(ahead[:2])
            for write in ahead[3]:
                write.result()
        future = self._io.submit(fn, *args)
        self._writes.append(future)
        return future

    def _flush_buffer(self, length: int | None = None) -> None:
        """Queue the current bounce buffer for writing and continue in the other once its own write is done."""
        length = self._filled if length is None else length
        self._buffer_writes[self._current] = self._submit(self._start, length, pwrite_all, self._fd,
                                                          self._views[self._current][:length], self._start)
        self._start += self._filled
        self._current ^= 1
        self._filled = 0
        pending = self._buffer_writes[self._current]
        if pending is not None:
            pending.result()

    def _copy_and_write(self, chunk: memoryview, offset: int) -> None:
        """In an I/O thread: copy a lent chunk whose address is not aligned into aligned memory, write it."""
        assert self._scratch is not None  # made by write_borrowed before it submits copies
        buffer = self._scratch.get()
        try:
            with memoryview(buffer) as target:
                ctypes.memmove(_address(target), _address(chunk), chunk.nbytes)
                pwrite_all(self._fd, target[:chunk.nbytes], offset)
        finally:
            self._scratch.put(buffer)

    def finish(self) -> None:
        size = self.size
        if self._filled:
            padded = -(-self._filled // self._align) * self._align
            self._views[self._current][self._filled:padded] = bytes(padded - self._filled)
            if self._start == 0 and not self._writes:
                # the whole file is in this one buffer (a start mark, a manifest, a model-states file): written
                # here, as an I/O thread would only have to start and be scheduled on cores training keeps busy
                pwrite_all(self._fd, self._views[self._current][:padded], 0)
            else:
                self._flush_buffer(padded)
        for future in self._writes:
            future.result()
        self._writes.clear()
        self._ahead.clear()
        os.ftruncate(self._fd, size)

    def release(self) -> None:
        """Stop the I/O threads (after the writes in flight) and free the buffers."""
        self._io.shutdown(wait=True)
        if self._ahead_io is not None:
            self._ahead_io.shutdown(wait=True)
        self._writes.clear()
        self._ahead.clear()
        self._buffer_writes = [None, None]
        buffers = self._buffers + ([] if self._scratch is None else list(self._scratch.queue))
        for view in self._views:
            view.release()
        for buffer in buffers:
            with contextlib.suppress(BufferError):  # an error's traceback may still hold a slice: freed with it
                buffer.close()


#: ``statfs`` ``f_type`` of the filesystems that keep files in memory.
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
#: ``statfs`` ``f_type`` of filesystems one machine alone mounts (ext2/3/4, XFS, Btrfs, ZFS, overlayfs,
#: and the memory ones), where names and locks are coherent between its processes.
_MACHINE_FILESYSTEMS = {0xEF53, 0x58465342, 0x9123683E, 0x2FC12FC1, 0x794C7630, *_MEMORY_FILESYSTEMS}


def _filesystem_type(path: str) -> int | None:
    """``statfs``'s ``f_type`` of ``path`` (or its nearest existing parent); Linux only (``None`` elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    result = ctypes.create_string_buffer(512)  # struct statfs (120 bytes on 64-bit Linux), f_type first
    if ctypes.CDLL(None).statfs(os.fsencode(probe), result) != 0:
        return None
    # f_type is a C long on x86_64 and aarch64; the magic numbers are 32-bit (ramfs's has the sign bit set)
    return ctypes.c_long.from_buffer(result).value & 0xFFFFFFFF


def memory_filesystem(path: str) -> str | None:
    """``"tmpfs"`` or ``"ramfs"`` when ``path`` (or its nearest existing parent) is on one, else ``None``.

    A write there is CPU work (page allocation and a copy) rather than a device's transfer, so a
    background write takes its cores from training; Linux only (``None`` elsewhere).
    """
    kind = _filesystem_type(path)
    return None if kind is None else _MEMORY_FILESYSTEMS.get(kind)


def _locks_node_wide(path: str) -> bool:
    """Whether ``path`` is on a filesystem only this machine mounts (see :data:`_MACHINE_FILESYSTEMS`)."""
    return _filesystem_type(path) in _MACHINE_FILESYSTEMS


def _open_direct(path: str) -> int | None:
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: this filesystem does not do O_DIRECT
            raise
        return None


class LocalStorage(FsspecStorage):
    """A checkpoint root in a local (or NFS-mounted) folder."""

    def __init__(self, path: str, *, fsync: bool = True, direct_io: bool = True) -> None:
        root = os.path.abspath(os.path.expanduser(path))
        super().__init__(fsspec.filesystem("file"), root, root)
        self.fsync = fsync
        self.direct_io = direct_io
        self.memory_filesystem = memory_filesystem(root)
        self.aligned_lending = direct_io and self.memory_filesystem is None

    def local_dir(self) -> str:
        return self.root

    @contextlib.contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        final = os.path.join(self.root, *relpath.split("/"))
        parent = os.path.dirname(final)
        make_folders(parent, fsync=self.fsync)
        tmp = f"{final}.{uuid.uuid4().hex[:12]}.partial"
        fd = _open_direct(tmp) if self.direct_io else None
        direct = fd is not None
        if fd is None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        stream: Any = None  # a DirectWriter, or a raw file object
        try:
            # Unbuffered either way: torch.save hands over whole tensor storages; a userspace buffer only adds a copy.
            # In memory every write is a copy on the CPU and the filesystem serializes the writes to one file:
            # a second thread per I/O pool only spins on its lock (benchmarks/RESULTS.md, "A memory-backed target").
            # There O_DIRECT is accepted but the writes are buffered ones, at any alignment: no bounce copies.
            in_memory = self.memory_filesystem is not None
            stream = (DirectWriter(fd, io_threads=1 if in_memory else _IO_THREADS, alignment=1 if in_memory else None)
                      if direct else open(fd, "wb", buffering=0, closefd=False))
            yield stream  # type: ignore[misc]
            if direct:
                stream.finish()
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            if stream is not None:
                stream.release() if direct else stream.close()
            os.close(fd)
        try:
            os.replace(tmp, final)
        except BaseException:  # a full folder, a stale NFS handle: the whole file must not stay under its .partial name
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            fsync_path(parent)
