"""Rank tasks for the CUDA tests: one DeepSpeed rank on one GPU (NCCL), importable by name."""

from __future__ import annotations


import async_ckpt
from async_ckpt import workload
from rank_tasks import CLIENT_STATE, STEPS_AFTER, STEPS_BEFORE


def save_overlapped_on_gpu(stage: int, dtype: str, root: str) -> dict:
    """Save a stock reference, then the same step with async_ckpt's overlapped copy, training on at once.

    The optimizer partitions are still being copied on the side stream when ``save()`` returns;
    the next ``step()`` must wait for that copy before it changes them, so the files hold the
    values at save time. Two more saves then reuse the pinned buffers of the first.
    """
    tokens = workload.token_stream()
    engine = workload.make_engine(stage, dtype)
    workload.train(engine, STEPS_BEFORE, tokens, 0)
    type(engine).save_checkpoint(engine, f"{root}/stock", client_state=dict(CLIENT_STATE))
    with async_ckpt.wrap(engine, f"{root}/async", overlap_copy=True) as ckpt:
        handle = ckpt.save(client_state=dict(CLIENT_STATE))
        losses = workload.train(engine, STEPS_AFTER, tokens, 0)
        first = handle.result(timeout=120)
        allocations, staging_bytes = ckpt.staging_allocations, ckpt.staging_bytes
        for i in range(2):
            workload.train(engine, 1, tokens, 0)
            ckpt.save(tag=f"again{i}").result(timeout=120)
        return {"tag": first.tag, "losses_after": losses, "device": str(engine.device),
                "allocations": [allocations, ckpt.staging_allocations],
                "staging_bytes": [staging_bytes, ckpt.staging_bytes],
                "step_wait_s": handle.metrics.get("step_wait_s"), "stall_s": handle.metrics["stall_s"]}


def resume_on_gpu(stage: int, dtype: str, root: str, tag: str, use_async: bool) -> dict:
    """A fresh engine (different init) on the GPU restores ``tag`` and trains on."""
    engine = workload.make_engine(stage, dtype, seed=1234)
    if use_async:
        with async_ckpt.wrap(engine, root) as ckpt:
            _, client_state = ckpt.load(tag)
    else:
        _, client_state = engine.load_checkpoint(root, tag)
    losses = workload.train(engine, STEPS_AFTER, workload.token_stream(), 0)
    return {"losses": losses, "client_state": {k: client_state[k] for k in CLIENT_STATE if k in client_state},
            "on_gpu": all(p.is_cuda for p in engine.module.parameters())}
