"""What a background staging copy and its CRC-32 cost one core: copied then checksummed, or checksummed in cache.

Every byte a save writes is first copied into staging memory (the snapshot) and checksummed once
(torch's zip records and the manifest). Until 2026-11-28 the helper thread copied each piece with
torch's ``copy_`` and the writer's CRC threads then read the piece again from memory; now the helper
thread checksums each :data:`~async_ckpt.staging.CACHED_PIECE` right after copying it, while it is
still in the core's cache (:func:`~async_ckpt.staging._copy_and_checksum`). On 2 cores that training
keeps busy, each CPU-second of either is taken from training, so this measures the process's CPU
time (every thread's: torch's ``copy_`` may spread over its intra-op threads, ``--threads`` of
them, as many as each bench rank trains with) as well as wall time, the machine otherwise idle:

- ``copy``: torch's ``copy_`` in :data:`~async_ckpt.staging.COPY_PIECE` pieces, nothing checksummed;
- ``copy_then_crc``: that copy, then the CRC-32 of each piece in a pass of its own (the earlier path,
  its CRC-32 on one thread here);
- ``cached_<size>``: :func:`~async_ckpt.staging._copy_and_checksum` with that cached-piece size.

Run: ``python -m async_ckpt.bench.copy_checksum --mb 512 --repeats 5``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable
from unittest import mock

import torch

from async_ckpt import staging
from async_ckpt.checksum import crc32

CACHED_SIZES = (128 * 1024, 512 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    for start in range(0, dst.numel(), staging.COPY_PIECE):
        dst[start:start + staging.COPY_PIECE].copy_(src[start:start + staging.COPY_PIECE])


def _copy_then_crc(dst: torch.Tensor, src: torch.Tensor) -> None:
    memory = memoryview(dst.numpy())
    crc = 0
    for start in range(0, dst.numel(), staging.COPY_PIECE):
        dst[start:start + staging.COPY_PIECE].copy_(src[start:start + staging.COPY_PIECE])
        crc = crc32(memory[start:start + staging.COPY_PIECE], crc)


def _cached(size: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def run(dst: torch.Tensor, src: torch.Tensor) -> None:
        with mock.patch.object(staging, "CACHED_PIECE", size):
            for start in range(0, dst.numel(), staging.COPY_PIECE):
                staging._copy_and_checksum(dst[start:start + staging.COPY_PIECE], src[start:start + staging.COPY_PIECE])
    return run


def measure(mb: int, repeats: int) -> dict:
    """Median CPU and wall seconds of each way over ``repeats`` rounds in which the ways take turns."""
    src = torch.randn(mb * 1024 * 1024 // 4).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the staging memory is touched before, as the pool's reserve is
    ways = {"copy": _copy, "copy_then_crc": _copy_then_crc,
            **{f"cached_{size // 1024}k": _cached(size) for size in CACHED_SIZES}}
    runs: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, run in ways.items():
            cpu, wall = time.process_time(), time.perf_counter()
            run(dst, src)
            runs[way].append((time.process_time() - cpu, time.perf_counter() - wall))
    nbytes = src.numel()
    return {way: {"cpu_s": statistics.median(c for c, _ in r), "wall_s": statistics.median(w for _, w in r),
                  "gbps_per_cpu_s": nbytes / statistics.median(c for c, _ in r) / 1e9} for way, r in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="MiB copied per round (default 512)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2, as a bench rank)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps({"mb": args.mb, "repeats": args.repeats, "threads": args.threads,
                      **measure(args.mb, args.repeats)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
