"""PROTOTYPE: a writer *process* per rank, to compare with async_ckpt's in-process writer thread.

The question this answers: on CPU training, does the background writer slow the training steps
because it shares the rank's Python interpreter (its GIL) and its process, and would a separate
process per rank (as Megatron-LM's persistent async worker does) be worth building? The benchmark
method ``async_ckpt_process`` (:class:`async_ckpt.bench.methods.AsyncCkptProcess`) runs async_ckpt with
default settings except for one step: the serialization of each file (``torch.save`` into the
storage, with its size and CRC-32) runs in a worker process instead of the writer thread.
Staging, the commit handshake and the save handle stay in the rank, unchanged. Compare, in one
run, ``async_ckpt`` against ``async_ckpt_process``: the stall, the time to durable and
``slowdown_while_persisting`` (how much slower the training steps are while a save is written).

How: the writer thread calls the module-level name ``async_ckpt.writer.write_torch_file``;
:meth:`WriterProcess.patch` replaces that name, in the rank process only, with
:meth:`WriterProcess.write_torch_file`, which

1. moves every tensor storage of the file's state into shared memory (``share_memory_()``; the
   staging buffers are reused from save to save, so only the first save pays for this copy),
2. sends ``(root, relpath, obj, tag_dir, rank, options)`` over a ``torch.multiprocessing`` queue to
   the worker (tensors travel as shared-memory handles, not bytes; their Python attributes, such as
   ZeRO-3's ``ds_id``, which torch's reduction drops, are carried along so the files are the same),
3. waits for the worker, which calls the real :func:`async_ckpt.serialization.write_torch_file`
   into its own :class:`~async_ckpt.storage.local.LocalStorage` on the same root, and
4. returns the worker's :class:`~async_ckpt.manifest.FileEntry` to the writer thread (or raises
   the worker's exception there, which fails the save as any write error does).

The worker is started (spawn context: forking a process that runs threads is unsafe) when the
method is constructed, before any save, and stopped and joined by :meth:`WriterProcess.close`.
It runs at nice 10, the value ``async_ckpt_tuned`` gives its background threads, so that the
scheduler prefers the training processes on a busy CPU. (Megatron-LM's persistent worker, the
design this mirrors, does not renice itself in the version of ``async_utils.py`` read when this
was written; nice 10 is this prototype's choice.)

Limits, as a prototype: local (or NFS) targets only, the worker opens the root by path, so
object storage raises ``RuntimeError`` (the benchmark records the method as skipped); only the
default ``torch.save`` path is moved (``max_shard_bytes`` weight shards are not); the staging
buffers are moved to shared memory at the first save and stay there (shared memory is
``/dev/shm``, which must be large enough for a rank's whole staged state); one file is in
flight at a time per rank, as with the thread. The worker lends the shared staging memory to the
local writer as the thread does (a :class:`~async_ckpt.serialization.Lending` recomputed at the
worker's addresses), but records no placements: the staging pool does not place its buffers to
match file offsets, so the in-process writer's writes ahead do not happen here. It patches a module global of a running
process, which is fine for a benchmark and not a design for the library.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing  # registers the tensor reductions (shared-memory handles) with ForkingPickler

from async_ckpt.manifest import FileEntry
from async_ckpt.serialization import storage_order

#: The worker's nice value (see the module docstring).
NICE = 10


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (nested dicts, lists and tuples)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def share_tensors(obj: Any) -> int:
    """Move the storage of every CPU tensor in ``obj`` to shared memory; return how many bytes were
    moved (0 when every storage was shared already)."""
    moved = 0
    seen: set[int] = set()
    for item in _tensors(obj):
        storage = item.untyped_storage()
        if item.device.type == "cpu" and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            if not storage.is_shared():
                moved += storage.nbytes()
                item.share_memory_()
    return moved


def _rebuild_with_state(tensor: torch.Tensor, cls: type, requires_grad: bool, state: dict) -> torch.Tensor:
    """The worker's side of :class:`_RequestPickler`: the tensor's class, flag and attributes, back."""
    if cls is torch.nn.Parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    else:
        if cls is not torch.Tensor:
            tensor = tensor.as_subclass(cls)
        tensor.requires_grad_(requires_grad)
    tensor.__dict__.update(state)
    return tensor


class _RequestPickler(ForkingPickler):
    """torch.multiprocessing's pickler (tensors travel as shared-memory handles), keeping what its
    tensor reduction drops: Python attributes (ZeRO-3's ``ds_id`` on the flat fp32 groups, which
    torch.save writes into the file) and tensor subclasses other than Parameter. Without this the
    worker's files would differ from the writer thread's by those attributes."""

    def reducer_override(self, obj: Any) -> Any:
        if not torch.is_tensor(obj) or (type(obj) in (torch.Tensor, torch.nn.Parameter) and not vars(obj)):
            return NotImplemented
        return _rebuild_with_state, (obj.detach(), type(obj), obj.requires_grad, dict(vars(obj)))


def _picklable_error(exc: BaseException, trace: str) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError naming it; the worker's traceback is attached."""
    try:
        error = pickle.loads(pickle.dumps(exc))
    except Exception:
        error = RuntimeError(f"{type(exc).__name__}: {exc}")
    error.worker_traceback = trace  # type: ignore[attr-defined]
    return error


