"""Snapshot DeepSpeed's state dicts into host memory that is allocated once and reused.

DeepSpeed hands the checkpoint engine *live* tensors: module parameters, fp32 master partitions
and Adam moments that the next optimizer step overwrites in place. The snapshot replaces every
tensor in the (nested) dict with a view of the same shape, strides and offset into a host copy
of its storage, owned by this pool; tensors that share a storage keep sharing one, so
``torch.save`` writes the same records DeepSpeed's own engine would. Buffers are keyed by
file and position, so the second and every later save reuses the memory of the first (a fresh
allocation costs page faults: about 4x slower than a copy into memory already touched).

On CUDA the buffers are pinned and the device-to-host copies run non-blocking on a dedicated
stream, tracked by an event; on CPU, deferred copies run on one helper thread owned by the pool.
Either way a :class:`CopyTicket` says when the snapshot is safe.
"""

from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from async_ckpt.errors import UsageError

logger = logging.getLogger("async_ckpt")

CopyPair = tuple[torch.Tensor, torch.Tensor]


class CopyTicket:
    """Completion of a batch of staging copies: ``wait()`` returns once every copy is done."""

    def __init__(self, waiters: list[Callable[[], None]]) -> None:
        self._waiters = waiters
        self._lock = threading.Lock()
        self._done = not waiters

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            for wait in self._waiters:
                wait()
            self._done = True

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


class StagingPool:
    """Host buffers for one rank's snapshots, reused across saves.

    Not thread-safe by design: the training thread snapshots, and the caller guarantees (by
    waiting for the previous save's write) that no writer still reads the buffers it reuses.
    """

    def __init__(self, *, copier_init: Callable[[], None] | None = None) -> None:
        self._copier_init = copier_init
        self._slots: dict[tuple[str, int], torch.Tensor] = {}
        self._copier: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self.allocations = 0

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots.values())

    def snapshot(self, obj: Any, relpath: str, *, slot_key: str, defer: bool, compact: bool = False) -> StagedFile:
        """Copy (or, with ``defer``, plan the copy of) every tensor in ``obj`` into pooled buffers.

        ``compact`` stages what DeepSpeed's clone before saving would produce (see :class:`_Memo`).
        """
        pairs: list[CopyPair] = []
        memo = _Memo(compact=compact)
        counter = iter(range(1 << 62))
        with torch.no_grad():
            staged = self._copy_tree(obj, slot_key, counter, memo, pairs, path="")
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        result = StagedFile(relpath=relpath, obj=staged, nbytes=nbytes)
        if defer:
            result.deferred = pairs
        else:
            self.copy(pairs).wait()
        return result

    def copy(self, pairs: list[CopyPair], *, background: bool = False) -> CopyTicket:
        """Start the copies and return their ticket.

        Device sources are copied non-blocking on a side stream. Host sources are copied inline,
        or with ``background`` on the pool's helper thread so that training can go on meanwhile.
        """
        device_pairs = [p for p in pairs if p[1].device.type != "cpu"]
        host_pairs = [p for p in pairs if p[1].device.type == "cpu"]
        waiters: list[Callable[[], None]] = []
        if device_pairs:
            waiters.append(self._copy_on_side_stream(device_pairs))
        if host_pairs and background:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_ckpt-stage",
                                                  initializer=self._copier_init)
            future: Future[None] = self._copier.submit(_copy_all, host_pairs)
            waiters.append(future.result)
        elif host_pairs:
            _copy_all(host_pairs)
        return CopyTicket(waiters)

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        self._slots.clear()

    def _copy_on_side_stream(self, pairs: list[CopyPair]) -> Callable[[], None]:
        device = pairs[0][1].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for _, src in pairs:
            src.record_stream(stream)  # the allocator must not hand src's memory out before the copy ran
        return event.synchronize

    def _buffer_for(self, slot: tuple[str, int], nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._slots.get(slot)
        if buf is None or buf.numel() != nbytes or (pin and nbytes and not buf.is_pinned()):  # empty never pins
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            self._slots[slot] = buf
            self.allocations += 1
        return buf

    def _view_in_staged_storage(self, src: torch.Tensor, slot_key: str, counter: Any, memo: _Memo,
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
            staged = self._buffer_for((slot_key, next(counter)), storage.nbytes(), pin=src.device.type == "cuda")
            whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(storage)
            pairs.append((staged, whole))
            memo.storages[key] = staged
        return torch.empty(0, dtype=src.dtype).set_(staged.untyped_storage(), src.storage_offset(), src.size(),
                                                    src.stride())

    def _compact_copy(self, src: torch.Tensor, slot_key: str, counter: Any, pairs: list[CopyPair]) -> torch.Tensor:
        """A host tensor laid out as ``src.detach().clone()`` would be, in a pooled buffer of its own."""
        layout = torch.empty_like(src, device="meta")  # the strides clone() picks (preserve_format)
        nbytes = src.numel() * src.element_size()
        staged = self._buffer_for((slot_key, next(counter)), nbytes, pin=src.device.type == "cuda")
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

    def _copy_tree(self, obj: Any, slot_key: str, counter: Any, memo: _Memo,
                   pairs: list[CopyPair], path: str) -> Any:
        if isinstance(obj, torch.Tensor) and memo.compact:
            if obj.layout != torch.strided:
                raise UsageError(f"cannot snapshot {path or 'tensor'}: layout {obj.layout} is not supported")
            return self._compact_copy(obj, slot_key, counter, pairs)
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo.tensors:  # the same tensor twice in one dict stays one tensor
                return memo.tensors[id(obj)]
            if obj.layout != torch.strided:
                raise UsageError(f"cannot snapshot {path or 'tensor'}: layout {obj.layout} is not supported")
            dst = self._view_in_staged_storage(obj, slot_key, counter, memo, pairs)
            memo.tensors[id(obj)] = dst = self._like(obj, dst)
            for name, value in vars(obj).items():  # e.g. ZeRO-3's ds_id on flat groups; torch.save writes them
                setattr(dst, name, self._copy_tree(value, slot_key, counter, memo, pairs, f"{path}.{name}"))
            return dst
        if isinstance(obj, dict):
            out = copy.copy(obj)
            for key, value in obj.items():
                out[key] = self._copy_tree(value, slot_key, counter, memo, pairs, f"{path}.{key}")
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._copy_tree(v, slot_key, counter, memo, pairs, f"{path}[{i}]") for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return type(obj)(items) if type(obj) is not list and not memo.compact else items
            if memo.compact:
                return tuple(items)  # as DeepSpeed's clone rebuilds tuples
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        try:
            return copy.deepcopy(obj)
        except Exception as exc:
            raise UsageError(f"cannot snapshot {path or 'value'} of type {type(obj).__name__}: {exc}; "
                             "client_state values must be copyable (picklable)") from exc


def _copy_all(pairs: list[CopyPair]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
