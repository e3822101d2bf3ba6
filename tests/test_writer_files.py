"""The background writer writes a save's ready files (copied within the save: the model states) while its
deferred ones (the optimizer partitions, copied as training goes on) wait for their copies, where the storage
writes files in parallel; elsewhere it writes them in turn."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import threading
import uuid

import pytest
import torch
import torch.distributed as dist

from async_ckpt.errors import SaveFailedError
from async_ckpt.handle import SaveHandle
from async_ckpt.handshake import Handshake
from async_ckpt.job import SaveJob
from async_ckpt.layout import start_mark
from async_ckpt.staging import StagingPool
from async_ckpt.storage import LocalStorage
from async_ckpt.writer import BackgroundWriter

MiB = 1024 * 1024
READY, DEFERRED = "t/model_states.pt", "t/optim_states.pt"


class _Recording(LocalStorage):
    """Local storage that notes which thread opened each file; with ``ready_waits``, the ready file's write
    waits for the deferred file's to begin (30 s at most, then fails): written in turn, it never would."""

    def __init__(self, root: str, *, ready_waits: bool = False, ready_fails: bool = False,
                 parallel: bool = True) -> None:
        super().__init__(root)
        self.parallel_files = parallel
        self.ready_waits, self.ready_fails = ready_waits, ready_fails
        self.deferred_begun = threading.Event()
        self.opened_by: dict[str, str] = {}

    @contextlib.contextmanager
    def open_write(self, relpath):
        self.opened_by[relpath] = threading.current_thread().name
        if relpath == DEFERRED:
            self.deferred_begun.set()
        if relpath == READY and (self.ready_waits or self.ready_fails):
            if not self.deferred_begun.wait(30):
                raise TimeoutError("the ready file's write waited for the deferred file's, which never began")
            if self.ready_fails:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", relpath)
        with super().open_write(relpath) as stream:
            yield stream


def _torch_save_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _save(storage: LocalStorage, cache_dir: str):
    """One rank's save of a ready file and a deferred one (its copy running in the background) through a
    background writer: the states, the handle, the writer's thread names, each after the writer ended."""
    torch.manual_seed(0)
    model = {"module": {"w": torch.randn(MiB // 4)}, "step": 3}
    optim = {"flat": torch.randn(2 * MiB), "exp_avg": torch.randn(MiB), "step": 3}
    pool = StagingPool()
    ready = pool.snapshot(model, READY, slot_key="model", defer=False)
    deferred = pool.snapshot(optim, DEFERRED, slot_key="optim", defer=True)
    save_id = uuid.uuid4().hex
    handle = SaveHandle(tag="t", url=storage.url)
    job = SaveJob(tag="t", save_id=save_id, storage=storage, rank=0, world_size=1, files=[ready, deferred],
                  ticket=pool.copy(deferred.deferred, background=True), handle=handle,
                  handshake=Handshake(dist.HashStore(), save_id, 0, 1), save_latest=True, keep_last=None,
                  keep_every=None, metadata={"step": 3}, extras_dir=None)
    before = {t.name for t in threading.enumerate()}
    writer = BackgroundWriter(0, 60, lambda error: None, cache_dir=cache_dir)
    writer.submit(job)
    writer.stop()
    assert writer.join(60)
    left = {t.name for t in threading.enumerate()} - before
    pool.close()
    return model, optim, handle, left


def test_the_ready_file_is_written_while_the_deferred_one_is(tmp_path):
    storage = _Recording(str(tmp_path / "root"), ready_waits=True)
    model, optim, handle, _ = _save(storage, str(tmp_path / "cache"))
    assert handle.result(0).tag == "t"
    assert storage.opened_by[READY] != storage.opened_by[DEFERRED]


def test_files_written_at_once_hold_torch_saves_bytes(tmp_path):
    storage = _Recording(str(tmp_path / "root"))
    model, optim, handle, _ = _save(storage, str(tmp_path / "cache"))
    handle.result(0)
    assert (tmp_path / "root" / READY).read_bytes() == _torch_save_bytes(model)
    assert (tmp_path / "root" / DEFERRED).read_bytes() == _torch_save_bytes(optim)
    assert (tmp_path / "root" / "latest").read_text() == "t"


def test_the_ready_files_thread_ends_with_the_writer(tmp_path):
    storage = _Recording(str(tmp_path / "root"))
    *_, left = _save(storage, str(tmp_path / "cache"))
    assert left == set()
    assert storage.opened_by[READY].startswith("async_ckpt-writer-rank0-ready")


def test_files_are_written_in_turn_by_the_writer_thread_where_the_storage_writes_one_at_a_time(tmp_path):
    storage = _Recording(str(tmp_path / "root"), parallel=False)
    _, _, handle, _ = _save(storage, str(tmp_path / "cache"))
    handle.result(0)
    assert set(storage.opened_by.values()) == {"async_ckpt-writer-rank0"}


def test_a_ready_file_that_fails_fails_the_save_naming_it(tmp_path):
    storage = _Recording(str(tmp_path / "root"), ready_fails=True)
    _, _, handle, _ = _save(storage, str(tmp_path / "cache"))
    with pytest.raises(SaveFailedError) as failed:
        handle.result(0)
    assert f"during {READY}" in str(failed.value) and "No space left on device" in str(failed.value)


def test_a_ready_file_that_fails_leaves_no_data_files_and_no_latest(tmp_path):
    storage = _Recording(str(tmp_path / "root"), ready_fails=True)
    _, _, handle, _ = _save(storage, str(tmp_path / "cache"))
    assert isinstance(handle.exception(0), SaveFailedError)
    left = [name for name in os.listdir(tmp_path / "root" / "t") if not name.startswith(".")]
    assert left == [] and not (tmp_path / "root" / "latest").exists()
    assert (tmp_path / "root" / start_mark("t", 0)).exists()  # a write cut short: gc gets the folder
