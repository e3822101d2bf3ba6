"""The ways of saving the same DeepSpeed state that the benchmark compares, behind one interface.

Each method's ``save(tag)`` is what the training loop calls (its duration is the stall),
``finish()`` blocks until every save is durable, and ``durable_s`` reports, per save, the time
from the save call to durability.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Method:
    name = "method"
    note = ""
    root = ""  # where this method's checkpoints go
    #: whether ``durable_s`` ends with the bytes on the disk (fsynced), or only handed to the page cache
    durable = True

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        self.engine = engine
        self.target = target
        self.rank = rank
        self.durable_s: list[float] = []
        self.extra_stall_s: list[float] = []
        self.save_metrics: list[dict[str, Any]] = []  # per save, where a method reports more (its handle's)
        self.bytes_per_save = 0
        # when the work the set-up left running in the background ended (``time.time()``; ``None``: not yet):
        # until then steps are slowed by it, not by a save
        self.setup_done_at: float | None = time.time()

    def save(self, tag: str) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        """Called after every training step: notice saves that became durable."""

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def discard(self) -> None:
        """Delete this method's checkpoints once measured, so that a long run does not fill the disk, nor the
        embedded S3 server's memory."""
        if self.rank != 0 or not self.root:
            return
        if "://" not in self.root:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # the run's folder is removed at its end, if this fails
            remove_url_folder(self.root, self.target["storage_options"])


def remove_url_folder(url: str, storage_options: dict) -> None:
    """Remove the folder ``url`` of an object store and everything under it; a failure is logged, not
    raised: a benchmark's figures stand without it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass  # nothing there (deleted already)
    except Exception as exc:
        logger.warning("could not remove %s: %s: %s", url, type(exc).__name__, exc)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


class StockDeepSpeed(Method):
    """``engine.save_checkpoint`` with DeepSpeed's Torch engine: synchronous, local disk only."""

    name = "stock"
    durable = False  # DeepSpeed's Torch engine does not fsync: its save ends in the page cache

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank)
        self.root = os.path.join(target["local_dir"], "stock")
        if target["kind"] != "local":
            self.note = "stock DeepSpeed cannot write to object storage: measured on local disk"

    def save(self, tag: str) -> None:
        started = time.perf_counter()
        type(self.engine).save_checkpoint(self.engine, self.root, tag=tag)
        self.durable_s.append(time.perf_counter() - started)
        dist.barrier()
        self.bytes_per_save = _dir_bytes(os.path.join(self.root, tag)) if self.rank == 0 else 0
        self.extra_stall_s.append(0.0)


class DecoupledDeepSpeed(Method):
    """DeepSpeed's decoupled writer (a spawned writer process per rank), where it runs.

    Its FastPersist writer pins memory and needs an accelerator, so the plain Python writer is
    used (the one that runs on CPU); the save is committed, blocking, in the next ``step()``.
    """

    name = "ds_decoupled"
    note = "DeepSpeed decoupled engine with its 'python' writer (FastPersist needs an accelerator and its async_io op)"
    durable = False  # the python writer flushes to the page cache, without fsync

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank)
        from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.utils import groups

        if target["kind"] != "local":
            raise RuntimeError("DeepSpeed's decoupled writer writes local files only")
        for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1"}.items():  # set by the deepspeed launcher
            os.environ.setdefault(key, value)
        config = dict(engine.config)
        config["checkpoint"] = {"writer": {"type": "python", "decoupled": True, "io_buffer_size": 64 * 1024 * 1024,
                                           "io_buffer_double": True, "show_statistics": False,
                                           "data_parallel": "socket"}}
        ds_config = DeepSpeedConfig(config)
        self.root = os.path.join(target["local_dir"], "decoupled")
        self._pending: tuple[float, str] | None = None
        self._commit_s = 0.0
        self._committed_at = 0.0
        commit = engine._commit_decoupled_checkpoint

        def timed_commit() -> None:  # the wait DeepSpeed adds inside the next step() is this method's stall too
            started = time.perf_counter()
            commit()
            self._committed_at = time.perf_counter()
            self._commit_s = self._committed_at - started

        engine._commit_decoupled_checkpoint = timed_commit
        self._saved = engine.checkpoint_engine
        engine.checkpoint_engine = create_checkpoint_engine(ds_config, groups, engine.zero_optimization_stage(),
                                                            engine.has_moe_layers, False)

    def save(self, tag: str) -> None:
        started = time.perf_counter()  # from the call, as for every method
        type(self.engine).save_checkpoint(self.engine, self.root, tag=tag)
        self._pending = (started, tag)

    def poll(self) -> None:
        """DeepSpeed commits a decoupled save inside the next ``step()``, which blocks until it is written:
        durable when that commit returned, not when this poll after the step notices it."""
        if self._pending is not None:
            started, tag = self._pending
            self.durable_s.append(self._committed_at - started)
            self.extra_stall_s.append(self._commit_s)
            self.bytes_per_save = _dir_bytes(os.path.join(self.root, tag)) if self.rank == 0 else 0
            self._pending = None

    def finish(self) -> None:
        if self._pending is not None:
            self.engine._commit_decoupled_checkpoint()
            self.poll()

    def close(self) -> None:
        self.engine.checkpoint_engine.cleanup()
        self.engine.checkpoint_engine = self._saved
        del self.engine._commit_decoupled_checkpoint


