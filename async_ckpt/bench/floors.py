"""Hardware floors for the same bytes: what a copy, a disk and the S3 endpoint can do at best."""

from __future__ import annotations

import io
import math
import mmap
import os
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from async_ckpt.storage.base import anonymous_memory

CHUNK = 16 * 1024 * 1024


def copy_floor_s(nbytes: int, device: torch.device | str = "cpu", repeats: int = 3) -> float:
    """Best time to copy ``nbytes`` from ``device`` into host memory that is already allocated and touched.

    From a GPU the destination is pinned, so this is the device-to-host copy engine's speed.
    """
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(0)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best


#: How the floor writes: buffered with one writer, ``O_DIRECT`` with one and with two requests in
#: flight (async_ckpt's own writer keeps two in flight: with one, a disk that queues requests looks
#: slower than it is, and a writer could persist "above the floor").
WAYS = {"buffered": (False, 1), "direct": (True, 1), "direct x2": (True, 2)}


def local_write_floor(nbytes: int, folder: str, samples: int = 1, train_step: Callable[[], None] | None = None,
                      device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Large sequential writes of ``nbytes`` plus fsync, every rank at once (as during a save): each way
    of :data:`WAYS`, ``samples`` times, the ways taking turns; seconds by way, less the ways the filesystem
    refuses (``O_DIRECT`` on tmpfs), which have no time.

    Why several samples: a write's time on a shared virtual disk varies by ±20 % from one to the next, so a
    single sample (the best of the ways') is a lucky draw that the median save, itself noisy, is held to.
    :func:`typical_and_best` turns the samples into the floor.

    With ``train_step`` (and ``device``, where the process group's tensors live), each write runs on a
    thread of each rank while its training thread keeps stepping. Why: a background save writes while
    training keeps the cores busy, and on a virtual machine even an ``O_DIRECT`` write needs CPU to submit
    and complete each request, so the disk writes slower then than on an idle machine. Persist against
    this floor is what the writer itself costs; the rest of the gap to the idle floor is the disk's own
    loss under a busy CPU, which no writer avoids.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    training = None if train_step is None else (train_step, torch.device(device))
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(samples):
        for way, (direct, streams) in WAYS.items():
            seconds[way].append(_timed_write_s(nbytes, folder, direct=direct, streams=streams, training=training))
    return {way: times for way, times in seconds.items() if all(math.isfinite(t) for t in times)}


def typical_and_best(seconds: dict[str, list[float]]) -> tuple[float, float]:
    """The floor from :func:`local_write_floor`'s samples: the median of the way whose median is lowest
    (what this disk typically does at best, the statistic a save's median time to durable is held to), and
    the fastest sample of all (the luckiest draw)."""
    if not seconds:
        raise ValueError("the write floor has no samples: the filesystem refused every way of writing it")
    typical = min(statistics.median(times) for times in seconds.values())
    return typical, min(min(times) for times in seconds.values())


def _timed_write_s(nbytes: int, folder: str, *, direct: bool, streams: int = 1,
                   training: tuple[Callable[[], None], torch.device] | None = None) -> float:
    """Every rank writes at once; with ``training`` (a training step and the device of the process
    group's tensors), on a thread while every rank trains (:func:`_write_while_training_s`)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"floor-{uuid.uuid4().hex}.bin")
    block = anonymous_memory(CHUNK)  # async_ckpt's own buffers: page-aligned, on huge pages where the kernel has them
    block.write(bytes(bytearray(os.urandom(1024)) * (CHUNK // 1024)))
    dist.barrier()
    try:
        if training is None:
            return _write_s(path, nbytes, block, direct, streams)
        return _write_while_training_s(path, nbytes, block, direct, streams, *training)
    finally:  # a rank whose write failed still meets the others here, then raises
        dist.barrier()
        if os.path.exists(path):
            os.unlink(path)
        block.close()


def _write_while_training_s(path: str, nbytes: int, block: mmap.mmap, direct: bool, streams: int,
                            train_step: Callable[[], None], device: torch.device) -> float:
    """:func:`_write_s` on a thread while this rank trains, until no rank's write is still running: the
    ranks agree on that after each step, as their steps are collective and must be as many on each."""
    outcome: list[float | BaseException] = []

    def write() -> None:
        try:
            outcome.append(_write_s(path, nbytes, block, direct, streams))
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread below
            outcome.append(exc)

    writer = threading.Thread(target=write, name="floor-write")
    writer.start()
    try:
        running = torch.ones(1, device=device)
        while running.item():
            train_step()
            running.fill_(float(writer.is_alive()))
            dist.all_reduce(running, op=dist.ReduceOp.MAX)
    finally:
        writer.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _write_s(path: str, nbytes: int, block: mmap.mmap, direct: bool, streams: int = 1) -> float:
    """Seconds to write ``nbytes`` from ``block`` to a new file and fsync it, with ``streams`` threads
    each writing its own consecutive chunks (so that many requests are in flight); infinite where this
    filesystem refuses ``O_DIRECT``."""
    started = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    except OSError:
        return float("inf")
    total = -(-nbytes // 4096) * 4096
    offsets = iter(range(0, total, CHUNK))
    take = threading.Lock()

    def write() -> None:
        with memoryview(block) as view:
            while True:
                with take:
                    offset = next(offsets, None)
                if offset is None:
                    return
                done, size = 0, min(CHUNK, total - offset)
                while done < size:
                    done += os.pwrite(fd, view[done:size], offset + done)

    try:
        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="floor-write") as pool:
            for writer in [pool.submit(write) for _ in range(streams)]:
                writer.result()  # the first failure, raised here
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def s3_upload_floor_s(nbytes: int, url: str, storage_options: dict, concurrency: int = 8) -> float:
    """boto3 TransferManager (``upload_fileobj``) of ``nbytes``, every rank at once."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    bucket, _, prefix = url[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=storage_options.get("endpoint_url"))
    payload = bytes(bytearray(os.urandom(1024)) * (nbytes // 1024))
    config = TransferConfig(multipart_chunksize=CHUNK, multipart_threshold=CHUNK, max_concurrency=concurrency)
    key = f"{prefix}/floor/{uuid.uuid4().hex}.bin".lstrip("/")
    dist.barrier()
    started = time.perf_counter()
    client.upload_fileobj(io.BytesIO(payload), bucket, key, Config=config)
    elapsed = time.perf_counter() - started
    client.delete_object(Bucket=bucket, Key=key)
    return elapsed
