"""The drainer: one thread per rank that copies tags committed on the local tier to the durable URL.

It is a thread of its own, not more work for the writer thread, so that the next save's local write
and commit never wait behind a drain to object storage, which takes many times longer. Drains run in
save order on every rank; each copies this rank's files of the tag (those the manifest lists under
this rank) from its node's folder, checks that every copy has the committed size and CRC-32 (a local
file that rotted is never made durable), and then commits the tag at the URL exactly as a direct save
commits (:func:`async_ckpt.commit.commit`, through the job's c10d store under keys of its own): the
manifest, then ``latest``, then ``keep_last`` retention. A drain that fails or is cut short leaves the
URL's ``latest`` and committed tags as they were; where its ranks agree that it failed, each removes what
it copied, and its start mark where that was all it left (else the mark stays for ``async-ckpt gc``; see
:meth:`Drainer._remove_copies`). The local tier keeps the tag, and the next ``save()``,
``close()`` or ``wrap()`` drains it again (:func:`async_ckpt.tiers.undrained`), unless a later tag
reached the URL first: that one supersedes it, and it stays on the local tier only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from async_ckpt import commit
from async_ckpt.catalog import read_manifest
from async_ckpt.errors import SaveFailedError
from async_ckpt.handle import SaveHandle, SaveResult
from async_ckpt.handshake import Handshake, Outcome, brief
from async_ckpt.inflight import IN_ON_SAVE_DONE, not_waiting
from async_ckpt.job import SaveJob
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.serialization import copy_local_file
from async_ckpt.staging import CopyTicket
from async_ckpt.storage.base import Storage
from async_ckpt.tiers import prune_local
from async_ckpt.writer import lower_thread_priority

logger = logging.getLogger("async_ckpt")


@dataclass
class DrainJob:
    """One tag to copy from this node's folder to the durable URL."""

    manifest: Manifest
    #: Unique per attempt (the save's id for the first one): the store keys of this drain's commit.
    drain_id: str
    handle: SaveHandle
    #: When ``save()`` started (``durable_s`` counts from there); for a drain after a restart, now.
    started: float = field(default_factory=time.perf_counter)
    #: Why this rank cannot drain the tag (its commit record is unknown here): the drain fails on every
    #: rank rather than commit a tag without this rank's files.
    error: str | None = None
    #: The save overwrote a committed tag: the URL's folder may hold that save's files besides this
    #: drain's copies, so a failed drain leaves its start mark there for gc, as a failed write does.
    overwrites: bool = False
    #: Queued by close()'s last pass (:meth:`Drainer.retry_failed`): no save of this process drains it again.
    last_in_process: bool = False

    @property
    def tag(self) -> str:
        return self.manifest.tag

    @property
    def metadata(self) -> dict[str, Any]:
        """What the durable commit records besides the files: the local commit's own record. Its time
        too, so that a tag saved straight to the URL while this drain waited stays the newer one there
        (the durable commit does not move ``latest`` back to an older save)."""
        m = self.manifest
        return {"step": m.step, "zero_stage": m.zero_stage, "dtype": m.dtype, "versions": m.versions,
                "created_unix": m.created_unix}


@dataclass(frozen=True)
class DrainTarget:
    """Where drains go and what each tier keeps."""

    local: Storage
    durable: Storage
    keep_last: int | None
    keep_every: int | None
    local_keep_last: int
    #: This rank is the first of its node: it applies the node folder's retention.
    tier_leader: bool


