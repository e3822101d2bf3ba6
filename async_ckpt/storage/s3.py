"""S3 (and S3-compatible stores) through s3fs, with a concurrent multipart upload of our own.

s3fs's ``open('wb')`` uploads one part at a time. Here each file streams into parts of
``part_size`` bytes that are uploaded concurrently, at most ``max_concurrency`` in flight: the
uploader holds at most ``(max_concurrency + 1) * part_size`` bytes, and reports its peak (for a
file past ``PARTS_PER_SIZE`` parts, the parts and that bound double: see ``MAX_PARTS``). The parts
are spread over ``upload_threads`` event loops, each with its own client (see :class:`UploadLanes`). Every
request is retried on transient errors with backoff and jitter; if a part still fails the
multipart upload is aborted, so no orphaned parts stay behind. An object becomes visible only
when its upload completes, which is what makes a commit's ``latest`` PUT atomic.

Downloads use parallel ranged GETs written straight into the local file, resumable part by part.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import functools
import hashlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Awaitable, BinaryIO, Callable, Iterator, Mapping, TypeVar

import botocore.exceptions
import fsspec.asyn
import s3fs

from async_ckpt.config import MAX_PART_SIZE, MiB
from async_ckpt.errors import ConfigError, MissingFileError, StorageError
from async_ckpt.storage.base import Progress, pwrite_all
from async_ckpt.storage.fsspec_store import FsspecStorage
from async_ckpt.storage.retry import RetryPolicy

T = TypeVar("T")
logger = logging.getLogger("async_ckpt")

#: What writing a downloaded file can fail with that is about the local folder, not the network.
_LOCAL_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS})


def _error_code(exc: BaseException) -> str | None:
    """The error code of S3's answer that ``exc`` carries (``NoSuchKey``...), or ``None``."""
    response = getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _not_found(exc: BaseException) -> bool:
    """Whether a client error is S3's answer that the key does not exist."""
    return _error_code(exc) in ("NoSuchKey", "404")


#: The errors a store gives where it refuses a multipart upload's parts at completion (R2 and Garage, for
#: parts of unequal sizes): the ones the equal_parts hint is for.
_REFUSED_PARTS = ("InvalidPart", "InvalidPartOrder", "EntityTooSmall", "InvalidRequest", "InvalidArgument",
                  "BadRequest", "400")


#: Why S3 denies a read (403), of which it does not say which.
_DENIED_WHY = ("the credentials may not read it (s3:GetObject), or it does not exist and they may not list the "
               "bucket (s3:ListBucket; S3 then answers 403 for a missing key, not 404)")


def _replaced(exc: BaseException) -> bool:
    """Whether a client error is S3's answer that the object no longer has the ETag asked for (``If-Match``)."""
    return _error_code(exc) in ("PreconditionFailed", "412")


#: Files up to this size are buffered in memory that grows with them; larger ones in full parts.
SMALL_FILE = 1024 * 1024

#: S3 takes at most 10,000 parts per object, each at most 5 GiB (MAX_PART_SIZE). Parts double in
#: size after every PARTS_PER_SIZE of them, so 10,000 parts reach S3's 5 TiB object limit from the
#: default 16 MiB (4.9 TiB from the 5 MiB minimum), while files up to PARTS_PER_SIZE * part_size
#: (16 GiB by default) keep the configured size. Stores that refuse parts of different sizes (Cloudflare R2,
#: Garage) need ``equal_parts``, which keeps the configured size up to the 10,000th part.
MAX_PARTS = 10_000
PARTS_PER_SIZE = 1000

#: A request that sends a body (a part, or a whole small object) is given up (and retried) once it has taken
#: longer than the client's connect and read timeouts plus its size at this rate. botocore's read timeout
#: starts only once the body is sent, so a store that stops reading mid-body would hold the request until TCP
#: gives up (about 15 min), or for ever while the store keeps answering with a zero window.
SLOWEST_PART_BYTES_PER_S = 256 * 1024


async def _sent_in_time(s3: Any, nbytes: int, send: Callable[[], Awaitable[Any]]) -> Any:
    """``send()``'s answer, or TimeoutError once a request with a body of ``nbytes`` took longer than it may
    (see SLOWEST_PART_BYTES_PER_S): a transient error, retried."""
    config = s3.meta.config
    deadline = (config.connect_timeout or 0) + (config.read_timeout or 0) + nbytes / SLOWEST_PART_BYTES_PER_S
    limit = asyncio.timeout(deadline)
    try:
        async with limit:
            return await send()
    except TimeoutError as exc:
        if not limit.expired():
            raise
        raise TimeoutError(f"no answer within {deadline:.0f} s (the client's connect and read timeouts, and the "
                           f"body of {nbytes} bytes at {SLOWEST_PART_BYTES_PER_S // 1024} KiB/s)") from exc

