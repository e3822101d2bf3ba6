"""Snapshot DeepSpeed's state dicts into host memory that is allocated once and reused.

DeepSpeed hands the checkpoint engine *live* tensors: module parameters, fp32 master partitions
and Adam moments that the next optimizer step overwrites in place. The snapshot replaces every
tensor in the (nested) dict with a view of the same shape, strides and offset into a host copy
of its storage, owned by this pool; tensors that share a storage keep sharing one, so
``torch.save`` writes the same records DeepSpeed's own engine would. Buffers are keyed by
file and by the tensor's path in the state dict, so the second and every later save reuses the memory
of the first (a fresh allocation costs page faults: about 4x slower than a copy into memory already
touched); a buffer a file's latest snapshot did not use is freed (:meth:`StagingPool.release_stale`).

The buffers are carved from anonymous mappings (:mod:`async_ckpt.host_memory`), reserved and faulted
in ahead of the first save. On CUDA those mappings are pinned where they lie and the device-to-host
copies run non-blocking on a dedicated stream, tracked by events; on CPU, deferred copies run on one
helper thread owned by the pool, which checksums each piece it copies while the piece is still in
its core's cache (see :func:`_copy_and_checksum`). Either way a :class:`CopyTicket` says when the
snapshot is safe, as a whole and buffer by buffer.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from async_ckpt import host_memory
from async_ckpt.checksum import combined_crc, crc32
from async_ckpt.errors import UsageError
from async_ckpt.storage.base import LEND_MIN, anonymous_memory, buffer_address

logger = logging.getLogger("async_ckpt")

CopyPair = tuple[torch.Tensor, torch.Tensor]
#: ``offsets_of(staged, regions)``: the file offset, by buffer address, at which each large buffer in
#: ``regions`` (address, size) of a staged object will be written (see :meth:`StagingPool.snapshot`).
RecordOffsets = Callable[[Any, Sequence[tuple[int, int]]], dict[int, int]]

#: Host buffers are placed so that address and file offset agree modulo this (a page: any device's
#: ``O_DIRECT`` alignment).
PLACEMENT_ALIGN = 4096

#: A pinned reserve whose unused tail is at most this fraction of it is kept whole after the first save:
#: trimming it means unpinning the reserve and pinning the used head again, gigabytes pinned on the
#: helper thread while training runs the steps after that save.
PINNED_TAIL_KEPT = 1 / 16

#: Host copies run on the helper thread in pieces of this size, each completed on its own: the writer
#: starts writing a large buffer once its first piece is copied instead of once all of it is.
COPY_PIECE = 32 * 1024 * 1024

#: A background host copy is made and checksummed in pieces of this size, each checksummed right after
#: its copy, while it is still in the core's cache (a fraction of a 2 MiB L2): the CRC-32 pass then
#: reads no memory of its own (see :func:`_copy_and_checksum`).
CACHED_PIECE = 512 * 1024

#: Background copies from a GPU queued on the side stream and unfinished at any time, at most: what a
#: device-wide synchronize of the training thread waits for (see ``StagingPool._queue_on_side_stream_in_pieces``).
PIECES_IN_FLIGHT = 2

#: Waits until the copy into one staging buffer has reached the given byte (``None``: all of it).
BufferWait = Callable[[int | None], None]


class CopyTicket:
    """Completion of a batch of staging copies: ``wait()`` returns once every copy is done, and
    ``wait_for(address, end)`` once the copy into the buffer at that address has reached byte ``end``
    (all of it by default). The writer starts on each piece of a buffer as soon as its copy ends,
    so an overlapped copy and the disk run together.

    ``crcs`` maps the address of each staging buffer whose copy also computed its CRC-32 to a function
    that waits for the copy and returns it: the writer needs every buffer's CRC-32 (torch's zip
    records, the manifest), and taken as the copy goes it costs no pass over memory of its own."""

    def __init__(self, waiters: list[Callable[[], None]],
                 buffers: dict[int, BufferWait] | None = None, crcs: dict[int, Callable[[], int]] | None = None) -> None:
        self._waiters = waiters
        self._buffers = buffers or {}
        self.crcs = crcs or {}
        self._lock = threading.Lock()
        self._done = not waiters

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            for wait in self._waiters:
                wait()
            self._done = True

    def wait_for(self, address: int, end: int | None = None) -> None:
        """Wait for the copy into the staging buffer that starts at ``address``, up to its byte ``end``
        (default: all of it); a buffer this ticket does not copy into is ready already."""
        waiter = None if self._done else self._buffers.get(address)
        if waiter is not None:
            waiter(end)

    @property
    def done(self) -> bool:
        return self._done


@dataclass
class StagedFile:
    """One file's snapshot: ``obj`` has the structure DeepSpeed handed over, with host tensors."""

    relpath: str
    obj: Any
    nbytes: int
    deferred: list[CopyPair] = field(default_factory=list)
    #: (address, size) of the pooled buffers ``obj`` lives in: memory that stays unchanged until the
    #: file is written, so the writer may lend it to storage instead of copying it.
    regions: list[tuple[int, int]] = field(default_factory=list)
    #: Buffer address -> file offset its bytes were (or will be) written at: filled by the writer, and
    #: before a snapshot's first write by its ``offsets_of``. The pool's own dict: the next snapshot places
    #: each buffer where it can be written with no copy, and the next write starts writing it there before
    #: torch.save reaches it (the layout repeats).
    placements: dict[int, int] = field(default_factory=dict)
    #: ``obj`` is the training state itself, not a copy (:func:`~async_ckpt.serialization.in_place`): it is
    #: valid only while training waits for the save.
    in_place: bool = False
    #: With ``in_place``: the storages lent, held so that the memory at ``regions`` stays allocated until
    #: the file is written even where training rebinds its tensors to new ones meanwhile.
    lent_storages: list[torch.UntypedStorage] = field(default_factory=list)