class Drainer:
    def __init__(self, rank: int, world_size: int, store: Any, target: DrainTarget, commit_timeout_s: float,
                 on_failure: Callable[[SaveFailedError, DrainJob], None], *, nice: int = 0,
                 on_done: Callable[[SaveHandle], None] | None = None) -> None:
        self._rank = rank
        self._world_size = world_size
        self._store = store  # the drainer's own client of the job's store: the writer thread has another
        self._target = target
        self._commit_timeout_s = commit_timeout_s
        self._on_failure = on_failure
        self._on_done = on_done
        self._nice = nice
        self._queue: queue.Queue[DrainJob | None] = queue.Queue()
        #: Drains queued or running, by drain id: a tag's redrain queued while its failed attempt is still
        #: settling stays in flight when that attempt ends.
        self._pending: dict[str, str] = {}
        self._failed: list[DrainJob] = []
        #: ``Manifest.recency`` of the newest tag this drainer committed at the URL.
        self._newest_drained: tuple[float, int] | None = None
        self._lock = threading.Lock()
        #: Set by a load (:meth:`pause_retention`): drains' retention deletes nothing. Its lock is held across
        #: each deletion, so that a pause returns only once a deletion in progress has ended.
        self._retention_paused = False
        self._retention_lock = threading.Lock()
        self._stopped = False  # see stop(): a drain submitted after it would never run
        self._thread = threading.Thread(target=self._run, name=f"async_ckpt-drainer-rank{rank}", daemon=True)
        self._thread.start()

    def submit(self, job: DrainJob) -> None:
        """Queue ``job``. It supersedes the failed drains of its tag: :meth:`retry_failed` retries them no
        more (two attempts of one save would both upload into the tag, the later one after the earlier
        committed; and a later save of the tag replaced the earlier save's files in the node folder)."""
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._pending[job.drain_id] = job.tag
                self._forget_failures(job.tag)
                self._queue.put(job)
        if stopped:
            self._closed_before(job)

    def _closed_before(self, job: DrainJob) -> None:
        """A save committed on the local tier after the drainer stopped (a ``close()`` that gave up waiting
        for it): fail its handle rather than leave it unsettled, and say where the tag is."""
        failure = SaveFailedError(f"tag {job.tag!r} is committed on the local tier {self._target.local.url}, but the "
                                  f"checkpointer closed before its drain to {self._target.durable.url}: the next "
                                  "wrap() with this local_tier drains it, unless the URL holds a newer tag by then",
                                  tag=job.tag)
        logger.error("rank %d: %s", self._rank, failure)
        self._settle_failed(job, failure)

    def _settle_failed(self, job: DrainJob, failure: SaveFailedError) -> None:
        """Record ``failure`` (a recording that raises is logged: the handle settles all the same), then fail
        the handle: whoever it wakes finds the failure recorded."""
        try:
            self._on_failure(failure, job)
        except BaseException:  # noqa: BLE001 - the handle still settles, and the drainer goes on
            logger.exception("could not record the failed drain of %s", job.tag)
        job.handle._fail(failure)

    def pause_retention(self) -> None:
        """The retention drains run deletes no tag until :meth:`resume_retention` (local retention in the node
        folder, and on rank 0 ``keep_last`` at the URL): a load may read any of them, on any rank, until
        every rank is past it. Returns once a deletion in progress has ended; later drains make the
        deletions it skipped."""
        with self._retention_lock:
            self._retention_paused = True

    def resume_retention(self) -> None:
        """Let the drains' retention delete again (the next drain's pass). Does not wait: a save calls it,
        and the lock may be held across a deletion at the URL."""
        self._retention_paused = False

    @contextlib.contextmanager
    def _retention_allowed(self) -> Iterator[bool]:
        with self._retention_lock:
            yield not self._retention_paused

    def in_flight(self) -> set[str]:
        """Tags queued or being drained now."""
        with self._lock:
            return set(self._pending.values())

    def failed_tags(self) -> set[str]:
        """Tags whose last drain attempt failed (recorded before the attempt's handle settles)."""
        with self._lock:
            return {job.tag for job in self._failed}

    def supersede(self, tag: str) -> None:
        """A new save of ``tag`` was agreed as an overwrite: its earlier save's failed drains are retried no
        more (the retry would copy that save's files from the node folder over the new one at the URL)."""
        with self._lock:
            self._forget_failures(tag)

    def _forget_failures(self, tag: str) -> None:
        """Drop the failed attempts of ``tag`` (the caller holds ``_lock``)."""
        self._failed = [failed for failed in self._failed if failed.tag != tag]

    def retry_failed(self) -> list[SaveHandle]:
        """Queue again the drains that failed (the last attempt of each tag), except those older than a tag
        drained since (that would move the URL's ``latest`` back); return their new handles.

        Call it on every rank once every drain so far has finished (``close()`` does): each drain's
        outcome is agreed by all ranks, so every rank then holds the same failures and retries them
        under the same fresh keys, without a collective.
        """
        with self._lock:
            failed, self._failed = self._failed, []
            newest = self._newest_drained
        retries = []
        for job in failed:
            if newest is not None and job.manifest.recency <= newest:
                continue
            # keyed by the save, not the attempt: ranks may have kept different attempts of one save
            retry = DrainJob(manifest=job.manifest, drain_id=f"{job.manifest.save_id}-retry", error=job.error,
                             overwrites=job.overwrites, last_in_process=True,
                             handle=SaveHandle(tag=job.tag, url=job.handle.url, metrics=dict(job.handle.metrics)))
            retry.handle._commit_local(job.handle.local_result())
            self.submit(retry)
            retries.append(retry.handle)
        return retries

    def stop(self) -> None:
        """End the thread after the drains queued so far; a drain submitted from now on fails at once."""
        with self._lock:
            self._stopped = True
            self._queue.put(None)

    def join(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while (job := self._queue.get()) is not None:
            try:
                self._drain(job)
            except BaseException as exc:  # noqa: BLE001 - a dead drainer would leave every later drain waiting
                self._failed_outside_drain(job, exc)
            finally:
                with self._lock:
                    self._pending.pop(job.drain_id, None)
            if self._on_done is not None:
                try:
                    with not_waiting(IN_ON_SAVE_DONE):
                        self._on_done(job.handle)
                except BaseException:  # noqa: BLE001 - a callback must never stop the drainer
                    logger.exception("on_save_done callback raised for tag %s (ignored)", job.tag)
        self._store = None  # its client holds a socket; a drain submitted from now on fails before using it

    def _failed_outside_drain(self, job: DrainJob, exc: BaseException) -> None:
        """What :meth:`_drain` raised past its own handling: the drain fails if it has not settled (not
        queued for a retry: whether it committed at the URL is unknown) and the thread goes on."""
        logger.error("rank %d: the drainer failed draining %s (%s: %s); it goes on", self._rank, job.tag,
                     type(exc).__name__, exc, exc_info=exc)
        if job.handle.done():
            return
        failure = SaveFailedError(f"tag {job.tag!r} is committed on the local tier but its drain to "
                                  f"{self._target.durable.url} failed in the drainer's bookkeeping "
                                  f"({type(exc).__name__}: {exc}); `async-ckpt ls` shows whether it committed there",
                                  tag=job.tag)
        failure.__cause__ = exc
        self._settle_failed(job, failure)

    def _drain(self, job: DrainJob) -> None:
        target, metrics = self._target, job.handle.metrics
        started = time.perf_counter()
        commit_job = SaveJob(tag=job.tag, save_id=job.manifest.save_id, storage=target.durable, rank=self._rank,
                             world_size=self._world_size, files=[], ticket=CopyTicket([]),
                             handle=SaveHandle(tag=job.tag, url=target.durable.url, metrics=dict(metrics)),
                             handshake=Handshake(self._store, f"{job.drain_id}-drain", self._rank, self._world_size),
                             save_latest=job.manifest.sets_latest, keep_last=target.keep_last,
                             keep_every=target.keep_every, metadata=job.metadata,
                             retention_allowed=self._retention_allowed)
        copied: list[FileEntry] = []
        try:
            self._copy(job, copied)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the handle
            error = f"rank {self._rank} could not drain it: {type(exc).__name__}: {exc}"
            try:
                commit.report_failure(commit_job, error)
            except Exception as store_exc:
                logger.debug("could not report the failed drain of %s: %s", job.tag, store_exc)
            self._acknowledge(commit_job)
            # a SaveFailedError is _copy's refusal to go on, which cuts no write short
            self._remove_copies(job, copied, cut_short=not isinstance(exc, SaveFailedError))
            self._fail(job, error)
            return
        try:
            outcome = commit.commit(commit_job, copied, self._commit_timeout_s)
        except Exception as exc:
            outcome = Outcome(False, f"the commit handshake through the job's c10d store failed on rank {self._rank} "
                                     f"({brief(exc)})")
        self._acknowledge(commit_job)
        if not outcome.committed:
            if outcome.cleanup:
                self._remove_copies(job, copied, cut_short=False)
            self._fail(job, outcome.error or "not committed")
            return
        metrics.update(drain_s=time.perf_counter() - started, durable_s=time.perf_counter() - job.started,
                       durable_commit_s=commit_job.handle.metrics.get("commit_s", 0.0))
        with self._lock:
            self._newest_drained = max(self._newest_drained or job.manifest.recency, job.manifest.recency)
        if target.tier_leader:
            try:
                prune_local(target.local, target.durable, target.local_keep_last, url_keep_last=target.keep_last,
                            url_keep_every=target.keep_every, in_flight=self.in_flight() - {job.tag},
                            allowed=self._retention_allowed)
            except Exception as exc:
                logger.warning("local retention on %s failed (%s: %s); older tags stay until the next drain",
                               target.local.url, type(exc).__name__, exc)
        if self._rank == 0:
            logger.info("drained %s to %s: durable %.2f s after save() (drain %.2f s)", job.tag, target.durable.url,
                        metrics["durable_s"], metrics["drain_s"])
        local = job.handle.local_result() if job.handle.local_done() else None
        job.handle._succeed(SaveResult(
            tag=job.tag, url=target.durable.url, bytes_written=sum(e.size for e in copied),
            stall_s=metrics.get("stall_s", 0.0), persist_s=local.persist_s if local else 0.0,
            commit_s=metrics.get("durable_commit_s", 0.0), warnings=tuple(outcome.warnings)))

    def _copy(self, job: DrainJob, copied: list[FileEntry]) -> None:
        """Copy this rank's files of the tag from the node folder to the URL, each checked against the
        manifest; each file copied goes to ``copied`` at once, so that a failure knows what to remove."""
        if job.error is not None:
            raise SaveFailedError(job.error, tag=job.tag)
        root = self._target.local.local_dir()
        mine = [entry for entry in job.manifest.one_copy_each().files if entry.rank == self._rank]
        if mine:
            commit.mark_started(self._target.durable, job.tag, self._rank, job.manifest.save_id)
        for entry in mine:
            source = os.path.join(root, job.tag, *entry.path.split("/"))
            done = copy_local_file(self._target.durable, f"{job.tag}/{entry.path}", source, tag_dir=job.tag,
                                   rank=self._rank)
            copied.append(done)
            if (done.size, done.crc32) != (entry.size, entry.crc32):
                raise SaveFailedError(f"{source} changed since its commit (size {done.size}, crc32 {done.crc32}; "
                                      f"committed {entry.size}, {entry.crc32}): not made durable", tag=job.tag)

    def _remove_copies(self, job: DrainJob, copied: list[FileEntry], *, cut_short: bool) -> None:
        """This attempt aborted at the URL: remove this rank's copies, then its start mark, as a failed
        write does (:meth:`async_ckpt.writer.BackgroundWriter._fail`).

        Unlike a write's, a drain's attempts share the save's id and file names, and an earlier attempt
        may have committed the tag while this rank took it for failed (rank 0's manifest written after
        this rank gave up waiting for it): where the URL holds a manifest of the tag, or it cannot be
        read, nothing is removed. The mark stays for gc where what this attempt copied may not be all
        the folder holds: a copy cut short, a save that overwrote a committed tag, or a drain that is
        not the save's first attempt (a failed or killed attempt before it may have left more files)."""
        durable = self._target.durable
        try:
            if read_manifest(durable, job.tag) is not None:
                return
        except Exception as exc:
            logger.debug("kept the copies of %s at %s: its manifest there cannot be read (%s)", job.tag, durable.url,
                         exc)
            return
        removed = commit.remove_files(durable, job.tag, copied)
        if removed and not (cut_short or job.overwrites) and job.drain_id == job.manifest.save_id:
            try:
                commit.unmark(durable, job.tag, self._rank)
            except Exception as exc:
                logger.debug("could not remove the start mark of %s at %s: %s", job.tag, durable.url, exc)

    def _fail(self, job: DrainJob, error: str) -> None:
        again = ("the next job's wrap() with this local_tier" if job.last_in_process
                 else "the next save(), close() or wrap()")
        failure = SaveFailedError(f"tag {job.tag!r} is committed on the local tier but its drain to "
                                  f"{self._target.durable.url} failed: {error}. The durable tier's tags and 'latest' "
                                  f"are unchanged; {again} drains it again, unless a later tag reaches the URL first "
                                  "(it then stays on the local tier only)", tag=job.tag)
        logger.error("rank %d: %s", self._rank, failure)
        with self._lock:  # drains run in order: this attempt supersedes the tag's earlier failed ones
            self._forget_failures(job.tag)
            self._failed.append(job)
            self._pending.pop(job.drain_id, None)  # before the handle settles: a save that sees it fail drains it again
        self._on_failure(failure, job)
        job.handle._fail(failure)

    @staticmethod
    def _acknowledge(job: SaveJob) -> None:
        try:
            job.handshake.acknowledge()
        except Exception as exc:
            logger.debug("could not acknowledge the drain outcome of %s: %s", job.tag, exc)
