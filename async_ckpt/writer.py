"""The background writer: one thread per rank that persists and commits saves in order.

The thread owns its work end to end: it waits for each staging copy it reads, streams every file through
the job's storage, publishes this rank's completion, takes part in the commit, and resolves the
save handle. It never touches the training process group. Failures are caught here, logged once
with the tag, the rank and the cause, and handed to ``on_failure``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from typing import Callable

from async_ckpt import commit
from async_ckpt.consolidated import write_weights
from async_ckpt.errors import SaveFailedError
from async_ckpt.handle import SaveHandle, SaveResult
from async_ckpt.handshake import Outcome, brief
from async_ckpt.inflight import IN_ON_SAVE_DONE, not_waiting
from async_ckpt.job import SaveJob
from async_ckpt.layout import MARKER_DIR
from async_ckpt.manifest import FileEntry
from async_ckpt.resume import owned_cache_dir
from async_ckpt.serialization import Lending, write_torch_file

logger = logging.getLogger("async_ckpt")


def _what_stays(job: SaveJob) -> str:
    """The sentence a failed save's error ends with: what the failure left as it was (the commit never
    began, or aborted before the manifest)."""
    if not job.overwrites:
        return "The previous checkpoint and 'latest' are unchanged."
    return (f"Tag {job.tag!r} was committed before this save uncommitted it to write it again, so it stays "
            "uncommitted (its files may be half overwritten): checkpoint.load() takes the newest other committed "
            f"tag. 'latest' is unchanged; if it names {job.tag!r}, DeepSpeed's own load_checkpoint would read those "
            "files.")


def remote_scratch_dir(cache_dir: str) -> str:
    """Where ``exact_bytes`` writes a file before it goes to an object store: under ``cache_dir``, held to
    what resume's cache is (:func:`~async_ckpt.resume.owned_cache_dir`): a file swapped there by another
    user would be uploaded, its checksum taken from it."""
    return os.path.join(owned_cache_dir(cache_dir), "scratch")


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread a Linux nice value (threads have their own on Linux)."""
    if nice and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as exc:
            logger.debug("could not lower the priority of %s: %s", threading.current_thread().name, exc)


class _CopyWait:
    """The job's staging copies as the writer waits for them, counting the time the writer thread (not
    the I/O threads writing ahead) spent waiting: what overlapping the copy with training adds to the write."""

    def __init__(self, job: SaveJob) -> None:
        self._ticket = job.ticket
        self._thread = threading.current_thread()
        self.waited_s = 0.0

    def __call__(self, address: int, end: int | None = None) -> None:
        self._timed(self._ticket.wait_for, address, end)

    def all(self) -> None:
        self._timed(self._ticket.wait)

    def _timed(self, wait: Callable[..., None], *args: int | None) -> None:
        started = time.perf_counter()
        wait(*args)
        if threading.current_thread() is self._thread:
            self.waited_s += time.perf_counter() - started