class DcpAsyncSave(Method):
    """``torch.distributed.checkpoint.async_save`` of the same tensors (its own gloo group)."""

    name = "dcp_async"
    note = "saves the optimizer's state_dict only (no model-states file): fewer bytes than the DeepSpeed methods"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.group = dist.new_group(backend="gloo")
        self.futures: list[tuple[float, Any, list[float]]] = []  # call time, future, its end time once done
        if target["kind"] == "local":
            self.root = os.path.join(target["local_dir"], "dcp")
            self.writer_kwargs: dict = {}
        else:
            self.root = f"{target['url'].rstrip('/')}/dcp"
            self.writer_kwargs = dict(target["storage_options"])

    def _state(self) -> dict[str, torch.Tensor]:
        flat: dict[str, torch.Tensor] = {}

        def walk(obj: Any, path: str) -> None:
            if torch.is_tensor(obj):
                flat[f"rank{self.rank}{path}"] = obj.detach()
            elif isinstance(obj, dict):
                for key, value in obj.items():
                    walk(value, f"{path}.{key}")
            elif isinstance(obj, (list, tuple)):
                for i, value in enumerate(obj):
                    walk(value, f"{path}.{i}")

        walk(self.engine.optimizer.state_dict(), "")
        return flat

    def save(self, tag: str) -> None:
        # Two async_save calls in flight run their collectives concurrently on one group and can
        # deadlock, so (as DCP recommends) the previous one is awaited first; that wait is stall, and in the
        # time to durable, which runs from the call as for every method
        started = time.perf_counter()
        self._drain()
        path = f"{self.root}/{tag}"
        if self.target["kind"] == "local":
            writer = self.dcp.FileSystemWriter(path, thread_count=2)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(path, thread_count=2, **self.writer_kwargs)
        future = self.dcp.async_save(self._state(), storage_writer=writer, process_group=self.group)
        ended: list[float] = []  # timed when the write ends, not when a poll after a step notices it
        future.add_done_callback(lambda _: ended.append(time.perf_counter()))
        self.futures.append((started, future, ended))
        self.extra_stall_s.append(0.0)

    def poll(self) -> None:
        still = []
        for started, future, ended in self.futures:
            if future.done():
                future.result()
                self.durable_s.append((ended or [time.perf_counter()])[0] - started)  # its callback may still run
            else:
                still.append((started, future, ended))
        self.futures = still

    def _drain(self) -> None:
        for started, future, ended in self.futures:
            future.result()
            self.durable_s.append((ended or [time.perf_counter()])[0] - started)
        self.futures = []

    def finish(self) -> None:
        self._drain()
        if self.rank != 0 or self.bytes_per_save:
            return
        if self.target["kind"] == "local" and os.path.isdir(self.root):
            self.bytes_per_save = _dir_bytes(os.path.join(self.root, sorted(os.listdir(self.root))[0]))
        elif self.target["kind"] != "local":
            import fsspec

            fs = fsspec.filesystem("s3", **self.writer_kwargs)
            first = sorted(fs.ls(self.root, detail=False))[0]
            self.bytes_per_save = int(fs.du(first))


#: the async_ckpt options the bench's variants change, recorded per method in the results
SETTINGS = ("overlap_copy", "direct_io", "fsync", "exact_bytes", "writer_nice")


class AsyncCkpt(Method):
    """async_ckpt with default settings (the variants below change one or two of them)."""

    name = "async_ckpt"

    def __init__(self, engine: Any, target: dict, rank: int, **options: Any) -> None:
        super().__init__(engine, target, rank)
        import async_ckpt

        if target["kind"] == "local":
            self.root = os.path.join(target["local_dir"], self.name)
        else:
            self.root = f"{target['url'].rstrip('/')}/{self.name}"
        self.ckpt = async_ckpt.wrap(engine, self.root, storage_options=target["storage_options"], **options)
        # the settings the variants below change, as the checkpointer took them (recorded in the results)
        self.settings = {key: getattr(self.ckpt.config, key) for key in SETTINGS}
        self.settings["synchronous"] = self.ckpt.synchronous
        if self.ckpt.synchronous and "synchronous" not in options:
            self.note = "synchronous saves, chosen by wrap(): CPU training and a destination in memory"
        self.handles: list[Any] = []
        self.rss_before_save: list[int] = []
        self.staging_bytes: list[int] = []
        self.setup_done_at = None
        self.poll()

    def poll(self) -> None:
        if self.setup_done_at is None and self.ckpt.staging_reserved:
            self.setup_done_at = time.time()

    def save(self, tag: str) -> None:
        import psutil

        if self.setup_done_at is None:  # the save waits for the reserve: the rest of it is in the stall
            self.setup_done_at = time.time()
        self.rss_before_save.append(psutil.Process().memory_info().rss)  # the previous save is done by now
        self.handles.append(self.ckpt.save(tag=tag))
        self.staging_bytes.append(self.ckpt.staging_bytes)

    def finish(self) -> None:
        self.ckpt.wait()
        for handle in self.handles:
            handle.result()
            self.durable_s.append(handle.metrics["durable_s"])
            self.extra_stall_s.append(handle.metrics.get("step_wait_s", 0.0))
            self.save_metrics.append({k: v for k, v in handle.metrics.items() if isinstance(v, (int, float, dict))})
        self.bytes_per_save = self.handles[-1].metrics["bytes_written"]

    def close(self) -> None:
        self.ckpt.close()


