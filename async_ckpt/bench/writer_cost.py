"""What one file costs the writer: wall time and CPU time of writing a staged optimizer-sized state.

The save benchmark measures the writer inside training, where two ranks and the training threads
share the cores; this one isolates the writer: one process, no training, the same staged state
written again and again to a local folder, alternating the two ways the writer can take:

- ``copying``: every record copied into the ``O_DIRECT`` bounce buffers (the writer before staging
  memory was lent to storage; what every byte costs where nothing is lent, as on S3), each
  checksummed once as it streams;
- ``lending``: large records written straight from the staging buffers (placed by the previous
  write, and written ahead), checksummed on the CRC threads as in a save whose copy ran in the save
  call (a copy in the background checksums as it copies: :mod:`async_ckpt.bench.copy_checksum`);
- ``in_place``: the state itself, not a staged copy, lent as a synchronous save lends it
  (:func:`~async_ckpt.serialization.in_place`);
- ``torch_save``: stock DeepSpeed's write, ``torch.save`` of the state to a file in the same folder
  (no fsync, as DeepSpeed's Torch engine does not fsync either).

CPU time is what a busy training machine pays; wall time is what a quiet one waits.
Run: ``python -m async_ckpt.bench.writer_cost --mb 600 --repeats 5 --dir /path/on/the/disk``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import torch

from async_ckpt.serialization import Lending, in_place, write_torch_file
from async_ckpt.staging import StagingPool
from async_ckpt.storage.local import LocalStorage


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(mb: int, repeats: int, folder: str) -> dict:
    """Median wall and CPU seconds per write, each way, over ``repeats`` alternating writes."""
    state = {"fp32_flat": torch.randn(mb * 1024 * 1024 // 4), "step": 7}
    pool, storage = StagingPool(), LocalStorage(folder)
    staged = pool.snapshot(state, "tag/optim.pt", slot_key="optim.pt", defer=False)
    lending = Lending(staged.regions, staged.placements)
    write_torch_file(storage, "tag/optim.pt", staged.obj, tag_dir="tag", rank=0, lending=lending)  # places
    staged = pool.snapshot(state, "tag/optim.pt", slot_key="optim.pt", defer=False)
    live = in_place(state, "tag/optim.pt")
    assert live is not None  # host tensors
    runs: dict[str, list[tuple[float, float]]] = {"copying": [], "lending": [], "in_place": [], "torch_save": []}
    for _ in range(repeats):
        for way in runs:
            cpu, wall = _cpu_s(), time.perf_counter()
            if way == "torch_save":
                torch.save(state, os.path.join(folder, "stock.pt"))
            else:
                source = live if way == "in_place" else staged
                lending = None if way == "copying" else Lending(source.regions, source.placements)
                write_torch_file(storage, "tag/optim.pt", source.obj, tag_dir="tag", rank=0, lending=lending)
            runs[way].append((time.perf_counter() - wall, _cpu_s() - cpu))
    return {way: {"wall_s": statistics.median(w for w, _ in r), "cpu_s": statistics.median(c for _, c in r),
                  "gbps": mb * 1024 * 1024 / statistics.median(w for w, _ in r) / 1e9} for way, r in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600, help="MiB of tensor data in the file (default 600)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        result = measure(args.mb, args.repeats, folder)
    print(json.dumps({"mb": args.mb, "repeats": args.repeats, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
