"""The operating system's deferred writeback, measured so that a save that leaves it behind pays for it.

Stock DeepSpeed's ``torch.save`` returns once its bytes are in the page cache; the kernel writes them
to disk later (after ``vm.dirty_expire_centisecs``, 30 s by default), on the same cores and, on a
virtual machine, with the same hypervisor's CPU time that training uses. async_ckpt writes with
``O_DIRECT`` and ``fsync`` before a save counts as durable, so its whole write falls inside its own
window and every step it slows is charged to it. Without this module a page-cache save's writeback
would land on later steps that the bench counts as ordinary (raising the baseline for every method),
or on the next method's steps, or nowhere at all once the method's checkpoints are deleted.

Here: the system's dirty and under-writeback bytes (``/proc/meminfo``), training on after a method's
last save until they are back to where they were before its first save, and the windows from each
save until its bytes are written back, which :mod:`async_ckpt.bench.report` charges to that method.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MEMINFO = "/proc/meminfo"

#: dirty bytes above the level before a save that still count as written back: the page cache's own
#: traffic (logs, the other ranks' small files) on a machine where nothing else writes
SLACK_BYTES = 128 * 1024 * 1024

#: the longest a method trains on waiting for its writeback (the kernel's default expiry is 30 s, and
#: a slow disk needs seconds per GB on top)
DRAIN_CAP_S = 90.0


def dirty_bytes(meminfo: str = MEMINFO) -> int | None:
    """The system's ``Dirty`` plus ``Writeback`` bytes; ``None`` where ``/proc/meminfo`` is missing."""
    try:
        with open(meminfo) as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return None
    return sum(int(fields[key].split()[0]) * 1024 for key in ("Dirty", "Writeback") if key in fields)


def train_until_written_back(step: Callable[[], None], level: int | None, agree: Callable[[bool], bool],
                             dirty: Callable[[], int | None] = dirty_bytes, cap_s: float = DRAIN_CAP_S) -> bool:
    """Run ``step`` until the dirty bytes are back within :data:`SLACK_BYTES` of ``level`` or ``cap_s``
    has passed; return whether they got back. ``agree(still_dirty)`` must return the same answer on
    every rank (any rank still waiting keeps them all training), since each step runs collectives."""
    started = time.monotonic()
    while True:
        now = dirty()
        waiting = (level is not None and now is not None and now > level + SLACK_BYTES
                   and time.monotonic() - started < cap_s)
        if not agree(waiting):
            return level is None or now is None or now <= level + SLACK_BYTES
        step()


def windows(steps: list[dict], method: str, saves: list[dict]) -> tuple[list[tuple[float, float]], list[float]]:
    """Per save of ``method`` that recorded the dirty bytes before and after its call: the window from
    the call's return to the end of the first of the method's steps at which the dirty bytes were back
    within :data:`SLACK_BYTES` of the level before (or to the method's last step, where they never
    were), and its length in seconds. A save whose bytes were above that level neither when its call
    returned nor at the end of the next step (one written with ``O_DIRECT``, or fsynced in time) has
    no window, and 0 s. ``steps`` carry ``dirty_bytes`` at their end."""
    own = [s for s in steps if s["method"] == method and s.get("dirty_bytes") is not None]
    spans, seconds = [], []
    for save in saves:
        if save.get("dirty_before") is None or save.get("dirty_after") is None:
            continue
        level = save["dirty_before"] + SLACK_BYTES
        returned = save["start"] + save["call_s"]
        later = [s for s in own if s["start"] >= returned]
        if save["dirty_after"] <= level and (not later or later[0]["dirty_bytes"] <= level):
            seconds.append(0.0)
            continue
        if not later:
            continue
        dirty_from = 0 if save["dirty_after"] > level else 1
        clean = next((s for s in later[dirty_from:] if s["dirty_bytes"] <= level), later[-1])
        spans.append((returned, clean["end"]))
        seconds.append(clean["end"] - returned)
    return spans, seconds
