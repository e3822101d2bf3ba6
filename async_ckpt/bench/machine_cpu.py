"""The whole machine's CPU time by kind (``/proc/stat``), so that a save's cost outside the training
process is counted, not inferred from step times.

On 2 CPU ranks training keeps every core busy, and a save's write takes CPU the bench's per-process
figures do not see: the kernel's flusher threads writing a page-cache save back (``system``), the other
rank's writer (``user`` and ``system``: the ranks wait for each other in every collective), and on a
virtual machine the hypervisor's disk emulation (``steal``). Step times drift over a run by as much as
such a write costs them, while the machine's CPU rates in ordinary steps hold steady, so a count per
kind says what a save costs where the step times cannot.
"""

from __future__ import annotations

import os
import statistics

STAT = "/proc/stat"

#: the kinds reported, each a sum of ``/proc/stat``'s columns; ``idle`` includes ``iowait`` (a core with
#: nothing to run while a write is in flight), ``system`` the interrupts
KINDS = {"user": ("user", "nice"), "system": ("system", "irq", "softirq"), "steal": ("steal",),
         "idle": ("idle", "iowait")}
_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu(stat: str = STAT) -> dict[str, float] | None:
    """CPU seconds all cores have spent so far in each of :data:`KINDS`; ``None`` where ``/proc/stat``
    is missing or has no ``cpu`` line with those columns."""
    try:
        with open(stat) as fh:
            line = next((row for row in fh if row.startswith("cpu ")), None)
    except OSError:
        return None
    if line is None or len(line.split()) < 1 + len(_COLUMNS):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    columns = dict(zip(_COLUMNS, (int(v) / tick for v in line.split()[1:])))
    return {kind: sum(columns[c] for c in parts) for kind, parts in KINDS.items()}


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Seconds per kind between two :func:`machine_cpu` readings; ``None`` if either is missing."""
    if before is None or after is None:
        return None
    return {kind: after[kind] - before[kind] for kind in after}


def extra_per_save(inside: list[dict], outside: list[dict], saves: int) -> dict[str, float] | None:
    """Per kind, the seconds the ``inside`` steps used beyond what ordinary steps use in the same wall time
    (the median over the ``outside`` steps of their rate per second, times each inside step's duration),
    summed and divided by ``saves``. The median, because a few ordinary steps are not quiet: each method's
    first ones carry its wrap (fresh staging memory) and the deletion of the previous method's checkpoints,
    up to a second of steal, which a mean would spread over every step of the run. Steps carry ``start``,
    ``end`` and ``machine_cpu_s`` (a :func:`delta`); ``None`` without readings on both sides or without a
    save."""
    inside = [s for s in inside if s.get("machine_cpu_s")]
    outside = [s for s in outside if s.get("machine_cpu_s") and s["end"] > s["start"]]
    if not inside or not outside or saves < 1:
        return None
    rates = {kind: statistics.median(s["machine_cpu_s"][kind] / (s["end"] - s["start"]) for s in outside)
             for kind in KINDS}
    return {kind: sum(s["machine_cpu_s"][kind] - rates[kind] * (s["end"] - s["start"]) for s in inside) / saves
            for kind in KINDS}