class BackgroundWriter:
    def __init__(self, rank: int, commit_timeout_s: float,
                 on_failure: Callable[[SaveFailedError], None], *, nice: int = 0, exact_bytes: bool = False,
                 cache_dir: str, on_done: Callable[[SaveHandle], None] | None = None,
                 on_local_commit: Callable[[SaveJob, Outcome], None] | None = None) -> None:
        """``on_local_commit`` takes over a committed save to the local tier (``job.tiered``): the drain
        resolves its handle."""
        self._on_local_commit = on_local_commit
        self._rank = rank
        self._cache_dir = cache_dir
        self._on_done = on_done
        self._exact_bytes = exact_bytes
        self._nice = nice
        self._commit_timeout_s = commit_timeout_s
        self._on_failure = on_failure
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"async_ckpt-writer-rank{rank}", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Let the thread finish the queued saves, then end; :meth:`join` waits for that."""
        self._queue.put(None)

    def join(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; return whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while (job := self._queue.get()) is not None:
            try:
                self._execute(job)
            except BaseException as exc:  # noqa: BLE001 - a dead writer would leave every later save waiting
                self._failed_outside_write(job, exc)
            if self._on_done is not None and job.handle.done() and job.abandoned is None:  # else save() raised
                try:
                    with not_waiting(IN_ON_SAVE_DONE):
                        self._on_done(job.handle)
                except BaseException:  # noqa: BLE001 - a callback must never stop the writer thread
                    logger.exception("on_save_done callback raised for tag %s (ignored)", job.tag)

    def _failed_outside_write(self, job: SaveJob, exc: BaseException) -> None:
        """What :meth:`_execute` raised past its own handling (the commit's bookkeeping, the hand-over to
        the drainer): the save fails if it has not settled, its buffers are freed and the thread goes on."""
        job.release_buffers()
        if job.handle.done():
            logger.error("rank %d: after tag %s settled, the writer thread failed (%s: %s); it goes on", job.rank,
                         job.tag, type(exc).__name__, exc, exc_info=exc)
            return
        error = SaveFailedError(f"save of tag {job.tag!r} to {job.storage.url} failed on rank {job.rank} in the "
                                f"writer thread's bookkeeping after the write: {type(exc).__name__}: {exc}. "
                                "`latest` is unchanged unless the tag committed; `async-ckpt ls` shows which",
                                tag=job.tag, url=job.storage.url)
        error.__cause__ = exc
        logger.error("%s", error, exc_info=exc)
        try:
            self._on_failure(error)
        except BaseException:  # noqa: BLE001 - the handle still settles and the thread goes on
            logger.exception("could not record the failure of tag %s", job.tag)
        job.handle._fail(error)

    def _execute(self, job: SaveJob) -> None:
        written: list[FileEntry] = []
        metrics = job.handle.metrics
        current = "the staging copies"
        try:
            if job.abandoned is not None:
                current = "save() on the training thread"
                raise SaveFailedError(job.abandoned, tag=job.tag)
            started = time.perf_counter()
            metrics["queued_s"] = started - job.started - metrics.get("stall_s", 0.0)
            lent = copied = 0
            copy_wait = _CopyWait(job)
            scratch_dir = self._scratch_dir(job)
            if job.files and not job.unmarked:  # a rank with nothing to write (of a consolidated save) starts nothing
                current = "its start mark"
                commit.mark_started(job.storage, job.tag, job.rank, job.save_id)
                metrics["mark_s"] = time.perf_counter() - started
            streamed = job.max_shard_bytes is None and scratch_dir is None
            seconds_by_file = metrics["seconds_by_file"] = {}
            for staged in job.files:
                if job.reads_abandoned:  # training went on: stop reading its state, the save fails below
                    break
                current = staged.relpath
                began = time.perf_counter()
                if staged.deferred and not streamed:  # copied in the background; no hook inside this write
                    copy_wait.all()
                if job.max_shard_bytes is None:
                    # a streamed file waits for each storage's own copy just before torch.save reads it
                    await_copy = copy_wait if staged.deferred and streamed else None
                    lending = Lending(staged.regions, staged.placements)
                    written.append(write_torch_file(job.storage, staged.relpath, staged.obj, tag_dir=job.tag,
                                                    rank=job.rank, scratch_dir=scratch_dir, lending=lending,
                                                    await_copy=await_copy, copy_crcs=job.ticket.crcs))
                    lent, copied = lent + lending.lent_bytes, copied + lending.copied_bytes
                else:
                    written.extend(write_weights(job.storage, job.tag, staged.obj, max_shard_bytes=job.max_shard_bytes,
                                                 rank=job.rank))
                seconds_by_file[staged.relpath] = time.perf_counter() - began
            current = "the staging copies"
            copy_wait.all()
            if not job.release_buffers():
                current = "its reads of the training state"
                raise RuntimeError("training stopped waiting for this synchronous save before its files were "
                                   "read from the training state, which it may have changed meanwhile")
            metrics["copy_wait_s"] = copy_wait.waited_s
            metrics["persist_s"] = time.perf_counter() - started
            metrics["bytes_written"] = sum(e.size for e in written)
            metrics["zero_copy_bytes"] = lent - copied
            metrics["upload_buffer_peak_bytes"] = job.storage.upload_buffer_peak_bytes
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the handle
            if current in {staged.relpath for staged in job.files}:  # before release_buffers() empties them
                job.keep_mark = True  # a file's write was cut short
            with contextlib.suppress(BaseException):  # no copy may still fill the buffers the next save reuses
                job.ticket.wait()
            job.release_buffers()
            what = (f"save of tag {job.tag!r} to {job.storage.url} failed on rank {job.rank} during {current}: "
                    f"{type(exc).__name__}: {exc}")
            error = SaveFailedError(f"{what}. {_what_stays(job)}", tag=job.tag, url=job.storage.url)
            error.__cause__ = exc
            try:
                commit.report_failure(job, what)  # each other rank adds _what_stays itself
            except Exception as store_exc:  # without a report no rank can commit the tag either
                logger.debug("could not report the failure of tag %s: %s", job.tag, store_exc)
            self._acknowledge(job)
            self._fail(job, error, written, cleanup=True)
            return
        try:
            outcome = commit.commit(job, written, self._commit_timeout_s)
        except Exception as exc:  # the job's store failed mid-handshake: the outcome is unknown
            outcome = Outcome(False, f"tag {job.tag!r}: the commit handshake through the job's c10d store failed on "
                                     f"rank {job.rank} ({brief(exc)}); this rank's files stay for `async-ckpt gc`")
        self._acknowledge(job)
        if not outcome.committed:
            self._fail(job, SaveFailedError(f"{outcome.error}. {_what_stays(job)}", tag=job.tag,
                                            url=job.storage.url), written, cleanup=outcome.cleanup)
            return
        handed_over = job.tiered and self._on_local_commit is not None
        metrics["local_committed_s" if handed_over else "durable_s"] = time.perf_counter() - job.started
        result = SaveResult(tag=job.tag, url=job.storage.url, bytes_written=metrics["bytes_written"],
                            stall_s=metrics.get("stall_s", 0.0), persist_s=metrics["persist_s"],
                            commit_s=metrics.get("commit_s", 0.0), warnings=tuple(outcome.warnings))
        if job.rank == 0:
            logger.info("saved %s to %s: %.3f GB on rank 0, stall %.3f s, persist %.2f s (%.2f GB/s on rank 0), "
                        "%s after %.2f s", job.tag, job.storage.url, result.bytes_written / 1e9,
                        result.stall_s, result.persist_s, result.persist_gbps,
                        "committed on the local tier" if handed_over else "durable",
                        metrics["local_committed_s" if handed_over else "durable_s"])
        if handed_over:
            job.handle._commit_local(result)
            self._on_local_commit(job, outcome)
        else:
            job.handle._succeed(result)

    @staticmethod
    def _acknowledge(job: SaveJob) -> None:
        try:
            job.handshake.acknowledge()
        except Exception as exc:  # only the store's bookkeeping: the outcome is already known
            logger.debug("could not acknowledge the outcome of tag %s: %s", job.tag, exc)

    def _scratch_dir(self, job: SaveJob) -> str | None:
        """Where byte-exact serialization writes first: next to the tag on local/NFS roots (one
        filesystem, removed with the commit markers), else the local cache folder."""
        if not self._exact_bytes:
            return None
        local = job.storage.local_dir()
        if local is not None:
            return os.path.join(local, job.tag, MARKER_DIR, f"scratch-rank{job.rank}")
        return remote_scratch_dir(self._cache_dir)

    def _fail(self, job: SaveJob, error: SaveFailedError, written: list[FileEntry], *, cleanup: bool) -> None:
        """Resolve the handle with ``error``; remove this rank's files of the tag if no manifest can appear,
        and then its start mark, unless the job keeps it (``keep_mark``) or overwrote a committed tag (whose
        files this save did not rewrite stay); remove the tokenizer and config saved for it (they would stay
        in the shadow folder until close)."""
        if job.extras_dir:
            shutil.rmtree(job.extras_dir, ignore_errors=True)
        if cleanup and commit.remove_files(job.storage, job.tag, written) and not (job.keep_mark or job.overwrites):
            try:  # only once its files are gone: a file left behind keeps the mark that lets gc remove it
                commit.unmark(job.storage, job.tag, job.rank)
            except Exception as cleanup_exc:
                logger.debug("could not remove the start mark of %s: %s", job.tag, cleanup_exc)
        logger.error("%s", error)
        if job.abandoned is None:  # else save() raised it already
            self._on_failure(error)  # before the handle settles: whoever it wakes finds the failure recorded
        job.handle._fail(error)
