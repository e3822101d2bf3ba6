"""Rank tasks for the interop tests: pull, export and universal conversion (run on every rank)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import async_ckpt
from async_ckpt import workload
from rank_tasks import STEPS_AFTER, STEPS_BEFORE, _outcome

PROBE_IDS = torch.arange(2, 26).unsqueeze(0)  # one fixed prompt for comparing logits


def train_and_save_everywhere(stage: int, local_root: str, s3_url: str, options: dict, stock_dir: str) -> dict:
    """Train, then save the same step three ways: stock DeepSpeed, async_ckpt to disk, async_ckpt to S3.

    Returns the engine's logits on :data:`PROBE_IDS` at that step (what an export must reproduce).
    """
    tokens = workload.token_stream()
    engine = workload.make_engine(stage, "fp32")
    workload.train(engine, STEPS_BEFORE, tokens, dist.get_rank())
    type(engine).save_checkpoint(engine, stock_dir)
    tags = []
    for url, opts in ((local_root, None), (s3_url, options)):
        with async_ckpt.wrap(engine, url, storage_options=opts, tokenizer=workload.build_tokenizer()) as ckpt:
            tags.append(ckpt.save().result(timeout=300).tag)
    engine.module.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE_IDS).logits.float()
    return {"tags": tags, "logits": logits}


def load_weights_only(source: str, options: dict | None, tag: str, cache_dir: str) -> dict:
    """A new ZeRO-3 job loads ``tag`` without optimizer states, each rank with a cache of its own (as on
    nodes of their own); returns its logits on :data:`PROBE_IDS`."""
    engine = workload.make_engine(3, "fp32", seed=4321)
    with async_ckpt.wrap(engine, source, storage_options=options,
                         cache_dir=os.path.join(cache_dir, f"rank{dist.get_rank()}")) as ckpt:
        ckpt.load(tag=tag, load_optimizer_states=False)
    engine.module.eval()
    with torch.no_grad():
        return {"logits": engine(input_ids=PROBE_IDS).logits.float()}


def load_tag(source: str, tag: str, load_optimizer_states: bool) -> dict:
    """A new ZeRO-3 job loads ``tag`` from ``source``: ``None`` or (error type, message)."""
    engine = workload.make_engine(3, "fp32", seed=4321)
    with async_ckpt.wrap(engine, source) as ckpt:
        return {"load": _outcome(lambda: ckpt.load(tag=tag, load_optimizer_states=load_optimizer_states))}


def resume_universal(stage: int, source: str, options: dict | None, via_async: bool) -> dict:
    """A 1-rank job loads a universal checkpoint (through async_ckpt, or DeepSpeed directly) and trains on."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = workload.make_engine(stage, "fp32", seed=4321, load_universal=True)
    tag = None
    if via_async:
        with async_ckpt.wrap(engine, source, storage_options=options) as ckpt:
            tag, _ = ckpt.load()
    else:
        engine.load_checkpoint(source)
    state = {}
    for name, param in engine.module.named_parameters():
        state[name] = [safe_get_full_fp32_param(param).clone()] + [
            safe_get_full_optimizer_state(param, key).clone() for key in ("exp_avg", "exp_avg_sq")]
    losses = workload.train(engine, STEPS_AFTER, workload.token_stream(), dist.get_rank())
    return {"tag": tag, "state": state, "losses": losses, "step": int(engine.global_steps),
            "world_size": dist.get_world_size()}