def _stable_regions(obj: Any) -> list[tuple[int, int]]:
    """The (address, size) of every tensor storage in ``obj``, in this process's memory."""
    return sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in _tensors(obj)})


def _worker_main(requests: Any, results: Any, nice: int) -> None:
    """The writer process: serialize each request into its root, answer ``("ok", entry, write_s)``
    or ``("error", exception, write_s)``; a ``None`` request ends it."""
    if nice and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass
    from async_ckpt.serialization import Lending, write_torch_file
    from async_ckpt.storage.local import LocalStorage

    try:  # unpickling a DeepSpeed state imports DeepSpeed's classes: here, not in the first save
        import deepspeed  # noqa: F401
    except Exception:
        pass
    storages: dict[tuple, LocalStorage] = {}
    results.put(("ready", os.getpid(), 0.0))
    while True:
        payload = requests.get()
        if payload is None:
            break
        started = time.perf_counter()
        request = obj = None
        try:
            request = pickle.loads(payload)  # maps the rank's shared staging memory
            root, relpath, obj, tag_dir, rank, options, kwargs = request
            key = (root, tuple(sorted(options.items())))
            storage = storages.get(key) or storages.setdefault(key, LocalStorage(root, **options))
            if kwargs.pop("lend", False):  # the same shared staging memory, at this process's addresses
                kwargs["lending"] = Lending(_stable_regions(obj))
            entry = write_torch_file(storage, relpath, obj, tag_dir=tag_dir, rank=rank, **kwargs)
            answer: tuple = ("ok", entry, time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the writer thread
            answer = ("error", _picklable_error(exc, traceback.format_exc()), time.perf_counter() - started)
        payload = request = obj = None  # drop the shared-memory mappings before answering
        results.put(answer)


class WriterProcess:
    """One worker process per rank that serializes the files the writer thread hands it."""

    def __init__(self, *, nice: int = NICE, start_timeout_s: float = 300.0) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        # Requests are pickled by the writer thread (_RequestPickler) and sent as bytes over a SimpleQueue,
        # which writes in the caller: a request that cannot be sent raises there (a Queue would pickle in
        # its feeder thread, print the error and leave the caller waiting).
        self._requests = ctx.SimpleQueue()
        self._results = ctx.Queue()
        self._lock = threading.Lock()
        self._restore: Callable[[], None] | None = None
        self._closed = False
        self.nice = nice
        self.stats = {"files": 0, "shared_bytes": 0, "share_s": 0.0, "round_trip_s": 0.0, "worker_write_s": 0.0}
        self._proc = ctx.Process(target=_worker_main, args=(self._requests, self._results, nice),
                                 name="async_ckpt-writer-process", daemon=True)  # daemon: never outlives the rank
        self._proc.start()
        try:
            self._answer(start_timeout_s, "start")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _answer(self, timeout_s: float | None, what: str) -> tuple:
        """The worker's next answer; raise if it dies (or, with ``timeout_s``, does not answer in time)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the writer process died during {what} (exit code {self._proc.exitcode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"the writer process did not answer within {timeout_s:.0f} s ({what})")

    def write_torch_file(self, storage: Any, relpath: str, obj: Any, *, tag_dir: str, rank: int,
                         scratch_dir: str | None = None, lending: Any = None, **kwargs: Any) -> FileEntry:
        """Drop-in for :func:`async_ckpt.serialization.write_torch_file`, run by the worker process.

        ``lending`` (the staging buffers, whose tensor data the writer may lend to the storage instead
        of copying) holds addresses in this process: the worker recomputes them in its own memory,
        where the same shared buffers are mapped. Its ``placements`` (where each lent buffer landed in
        the file, used to place the next save's buffers and to write them ahead) are not filled: the
        worker's addresses mean nothing here, so the staging buffers keep their place (and stay shared)."""
        from async_ckpt.storage.local import LocalStorage

        if not isinstance(storage, LocalStorage):
            where = getattr(storage, "url", storage)
            raise RuntimeError(f"the writer-process prototype writes local folders only, not {where!r}")
        options = {"fsync": getattr(storage, "fsync", True), "direct_io": getattr(storage, "direct_io", True)}
        kwargs.pop("copy_crcs", None)  # computed in this process; the worker checksums what it writes
        await_copy = kwargs.pop("await_copy", None)  # the copies run in this process: wait for them all here
        if await_copy is not None:
            for address in storage_order(obj):
                await_copy(address)
        kwargs = {**kwargs, "scratch_dir": scratch_dir, "lend": lending is not None}
        with self._lock:
            started = time.perf_counter()
            self.stats["shared_bytes"] += share_tensors(obj)
            shared = time.perf_counter()
            payload = _RequestPickler.dumps((storage.root, relpath, obj, tag_dir, rank, options, kwargs))
            self._requests.put(bytes(payload))
            kind, value, write_s = self._answer(None, f"the write of {relpath}")
            self.stats["share_s"] += shared - started
            self.stats["round_trip_s"] += time.perf_counter() - shared
            self.stats["worker_write_s"] += write_s
            self.stats["files"] += 1
        if kind == "error":
            raise value
        return value

    def patch(self) -> None:
        """Make the writer threads of this process serialize through the worker, until :meth:`close`."""
        import async_ckpt.writer as writer_module

        if self._restore is not None:
            return
        original = writer_module.write_torch_file
        ours = self.write_torch_file
        writer_module.write_torch_file = ours

        def restore() -> None:
            if writer_module.write_torch_file == ours:  # a bound method: compared by ==, not is
                writer_module.write_torch_file = original

        self._restore = restore

    def unpatch(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def close(self, timeout_s: float = 60.0) -> None:
        """Restore the writer's function, stop the worker and join it (terminate it if it does not end)."""
        self.unpatch()
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive() and self._lock.acquire(timeout=timeout_s):  # not while a write is in flight
            try:
                self._requests.put(None)
            except Exception:
                pass
            finally:
                self._lock.release()
            self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
        self._results.close()
        self._results.join_thread()

    def summary(self) -> str:
        s = self.stats
        return (f"writer process (pid {self.pid}, nice {self.nice}): {s['files']} files; "
                f"moved {s['shared_bytes'] / 1e9:.3f} GB to shared memory in {s['share_s']:.2f} s (first save); "
                f"round trips {s['round_trip_s']:.2f} s of which the worker wrote {s['worker_write_s']:.2f} s")
