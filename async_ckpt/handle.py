"""The handle ``save()`` returns: completion, result and metrics of one background save."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from async_ckpt.config import timeout_argument
from async_ckpt.errors import WaitTimeoutError


@dataclass(frozen=True)
class SaveResult:
    """What a committed save reports."""

    tag: str
    url: str
    bytes_written: int
    stall_s: float
    persist_s: float
    commit_s: float
    #: Work after the commit that failed (writing ``latest``, retention), one line each. The tag is
    #: committed and loads regardless; each warning was also logged.
    warnings: tuple[str, ...] = ()

    @property
    def persist_gbps(self) -> float:
        """This rank's bytes over ``persist_s``, in GB/s (the figure the save's log line gives)."""
        return self.bytes_written / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")


@dataclass
class SaveHandle:
    """Tracks one save. ``done()`` is true once it is durably committed or failed.

    With a local tier (``wrap(..., local_tier=PATH)``) a save is committed twice: first on the
    node-local tier (:meth:`local_done`, :meth:`wait_local`, :meth:`local_result`: a process restart
    can resume from it), then at the durable URL once the drain copied it there (:meth:`done`,
    :meth:`wait`, :meth:`result`). Without a local tier both moments are the same commit.

    ``metrics`` fills in as the save progresses: ``stall_s`` (time the training loop was blocked
    in ``save()``; of it ``snapshot_s`` staging the state, ``buffer_wait_s`` waiting for the
    previous save), ``staging_bytes``, ``in_place_bytes`` (a synchronous save's host state, written from
    where it is with no staging copy), ``commit_wait_s`` (a synchronous save: the wait in ``save()`` for
    the commit, after ``stall_s``), ``step_wait_s`` (with ``overlap_copy``: the wait of the next
    optimizer step for the copy), then ``persist_s``, ``copy_wait_s`` (of it, the writer waiting
    for overlapped copies), ``mark_s`` (of it, writing the save's start mark), ``seconds_by_file``
    (of it, the seconds each file took, by its path: its copy waits, its write and the fsyncs that make it
    durable), ``bytes_written``, ``zero_copy_bytes`` (bytes written straight from the staging memory), ``upload_buffer_peak_bytes`` (object stores: the most part memory the
    uploader has held so far, bounded by ``(max_concurrency + 1) * part_size``), ``queued_s`` (from
    the end of ``save()`` until the writer thread began it), on rank 0 the commit's steps
    ``ranks_wait_s`` (waiting for the other ranks' files), ``extras_s`` (tokenizer, config and
    DeepSpeed's recovery scripts), ``commit_s`` (the manifest) and ``after_commit_s`` (``latest``
    and retention), and ``durable_s`` (seconds from ``save()`` to the commit); with a local tier ``local_committed_s``
    and ``durable_s`` (seconds from ``save()`` to each commit), ``drain_s`` and ``tier``
    (``"local"``, or ``"durable"`` when the save went straight to the URL).
    """

    tag: str
    url: str
    _future: Future = field(default_factory=Future, repr=False)
    _local: Future = field(default_factory=Future, repr=False)
    metrics: dict[str, Any] = field(default_factory=dict)

    def done(self) -> bool:
        """Durably committed on every tier, or failed; never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until committed or failed, at most ``timeout`` seconds; return :meth:`done`."""
        return _settles(self._future, _timeout("wait", timeout))

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block until committed; re-raise the background failure (:class:`SaveFailedError`), or raise
        :class:`WaitTimeoutError` once ``timeout`` seconds have passed."""
        return self._bounded(self._future, self._future.result, _timeout("result", timeout), "committed")

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until committed or failed; the failure (:class:`SaveFailedError`), or ``None``;
        :class:`WaitTimeoutError` once ``timeout`` seconds have passed."""
        return self._bounded(self._future, self._future.exception, _timeout("exception", timeout), "settled")

    def local_done(self) -> bool:
        """Committed on the first tier (the local tier, or the URL without one), or failed."""
        return self._local.done()

    def wait_local(self, timeout: float | None = None) -> bool:
        """Block until :meth:`local_done`, at most ``timeout`` seconds; return it."""
        return _settles(self._local, _timeout("wait_local", timeout))

    def local_result(self, timeout: float | None = None) -> SaveResult:
        """Block until committed on the first tier (its ``url`` says which); re-raise its failure, or raise
        :class:`WaitTimeoutError` once ``timeout`` seconds have passed."""
        return self._bounded(self._local, self._local.result, _timeout("local_result", timeout),
                             "committed on its first tier")

    def _bounded(self, future: Future, call: Callable[[float | None], Any], timeout: float | None, what: str) -> Any:
        """``call(timeout)``, its timeout raised as the :class:`WaitTimeoutError` every other bounded wait of
        async_ckpt raises (a subclass of the ``TimeoutError`` that ``Future`` raises), naming the save."""
        try:
            return call(timeout)
        except TimeoutError as exc:
            if future.done():  # the save's own failure, or it settled as this wait gave up: its outcome
                return call(0)
            raise WaitTimeoutError(f"the save of tag {self.tag!r} to {self.url} was not {what} within {timeout} s; "
                                   "wait longer, or check the log for a slow or stuck write") from exc

    def _commit_local(self, result: SaveResult) -> None:
        if not self._local.done():
            self._local.set_result(result)

    def _succeed(self, result: SaveResult) -> None:
        self._commit_local(result)
        self._future.set_result(result)

    def _fail(self, exc: BaseException) -> None:
        if not self._local.done():
            self._local.set_exception(exc)
        self._future.set_exception(exc)


def _timeout(call: str, timeout: Any) -> float | None:
    """``timeout`` checked as every wait's is (:class:`~async_ckpt.errors.ConfigError` before waiting); infinity
    is no limit, which ``Future`` takes as ``None`` only."""
    checked = timeout_argument(f"{call}(timeout=...)", timeout)
    return None if checked == float("inf") else checked


def _settles(future: Future, timeout: float | None) -> bool:
    """Whether ``future`` ends (with a result or a failure) within ``timeout`` seconds."""
    try:
        future.exception(timeout)
    except TimeoutError:  # concurrent.futures.TimeoutError is this builtin from Python 3.11, the oldest supported
        return False
    return True
