"""The clone stall of pipeline-parallel saves: DeepSpeed's clone before the snapshot, or the snapshot alone.

For pipeline (``PipelineModule``) layer files and MoE files DeepSpeed clones the state before handing
it to a checkpoint engine that keeps storage sharing (its own Torch engine, and async_ckpt), so that
each file holds just its tensors. async_ckpt's snapshot copies to host memory anyway and, since this
harness was written, stages those tensors compactly in place of the clone
(:func:`async_ckpt.deepspeed_adapter.deferred_clones`). This measures, in one run on the same
engines, the stall of ``save()`` with DeepSpeed's clone kept (the former behaviour), with the clone
deferred to the snapshot (today's), and stock DeepSpeed's synchronous ``save_checkpoint``.

    python -m async_ckpt.bench.clone_stall --ranks 2 --layers 8 --width 2048 --out benchmarks/results/clone_stall.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any


def _pipeline_engine(layers: int, width: int) -> Any:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    blocks = [torch.nn.Linear(width, width) for _ in range(layers)]
    model = PipelineModule(layers=blocks, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine: Any, width: int) -> None:
    import torch

    batch = (torch.randn(2, width), torch.randn(2, width))
    engine.train_batch(data_iter=iter([batch]))


def bench_rank(layers: int, width: int, repeats: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import async_ckpt
    from async_ckpt import checkpointer

    engine = _pipeline_engine(layers, width)
    _step(engine, width)
    stalls: dict[str, list[float]] = {"stock": [], "clone_then_snapshot": [], "snapshot_only": []}
    for i in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        engine.save_checkpoint(os.path.join(root, "stock"), tag=f"s{i}")
        stalls["stock"].append(time.perf_counter() - started)
        _step(engine, width)
    with async_ckpt.wrap(engine, os.path.join(root, "async")) as ckpt:
        for i in range(repeats):
            for mode in ("clone_then_snapshot", "snapshot_only"):
                ckpt.wait()
                dist.barrier()
                deferred = checkpointer.deferred_clones
                if mode == "clone_then_snapshot":
                    checkpointer.deferred_clones = contextlib.nullcontext  # DeepSpeed's own clone runs
                try:
                    handle = ckpt.save(tag=f"{mode}{i}")
                finally:
                    checkpointer.deferred_clones = deferred
                stalls[mode].append(handle.metrics["stall_s"])
                _step(engine, width)
        ckpt.wait()
    return {"rank": dist.get_rank(), "stalls": stalls,
            "layer_file_bytes": sum(os.path.getsize(os.path.join(root, "stock", "s0", f))
                                    for f in os.listdir(os.path.join(root, "stock", "s0")) if f.startswith("layer_"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from async_ckpt.launch import RankGroup

    with tempfile.TemporaryDirectory(prefix="async_ckpt_clone_stall_") as root:
        with RankGroup(args.ranks, daemon=False, env={"DS_ACCELERATOR": "cpu"}) as ranks:
            per_rank = ranks.run(bench_rank, args.layers, args.width, args.repeats, root, timeout_s=3600)
    worst = {mode: statistics.median(max(r["stalls"][mode][i] for r in per_rank) for i in range(args.repeats))
             for mode in per_rank[0]["stalls"]}
    report = {"config": vars(args), "median_stall_s_slowest_rank": worst,
              "layer_file_bytes_rank0": per_rank[0]["layer_file_bytes"], "per_rank": per_rank,
              "ratios": {"snapshot_only_vs_clone_then_snapshot": worst["snapshot_only"] / worst["clone_then_snapshot"],
                         "snapshot_only_vs_stock": worst["snapshot_only"] / worst["stock"]}}
    print(json.dumps({k: report[k] for k in ("median_stall_s_slowest_rank", "layer_file_bytes_rank0", "ratios")},
                     indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