#: Every part carries its CRC-32, which the store checks on arrival and combines into the object's
#: checksum at completion (boto3's TransferManager does the same; the store finishes faster with it).
CHECKSUM = "CRC32"


def _checksum_args(s3: Any) -> dict[str, str]:
    """``ChecksumAlgorithm`` for a request, unless the client was told to send checksums only where
    required (``request_checksum_calculation="when_required"`` in ``config_kwargs``, or
    ``AWS_REQUEST_CHECKSUM_CALCULATION``): the setting for stores that refuse them."""
    return {} if s3.meta.config.request_checksum_calculation == "when_required" else {"ChecksumAlgorithm": CHECKSUM}


@dataclass
class TransferStats:
    """Bytes moved by one storage object, for reports (a rank must not read other ranks' shards)."""

    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    objects_downloaded: int = 0
    peak_buffered_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def note_buffered(self, nbytes: int) -> None:
        with self._lock:
            self.peak_buffered_bytes = max(self.peak_buffered_bytes, nbytes)


class PartJournal:
    """Which parts of a download are on disk: a header line, then one finished part offset per line.

    A journal written for another object (size, part size or ETag differ) is ignored: the
    download restarts rather than mix parts of two objects.
    """

    def __init__(self, path: str, size: int, part_size: int, etag: str) -> None:
        self.path = path
        self._header = f"{size} {part_size} {etag}"
        self._fh: Any = None

    def load(self) -> set[int]:
        try:
            with open(self.path) as fh:
                lines = fh.read().splitlines()
        except FileNotFoundError:
            return set()
        if not lines or lines[0] != self._header:
            return set()
        return {int(line) for line in lines[1:] if line.strip().isdigit()}

    def start(self, *, keep: bool) -> None:
        self._fh = open(self.path, "a" if keep else "w")  # noqa: SIM115 (closed in close())
        if not keep:
            self._fh.write(self._header + "\n")
            self._fh.flush()

    def record(self, start: int) -> None:
        self._fh.write(f"{start}\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class UploadLanes:
    """Event-loop threads, each with its own S3 client, over which upload parts are spread.

    Why: s3fs runs every request of a filesystem on its one asyncio thread, and each part's
    request costs CPU on the thread that sends it (over plain HTTP botocore SHA-256-signs the
    whole body; every part's CRC-32 is computed). With one thread the client tops out where
    boto3's TransferManager, which spreads the same work over a thread pool, does (0.55 GB/s
    against an endpoint that drops what it gets, on 2 cores); hashlib and the CRC-32 release the GIL,
    so with 4 loops parts are hashed in parallel (0.75 GB/s; benchmarks/RESULTS.md). The threads
    (``async_ckpt-s3-lane-N``) start with the first multipart upload and stop in :meth:`close`.
    """

    def __init__(self, count: int, make_client: Callable[[asyncio.AbstractEventLoop], Awaitable[Any]]) -> None:
        self._lanes: list[tuple[asyncio.AbstractEventLoop, threading.Thread, Any]] = []
        self._next = itertools.count()
        self._lock = threading.Lock()  # a part is handed to a lane whole, or not at all once close() began
        self._closed = False
        try:
            for index in range(count):
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve, args=(loop,), name=f"async_ckpt-s3-lane-{index}", daemon=True)
                thread.start()
                self._lanes.append((loop, thread, None))
                client = asyncio.run_coroutine_threadsafe(make_client(loop), loop).result()
                self._lanes[-1] = (loop, thread, client)
        except BaseException:
            self.close()
            raise

    def submit(self, call: Callable[[Any], Awaitable[T]]) -> Future:
        """Run ``call(client)`` on the next lane, round robin: parts are of equal size, so is the load."""
        with self._lock:
            if self._closed:
                raise StorageError("the S3 upload threads were closed while an upload was still running")
            loop, _, client = self._lanes[next(self._next) % len(self._lanes)]
            return asyncio.run_coroutine_threadsafe(call(client), loop)

    def run_everywhere(self, call: Callable[[], Awaitable[Any]], timeout_s: float = 30) -> None:
        """Run ``call()`` on every lane in turn, after whatever was handed to that lane before it."""
        for loop, thread, _ in self._lanes:
            if thread is not threading.current_thread():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=timeout_s)

    def close(self) -> None:
        """Cancel what still runs on the lanes (its callers see the cancellation, rather than wait
        forever), close every lane's client, stop its loop and join its thread. A part handed in
        meanwhile is refused (:meth:`submit`)."""
        with self._lock:
            self._closed = True
        self.run_everywhere(_cancel_other_tasks)
        lanes, self._lanes = self._lanes, []
        for loop, thread, client in lanes:
            if thread is threading.current_thread():  # a finalizer run by the GC on this lane: it cannot wait for itself
                loop.call_soon(loop.stop)
                continue
            if client is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(client.close(), loop).result(timeout=10)
            with contextlib.suppress(Exception):  # the resolver's executor threads, started by aiohttp
                asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            if thread.is_alive():
                logger.warning("the S3 upload thread %s did not stop within 30 s of close(); it is left to end on "
                               "its own", thread.name)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """A lane's thread: its loop, until :meth:`UploadLanes.close` stops it. Then what is still pending there
    (a part that a closing client sent into its retry's backoff) is cancelled, so that no caller waits
    for a loop that no longer runs, and the loop is closed."""
    try:
        loop.run_forever()
        loop.run_until_complete(_cancel_leftovers())
    finally:
        loop.close()


