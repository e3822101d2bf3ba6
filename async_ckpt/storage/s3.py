"""S3 (and S3-compatible stores) through s3fs, with a concurrent multipart upload of our own.

s3fs's ``open('wb')`` uploads one part at a time. Here each file streams into parts of
``part_size`` bytes that are uploaded concurrently, at most ``max_concurrency`` in flight: the
uploader holds at most ``(max_concurrency + 1) * part_size`` bytes, and reports its peak. Every
request is retried on transient errors with backoff and jitter; if a part still fails the
multipart upload is aborted, so no orphaned parts stay behind. An object becomes visible only
when its upload completes, which is what makes a commit's ``latest`` PUT atomic.

Downloads use parallel ranged GETs written straight into the local file, resumable part by part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

import fsspec.asyn
import s3fs

from async_ckpt.errors import StorageError
from async_ckpt.storage.base import Progress
from async_ckpt.storage.fsspec_store import FsspecStorage
from async_ckpt.storage.retry import RetryPolicy

MiB = 1024 * 1024


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


class S3Storage(FsspecStorage):
    writes_in_place = True

    def __init__(self, url: str, storage_options: dict[str, Any], *, part_size: int | None = None,
                 max_concurrency: int | None = None, retry: RetryPolicy | None = None) -> None:
        options = dict(storage_options)
        options.setdefault("skip_instance_cache", True)
        options.setdefault("use_listings_cache", False)  # commit polls listings; they must be fresh
        config_kwargs = dict(options.pop("config_kwargs", None) or {})
        config_kwargs.setdefault("retries", {"max_attempts": 1, "mode": "standard"})  # retries are ours
        fs = s3fs.S3FileSystem(config_kwargs=config_kwargs, **options)
        super().__init__(fs, fs._strip_protocol(url), url.rstrip("/"))
        self.bucket, _, self.prefix = self.root.partition("/")
        self.part_size = part_size or 16 * MiB
        self.max_concurrency = max_concurrency or 8
        self.retry = retry or RetryPolicy()
        self.stats = TransferStats()

    def _key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def _run(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _client(self) -> Any:
        return await self.fs.set_session()

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
        """
        key = self._key(relpath)
        try:
            fsspec.asyn.sync(self.fs.loop, self._download, key, local_path, progress, resume)
        except (StorageError, FileNotFoundError):
            raise
        except Exception as exc:  # botocore / aiohttp errors left after the retries
            raise StorageError(f"cannot download s3://{self.bucket}/{key}: {type(exc).__name__}: {exc}. Check the "
                               "endpoint, credentials and network; the download resumes where it stopped") from exc

    async def _download(self, key: str, local_path: str, progress: Progress | None, resume: bool) -> None:
        s3 = await self._client()
        head = await self.retry.run(f"HEAD {key}", lambda: s3.head_object(Bucket=self.bucket, Key=key))
        size = int(head["ContentLength"])
        journal = PartJournal(f"{local_path}.parts", size, self.part_size, str(head.get("ETag", "")))
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
                        resp = await s3.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
                        async with resp["Body"] as body:
                            return await body.read()

                    data = await self.retry.run(f"GET {key} [{start}-{end}]", get)
                if len(data) != end - start + 1:
                    raise StorageError(f"s3://{self.bucket}/{key}: short read at {start} ({len(data)} bytes)")
                os.pwrite(fd, data, start)
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
            found, kwargs = [], {"Bucket": self.bucket, "Prefix": f"{self.prefix}/" if self.prefix else ""}
            while True:
                resp = await s3.list_multipart_uploads(**kwargs)
                found += [(u["Key"], u["UploadId"], u["Initiated"].timestamp()) for u in resp.get("Uploads", [])]
                if not resp.get("IsTruncated"):
                    return found
                kwargs.update(KeyMarker=resp["NextKeyMarker"], UploadIdMarker=resp["NextUploadIdMarker"])

        return fsspec.asyn.sync(self.fs.loop, listing)

    def abort_upload(self, key: str, upload_id: str) -> None:
        async def abort() -> None:
            s3 = await self._client()
            await self.retry.run(f"abort {key}", lambda: s3.abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id))

        fsspec.asyn.sync(self.fs.loop, abort)

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
                resp = await s3.get_object(Bucket=self.bucket, Key=key)
            except Exception as exc:
                if getattr(exc, "response", {}).get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise FileNotFoundError(f"s3://{self.bucket}/{key}") from None
                raise
            async with resp["Body"] as body:
                return await body.read()

        return fsspec.asyn.sync(self.fs.loop, self.retry.run, f"GET {key}", get)