@dataclass
class _Memo:
    """What one snapshot has staged so far: by tensor identity and by source storage.

    ``compact`` snapshots stand in for DeepSpeed's ``clone_tensors_for_torch_save``: every tensor
    is staged on its own, as a plain tensor laid out as ``clone()`` lays it out, so the file holds
    just those tensors (not the flat buffers they view), exactly as after DeepSpeed's clone.
    """

    compact: bool = False
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    storages: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Containers and values already copied, by identity: one object met twice (an optimizer's
    #: ``betas`` tuple shared by its parameter groups) stays one object, which torch.save's pickler
    #: writes once and then refers to, as in DeepSpeed's own file. DeepSpeed's clone rebuilds every
    #: container, so ``compact`` snapshots do not share containers.
    containers: dict[int, Any] = field(default_factory=dict)
    values: dict[int, Any] = field(default_factory=dict)
    #: The buffer names (paths) given so far: two dict keys with one ``repr`` (tensors as keys) would
    #: otherwise share a buffer, one copy overwriting the other.
    slots: set[str] = field(default_factory=set)

    def slot(self, path: str) -> str:
        """``path``, made unique within this snapshot."""
        name, n = path, 1
        while name in self.slots:
            name, n = f"{path}#{n}", n + 1
        self.slots.add(name)
        return name


class StagingPool:
    """Host buffers for one rank's snapshots, reused across saves.

    Not thread-safe by design: the training thread snapshots, and the caller guarantees (by
    waiting for the previous save's write) that no writer still reads the buffers it reuses.
    """

    def __init__(self, *, copier_init: Callable[[], None] | None = None) -> None:
        self._copier_init = copier_init
        self._slots: dict[tuple[str, str], torch.Tensor] = {}  # (file, tensor path) -> buffer
        self._bases: dict[tuple[str, str], tuple[mmap.mmap, int, int]] = {}  # mapping, start, length
        self._placements: dict[int, int] = {}
        self._used_in: dict[tuple[str, str], int] = {}  # slot -> the save (generation) that last used it
        self._generation = 0
        self._reserve: mmap.mmap | None = None
        self._reserve_used = 0
        self._reserving: Future[None] | None = None
        self._trimming: Future[None] | None = None
        self._helper: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self._pinned = host_memory.PinnedMappings()
        self._reserve_pin: torch.device | None = None  # the CUDA device the reserve is pinned for
        # A pool collected unclosed unpins too (its buffers are pinned while it lives); not at exit, when
        # the pages go back anyway and CUDA may be torn down already.
        weakref.finalize(self, _unpin_all, self._pinned, self._streams).atexit = False
        self.allocations = 0

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots.values())

    @property
    def reserved(self) -> bool:
        """Whether the memory :meth:`reserve` maps is faulted in (and pinned) by now, or none was reserved."""
        return self._reserving is None or self._reserving.done()

    @property
    def buffers_outside_reserve(self) -> int:
        """Buffers in mappings of their own: those the reserve had no room for (or a reserve not pinned
        for their device), each mapped, and on a GPU pinned, in the stall of the save that needed it."""
        return sum(base[0] is not self._reserve for base in self._bases.values())

    def reserve(self, nbytes: int, *, buffers: int = 0, pin_for: torch.device | None = None) -> None:
        """Map ``nbytes`` of host memory and fault it in on the pool's helper thread, so that the first
        snapshot copies into memory already touched (faulting in fresh pages costs several times the
        copy) and the first save stalls no longer than the next ones. With ``pin_for`` (a CUDA device)
        the memory is then pinned there too, which takes seconds for gigabytes: from ``wrap()``, not in
        the first save. The first snapshots carve their buffers out of it; :meth:`trim_reserve` gives
        back what they left. Starting the helper thread here also keeps its start (milliseconds on a
        busy machine) out of the first save's stall.

        ``buffers``: how many buffers the first snapshots will carve. Each takes up to
        ``2 * PLACEMENT_ALIGN`` bytes beyond its own (its placement), so the reserve holds that much
        more: without it the last buffers fell outside the reserve, and on a GPU were pinned in the
        first save's stall (0.43 s against 0.03 s for ZeRO-2 bf16 on an H200)."""
        if nbytes <= 0 or self._reserve is not None:
            return
        self._reserve, self._reserve_pin = anonymous_memory(nbytes + buffers * 2 * PLACEMENT_ALIGN), pin_for
        self._reserving = self._helper_thread().submit(self._fault_in, self._reserve, pin_for)

    def trim_reserve(self) -> None:
        """After the first save's snapshots: return the reserved memory they did not use to the system,
        on the helper thread after the save's copies (freeing hundreds of MB takes tens of milliseconds:
        not the stall's). A pinned reserve is unpinned once the copies into it are done, and what the
        snapshots use is pinned again before the next snapshot; unless its unused tail is small
        (:data:`PINNED_TAIL_KEPT`), which then stays pinned rather than have the head pinned again."""
        if self._reserve is None or self._reserving is None or self._trimming is not None:
            return
        start = -(-self._reserve_used // mmap.PAGESIZE) * mmap.PAGESIZE
        self._reserve_used = len(self._reserve)  # nothing more is carved from it
        if self._reserve_pin is not None and len(self._reserve) - start <= len(self._reserve) * PINNED_TAIL_KEPT:
            return
        self._trimming = self._helper_thread().submit(self._trim, self._reserve, start)

    def release_stale(self) -> None:
        """After a save's snapshots: free the buffers of the files it snapshotted that it did not use, and
        start the next save's count.

        Buffers are named by their tensor's path in the state dict, so a tensor that goes (or a key that
        changes every save, such as a step number in ``client_state``) would otherwise keep its buffer, on
        a GPU pinned, for the pool's life: memory growing without bound. Only the files this save wrote are
        pruned; a file saved now and then (a consolidated export) keeps its buffers between its saves.
        No writer reads a stale buffer: it was last used by an earlier save, whose write the caller waited
        for before these snapshots. Where a buffer lies in the reserve, its room there is not reused."""
        current = self._generation
        files = {slot[0] for slot, used in self._used_in.items() if used == current}
        for slot in [s for s, used in self._used_in.items() if s[0] in files and used != current]:
            del self._used_in[slot]
            buf, (mapping, _, _) = self._slots.pop(slot, None), self._bases.pop(slot)
            if buf is not None:
                self._placements.pop(buf.data_ptr(), None)
            if mapping is not self._reserve and mapping in self._pinned:
                # unmapped once nothing holds it: this task holds it until the copies into it ended and it is unpinned
                self._helper_thread().submit(self._unpin_after_copies, mapping)
        self._generation += 1

    def snapshot(self, obj: Any, relpath: str, *, slot_key: str, defer: bool, compact: bool = False,
                 offsets_of: RecordOffsets | None = None) -> StagedFile:
        """Copy (or, with ``defer``, plan the copy of) every tensor in ``obj`` into pooled buffers.

        ``compact`` stages what DeepSpeed's clone before saving would produce (see :class:`_Memo`).
        ``offsets_of(staged, regions)``: the file offset each large buffer of the staged object will be
        written at (:func:`~async_ckpt.serialization.record_offsets`). A large buffer no write has placed
        yet (new to this snapshot, or last written where nothing is placed, as to S3) is placed by it
        before any copy.
        """
        if self._reserve_pin is not None and self._trimming is not None:
            self._trimming.result()  # the reserve is pinned again before any copy into it
        memo = _Memo(compact=compact)
        staged, pairs = self._stage(obj, slot_key, memo)
        regions = _regions(pairs)
        if offsets_of is not None and any(size >= LEND_MIN and address not in self._placements
                                          for address, size in regions):
            self._placements.update(offsets_of(staged, regions))
            # the same slots, moved to their placements; plain values are not copied again
            staged, pairs = self._stage(obj, slot_key, _Memo(compact=compact, values=memo.values))
            regions = _regions(pairs)
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        result = StagedFile(relpath=relpath, obj=staged, nbytes=nbytes, regions=regions, placements=self._placements)
        if defer:
            result.deferred = pairs
        else:
            self.copy(pairs).wait()
        return result

    def _stage(self, obj: Any, slot_key: str, memo: _Memo) -> tuple[Any, list[CopyPair]]:
        """``obj`` with its tensors in pooled buffers, and the copies that fill them (not started)."""
        pairs: list[CopyPair] = []
        with torch.no_grad():
            staged = self._copy_tree(obj, slot_key, memo, pairs, path="")
        return staged, pairs

    def copy(self, pairs: list[CopyPair], *, background: bool = False, checksum: bool = True) -> CopyTicket:
        """Start the copies and return their ticket.

        Device sources are copied non-blocking on a side stream: all queued at once, or with
        ``background`` queued by the pool's helper thread a few pieces at a time (see
        :meth:`_queue_on_side_stream_in_pieces`). Host sources are copied inline, or with ``background``
        on the helper thread, one buffer after the other in the order given (a whole storage in pieces
        of :data:`COPY_PIECE`, each completed on its own), so that training can go on meanwhile; there a
        whole staged storage is checksummed as it is copied (the ticket's ``crcs``), unless ``checksum``
        is false (a writer that checksums the file it writes itself, as ``exact_bytes`` does).
        """
        device_pairs = [p for p in pairs if p[1].device.type != "cpu"]
        host_pairs = [p for p in pairs if p[1].device.type == "cpu"]
        waiters: list[Callable[[], None]] = []
        buffers: dict[int, BufferWait] = {}
        crcs: dict[int, Callable[[], int]] = {}
        if device_pairs and background:
            for dst, pieces in self._queue_on_side_stream_in_pieces(device_pairs):
                waiters += [functools.partial(_wait_for_device_piece, future) for _, future in pieces]
                buffers[dst.untyped_storage().data_ptr()] = functools.partial(_wait_for_pieces, pieces, device=True)
        elif device_pairs:
            for address, event_done in self._copy_on_side_stream(device_pairs).items():
                waiters.append(event_done)
                buffers[address] = lambda end, done=event_done: done()
        if host_pairs and background:
            helper = self._helper_thread()
            for dst, src in host_pairs:
                address = dst.untyped_storage().data_ptr()
                if checksum and _whole_flat_storage(dst, src):
                    parts = [(start, pair[0].numel(), helper.submit(_copy_and_checksum, *pair))
                             for start, pair in _pieces(dst, src)]
                    pieces = [(start, future) for start, _, future in parts]
                    crcs[address] = combined_crc([(length, future) for _, length, future in parts])
                else:
                    pieces = [(start, helper.submit(_copy_all, [piece])) for start, piece in _pieces(dst, src)]
                waiters += [future.result for _, future in pieces]
                buffers[address] = functools.partial(_wait_for_pieces, pieces)
        elif host_pairs:
            _copy_all(host_pairs)
        return CopyTicket(waiters, buffers, crcs)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)  # after the copies, the reservation's faulting-in and trim
            self._helper = None
        _unpin_all(self._pinned, self._streams)
        self._slots.clear()
        self._bases.clear()
        self._placements.clear()
        self._used_in.clear()
        self._reserving = self._trimming = None
        self._reserve = None

    def _helper_thread(self) -> ThreadPoolExecutor:
        """The pool's one helper thread: deferred host copies, and the reservation's faulting-in and trim,
        in the order submitted."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_ckpt-stage",
                                              initializer=self._copier_init)
            self._helper.submit(lambda: None)  # the thread starts now, not at the first save
        return self._helper

    # The helper thread's memory work: faulting in, trimming and pinning (its CUDA calls then leave their
    # per-thread last error on that thread, away from training's).
    def _fault_in(self, mapping: mmap.mmap, pin_for: torch.device | None) -> None:
        host_memory.populate(mapping)
        if pin_for is not None:
            self._pinned.pin(mapping, len(mapping), pin_for)

    def _unpin_after_copies(self, mapping: mmap.mmap) -> None:
        _synchronize(self._streams)  # the copies into its pages (this thread queued them) end before it is unpinned
        self._pinned.unpin(mapping)

    def _trim(self, mapping: mmap.mmap, start: int) -> None:
        if start >= len(mapping):
            return
        pinned = mapping in self._pinned
        if pinned:
            self._unpin_after_copies(mapping)
        host_memory.release_tail(mapping, start)
        if pinned and start:
            self._pinned.pin(mapping, start, self._reserve_pin)

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _copy_on_side_stream(self, pairs: list[CopyPair]) -> dict[int, Callable[[], None]]:
        """Queue the copies on the device's side stream; per destination buffer, what waits for its copy."""
        device = pairs[0][1].device
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        done: dict[int, Callable[[], None]] = {}
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # waiters sleep instead of spinning on a busy host
                event.record(stream)
                done[dst.untyped_storage().data_ptr()] = event.synchronize
        for _, src in pairs:
            src.record_stream(stream)  # the allocator must not hand src's memory out before the copy ran
        return done

    def _queue_on_side_stream_in_pieces(self, pairs: list[CopyPair]) -> list[tuple[torch.Tensor, list]]:
        """Have the helper thread queue the copies on the side stream in pieces of :data:`COPY_PIECE`, at most
        :data:`PIECES_IN_FLIGHT` queued and unfinished at a time; per destination, (first byte, future of
        the piece's event) for each piece.

        Queued all at once, gigabytes of copies make any device-wide synchronize of the training
        thread wait for all of them, and DeepSpeed synchronizes the device at the start of every
        forward (its throughput timer): the step after a save then waited for the whole copy (40 ms
        for 4.2 GB on an H200, see benchmarks/RESULTS.md). Queued a few pieces at a time, such a
        synchronize waits for those few, and the copy runs alongside the next forward and backward
        at the same speed. The side stream first waits for the work queued on the training stream
        up to now, so every piece copies the state as of the save, whenever it is queued.
        """
        device = pairs[0][1].device
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        helper = self._helper_thread()
        in_flight: deque[Any] = deque()
        return [(dst, [(start, helper.submit(self._queue_piece, stream, piece, in_flight))
                       for start, piece in _pieces(dst, src)])
                for dst, src in pairs]

    def _queue_piece(self, stream: Any, pair: CopyPair, in_flight: deque[Any]) -> Any:
        """On the helper thread: queue one piece's copy on ``stream``; once more than :data:`PIECES_IN_FLIGHT`
        are queued and unfinished, wait for the oldest. Returns the event that marks the piece done.

        A method, so that a pool with pieces still to queue is not collected (and its memory unpinned by
        its finalizer) before they are queued. The stream's device is made current for the calls: the
        helper thread's default is GPU 0, where switching streams back would open a context for every rank."""
        dst, src = pair
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)  # the allocator must not hand src's memory out before the copy ran
            event = torch.cuda.Event(blocking=True)  # waiters sleep instead of spinning on a busy host
            event.record(stream)
        in_flight.append(event)
        if len(in_flight) > PIECES_IN_FLIGHT:
            in_flight.popleft().synchronize()
        return event

    def _buffer_for(self, slot: tuple[str, str], nbytes: int, device: torch.device) -> torch.Tensor:
        """A host buffer for a copy from ``device``; for a CUDA one, pinned (see :meth:`_placed_buffer`)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return self._placed_buffer(slot, nbytes, pin_for=device if device.type == "cuda" else None)

    def _placed_buffer(self, slot: tuple[str, str], nbytes: int, pin_for: torch.device | None) -> torch.Tensor:
        """A host buffer whose address is congruent, modulo :data:`PLACEMENT_ALIGN`, to the file offset
        the same slot's bytes were written at last time (the record layout repeats from save to save), or,
        for a buffer no write has placed yet, will be written at (the snapshot's ``offsets_of``).

        Aligned so, a buffer can be written with ``O_DIRECT`` straight from its memory (see
        :class:`~async_ckpt.storage.local.DirectWriter`). Each buffer sits in an anonymous mapping
        :data:`PLACEMENT_ALIGN` bytes larger than itself, so moving it costs no new allocation. A buffer
        for copies from ``pin_for`` (a CUDA device) lies in memory pinned for it: the reserve if that was
        pinned for the device, else a mapping of its own, pinned here (ZeRO-Offload's reserve, for its
        host partitions, is not pinned).
        """
        buf, base = self._slots.get(slot), self._bases.get(slot)
        if base is None or base[2] != nbytes + PLACEMENT_ALIGN:
            if base is not None and base[0] is not self._reserve and base[0] in self._pinned:
                self._helper_thread().submit(self._unpin_after_copies, base[0]).result()  # before it is unmapped
            base = self._bases[slot] = self._carve(nbytes + PLACEMENT_ALIGN, pin_for in (None, self._reserve_pin))
            if pin_for is not None and nbytes and base[0] is not self._reserve:
                self._helper_thread().submit(self._pinned.pin, base[0], base[2], pin_for).result()
            if buf is not None:  # a later buffer at its address must not take its place in the file for its own
                self._placements.pop(buf.data_ptr(), None)
            buf = None
            self.allocations += 1
        written_at = self._placements.get(buf.data_ptr()) if buf is not None else None
        if buf is None or (written_at is not None and (buf.data_ptr() - written_at) % PLACEMENT_ALIGN):
            if buf is not None:
                del self._placements[buf.data_ptr()]
            mapping, start, _ = base
            shift = ((written_at or 0) - buffer_address(mapping) - start) % PLACEMENT_ALIGN
            buf = self._slots[slot] = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start + shift) \
                if nbytes else torch.empty(0, dtype=torch.uint8)
            if written_at is not None:  # the next write of this slot is expected at the same offset
                self._placements[buf.data_ptr()] = written_at
        self._used_in[slot] = self._generation
        return buf

    def _carve(self, length: int, from_reserve: bool) -> tuple[mmap.mmap, int, int]:
        """``length`` bytes of the reserve (once its pages are faulted in) if ``from_reserve`` and it has
        them left, else a new mapping."""
        if from_reserve and self._reserve is not None and self._reserve_used + length <= len(self._reserve):
            if self._reserving is not None:
                self._reserving.result()
            start = -(-self._reserve_used // PLACEMENT_ALIGN) * PLACEMENT_ALIGN
            if start + length <= len(self._reserve):
                self._reserve_used = start + length
                return self._reserve, start, length
        return anonymous_memory(length), 0, length

    def _view_in_staged_storage(self, src: torch.Tensor, slot_key: str, path: str, memo: _Memo,
                                pairs: list[CopyPair]) -> torch.Tensor:
        """The host tensor with ``src``'s shape, strides and offset inside a staged copy of its storage.

        The whole storage is staged because that is what ``torch.save`` writes: views that share
        one storage in DeepSpeed's dict (ZeRO-1/2 module weights are views of one flat buffer)
        share one staged storage, so the file has the same records as DeepSpeed's own.
        """
        storage = src.untyped_storage()
        key = storage._cdata  # the storage's identity, as torch.save keys it
        staged = memo.storages.get(key)
        if staged is None:
            staged = self._buffer_for((slot_key, memo.slot(path)), storage.nbytes(), src.device)
            whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(storage)
            pairs.append((staged, whole))
            memo.storages[key] = staged
        view = torch.empty(0, dtype=src.dtype).set_(staged.untyped_storage(), src.storage_offset(), src.size(),
                                                    src.stride())
        # the storage holds the bytes before a lazy conjugation or negation (x.conj(), x.conj().imag): the
        # view keeps src's flags, as torch.save does, or it would hold other values
        if src.is_conj():
            view = view.conj()
        if src.is_neg():
            view = torch._neg_view(view)
        return view

    def _compact_copy(self, src: torch.Tensor, slot_key: str, path: str, memo: _Memo,
                      pairs: list[CopyPair]) -> torch.Tensor:
        """A host tensor laid out as ``src.detach().clone()`` would be, in a pooled buffer of its own."""
        layout = torch.empty_like(src, device="meta")  # the strides clone() picks (preserve_format)
        nbytes = src.numel() * src.element_size()
        staged = self._buffer_for((slot_key, memo.slot(path)), nbytes, src.device)
        dst = torch.empty(0, dtype=src.dtype).set_(staged.untyped_storage(), 0, layout.size(), layout.stride())
        pairs.append((dst, src.detach()))
        return dst

    @staticmethod
    def _like(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``dst`` with the type and ``requires_grad`` flag of ``src``: torch.save records both."""
        grad = src.requires_grad and (src.is_floating_point() or src.is_complex())
        if isinstance(src, torch.nn.Parameter):
            return torch.nn.Parameter(dst, requires_grad=grad)
        if type(src) is not torch.Tensor:
            dst = dst.as_subclass(type(src))
        return dst.requires_grad_(grad)

    def _copy_tree(self, obj: Any, slot_key: str, memo: _Memo, pairs: list[CopyPair], path: str) -> Any:
        """``obj`` staged. ``path`` (``['optimizer_state_dict']['state'][0]['exp_avg']``) names a tensor's
        buffer from save to save: a tensor that appears (Adam's moments, made at the first step) or goes
        does not move the others to new buffers, which on a GPU would be pinned again in the stall."""
        if isinstance(obj, torch.Tensor) and memo.compact:
            if obj.layout != torch.strided:
                raise UsageError(f"cannot snapshot {path or 'tensor'}: layout {obj.layout} is not supported")
            return self._compact_copy(obj, slot_key, path, memo, pairs)
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo.tensors:  # the same tensor twice in one dict stays one tensor
                return memo.tensors[id(obj)]
            if obj.layout != torch.strided:
                raise UsageError(f"cannot snapshot {path or 'tensor'}: layout {obj.layout} is not supported")
            dst = self._view_in_staged_storage(obj, slot_key, path, memo, pairs)
            memo.tensors[id(obj)] = dst = self._like(obj, dst)
            for name, value in vars(obj).items():  # e.g. ZeRO-3's ds_id on flat groups; torch.save writes them
                setattr(dst, name, self._copy_tree(value, slot_key, memo, pairs, f"{path}.{name}"))
            return dst
        if isinstance(obj, (dict, list, tuple)):
            if not memo.compact and id(obj) in memo.containers:
                return memo.containers[id(obj)]
            out = self._copy_container(obj, slot_key, memo, pairs, path)
            if not memo.compact:
                memo.containers[id(obj)] = out
            return out
        try:
            return copy.deepcopy(obj, memo.values)
        except Exception as exc:
            raise UsageError(f"cannot snapshot {path or 'value'} of type {type(obj).__name__}: {exc}; "
                             "client_state values must be copyable (picklable)") from exc

    def _copy_container(self, obj: dict | list | tuple, slot_key: str, memo: _Memo,
                        pairs: list[CopyPair], path: str) -> Any:
        if isinstance(obj, dict):
            items = {key: self._copy_tree(value, slot_key, memo, pairs, f"{path}[{key!r}]")
                     for key, value in obj.items()}
            if memo.compact:  # as DeepSpeed's clone rebuilds it: no attributes (a state dict's _metadata)
                return type(obj)(items)
            out = copy.copy(obj)
            out.update(items)
            return out
        elements = [self._copy_tree(v, slot_key, memo, pairs, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return type(obj)(elements) if type(obj) is not list and not memo.compact else elements
        if memo.compact:
            return tuple(elements)  # as DeepSpeed's clone rebuilds tuples
        return type(obj)(*elements) if hasattr(obj, "_fields") else type(obj)(elements)


def _regions(pairs: list[CopyPair]) -> list[tuple[int, int]]:
    """The (address, size) of each pooled buffer the copies fill, once, by address."""
    return sorted({(dst.untyped_storage().data_ptr(), dst.untyped_storage().nbytes()) for dst, _ in pairs})


def _synchronize(streams: dict[torch.device, Any]) -> None:
    for stream in list(streams.values()):
        stream.synchronize()


def _unpin_all(pinned: host_memory.PinnedMappings, streams: dict[torch.device, Any]) -> None:
    """Unpin a pool's memory once the copies on its side streams are done (no DMA into unpinned pages)."""
    _synchronize(streams)
    pinned.unpin_all()


def _flat(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` copies contiguous bytes to contiguous bytes, as
    :meth:`StagingPool._view_in_staged_storage` copies a whole storage."""
    return (dst.dtype == src.dtype == torch.uint8 and dst.dim() == src.dim() == 1 and dst.is_contiguous()
            and src.is_contiguous() and dst.numel() == src.numel())


def _whole_flat_storage(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the copy is :func:`_flat` and fills all of ``dst``'s storage: the bytes of its zip record."""
    return (_flat(dst, src) and dst.device.type == src.device.type == "cpu" and dst.storage_offset() == 0
            and dst.numel() == dst.untyped_storage().nbytes())


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[int, CopyPair]]:
    """``dst.copy_(src)`` as (first byte, pair) pieces of :data:`COPY_PIECE` bytes: a whole staged storage
    (:func:`_flat`) in pieces, anything else whole."""
    if not _flat(dst, src) or dst.numel() <= COPY_PIECE:
        return [(0, (dst, src))]
    return [(start, (dst[start:start + COPY_PIECE], src[start:start + COPY_PIECE]))
            for start in range(0, dst.numel(), COPY_PIECE)]


def _wait_for_device_piece(future: Future[Any]) -> None:
    future.result().synchronize()


def _wait_for_pieces(pieces: list[tuple[int, Future[Any]]], end: int | None, *, device: bool = False) -> None:
    """Wait for the pieces of one buffer's copy that hold bytes before ``end`` (all of them for ``None``);
    ``device``: each future gives the event of a piece queued on a side stream, waited for too."""
    for start, future in pieces:
        if end is not None and start >= end:
            return
        if device:
            _wait_for_device_piece(future)
        else:
            future.result()


def _copy_and_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copy the bytes of ``src`` into ``dst`` (both :func:`_flat`) and return their CRC-32.

    In pieces of :data:`CACHED_PIECE`, each checksummed right after its copy while it is still in the
    core's cache: a CRC-32 pass of its own, after the copy, reads the whole buffer from memory again.
    ``memmove`` rather than torch's ``copy_``, which may spread over torch's intra-op threads, and
    those spin between pieces. On the development machine (2 vCPUs, 2 MiB of
    L2 per core), 512 MiB copied with ``copy_`` on 2 threads, then checksummed, took 159 ms of CPU;
    copied and checksummed here, 85 ms (:mod:`async_ckpt.bench.copy_checksum`, benchmarks/RESULTS.md).
    Both ``memmove`` and the CRC-32 run without the GIL."""
    into, source, size = dst.data_ptr(), src.data_ptr(), dst.numel()
    copied = memoryview((ctypes.c_char * size).from_address(into)).cast("B") if size else memoryview(b"")
    crc = 0
    for start in range(0, size, CACHED_PIECE):
        length = min(CACHED_PIECE, size - start)
        ctypes.memmove(into + start, source + start, length)
        crc = crc32(copied[start:start + length], crc)
    return crc


def _copy_all(pairs: list[CopyPair]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
