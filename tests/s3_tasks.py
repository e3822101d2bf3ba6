"""Rank tasks for the object-storage tests (run on every rank of a RankGroup)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict

import torch.distributed as dist

import async_ckpt
from async_ckpt import workload
from rank_tasks import STEPS_AFTER, STEPS_BEFORE, _outcome, async_ckpt_log
from s3_server import set_faults


def save_to_bucket(stage: int, url: str, options: dict, stock_dir: str) -> dict:
    tokens = workload.token_stream()
    engine = workload.make_engine(stage, "fp32")
    workload.train(engine, STEPS_BEFORE, tokens, dist.get_rank())
    type(engine).save_checkpoint(engine, stock_dir)
    with async_ckpt.wrap(engine, url, storage_options=options, tokenizer=workload.build_tokenizer()) as ckpt:
        handle = ckpt.save()
        losses = workload.train(engine, STEPS_AFTER, tokens, dist.get_rank())
        result = handle.result(timeout=300)
    return {"tag": result.tag, "losses_after": losses, "upload_buffer_peak_bytes": handle.metrics["upload_buffer_peak_bytes"],
            "upload_buffer_bound": (ckpt.config.max_concurrency + 1) * ckpt.config.part_size}


def default_and_synchronous_saves_to_bucket(url: str, options: dict) -> dict:
    """The same step saved to ``url/staged`` with the defaults and to ``url/in_place`` with synchronous=True."""
    engine = workload.make_engine(3, "fp32")
    workload.train(engine, 1, workload.token_stream(), dist.get_rank())
    with async_ckpt.wrap(engine, f"{url}/staged", storage_options=options) as ckpt:
        ckpt.save(tag="t").result(timeout=300)
    with async_ckpt.wrap(engine, f"{url}/in_place", storage_options=options, synchronous=True) as ckpt:
        handle = ckpt.save(tag="t")
    return {"in_place_bytes": handle.metrics["in_place_bytes"]}


def _async_ckpt_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("async_ckpt"))


def resume_from_bucket(stage: int, url: str, options: dict, cache_base: str) -> dict:
    """A new job with its own (empty) cache per rank, as on separate machines sharing only the bucket."""
    rank = dist.get_rank()
    cache_dir = os.path.join(cache_base, f"rank{rank}")
    engine = workload.make_engine(stage, "fp32", seed=4321)
    out: dict = {}
    with async_ckpt.wrap(engine, url, storage_options=options, cache_dir=cache_dir) as ckpt:
        tag, _ = ckpt.load()
        out["first"] = asdict(ckpt.last_fetch)
        out["bytes_read"] = ckpt.storage.stats.bytes_downloaded
        out["losses"] = workload.train(engine, STEPS_AFTER, workload.token_stream(), rank)
        ckpt.load()
        out["second"] = asdict(ckpt.last_fetch)
        own = next(p for p in out["first"]["files"] if f"zero_pp_rank_{rank}_" in p and "optim" in p)
        cached = [os.path.join(r, n) for r, _, names in os.walk(cache_dir) for n in names if n == os.path.basename(own)]
        with open(cached[0], "r+b") as fh:  # flip one byte of the cached shard
            fh.seek(100)
            byte = fh.read(1)
            fh.seek(100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        ckpt.load()
        out["after_corruption"] = asdict(ckpt.last_fetch)
    out["tag"] = tag
    return out


def save_through_fault_proxy(url: str, options: dict, proxy: str) -> dict:
    """Transient 503s are retried; a permanent failure aborts the upload and keeps 'latest'."""
    engine = workload.make_engine(2, "fp32", size="small")
    workload.train(engine, 1, workload.token_stream(), dist.get_rank())
    out: dict = {}
    ckpt = async_ckpt.wrap(engine, url, storage_options=options, part_size=5 * 1024 * 1024,
                           retry_attempts=4, retry_base_delay_s=0.01)
    if dist.get_rank() == 0:
        set_faults(proxy, 3)
    dist.barrier()
    out["transient"] = _outcome(lambda: ckpt.save(tag="good").result(timeout=300))
    dist.barrier()
    if dist.get_rank() == 0:
        out["injected_while_transient"] = set_faults(proxy, -1)
    dist.barrier()
    error = ckpt.save(tag="bad").exception(timeout=300)
    out["permanent"] = (type(error).__name__, str(error)) if error else None
    dist.barrier()
    if dist.get_rank() == 0:
        set_faults(proxy, 0)
    out["latest"] = ckpt.storage.read_bytes("latest").decode()
    out["threads_open"] = _async_ckpt_threads()
    ckpt.close()
    out["threads_closed"] = _async_ckpt_threads()
    return out


def save_into_new_folders(url: str, options: dict, saves: int) -> dict:
    """``engine.save_checkpoint`` into a new ``checkpoint-N`` folder each time, as Hugging Face Trainer
    saves: the upload threads open after each save (shards of several 5 MiB parts, so each upload runs
    on them)."""
    engine = workload.make_engine(2, "fp32", size="small")
    lanes = []
    with async_ckpt.wrap(engine, url, storage_options=options, part_size=5 * 1024 * 1024) as ckpt:
        for i in range(saves):
            engine.save_checkpoint(f"{url}/checkpoint-{i}")
            ckpt.wait()
            lanes.append(sum(name.startswith("async_ckpt-s3-lane") for name in _async_ckpt_threads()))
    return {"lane_threads": lanes}


def wrap_with_bad_destinations(endpoint: str, bucket: str) -> dict:
    engine = workload.make_engine(1, "fp32")
    return {
        "malformed": _outcome(lambda: async_ckpt.wrap(engine, f"s3:/{bucket}/run")),
        "no_bucket_name": _outcome(lambda: async_ckpt.wrap(engine, "s3://", storage_options={"endpoint_url": endpoint})),
        "missing_bucket": _outcome(lambda: async_ckpt.wrap(engine, "s3://no-such-bucket-here/run",
                                                           storage_options={"endpoint_url": endpoint})),
    }


def wrap_with_wrong_credentials(endpoint: str, bucket: str) -> dict:
    engine = workload.make_engine(1, "fp32")
    options = {"endpoint_url": endpoint, "key": "AKIAWRONGWRONGWRONG1", "secret": "s3cr3t-never-printed"}
    return {"wrong_credentials": _outcome(lambda: async_ckpt.wrap(engine, f"s3://{bucket}/run", storage_options=options))}


def save_with_credentials_in_options(endpoint: str, bucket: str, key: str, secret: str) -> dict:
    """A whole save with credentials passed in storage_options, keeping every async_ckpt log line."""
    with async_ckpt_log() as lines:
        engine = workload.make_engine(2, "fp32")
        workload.train(engine, 1, workload.token_stream(), dist.get_rank())
        options = {"endpoint_url": endpoint, "key": key, "secret": secret}
        with async_ckpt.wrap(engine, f"s3://{bucket}/run", storage_options=options) as ckpt:
            result = ckpt.save(tag="creds").result(timeout=300)
            shown = [repr(ckpt.config), repr(result), str(ckpt.storage.url)]
    return {"logs": lines, "shown": shown}


def resume_after_losses_in_the_bucket(url: str, options: dict, cache_dir: str) -> dict:
    """Tags 'older' and 'newer' in the bucket, then rank 1's optimizer shard of 'newer' is deleted: a load of
    'newer' is refused naming it, a load with fallback takes 'older'. Then 'older' is saved again
    (overwrite_tags): its next load fetches into a cache folder of its own save, apart from the first's, which
    stays while recent; made two hours old, the next load removes it."""
    rank = dist.get_rank()
    engine = workload.make_engine(2, "fp32")
    out: dict = {}
    with async_ckpt.wrap(engine, url, storage_options=options, cache_dir=cache_dir, overwrite_tags=True) as ckpt:
        ckpt.save(tag="older").result(timeout=120)
        ckpt.save(tag="newer").result(timeout=120)
        if rank == 0:
            lost = next(p for p in ckpt.storage.list_dir("newer") if p.startswith("zero_pp_rank_1_") and "optim" in p)
            ckpt.storage.delete(f"newer/{lost}")
        dist.barrier()
        out["named"] = _outcome(lambda: ckpt.load(tag="newer"))
        out["fallback"] = ckpt.load(tag="newer", fallback=True)[0]
        out["first_fetch"] = ckpt.last_fetch.dest
        ckpt.save(tag="older").result(timeout=120)
        out["resaved"] = ckpt.load(tag="older")[0]
        out["second_fetch"] = ckpt.last_fetch.dest
        first_save = os.path.dirname(out["first_fetch"])
        out["first_kept_while_recent"] = os.path.isdir(first_save)
        dist.barrier()
        if rank == 0:  # the ranks share the cache
            hours_ago = time.time() - 7200
            for folder, _, names in os.walk(first_save):
                for path in [folder] + [os.path.join(folder, n) for n in names]:
                    os.utime(path, (hours_ago, hours_ago))
        dist.barrier()
        ckpt.load(tag="older")
        dist.barrier()  # each rank prunes after its own load; one may still be removing it when the other is done
        out["first_after_it_was_old"] = os.path.isdir(first_save)
    return out


def resume_elastic_from_bucket(url: str, options: dict, cache_base: str) -> dict:
    """ZeRO-2 with ``elastic_checkpoint``, with which DeepSpeed reads every rank's optimizer shard on every
    rank: saved to the bucket, then loaded with an empty cache per rank (as on separate machines); and the
    same step saved and loaded by stock DeepSpeed on local disk."""
    import deepspeed

    rank = dist.get_rank()
    config = workload.ds_config(2, "fp32")
    config["zero_optimization"]["elastic_checkpoint"] = True
    model = workload.build_model("tiny")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    workload.train(engine, 1, workload.token_stream(), rank)
    stock_root = os.path.join(cache_base, "stock")
    engine.save_checkpoint(stock_root, tag="stock")
    stock_error = _outcome(lambda: engine.load_checkpoint(stock_root, tag="stock"))
    with async_ckpt.wrap(engine, url, storage_options=options) as ckpt:
        ckpt.save(tag="elastic").result(timeout=120)
    with async_ckpt.wrap(engine, url, storage_options=options, cache_dir=os.path.join(cache_base, f"rank{rank}")) as ckpt:
        error = _outcome(ckpt.load)
        fetched = sorted(ckpt.last_fetch.files) if ckpt.last_fetch else []
    return {"load_error": error, "stock_load_error": stock_error, "fetched": fetched}


def resume_with_a_cache_shared_by_the_ranks(url: str, options: dict, cache_dir: str) -> dict:
    """ZeRO-2 saved to the bucket, then loaded by both ranks into one cache_dir (ranks of one node): each
    needs its own optimizer shard and the same model-states file."""
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, workload.token_stream(), dist.get_rank())
    with async_ckpt.wrap(engine, url, storage_options=options) as ckpt:
        ckpt.save(tag="shared").result(timeout=120)
    with async_ckpt.wrap(engine, url, storage_options=options, cache_dir=cache_dir) as ckpt:
        ckpt.load()
        return asdict(ckpt.last_fetch)