async def _cancel_leftovers(timeout_s: float = 5) -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` (of the running loop) and wait until they have stopped."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _cancel_other_tasks() -> None:
    await _cancel([task for task in asyncio.all_tasks() if task is not asyncio.current_task()])


class S3Storage(FsspecStorage):
    writes_in_place = True

    def __init__(self, url: str, storage_options: dict[str, Any], *, part_size: int | None = None,
                 equal_parts: bool = False, max_concurrency: int | None = None, upload_threads: int | None = None,
                 retry: RetryPolicy | None = None) -> None:
        options = dict(storage_options)
        options.setdefault("skip_instance_cache", True)
        options.setdefault("use_listings_cache", False)  # commit polls listings; they must be fresh
        config_kwargs = options.pop("config_kwargs", None) or {}
        if not isinstance(config_kwargs, Mapping):
            raise ConfigError(f"storage_options['config_kwargs'] must be a dict of botocore Config options, such as "
                              f"{{'connect_timeout': 10}}, got {config_kwargs!r}")
        # Two kinds of client: s3fs's requests (listings, HEADs, deletes) retry as botocore does; this
        # module's own requests retry through ``self.retry`` alone, not through both loops at once.
        theirs, ours = dict(config_kwargs), dict(config_kwargs)
        theirs.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        ours.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        # botocore's pool holds 10 connections: a part beyond them would wait for one inside its deadline (two
        # uploads share a lane: a save's, and a drain's or another save's)
        ours.setdefault("max_pool_connections", max(10, 2 * (max_concurrency or 8)))
        fs = s3fs.S3FileSystem(config_kwargs=theirs, **options)
        try:  # the client is made here: options s3fs does not know and unusable credentials fail now, typed
            fs.connect()
        except TypeError as exc:  # s3fs hands options it does not know to the botocore session
            raise ConfigError(f"storage_options for {url} are invalid: {exc} (s3fs takes e.g. 'endpoint_url', 'key' "
                              "and 'secret', and botocore Config options inside 'config_kwargs')") from exc
        except Exception as exc:  # credentials botocore cannot resolve: a key without its secret, a missing profile
            raise StorageError(f"cannot open {url}: {type(exc).__name__}: {exc}. Check the credentials in "
                               "storage_options or the environment (AWS_PROFILE, AWS_ACCESS_KEY_ID...)") from exc
        super().__init__(fs, fs._strip_protocol(url), url.rstrip("/"))
        self.bucket, _, self.prefix = self.root.partition("/")
        self.part_size = part_size or 16 * MiB
        self.equal_parts = equal_parts
        self.max_concurrency = max_concurrency or 8
        self.upload_threads = upload_threads or 4
        self.retry = retry or RetryPolicy()
        self.stats = TransferStats()
        self._own_fs_options = {**options, "skip_instance_cache": True, "config_kwargs": ours}
        self._own_fs: s3fs.S3FileSystem | None = None  # the client of this module's requests on fs.loop
        self._lanes: UploadLanes | None = None
        self._lanes_finalizer: weakref.finalize | None = None
        self._lanes_lock = threading.Lock()

    def _upload_lanes(self) -> UploadLanes:
        with self._lanes_lock:
            if self._lanes is None:
                self._lanes = UploadLanes(min(self.upload_threads, self.max_concurrency), self._lane_client)
                # a storage dropped (or left at exit) without close() still stops its threads
                self._lanes_finalizer = weakref.finalize(self, self._lanes.close)
            return self._lanes

    async def _lane_client(self, loop: asyncio.AbstractEventLoop) -> Any:
        """A client like this storage's own (same endpoint, credentials, config), bound to ``loop``."""
        return await s3fs.S3FileSystem(asynchronous=True, loop=loop, **self._own_fs_options).set_session()

    def close(self) -> None:
        """Stop the upload threads and close every client's connections; a later request opens them again."""
        with self._lanes_lock:
            self._lanes = None
            finalizer, self._lanes_finalizer = self._lanes_finalizer, None
        if finalizer is not None:
            finalizer()
        own, self._own_fs = self._own_fs, None
        for fs in (self.fs, own):
            if fs is not None and fs._s3 is not None:  # a client's pooled keep-alive connections would stay open
                with contextlib.suppress(Exception):
                    fsspec.asyn.sync(self.fs.loop, fs._s3.close)

    def _key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def _run(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _client(self) -> Any:
        """The client of this module's own requests (each retried by ``self.retry``), on ``fs.loop``."""
        if self._own_fs is None:  # not asynchronous: on fsspec's loop (fs.loop), closed by s3fs when dropped
            self._own_fs = s3fs.S3FileSystem(**self._own_fs_options)
        return await self._own_fs.set_session()

    def request(self, s3: Any, operation: str, **params: Any) -> Awaitable[Any]:
        """``s3.<operation>(**params)`` with what s3fs adds to its own requests, where the operation takes
        it: ``s3_additional_kwargs`` (server-side encryption, its key...) and ``RequestPayer`` under
        ``requester_pays``. This module calls the client directly, which adds neither: without this an
        encryption key given in storage_options was ignored by every upload and download."""
        method = getattr(s3, operation)
        return method(**self.fs._get_s3_method_kwargs(method, **params))

    def delete(self, relpath: str, *, recursive: bool = False) -> None:
        """As on any fsspec store, then a check that nothing is left: DeleteObjects answers each key
        that S3 refuses (a bucket policy, an object lock) with an error inside a 200 response, and
        s3fs drops those errors. Unchecked, a cleanup would go on as if the files were gone: remove a
        tag's start mark while its files stay, say, so that gc keeps them as a foreign folder."""
        super().delete(relpath, recursive=recursive)
        path = self.full_path(relpath)
        self.fs.invalidate_cache(path)
        left = self.fs.find(path) if recursive else [path] if self.fs.exists(path) else []
        if left:
            raise PermissionError(errno.EACCES, f"S3 kept {len(left)} object(s) that a delete of {relpath!r} at "
                                  f"{self.url} asked it to remove (e.g. {left[0]}): it refused them. Check the "
                                  "bucket policy or object lock for s3:DeleteObject", path)

    @contextlib.contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        upload = MultipartUpload(self, self._key(relpath))
        try:
            yield upload  # type: ignore[misc]
            upload.complete()
        except BaseException:
            upload.abort()
            raise

    def get_file(self, relpath: str, local_path: str, *, progress: Progress | None = None,
                 resume: bool = False) -> None:
        """Parallel ranged GETs of ``part_size`` bytes, written in place with ``pwrite``.

        Parts finish out of order, so a journal next to the file (``<file>.parts``) records each
        finished part; ``resume`` skips those and fetches only the rest.

        Every part is asked for by the ETag the first HEAD saw (``If-Match``), so that an object replaced
        meanwhile is never mixed with its new version; it is downloaded once more, whole, from a new
        HEAD (the caller's checksum then tells whether that version is the one it expects).
        """
        key = self._key(relpath)
        once = _ReportedOnce(progress) if progress is not None else None
        try:
            try:
                fsspec.asyn.sync(self.fs.loop, self._download, key, local_path, once, resume)
            except Exception as exc:
                if not _replaced(exc):
                    raise
                logger.info("s3://%s/%s was replaced while it was downloaded; downloading it again", self.bucket, key)
                if once is not None:
                    once.restart()
                fsspec.asyn.sync(self.fs.loop, self._download, key, local_path, once, resume)
        except (StorageError, FileNotFoundError):
            raise
        except Exception as exc:  # botocore / aiohttp errors left after the retries, or the local file's
            if _not_found(exc):  # its HEAD found it: gone since (a lifecycle rule, a delete, a retention pass)
                raise MissingFileError(f"s3://{self.bucket}/{key} was deleted while it was downloaded") from None
            if _replaced(exc):  # replaced again during the second download
                raise StorageError(f"s3://{self.bucket}/{key} was replaced while it was downloaded, twice (its ETag "
                                   "changed); nothing of two versions was mixed. Run again once no other job "
                                   "writes that checkpoint") from None
            if _error_code(exc) in ("403", "AccessDenied"):
                raise StorageError(f"access to s3://{self.bucket}/{key} was denied (403): {_DENIED_WHY}. Check the "
                                   "credentials and the bucket policy") from exc
            if isinstance(exc, OSError) and exc.errno in _LOCAL_WRITE_ERRNOS:  # the local file, not the network
                raise StorageError(f"cannot write {local_path} (downloading s3://{self.bucket}/{key}): "
                                   f"{exc.strerror}. Free space in that folder (on resume: cache_dir) or make it "
                                   "writable") from exc
            raise StorageError(f"cannot download s3://{self.bucket}/{key}: {type(exc).__name__}: {exc}. Check the "
                               "endpoint, credentials and network") from exc

    async def _download(self, key: str, local_path: str, progress: Progress | None, resume: bool) -> None:
        s3 = await self._client()
        try:
            head = await self.retry.run(f"HEAD {key}",
                                        lambda: self.request(s3, "head_object", Bucket=self.bucket, Key=key))
        except Exception as exc:
            if _not_found(exc):
                raise MissingFileError(f"s3://{self.bucket}/{key} does not exist") from None
            raise
        size = int(head["ContentLength"])
        etag = str(head.get("ETag", ""))
        # each part only from the object the HEAD saw: one replaced meanwhile fails the GET (412), never mixes in;
        # a weak ETag (W/..., from some proxies) never matches If-Match, which compares strongly
        same_object = {"IfMatch": etag} if etag and not etag.startswith("W/") else {}
        journal = PartJournal(f"{local_path}.parts", size, self.part_size, etag)
        done = journal.load() if resume and os.path.exists(local_path) else set()
        if progress and done:
            progress(sum(min(self.part_size, size - start) for start in done))
        gate = asyncio.Semaphore(self.max_concurrency)
        fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | (0 if done else os.O_TRUNC), 0o644)
        try:
            os.ftruncate(fd, size)
            journal.start(keep=bool(done))

            async def fetch(start: int) -> None:
                end = min(start + self.part_size, size) - 1
                async with gate:
                    async def get() -> bytes:
                        resp = await self.request(s3, "get_object", Bucket=self.bucket, Key=key,
                                                  Range=f"bytes={start}-{end}", **same_object)
                        async with resp["Body"] as body:
                            return await body.read()

                    data = await self.retry.run(f"GET {key} [{start}-{end}]", get)
                if len(data) != end - start + 1:
                    raise StorageError(f"s3://{self.bucket}/{key}: short read at {start} ({len(data)} bytes)")
                with memoryview(data) as view:
                    pwrite_all(fd, view, start)
                journal.record(start)
                self.stats.add(bytes_downloaded=len(data))
                if progress:
                    progress(len(data))

            tasks = [asyncio.ensure_future(fetch(start)) for start in range(0, size, self.part_size) if start not in done]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # no part may write to fd after it is closed
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            self.stats.add(objects_downloaded=1)
        finally:
            os.close(fd)
            journal.close()
        journal.remove()

    def list_incomplete_uploads(self) -> list[tuple[str, str, float]]:
        async def listing() -> list[tuple[str, str, float]]:
            s3 = await self._client()
            prefix = f"{self.prefix}/" if self.prefix else ""
            found, kwargs = [], {"Bucket": self.bucket, "Prefix": prefix}
            while True:
                resp = await self.retry.run("list multipart uploads",
                                            lambda: self.request(s3, "list_multipart_uploads", **kwargs))
                found += [(u["Key"][len(prefix):], u["UploadId"], u["Initiated"].timestamp())
                          for u in resp.get("Uploads", [])]
                if not resp.get("IsTruncated"):
                    return found
                kwargs.update(KeyMarker=resp["NextKeyMarker"], UploadIdMarker=resp["NextUploadIdMarker"])

        return fsspec.asyn.sync(self.fs.loop, listing)

    def last_part_uploaded(self, relpath: str, upload_id: str) -> float:
        key = self._key(relpath)

        async def newest_part() -> float:
            s3 = await self._client()
            newest, kwargs = 0.0, {"Bucket": self.bucket, "Key": key, "UploadId": upload_id}
            while True:
                try:
                    resp = await self.retry.run(f"list parts of {key}",
                                                lambda: self.request(s3, "list_parts", **kwargs))
                except botocore.exceptions.ClientError as exc:
                    code = _error_code(exc)
                    if code == "NoSuchUpload":  # completed or aborted since it was listed
                        return time.time()
                    if code != "AccessDenied":
                        raise
                    logger.warning("cannot list the parts of s3://%s/%s (AccessDenied): it may still be uploading, "
                                   "so it counts as active now (grant s3:ListMultipartUploadParts to let gc tell)",
                                   self.bucket, key)
                    return time.time()
                newest = max([newest] + [part["LastModified"].timestamp() for part in resp.get("Parts", [])])
                if not resp.get("IsTruncated"):
                    return newest
                kwargs = {**kwargs, "PartNumberMarker": resp["NextPartNumberMarker"]}

        return fsspec.asyn.sync(self.fs.loop, newest_part)

    def abort_upload(self, relpath: str, upload_id: str) -> None:
        fsspec.asyn.sync(self.fs.loop, self._abort_upload, self._key(relpath), upload_id)

    async def _abort_upload(self, key: str, upload_id: str) -> None:
        """Abort the multipart upload ``upload_id`` of ``key``; one that completed or was aborted since is
        done (two gc runs at once, or a save's own abort first)."""
        s3 = await self._client()
        try:
            await self.retry.run(f"abort {key}", lambda: self.request(
                s3, "abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id))
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) != "NoSuchUpload":
                raise

    @property
    def upload_buffer_peak_bytes(self) -> int:
        return self.stats.peak_buffered_bytes

    def list_dir(self, relpath: str = "") -> list[str]:
        self.fs.invalidate_cache(self.full_path(relpath))
        return super().list_dir(relpath)

    def read_bytes(self, relpath: str) -> bytes:
        key = self._key(relpath)

        async def get() -> bytes:
            s3 = await self._client()
            try:
                resp = await self.request(s3, "get_object", Bucket=self.bucket, Key=key)
            except Exception as exc:
                if _not_found(exc):
                    raise FileNotFoundError(f"s3://{self.bucket}/{key}") from None
                if _error_code(exc) in ("403", "AccessDenied"):  # as s3fs's reads raise it: callers that
                    # take an unreadable file for one (catalog.inspect_latest) work on S3 too
                    raise PermissionError(errno.EACCES, f"access denied (403): {_DENIED_WHY}",
                                          f"s3://{self.bucket}/{key}") from exc
                raise
            async with resp["Body"] as body:
                return await body.read()

        return fsspec.asyn.sync(self.fs.loop, self.retry.run, f"GET {key}", get)


class _ReportedOnce:
    """A download's progress callback that reports each byte of the file once, though a second attempt
    fetches the parts the first one reported again (the object was replaced: :meth:`S3Storage.get_file`).
    Called on the event loop's thread only."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._reported = 0  # the most bytes any attempt has reached so far
        self._attempt = 0  # bytes of the current attempt

    def restart(self) -> None:
        self._attempt = 0

    def __call__(self, nbytes: int) -> None:
        self._attempt += nbytes
        if self._attempt > self._reported:
            self._progress(self._attempt - self._reported)
            self._reported = self._attempt


def _rewound(part: io.BytesIO) -> io.BytesIO:
    """``part`` at its start: every attempt of a request sends it whole."""
    part.seek(0)
    return part


class MultipartUpload:
    """A write-only stream that uploads to one S3 key in concurrent parts (see module docstring).

    Each part is an ``io.BytesIO`` that is filled here, then handed as it is to the request and
    reused for a later part once its request is over. A stream, not bytes: handed bytes, aiohttp
    writes the whole body to the socket transport at once, which (Python 3.11) joins it with
    the headers, buffers what the socket did not take and shifts that buffer after every send,
    per byte 1.4x the CPU boto3 spends (measured). A stream is sent in chunks, without a copy.
    """

    def __init__(self, storage: S3Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._part_size = storage.part_size
        self._part = io.BytesIO()  # grows while the file is small; see write()
        self._small = True
        self._upload_id: str | None = None
        self._spare: list[io.BytesIO] = []  # parts whose request is over, filled again rather than allocated
        self._inflight: deque[tuple[Future, io.BytesIO]] = deque()
        self._running: set[asyncio.Task] = set()  # part requests that have started, on whichever lane
        self._lanes: UploadLanes | None = None  # taken at the first part: a close() meanwhile fails the upload
        self._parts: list[dict[str, Any]] = []
        self._next_part = 1
        self.size = 0
        storage.stats.note_buffered(self._part_size)  # the part being filled

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            if self._small and self._part.tell() + view.nbytes > SMALL_FILE:
                self._part = self._new_part(self._part.getvalue())  # no longer small: full-size parts from now
                self._small = False
            take = min(self._part_size - self._part.tell(), view.nbytes)
            self._part.write(view[:take])
            view = view[take:]
            if self._part.tell() == self._part_size:
                self._send_part()
        self.size += total
        return total

    def flush(self) -> None:
        pass

    def _wait(self, future: Future) -> Any:
        """The result of one request; its failure becomes a StorageError naming the object."""
        try:
            return future.result()
        except Exception as exc:
            raise StorageError(f"upload of s3://{self._storage.bucket}/{self._key} failed: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _take_part(self) -> io.BytesIO:
        """The filled part, cut to its length; a fresh (or spare) one takes its place."""
        part = self._part
        part.truncate()
        self._part = self._spare.pop() if self._spare else self._new_part()
        self._part.seek(0)
        return part

    def _new_part(self, start: bytes = b"") -> io.BytesIO:
        """A part buffer of exactly ``part_size`` bytes, positioned after ``start``: one grown by
        writes would hold up to 1/8 more than it reports."""
        part = io.BytesIO(bytes(self._part_size))
        part.write(start)
        return part

    def _send_part(self) -> None:
        storage = self._storage
        if self._upload_id is None:
            self._lanes = storage._upload_lanes()
            self._upload_id = self._wait(storage._run(self._create()))
        while len(self._inflight) >= storage.max_concurrency:
            self._collect()
        number, self._next_part = self._next_part, self._next_part + 1
        if number > MAX_PARTS:
            raise StorageError(f"s3://{storage.bucket}/{self._key} needs more than S3's {MAX_PARTS} parts "
                               f"(parts of up to {self._part_size} bytes): raise part_size")
        if number % PARTS_PER_SIZE == 0 and number < MAX_PARTS and self._part_size < MAX_PART_SIZE \
                and not storage.equal_parts:
            self._grow_parts()
        part = self._take_part()
        future = self._lanes.submit(functools.partial(self._upload_part, number, part))
        self._inflight.append((future, part))
        storage.stats.note_buffered((len(self._inflight) + 1) * self._part_size)

    def _grow_parts(self) -> None:
        """Double the size of the parts from the next one on (see PARTS_PER_SIZE); the smaller spares go."""
        self._part_size = min(2 * self._part_size, MAX_PART_SIZE)
        for spare in self._spare:
            spare.close()
        self._spare.clear()

    def _collect(self) -> None:
        """Wait for the oldest part in flight; its buffer is free for the next part, if of the current size."""
        future, part = self._inflight.popleft()
        self._parts.append(self._wait(future))
        if part.getbuffer().nbytes == self._part_size:
            self._spare.append(part)
        else:
            part.close()

    async def _create(self) -> str:
        s3 = await self._storage._client()
        resp = await self._storage.retry.run(
            f"create upload {self._key}",
            lambda: self._storage.request(s3, "create_multipart_upload", Bucket=self._storage.bucket, Key=self._key,
                                           **_checksum_args(s3)))
        return resp["UploadId"]

    async def _upload_part(self, number: int, part: io.BytesIO, s3: Any) -> dict[str, Any]:
        task = asyncio.current_task()
        self._running.add(task)

        def attempt() -> Awaitable[Any]:
            return _sent_in_time(s3, part.getbuffer().nbytes, lambda: self._storage.request(
                s3, "upload_part", Bucket=self._storage.bucket, Key=self._key, PartNumber=number,
                UploadId=self._upload_id, Body=_rewound(part), **_checksum_args(s3)))

        try:
            resp = await self._storage.retry.run(f"part {number} of {self._key}", attempt)
        finally:
            self._running.discard(task)
        self._storage.stats.add(bytes_uploaded=part.getbuffer().nbytes)
        entry = {"PartNumber": number, "ETag": resp["ETag"]}
        if resp.get(f"Checksum{CHECKSUM}"):  # the store verified the part; complete names it back
            entry[f"Checksum{CHECKSUM}"] = resp[f"Checksum{CHECKSUM}"]
        return entry

    async def _settle(self) -> None:
        """On one lane: cancel this upload's part requests running there and wait until they have stopped."""
        loop = asyncio.get_running_loop()
        await _cancel([task for task in list(self._running) if task.get_loop() is loop])

    def _release(self) -> None:
        for part in [self._part, *self._spare, *(part for _, part in self._inflight)]:
            part.close()
        self._inflight.clear()
        self._spare.clear()

    def complete(self) -> None:
        storage = self._storage
        if self._upload_id is None:  # small object: one PUT
            part = self._part
            part.truncate()

            async def put() -> None:
                s3 = await storage._client()
                await storage.retry.run(f"PUT {self._key}", lambda: _sent_in_time(
                    s3, part.getbuffer().nbytes, lambda: storage.request(s3, "put_object", Bucket=storage.bucket,
                                                                         Key=self._key, Body=_rewound(part))))
                storage.stats.add(bytes_uploaded=part.getbuffer().nbytes)

            self._wait(storage._run(put()))
            return
        if self._part.tell():
            self._send_part()
        while self._inflight:
            self._collect()

        parts = sorted(self._parts, key=lambda p: p["PartNumber"])

        async def complete(s3: Any) -> None:
            try:
                await storage.request(s3, "complete_multipart_upload", Bucket=storage.bucket, Key=self._key,
                                      UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            except botocore.exceptions.ClientError as exc:
                if not (_error_code(exc) == "NoSuchUpload" and await self._stored(s3, parts)):
                    raise

        async def finish() -> None:
            s3 = await storage._client()
            await storage.retry.run(f"complete {self._key}", lambda: complete(s3))

        try:
            self._wait(storage._run(finish()))
        except StorageError as exc:
            # the hint only where the store refused the parts themselves: not a timeout, a lost upload, a denial
            if self._part_size == storage.part_size or _error_code(exc.__cause__) not in _REFUSED_PARTS:
                raise
            raise StorageError(f"{exc}. Its parts grew from {storage.part_size} to {self._part_size} bytes after "
                               f"every {PARTS_PER_SIZE} parts; if the store needs every part but the last of one "
                               "size (Cloudflare R2, Garage), set equal_parts=True (and a part_size above "
                               "the file's size / 10,000)") from exc.__cause__

    async def _stored(self, s3: Any, parts: list[dict[str, Any]]) -> bool:
        """Whether the object at the key is these parts, joined: a completion that the store answers
        ``NoSuchUpload`` may be the retry (the client's or ours) of one that succeeded and whose answer
        was lost (MinIO and Ceph answer so once an upload completed; S3 answers 200). The multipart ETag (the
        MD5 of the parts' MD5s, then ``-N``) says so; where it is no MD5 (SSE-KMS), the error stands."""
        try:
            digests = b"".join(bytes.fromhex(part["ETag"].strip('"')) for part in parts)
            head = await self._storage.retry.run(
                f"HEAD {self._key}",
                lambda: self._storage.request(s3, "head_object", Bucket=self._storage.bucket, Key=self._key))
        except (ValueError, botocore.exceptions.ClientError):
            return False
        stored = head.get("ETag", "").strip('"') == f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"
        if stored:
            logger.info("the completion of s3://%s/%s was answered NoSuchUpload; the object there is its parts, "
                        "joined: an earlier try succeeded", self._storage.bucket, self._key)
        return stored

    def abort(self) -> None:
        """Cancel parts in flight and abort the multipart upload, so no parts are left billed.

        The abort waits until no part request runs any more (S3 may keep a part whose upload ends
        after the abort), and frees the part buffers: a failure is kept, with its traceback, by
        the checkpointer, and the traceback would keep this object alive.
        """
        for future, _ in self._inflight:
            future.cancel()  # a request that has not started yet never will
        if self._inflight and self._lanes is not None:
            self._lanes.run_everywhere(self._settle)
        self._release()
        if self._upload_id is None:
            return
        storage = self._storage
        try:
            storage._run(storage._abort_upload(self._key, self._upload_id)).result()
        except Exception as exc:  # the write's own error is what the caller sees
            logger.warning("could not abort the multipart upload of s3://%s/%s (%s: %s): its parts stay stored, "
                           "and billed, until `async-ckpt gc` or a bucket lifecycle rule aborts it", storage.bucket,
                           self._key, type(exc).__name__, exc)
