"""What writing to this machine's disk costs its CPUs, by how the write is issued, while every core is busy.

On a virtual machine the hypervisor's disk emulation can run on the same physical cores as the guest's
vCPUs; the guest sees that as ``steal`` in ``/proc/stat``. The save bench measured about a second of it
per GB that async_ckpt wrote, in the step after each save. This probe takes DeepSpeed out: one busy
loop per core stands in for training, and each mode writes the same bytes while the whole machine's CPU
is counted by kind (:mod:`async_ckpt.bench.machine_cpu`). The modes ask whether a different way of
writing would cost less: ``O_DIRECT`` in 4 MiB requests one at a time (as fast as the disk takes them,
paced to 100 MB/s, or with the fsync 5 s after the writes), in 32 MiB writes from two threads (as
async_ckpt's local writer), from two processes at once (as two ranks), and through the page cache, either
with fsync or left to the kernel's writeback (as stock DeepSpeed's ``torch.save``: written back 30 s later).
Each round runs every mode in turn; each write's deletion is measured apart (on a disk mounted with online
discard it costs steal too), and idle modes (sleeping) give the steal the machine shows anyway.

Run: ``python -m async_ckpt.bench.write_steal --dir /var/tmp --gib 1 --rounds 3``. Figures:
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from async_ckpt.bench import machine_cpu, writeback
from async_ckpt.storage.base import anonymous_memory
from async_ckpt.storage.local import fsync_path

MIB = 1 << 20
GIB = 1 << 30
#: the paced mode's rate, a fifth to a sixth of this VM's disk: does a slower write cost less steal per byte?
PACED_RATE = 100e6
#: how long the fsync-later mode leaves the written bytes to the host before its fsync
FSYNC_LATER_S = 5.0
#: memory the writes read from, reused for every request (on huge pages, like async_ckpt's buffers)
SOURCE_BYTES = 64 * MIB

_SPIN = "while True: pass"
IDLE = "idle (sleep 5 s)"
DELETE = "delete + sync"
_MODULE = "async_ckpt.bench.write_steal"  # run as the writing children, also when this file is __main__


def direct_write(path: str, nbytes: int, request: int, threads: int, rate: float | None = None, *,
                 fsync: bool = True) -> None:
    """Write ``nbytes`` to ``path`` with ``O_DIRECT`` in ``request``-byte positioned writes from ``threads``
    threads, then fsync unless told not to (the file stays: :func:`delete` removes it, measured apart).

    With ``rate`` (bytes per second), a thread sleeps after its write of request ``i`` until
    ``(i + 1) * request / rate`` seconds have passed: the whole file no faster than ``rate``."""
    source = anonymous_memory(SOURCE_BYTES)
    source.write(b"\x01" * SOURCE_BYTES)
    view = memoryview(source)
    per = SOURCE_BYTES // request
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    errors: list[BaseException] = []

    def work(first: int) -> None:
        started = time.monotonic()
        try:
            for i in range(first, nbytes // request, threads):
                os.pwrite(fd, view[(i % per) * request:(i % per + 1) * request], i * request)
                if rate:
                    time.sleep(max(0.0, started + (i + 1) * request / rate - time.monotonic()))
        except BaseException as exc:  # raised below, on the calling thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        source.close()


def fsync_later(path: str, nbytes: int, wait_s: float = FSYNC_LATER_S) -> dict[str, float]:
    """The 4 MiB ``O_DIRECT`` write without its fsync, ``wait_s`` of the busy machine, then the fsync; returns
    each phase's wall time and steal (``write_steal``, ``wait_steal``, ``fsync_steal``...).

    On a virtual disk with a volatile write cache (``/sys/block/*/queue/write_cache`` reads ``write back``)
    an ``O_DIRECT`` write can end in the host's memory, and the fsync sends the cache flush that makes the
    host write it out at once; this mode asks what the flush costs once the host has had time of its own.
    """
    phases: dict[str, float] = {}
    for phase, run in (("write", lambda: direct_write(path, nbytes, 4 * MIB, 1, fsync=False)),
                       ("wait", lambda: time.sleep(wait_s)), ("fsync", lambda: fsync_path(path))):
        used = measure(run)
        phases[f"{phase}_wall_s"], phases[f"{phase}_steal"] = used["wall_s"], used.get("steal", 0.0)
    return phases


def buffered_write(path: str, nbytes: int, *, fsync: bool, drain_cap_s: float = writeback.DRAIN_CAP_S) -> None:
    """Write ``nbytes`` through the page cache; then fsync, or wait until the kernel has written the
    system's dirty bytes back to where they were (at most ``drain_cap_s``). The file stays (:func:`delete`)."""
    level = writeback.dirty_bytes()
    chunk = b"\x01" * (4 * MIB)
    with open(path, "wb") as fh:
        for _ in range(nbytes // len(chunk)):
            fh.write(chunk)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    if not fsync:  # the bench's own drain, with a pause for a training step and no other rank to agree with
        writeback.train_until_written_back(lambda: time.sleep(0.2), level, lambda waiting: waiting, cap_s=drain_cap_s)


def delete(folder: str) -> None:
    """Remove every file in ``folder`` and sync: on a disk mounted with online discard (``-o discard``) the
    device trims the freed blocks at the journal's commit, which on a VM costs the hypervisor CPU too; synced
    here, that cost is measured on its own instead of landing in the next mode's figures."""
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.sync()


def _in_processes(path: str, nbytes: int, request: int, threads: int, processes: int) -> None:
    """:func:`direct_write` of ``nbytes / processes`` each from ``processes`` processes at once (as ranks).
    Their wall time includes each interpreter's start; their steal hardly does."""
    children: list[subprocess.Popen] = []
    try:
        for k in range(processes):
            children.append(subprocess.Popen([sys.executable, "-m", _MODULE, "--child", f"{path}.{k}",
                                              str(nbytes // processes), str(request), str(threads)]))
        codes = [child.wait() for child in children]
    finally:
        for child in children:  # on an error or an interrupt, none is left writing
            if child.poll() is None:
                child.kill()
                child.wait()
    if any(codes):
        raise RuntimeError(f"a writing process failed (exit codes {codes})")


def modes(path: str, nbytes: int) -> dict[str, Callable[[], dict[str, float] | None]]:
    """Each way of writing ``nbytes`` that the probe compares, by name."""
    return {
        IDLE: lambda: time.sleep(5.0),
        "O_DIRECT, 4 MiB requests, 1 thread": lambda: direct_write(path, nbytes, 4 * MIB, 1),
        f"O_DIRECT, 4 MiB requests, 1 thread, paced to {PACED_RATE / 1e6:.0f} MB/s":
            lambda: direct_write(path, nbytes, 4 * MIB, 1, PACED_RATE),
        f"O_DIRECT, 4 MiB requests, 1 thread, fsync {FSYNC_LATER_S:.0f} s later": lambda: fsync_later(path, nbytes),
        "O_DIRECT, 32 MiB writes, 2 threads (async_ckpt)": lambda: direct_write(path, nbytes, 32 * MIB, 2),
        "O_DIRECT, 32 MiB writes, 2 threads, 2 processes (two ranks)": lambda: _in_processes(path, nbytes, 32 * MIB, 2, 2),
        "page cache + fsync": lambda: buffered_write(path, nbytes, fsync=True),
        "page cache, kernel writeback (stock)": lambda: buffered_write(path, nbytes, fsync=False),
    }


def measure(run: Callable[[], dict[str, float] | None]) -> dict[str, float]:
    """Wall seconds of ``run()`` and the machine's CPU seconds by kind over it, with what ``run()`` returns
    (a mode's phases)."""
    before, started = machine_cpu.machine_cpu(), time.monotonic()
    phases = run()
    wall, used = time.monotonic() - started, machine_cpu.delta(before, machine_cpu.machine_cpu())
    return {"wall_s": wall, **(used or {}), **(phases or {})}


def probe(folder: str, nbytes: int, rounds: int, busy: int | None = None) -> dict:
    """Every mode ``rounds`` times, alternating, with ``busy`` spinning processes (default: one per CPU).
    Each write is followed by the deletion of its file, measured as a row of its own. Returns the rows and
    their :func:`summarize`."""
    if machine_cpu.machine_cpu() is None:
        raise SystemExit("write_steal counts the machine's CPU from /proc/stat, which this system does not have")
    busy = (os.cpu_count() or 1) if busy is None else busy
    folder = tempfile.mkdtemp(prefix="write_steal_", dir=folder)
    path = os.path.join(folder, "probe.bin")
    spinners: list[subprocess.Popen] = []
    rows = []
    try:
        spinners += [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(busy)]
        time.sleep(1.0)
        for r in range(rounds):
            for name, run in modes(path, nbytes).items():
                rows.append({"round": r, "mode": name, **measure(run)})
                if name != IDLE:
                    rows.append({"round": r, "mode": f"{name}: {DELETE}", **measure(lambda: delete(folder))})
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        delete(folder)
        os.rmdir(folder)
    return {"bytes": nbytes, "busy_processes": busy, "rows": rows, **summarize(rows, nbytes)}


def summarize(rows: list[dict], nbytes: int) -> dict:
    """Per write mode, and for the deletions over all modes: the median and range of the steal per GiB
    written, as measured and beyond the quietest idle round's rate, and the median wall time.

    The quietest idle round, because a deletion's trims can run on for seconds after its sync, into the
    next round's idle one; the figure as measured bounds the cost from above."""
    rate = min(row["steal"] / row["wall_s"] for row in rows if row["mode"] == IDLE)
    gib = nbytes / GIB
    summary = {}
    names = [name for name in dict.fromkeys(row["mode"] for row in rows) if name != IDLE and not name.endswith(DELETE)]
    for label in [*names, DELETE]:
        chosen = [row for row in rows if (row["mode"].endswith(DELETE) if label == DELETE else row["mode"] == label)]
        if chosen:
            extra = [(row["steal"] - rate * row["wall_s"]) / gib for row in chosen]
            summary[label] = {"steal_s_per_gib": statistics.median(row["steal"] / gib for row in chosen),
                              "extra_steal_s_per_gib": statistics.median(extra),
                              "extra_steal_s_per_gib_range": [min(extra), max(extra)],
                              "wall_s_median": statistics.median(row["wall_s"] for row in chosen)}
            phases = [key[:-len("_steal")] for key in chosen[0] if key.endswith("_steal")]
            if phases:  # as measured: an idle rate over a phase is not subtracted
                summary[label]["phase_steal_s_per_gib"] = {
                    phase: statistics.median(row[f"{phase}_steal"] / gib for row in chosen) for phase in phases}
                summary[label]["phase_wall_s_median"] = {
                    phase: statistics.median(row[f"{phase}_wall_s"] for row in chosen) for phase in phases}
    return {"idle_steal_per_s": rate, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    """The command line; ``--child`` is one writing process of the two-process mode."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        path, nbytes, request, threads = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        direct_write(path, nbytes, request, threads)
        return 0
    parser = argparse.ArgumentParser(prog="python -m async_ckpt.bench.write_steal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder on the disk to measure")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB written per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=None, help="spinning processes (default: one per CPU)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    nbytes = int(args.gib * GIB) // (64 * MIB) * (64 * MIB)
    if nbytes <= 0 or args.rounds < 1:
        raise SystemExit("--gib must be at least 1/16 and --rounds at least 1")
    result = probe(args.dir, nbytes, args.rounds, args.busy)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps({"idle_steal_per_s": result["idle_steal_per_s"], "summary": result["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
