"""Each method's peak memory during its turn, side by side with stock's.

A sample after each step misses what a save holds only for a moment (torch.save's pickling, a
snapshot's buffers before the copy). The kernel keeps the high-water mark of the resident set
(``VmHWM``), and writing ``5`` to ``/proc/self/clear_refs`` resets it to the current size (Linux ≥
4.0): reset at a turn's start, read at its end, it is the turn's true peak. On a GPU, PyTorch's
caching allocator keeps its own peak, reset the same way.
"""

from __future__ import annotations

import re

import torch

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int | None:
    try:
        with open(STATUS) as fh:
            found = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def start(device: torch.device) -> dict[str, int | None]:
    """Reset the peaks; this process's resident set and the device's allocated bytes now."""
    try:
        with open(CLEAR_REFS, "w") as fh:
            fh.write("5")
        resettable = True
    except OSError:  # not Linux, or a kernel without it: no peak for this turn
        resettable = False
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    return {"rss": _status_kib("VmRSS") if resettable else None,
            "gpu": torch.cuda.memory_allocated(device) if gpu else None}


def peak_above(started: dict[str, int | None], device: torch.device) -> dict[str, int | None]:
    """How far above the turn's start the resident set and the device's allocated bytes peaked."""
    hwm = _status_kib("VmHWM")
    gpu = started["gpu"]
    return {"rss": hwm - started["rss"] if started["rss"] is not None and hwm is not None else None,
            "gpu": torch.cuda.max_memory_allocated(device) - gpu if gpu is not None else None}