class MultipartUpload:
    """A write-only stream that uploads to one S3 key in concurrent parts (see module docstring)."""

    def __init__(self, storage: S3Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._part_size = storage.part_size
        self._buffer = bytearray(self._part_size)
        self._filled = 0
        self._upload_id: str | None = None
        self._inflight: deque[Future] = deque()
        self._parts: list[dict[str, Any]] = []
        self._next_part = 1
        self.size = 0
        storage.stats.note_buffered(self._part_size)  # the part being filled

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            take = min(self._part_size - self._filled, view.nbytes)
            self._buffer[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
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

    def _send_part(self) -> None:
        storage = self._storage
        if self._upload_id is None:
            self._upload_id = self._wait(storage._run(self._create()))
        while len(self._inflight) >= storage.max_concurrency:
            self._parts.append(self._wait(self._inflight.popleft()))
        body, number = bytes(memoryview(self._buffer)[:self._filled]), self._next_part
        self._next_part += 1
        self._filled = 0
        self._inflight.append(storage._run(self._upload_part(number, body)))
        storage.stats.note_buffered((len(self._inflight) + 1) * self._part_size)

    async def _create(self) -> str:
        s3 = await self._storage._client()
        resp = await self._storage.retry.run(
            f"create upload {self._key}",
            lambda: s3.create_multipart_upload(Bucket=self._storage.bucket, Key=self._key))
        return resp["UploadId"]

    async def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        s3 = await self._storage._client()
        resp = await self._storage.retry.run(
            f"part {number} of {self._key}",
            lambda: s3.upload_part(Bucket=self._storage.bucket, Key=self._key, PartNumber=number,
                                   UploadId=self._upload_id, Body=body))
        self._storage.stats.add(bytes_uploaded=len(body))
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def complete(self) -> None:
        storage = self._storage
        if self._upload_id is None:  # small object: one PUT
            body = bytes(memoryview(self._buffer)[:self._filled])

            async def put() -> None:
                s3 = await storage._client()
                await storage.retry.run(f"PUT {self._key}",
                                        lambda: s3.put_object(Bucket=storage.bucket, Key=self._key, Body=body))
                storage.stats.add(bytes_uploaded=len(body))

            self._wait(storage._run(put()))
            return
        if self._filled:
            self._send_part()
        while self._inflight:
            self._parts.append(self._wait(self._inflight.popleft()))

        async def finish() -> None:
            s3 = await storage._client()
            await storage.retry.run(f"complete {self._key}", lambda: s3.complete_multipart_upload(
                Bucket=storage.bucket, Key=self._key, UploadId=self._upload_id,
                MultipartUpload={"Parts": sorted(self._parts, key=lambda p: p["PartNumber"])}))

        self._wait(storage._run(finish()))

    def abort(self) -> None:
        """Cancel parts in flight and abort the multipart upload, so no parts are left billed."""
        for future in self._inflight:
            future.cancel()
        for future in self._inflight:
            with contextlib.suppress(BaseException):
                future.result()
        self._inflight.clear()
        if self._upload_id is None:
            return
        storage = self._storage

        async def abort() -> None:
            s3 = await storage._client()
            await storage.retry.run(f"abort {self._key}", lambda: s3.abort_multipart_upload(
                Bucket=storage.bucket, Key=self._key, UploadId=self._upload_id))

        with contextlib.suppress(Exception):
            storage._run(abort()).result()
