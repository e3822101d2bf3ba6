"""The commit handshake at scale: N ranks as threads, one storage, one c10d store.

Each rank writes one small file, then runs the real commit (:func:`async_ckpt.commit.commit`) with
its own client of a TCPStore served in this process, as the ranks of a job do with the job's store.
No model is involved: this measures only what the commit costs and how it grows with the world
size. Per save it reports the storage requests each rank made for the commit (rank 0 and the
others apart), the store requests, and the commit latency: from the moment the last rank's files
were durable to the moment every rank knew the outcome.

    python -m async_ckpt.bench.commit_scale --ranks 64 256 --target local s3 --saves 3

``--target s3`` starts moto on 127.0.0.1. Figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from async_ckpt import commit
from async_ckpt.handle import SaveHandle
from async_ckpt.handshake import Handshake, Outcome
from async_ckpt.job import SaveJob
from async_ckpt.manifest import FileEntry
from async_ckpt.checksum import crc32, format_crc
from async_ckpt.staging import CopyTicket
from async_ckpt.storage.base import Storage

#: Storage methods that each cost at least one request to the store behind them.
REQUESTS = ("read_bytes", "write_bytes", "exists", "size", "list_dir", "delete", "is_dir", "iter_files",
            "modified", "open_write", "open_read", "get_file")


class CountingStorage:
    """One rank's view of a storage that counts the requests this rank makes through it."""

    def __init__(self, inner: Storage, before: Callable[[str, tuple], None] | None = None) -> None:
        self._inner = inner
        self._before = before
        self.requests: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in REQUESTS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests[name] += 1
            if self._before is not None:
                self._before(name, args)
            return attr(*args, **kwargs)
        return counted


@dataclass
class RankRun:
    rank: int
    outcome: Outcome | None = None
    error: BaseException | None = None
    reported: float = 0.0
    learned: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)


def run_save(storage_for: Callable[[int], CountingStorage], stores: list[Any], tag: str, *,
             timeout_s: float = 60.0, keep_last: int | None = None, write_delay: Callable[[int], float] = lambda r: 0.0,
             ) -> list[RankRun]:
    """One save by ``len(stores)`` thread ranks: each writes ``{tag}/rank{r}.bin`` and commits."""
    world_size = len(stores)
    save_id = uuid.uuid4().hex
    runs = [RankRun(r) for r in range(world_size)]

    def rank_main(run: RankRun) -> None:
        storage = storage_for(run.rank)
        job = SaveJob(tag=tag, save_id=save_id, storage=storage, rank=run.rank, world_size=world_size, files=[],
                      ticket=CopyTicket([]), handle=SaveHandle(tag=tag, url=storage.url),
                      handshake=Handshake(stores[run.rank], save_id, run.rank, world_size), save_latest=True,
                      keep_last=keep_last, keep_every=None, metadata={"step": int(time.time())})
        try:
            payload = f"rank {run.rank} of {tag}".encode()
            time.sleep(write_delay(run.rank))
            storage.write_bytes(f"{tag}/rank{run.rank}.bin", payload)
            entry = FileEntry(path=f"rank{run.rank}.bin", size=len(payload), crc32=format_crc(crc32(payload)),
                              rank=run.rank)
            storage.requests.clear()  # from here on: what the commit costs
            run.reported = time.perf_counter()
            run.outcome = commit.commit(job, [entry], timeout_s)
            run.learned = time.perf_counter()
            job.handshake.acknowledge()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            run.error = exc
        run.requests = dict(storage.requests)

    threads = [threading.Thread(target=rank_main, args=(run,), name=f"rank{run.rank}") for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def tcp_stores(world_size: int) -> tuple[Any, list[Any]]:
    """A TCPStore server and one client of its own per rank (as ``Store.clone()`` gives each writer)."""
    server = dist.TCPStore("127.0.0.1", 0, world_size, True, datetime.timedelta(seconds=120),
                           wait_for_workers=False)
    return server, [server.clone() for _ in range(world_size)]


def summarize(world_size: int, runs: list[RankRun]) -> dict:
    errors = [f"rank {r.rank}: {r.error!r}" for r in runs if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rank(s) failed: {errors[:3]}")
    peers = [sum(r.requests.values()) for r in runs[1:]]
    return {
        "world_size": world_size,
        "committed": all(r.outcome and r.outcome.committed for r in runs),
        "rank0_requests": dict(runs[0].requests),
        "rank0_requests_total": sum(runs[0].requests.values()),
        "peer_requests_max": max(peers) if peers else 0,
        "peer_requests_mean": statistics.mean(peers) if peers else 0,
        "commit_latency_s": max(r.learned for r in runs) - max(r.reported for r in runs),
    }


def measure(target: str, world_size: int, saves: int, url: str, options: dict) -> list[dict]:
    from async_ckpt.storage import open_storage

    server, stores = tcp_stores(world_size)
    shared = open_storage(url, options)
    rows = []
    try:
        for i in range(saves):
            runs = run_save(lambda rank: CountingStorage(shared), stores, f"save{i}", keep_last=2)
            rows.append({"target": target, "save": i, **summarize(world_size, runs)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shared.close()
        del server
    return rows


def open_storage_root(url: str, options: dict) -> None:
    """Create the bucket of an S3 URL."""
    import s3fs

    s3fs.S3FileSystem(**options).mkdir(url.split("://", 1)[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m async_ckpt.bench.commit_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--target", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="async_ckpt_commit_scale_") as tmp, contextlib.ExitStack() as stack:
        for target in args.target:
            options: dict = {}
            if target == "s3":
                from async_ckpt.bench.s3_transfer import server_process

                endpoint = stack.enter_context(server_process("moto"))
                options = {"endpoint_url": endpoint, "key": "x", "secret": "x"}
                open_storage_root("s3://commit-scale", options)
            for world_size in args.ranks:
                url = f"{tmp}/{target}-{world_size}" if target == "local" else f"s3://commit-scale/w{world_size}"
                rows += measure(target, world_size, args.saves, url, options)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
