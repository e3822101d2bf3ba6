"""Consolidated saves: how long each way of writing the whole gathered model blocks training.

One 2-rank ZeRO-3 run on one engine times, save by save: DeepSpeed's own ``save_16bit_model``
(before wrap, synchronous), ``save_16bit_model`` after ``async_ckpt.wrap`` and
``save_consolidated`` (safetensors folder). The stall is the time the call blocks (the slowest
rank: the gather is a collective); time to durable runs until the files are fsync'd and
committed (for the stock save: its return plus an fsync of the file, which DeepSpeed does not do).
The first save of each method is reported apart: it allocates the staging buffers.

    python -m async_ckpt.bench.consolidated [--size bench] [--repeats 3] [--out benchmarks/results/consolidated.json]

Figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

from async_ckpt.workload import SIZES

METHODS = ("stock_save_16bit_model", "async_save_16bit_model", "save_consolidated")
#: Per save: the stall, the time to durable, and (async saves) the stall's parts: DeepSpeed's gather, the snapshot.
TIMES = ("stall_s", "durable_s", "gather_s", "snapshot_s")


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch", "async_ckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


def bench_rank(size: str, repeats: int, root: str) -> dict[str, Any]:
    """Runs on every rank: train, then save the whole model ``repeats`` times with each method."""
    _quiet()
    import deepspeed
    import torch.distributed as dist

    import async_ckpt
    from async_ckpt import workload
    from async_ckpt.layout import MANIFEST
    from async_ckpt.manifest import Manifest
    from async_ckpt.storage.local import fsync_path

    rank = dist.get_rank()
    config = workload.ds_config(3, "fp32")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    model = workload.build_model(size)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = workload.token_stream()
    workload.train(engine, 1, tokens, rank)
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in TIMES} for m in METHODS}
    sizes: dict[str, int] = {}

    def start() -> float:
        dist.barrier()
        return time.perf_counter()

    def record(method: str, started: float, returned: float, folder: str) -> None:
        """``returned``: when the call gave training back; now: the save is durable."""
        times[method]["stall_s"].append(returned - started)
        times[method]["durable_s"].append(time.perf_counter() - started)
        dist.barrier()
        if rank == 0:
            sizes[method] = _folder_bytes(folder)
            manifest = os.path.join(folder, MANIFEST)
            if os.path.exists(manifest):  # an async save: the parts of its stall, as its manifest records them
                with open(manifest, "rb") as fh:
                    timings = Manifest.from_json(fh.read()).timings
                for key in ("gather_s", "snapshot_s"):
                    times[method][key].append(timings[key])
        workload.train(engine, 1, tokens, rank)  # as between saves in training

    for i in range(repeats):
        folder = os.path.join(root, "stock", f"r{i}")
        started = start()
        type(engine).save_16bit_model(engine, folder)
        returned = time.perf_counter()
        if rank == 0:  # DeepSpeed does not fsync; durable needs it
            fsync_path(os.path.join(folder, "pytorch_model.bin"))
        record("stock_save_16bit_model", started, returned, folder)
    with async_ckpt.wrap(engine, os.path.join(root, "async")) as ckpt:
        for i in range(repeats):
            folder = os.path.join(root, "async", f"bin{i}")
            started = start()
            engine.save_16bit_model(folder)
            returned = time.perf_counter()
            ckpt.wait()
            record("async_save_16bit_model", started, returned, folder)
            started = start()
            handle = ckpt.save_consolidated(tag=f"hf{i}")
            returned = time.perf_counter()
            handle.result()
            record("save_consolidated", started, returned, os.path.join(root, "async", f"hf{i}"))
    return {"rank": rank, "times": times, "bytes": sizes}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the slowest rank's figure per save; the first save and the median of the others."""
    summary: dict[str, Any] = {}
    for method in METHODS:
        entry: dict[str, Any] = {"bytes": per_rank[0]["bytes"].get(method)}
        for metric in ("stall_s", "durable_s"):
            worst = [max(r["times"][method][metric][i] for r in per_rank)
                     for i in range(len(per_rank[0]["times"][method][metric]))]
            entry[f"first_{metric}"] = round(worst[0], 3)
            entry[f"median_{metric}"] = round(statistics.median(worst[1:] or worst), 3)
        if method != "stock_save_16bit_model":
            for part in ("gather_s", "snapshot_s"):  # rank 0's, which gathers and snapshots
                values = per_rank[0]["times"][method][part]
                entry[f"median_{part}_rank0"] = round(statistics.median(values[1:] or values), 3)
        summary[method] = entry
    stock = summary["stock_save_16bit_model"]["median_stall_s"]
    for method in METHODS[1:]:
        summary[method]["stall_vs_stock"] = round(summary[method]["median_stall_s"] / stock, 3) if stock else None
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [("| method | stall (median) | of which gather / snapshot (rank 0) | stall (first save) | "
              "time to durable (median) | stall vs stock | MB written |"),
             "|---|---|---|---|---|---|---|"]
    for method, m in summary.items():
        ratio = m.get("stall_vs_stock")
        parts = (f"{m['median_gather_s_rank0']:.2f} s / {m['median_snapshot_s_rank0']:.2f} s"
                 if "median_gather_s_rank0" in m else "-")
        lines.append(f"| {method} | {m['median_stall_s']:.2f} s | {parts} | {m['first_stall_s']:.2f} s | "
                     f"{m['median_durable_s']:.2f} s | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                     f"{(m['bytes'] or 0) / 1e6:.0f} |")
    return "\n".join(lines)


def run(size: str, repeats: int, out: str, workdir: str | None = None) -> dict[str, Any]:
    import deepspeed
    import torch

    from async_ckpt.launch import RankGroup

    started = time.time()
    with (tempfile.TemporaryDirectory(prefix="async_ckpt_consolidated_", dir=workdir) as root,
          RankGroup(2, env={"DS_ACCELERATOR": "cpu"}) as ranks):
        per_rank = ranks.run(bench_rank, size, repeats, root, timeout_s=3600)
    summary = summarize(per_rank)
    report = {"config": {"stage": 3, "dtype": "fp32", "ranks": 2, "size": size, "layers_embd_heads_seq": SIZES[size],
                         "repeats": repeats},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "deepspeed": deepspeed.__version__},
              "wall_s": round(time.time() - started, 1), "summary": summary, "ranks": per_rank}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(table(summary))
    print(f"\nraw figures: {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_ckpt.bench.consolidated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="bench", help="workload model size (default bench)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per method (default 3)")
    parser.add_argument("--out", default="benchmarks/results/consolidated.json")
    parser.add_argument("--workdir", default=None, help="folder for the saves (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    run(args.size, args.repeats, args.out, args.workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
