"""CPU time per thread of this process, by Python thread name, from ``/proc``.

A background write slows the training steps it overlaps; on a machine with no idle core that is CPU
time, and these readings say whose: the training thread's, the writer's, its CRC-32 and I/O pools',
or threads Python did not start (PyTorch's intra-op workers, gloo's, CUDA's).
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: The name of threads that Python did not start.
NATIVE = "native"

#: The CPU time of threads that ended in between two readings (``/proc`` no longer lists them: pools
#: started and shut down per file, such as the CRC-32 threads): the process's total minus the rest.
ENDED = "ended threads"


def thread_cpu() -> dict[str, float]:
    """CPU seconds each thread of this process has used so far, by Python thread name (numbers of
    pool threads dropped, so a pool sums up); threads Python did not start count as :data:`NATIVE`.
    Empty where ``/proc`` has no per-thread figures."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("_-") for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return used
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(tid), NATIVE)
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return used


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread name used between two :func:`thread_cpu` readings (those that used any).

    A pool whose threads ended in between can read less than before: its figure is dropped rather than
    counted as negative."""
    return {name: after[name] - before.get(name, 0.0) for name in after if after[name] > before.get(name, 0.0)}


def with_ended(delta: dict[str, float], process_cpu_s: float) -> dict[str, float]:
    """``delta`` plus, under :data:`ENDED`, what the process used (``process_cpu_s``, from ``getrusage``)
    beyond the threads still listed, where that is more than the ticks' rounding (10 ms per thread)."""
    rest = process_cpu_s - sum(delta.values())
    return {**delta, ENDED: rest} if rest > 0.01 * (len(delta) + 1) else dict(delta)


def as_rows(delta: dict[str, Any], scale: float = 1e3) -> list[list[Any]]:
    """``[name, figure * scale]`` rows, most first (milliseconds by default)."""
    return [[name, round(value * scale)] for name, value in sorted(delta.items(), key=lambda kv: -kv[1])]
