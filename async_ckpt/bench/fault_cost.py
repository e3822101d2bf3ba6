"""What first touching fresh memory costs, as the machine's memory in use grows.

The save benchmark saw the training step right after each save run seconds slow on tmpfs, after
stock DeepSpeed's saves as after ours, and not on a disk. A training step on CPU faults in much of
its memory anew (a million page faults per step in the bench's GPT workload), and each save to
tmpfs leaves its bytes resident. This probe takes DeepSpeed and training out: it times the first
touch of a fresh 1 GiB mapping (page faults and zeroing) against a second pass over the same pages
(no faults), while memory in use grows by ``--step-gib`` at a time, held as ``tmpfs`` files in
``--dir`` (``/dev/shm``), as files on a disk (``--dir`` elsewhere: the page cache may drop them),
or as anonymous memory (``--dir anon``). Everything it holds is released at the end.

Run: ``python -m async_ckpt.bench.fault_cost --dir /dev/shm --steps 6`` (and ``--dir anon``,
``--dir /var/tmp``). Figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import time

GIB = 1 << 30
CHUNK = 64 << 20


def touch_s(nbytes: int) -> tuple[float, float]:
    """Seconds to write a fresh anonymous mapping of ``nbytes`` once (faulting it in), then again."""
    block = mmap.mmap(-1, nbytes)
    view = (ctypes.c_char * nbytes).from_buffer(block)
    try:
        started = time.perf_counter()
        ctypes.memset(view, 1, nbytes)
        first = time.perf_counter() - started
        started = time.perf_counter()
        ctypes.memset(view, 2, nbytes)
        return first, time.perf_counter() - started
    finally:
        del view
        block.close()


class _Held:
    """Memory held on purpose: files in a folder, or anonymous mappings (``folder == "anon"``)."""

    def __init__(self, folder: str) -> None:
        self.folder = None if folder == "anon" else tempfile.mkdtemp(prefix="fault_cost_", dir=folder)
        self._maps: list[tuple[mmap.mmap, ctypes.Array]] = []

    def grow(self, nbytes: int) -> float:
        started = time.perf_counter()
        if self.folder is None:
            block = mmap.mmap(-1, nbytes)
            view = (ctypes.c_char * nbytes).from_buffer(block)
            ctypes.memset(view, 1, nbytes)
            self._maps.append((block, view))
        else:
            data = b"\1" * CHUNK
            with open(os.path.join(self.folder, f"held{len(os.listdir(self.folder))}.bin"), "wb") as fh:
                for _ in range(-(-nbytes // CHUNK)):
                    fh.write(data)
        return time.perf_counter() - started

    def release(self) -> None:
        while self._maps:
            block, view = self._maps.pop()
            del view  # the buffer export goes first, or the mapping refuses to close
            block.close()
        if self.folder is not None:
            for name in os.listdir(self.folder):
                os.remove(os.path.join(self.folder, name))
            os.rmdir(self.folder)


def measure(folder: str, steps: int, step_bytes: int, touch_bytes: int = GIB, repeats: int = 3) -> dict:
    """First-touch and rewrite times of ``touch_bytes``, before and after each growth of ``step_bytes``."""
    def touches() -> list[dict]:
        return [dict(zip(("first_s", "again_s"), touch_s(touch_bytes))) for _ in range(repeats)]

    held = _Held(folder)
    rows = [{"held_bytes": 0, "grow_s": 0.0, "touches": touches()}]
    try:
        for step in range(1, steps + 1):
            grow_s = held.grow(step_bytes)
            rows.append({"held_bytes": step * step_bytes, "grow_s": grow_s, "touches": touches()})
    finally:
        held.release()
    rows.append({"held_bytes": 0, "released": True, "touches": touches()})
    return {"folder": folder, "touch_bytes": touch_bytes, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm", help="where the held memory goes: a folder, or 'anon'")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-gib", type=float, default=1.2)
    parser.add_argument("--touch-gib", type=float, default=1.0)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    result = measure(args.dir, args.steps, int(args.step_gib * GIB), int(args.touch_gib * GIB))
    for row in result["rows"]:
        label = "released" if row.get("released") else f"{row['held_bytes'] / GIB:4.1f} GiB held"
        firsts = ", ".join(f"{t['first_s']:.2f}" for t in row["touches"])
        agains = ", ".join(f"{t['again_s']:.3f}" for t in row["touches"])
        print(f"{label}: first touch {firsts} s; again {agains} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
