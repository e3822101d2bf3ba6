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
    """The system's ``Dirty`` plus ``Writeback`` bytes; ``None`` where ``/proc/meminfo`` is missing or
    lists neither. System-wide: another process's writes count too (the bench wants a quiet machine)."""
    try:
        with open(meminfo) as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return None
    present = [key for key in ("Dirty", "Writeback") if key in fields]
    return sum(int(fields[key].split()[0]) * 1024 for key in present) if present else None


def train_until_written_back(step: Callable[[], None], level: int | None, agree: Callable[[bool], bool],
                             dirty: Callable[[], int | None] = dirty_bytes, cap_s: float = DRAIN_CAP_S) -> bool | None:
    """Run ``step`` until the dirty bytes are back within :data:`SLACK_BYTES` of ``level`` or ``cap_s``
    has passed; return whether they got back (``None``: not measured, no level or no reading).
    ``agree(still_dirty)`` must return the same answer on every rank (any rank still waiting keeps them
    all training), since each step runs collectives."""
    started = time.monotonic()
    while True:
        now = dirty()
        waiting = (level is not None and now is not None and now > level + SLACK_BYTES
                   and time.monotonic() - started < cap_s)
        if not agree(waiting):
            return None if level is None or now is None else now <= level + SLACK_BYTES
        step()


def windows(steps: list[dict], method: str, saves: list[dict]) -> list[tuple[float, float]] | None:
    """The windows in which ``method``'s page-cache bytes were waiting for the kernel: per save, from its
    call's return to the end of the first of the method's steps at which the dirty bytes were back within
    :data:`SLACK_BYTES` of their level before the method's *first* save (or to the method's last step of
    that round, where they never were; with ``--rounds`` steps and saves carry their round). A save whose
    bytes were above that level neither when its call returned nor at the end of the next step (one
    written with ``O_DIRECT``, or fsynced in time) has no window.

    One level for all saves, because the counter is system-wide: a save that starts while an earlier
    one's bytes are still dirty can return with fewer dirty bytes than before it (older ones written
    back meanwhile) and still have left its own. So saves closer together than the kernel's expiry get
    windows that run on to the drain after the last save, and only their union means something.
    ``None`` where the method recorded no dirty bytes (not measured). ``steps`` carry ``dirty_bytes``."""
    own = [s for s in steps if s["method"] == method and s.get("dirty_bytes") is not None]
    measured = [save for save in saves if save.get("dirty_before") is not None and save.get("dirty_after") is not None]
    if not own or not measured:
        return None
    level = measured[0]["dirty_before"] + SLACK_BYTES
    spans = []
    for save in measured:
        returned = save["start"] + save["call_s"]
        later = [s for s in own if s["start"] >= returned  # steps of runs from before rounds carry none
                 and s.get("round", save.get("round", 0)) == save.get("round", 0)]
        dirty_from = 0 if save["dirty_after"] > level else 1  # the first reading above the level
        if not later or (dirty_from and later[0]["dirty_bytes"] <= level):
            continue
        clean = next((s for s in later[dirty_from:] if s["dirty_bytes"] <= level), later[-1])
        spans.append((returned, clean["end"]))
    return spans


def union_s(spans: list[tuple[float, float]]) -> float:
    """The seconds that at least one of ``spans`` covers."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