class AsyncCkptCopyInSave(AsyncCkpt):
    """``overlap_copy=False`` (the default until the zero-copy writer): every copy is done before ``save()`` returns."""

    name = "async_ckpt_copy_in_save"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, overlap_copy=False)


class AsyncCkptTuned(AsyncCkpt):
    """Defaults plus background threads at nice 10 (a lower priority than training's on a busy CPU)."""

    name = "async_ckpt_tuned"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, writer_nice=10)


class AsyncCkptBuffered(AsyncCkpt):
    """A/B, run on request only: defaults but ``direct_io=False``: each file written through the page cache
    and fsynced, where the kernel builds the disk's requests (on a VM whose every request costs CPU)."""

    name = "async_ckpt_buffered"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, direct_io=False)


class AsyncCkptNoFsync(AsyncCkpt):
    """A/B, run on request only: defaults but ``fsync=False``: files published without the cache flush, as
    durable as stock's ``torch.save`` (the bytes may sit in the disk's volatile cache, on a VM the host's memory,
    when ``latest`` moves). It prices durability: on a VM the flush makes the host write at once, on the
    guest's cores (``python -m async_ckpt.bench.write_steal``). Its ``durable_s`` is the time to written."""

    name = "async_ckpt_no_fsync"
    durable = False

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, fsync=False)


class AsyncCkptSynchronous(AsyncCkpt):
    """``synchronous=True``: each save returns once committed, so the write runs while training waits, as
    stock's does (what a memory-backed target on a busy CPU calls for: benchmarks/RESULTS.md)."""

    name = "async_ckpt_sync"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, synchronous=True)


class AsyncCkptExact(AsyncCkpt):
    """Defaults but ``exact_bytes=True``: what byte-identical files cost (a scratch write per file)."""

    name = "async_ckpt_exact"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        super().__init__(engine, target, rank, exact_bytes=True)


class AsyncCkptProcess(AsyncCkpt):
    """PROTOTYPE, run on request only: defaults, but each file is serialized by a writer *process* per rank
    instead of the writer thread (:mod:`async_ckpt.bench.writer_process`); local targets only."""

    name = "async_ckpt_process"

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        from async_ckpt.bench.writer_process import WriterProcess

        if target["kind"] != "local":
            raise RuntimeError("the writer-process prototype writes to local disk only")
        self.worker = WriterProcess()
        try:
            self.worker.patch()
            super().__init__(engine, target, rank)
        except BaseException:
            self.worker.close()
            raise
        self.note = "prototype: " + self.worker.summary()

    def finish(self) -> None:
        try:
            super().finish()
        except BaseException:
            self.worker.close()  # also on error: the worker never outlives the method
            raise
        finally:
            self.note = "prototype: " + self.worker.summary()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.worker.close()


class AsyncCkptPieces128(AsyncCkpt):
    """A/B, run on request only: defaults, but background copies, CRC-32 tasks and lent writes in pieces
    of 128 MiB instead of 32 MiB, a quarter of the hand-offs between threads per byte (each takes the
    GIL back from training). It sets the module constants while the method runs and restores them.
    Measured on an H100: no gain, the step after a save costs the same (benchmarks/RESULTS.md)."""

    name = "async_ckpt_pieces128"
    PIECE = 128 * 1024 * 1024

    def __init__(self, engine: Any, target: dict, rank: int) -> None:
        from async_ckpt import serialization, staging
        from async_ckpt.storage import local

        self._constants = [(staging, "COPY_PIECE"), (serialization, "COPY_PIECE"), (local, "_CHUNK")]
        self._saved_constants = [getattr(module, name) for module, name in self._constants]
        for module, name in self._constants:
            setattr(module, name, self.PIECE)
        try:
            super().__init__(engine, target, rank)
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        for (module, name), value in zip(self._constants, self._saved_constants):
            setattr(module, name, value)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._restore()


METHODS = {m.name: m for m in (StockDeepSpeed, DecoupledDeepSpeed, DcpAsyncSave, AsyncCkpt, AsyncCkptExact,
                               AsyncCkptCopyInSave, AsyncCkptTuned, AsyncCkptSynchronous, AsyncCkptBuffered,
                               AsyncCkptProcess, AsyncCkptPieces128, AsyncCkptNoFsync)}
#: Methods that run only when named in ``--methods`` (prototypes and A/Bs), not in the default comparison.
ON_REQUEST = (AsyncCkptSynchronous.name, AsyncCkptBuffered.name, AsyncCkptProcess.name, AsyncCkptPieces128.name,
              AsyncCkptNoFsync.name)

