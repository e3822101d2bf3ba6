"""Tiered checkpoints benchmark: save to a node-local tier then drain to object storage; restart three ways.

Run ``async-ckpt bench --target tiered`` (or ``python -m async_ckpt.bench.save_bench --target tiered``);
``--quick`` for a smoke run. The ranks are simulated nodes: each uses a local tier folder of its own
(``node{rank}`` under the work folder), so no rank sees another's node folder. The durable tier is an
embedded moto S3 server on 127.0.0.1 (or ``--url``/``--endpoint``).

Measured:

1. **Saves** with ``wrap(engine, url, local_tier=...)``: per save, the stall (``stall_s``), the time from
   ``save()`` to committed on the local tier (``local_committed_s``) and to committed at the URL
   (``durable_s``). After each save, training goes on until the save is durable on every rank (at
   least ``steps_between`` steps), so a save's drain never queues behind the previous one.
2. **Restart time**: process start to the first training step completed after the resume, taken in
   this (parent) process: from just before a new :class:`~async_ckpt.launch.RankGroup` is created
   (process start, imports, ``init_distributed``, ``deepspeed.initialize`` and the resume are all
   inside) to the latest rank's clock right after its first step. Three ways, each in fresh processes:
   ``local`` (node folders intact: ``wrap(..., local_tier=...)`` + ``load()``), ``bucket`` (node folders
   wiped first, same code) and ``stock`` (each rank downloads its share of the tag with
   :func:`async_ckpt.pull.pull`, as stock DeepSpeed cannot read S3, then ``engine.load_checkpoint`` on an
   unwrapped engine). Every restart must resume the same tag and step; the first step's loss after each
   restart is compared with the loss the saving run had at that step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Any, Iterator

from async_ckpt.bench.save_bench import BenchConfig, _machine, _quiet, _start_target, stop_target

GB = 1e9
RESTARTS = ("local", "bucket", "stock")
RESTART_LABELS = {
    "local": "a. local tier (node folders intact)",
    "bucket": "b. bucket (node folders wiped)",
    "stock": "c. stock DeepSpeed (download, then load_checkpoint)",
}
LOCAL_KEEP_LAST = 2
KEEP_LAST = 2  # moto keeps every object in memory: the bucket keeps the same number of tags
MAX_DRAIN_STEPS = 1000  # a guard: training waits for the drain after this many steps


def node_folder(work: str, rank: int) -> str:
    return os.path.join(work, f"node{rank}")


def _wrap(engine: Any, target: dict, work: str, rank: int, cache: str) -> Any:
    import async_ckpt

    return async_ckpt.wrap(engine, target["url"], storage_options=target["storage_options"],
                           local_tier=node_folder(work, rank), local_keep_last=LOCAL_KEEP_LAST, keep_last=KEEP_LAST,
                           cache_dir=os.path.join(work, cache))


@contextlib.contextmanager
def _tier_lines() -> Iterator[list[str]]:
    """The async_ckpt log lines that say which tier each rank resumed from (INFO), kept while quiet otherwise."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "resumes" in message and "tier" in message:
                lines.append(message)

    logger = logging.getLogger("async_ckpt")
    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def save_rank(cfg: dict, target: dict, work: str) -> dict:
    """Train, and save ``cfg['saves']`` times to the local tier (drained to the URL); raw figures per save."""
    _quiet()
    import torch
    import torch.distributed as dist

    from async_ckpt import workload

    rank = dist.get_rank()
    engine = workload.make_engine(cfg["stage"], cfg["dtype"], size=cfg["size"])
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    tokens = workload.token_stream()
    step_s: list[float] = []

    def train(steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            started = time.perf_counter()
            losses += workload.train(engine, 1, tokens, rank)
            step_s.append(time.perf_counter() - started)
        return losses

    train(1)  # warm-up
    saves = []
    with _wrap(engine, target, work, rank, f"cache-save{rank}") as ckpt:
        for i in range(cfg["saves"]):
            train(cfg["steps_between"])
            tag = f"tiered-{i}"
            handle = ckpt.save(tag=tag)
            step = int(engine.global_steps)
            losses = []
            while True:  # train on while the save drains; every rank agrees when it is durable everywhere
                losses += train(1)
                done = torch.tensor([1 if handle.done() else 0])
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
                if len(losses) >= max(cfg["steps_between"], 1) and (done.item() or len(losses) >= MAX_DRAIN_STEPS):
                    break
            local, durable = handle.local_result(), handle.result()
            metrics = handle.metrics
            saves.append({"tag": tag, "global_steps": step, "stall_s": metrics["stall_s"],
                          "local_committed_s": metrics.get("local_committed_s"), "durable_s": metrics.get("durable_s"),
                          "drain_s": metrics.get("drain_s"), "tier": metrics.get("tier"), "local_url": local.url,
                          "durable_url": durable.url, "local_bytes": local.bytes_written,
                          "durable_bytes": durable.bytes_written, "steps_while_draining": len(losses),
                          "loss_after": losses[0]})
    return {"rank": rank, "params": params, "saves": saves, "global_steps": int(engine.global_steps),
            "step_s": step_s[1:]}


def restart_rank(cfg: dict, target: dict, work: str, how: str) -> dict:
    """A fresh process resumes the newest tag (``how``: local, bucket or stock) and trains one step."""
    entered = time.time()
    _quiet()
    import torch.distributed as dist

    from async_ckpt import workload
    from async_ckpt.catalog import read_latest, read_manifest
    from async_ckpt.resume import rank_files
    from async_ckpt.storage import open_storage

    rank = dist.get_rank()
    engine = workload.make_engine(cfg["stage"], cfg["dtype"], size=cfg["size"], seed=1234 + rank)
    tokens = workload.token_stream()
    initialized = time.time()
    ckpt, tiers, downloaded = None, [], 0
    if how == "stock":
        from async_ckpt.pull import pull

        storage = open_storage(target["url"], target["storage_options"])
        tag = read_latest(storage)
        report = pull(storage, read_manifest(storage, tag), os.path.join(work, f"stock{rank}"), rank=rank,
                      show_progress=False)
        downloaded = report.bytes_fetched
        engine.load_checkpoint(os.path.join(work, f"stock{rank}"), tag)
    else:
        with _tier_lines() as tiers:
            ckpt = _wrap(engine, target, work, rank, f"cache-{how}{rank}")
            tag, _ = ckpt.load()
        downloaded = ckpt.last_fetch.bytes_fetched if ckpt.last_fetch is not None else 0
    loaded = time.time()
    loss = workload.train(engine, 1, tokens, rank)[0]
    end = time.time()
    if ckpt is not None:
        ckpt.close()
    manifest = read_manifest(open_storage(target["url"], target["storage_options"]), tag)
    read = sum(manifest.entry(p).size for p in rank_files(manifest, rank))
    return {"rank": rank, "how": how, "tag": tag, "global_steps": int(engine.global_steps) - 1, "loss": loss,
            "entered": entered, "initialized": initialized, "loaded": loaded, "end": end,
            "init_s": initialized - entered, "load_s": loaded - initialized, "first_step_s": end - loaded,
            "bytes_read": read, "bytes_downloaded": downloaded, "tiers": tiers}


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(report: dict) -> dict:
    saved = report["saves"]
    per_save = []
    for i, first in enumerate(saved[0]["saves"]):
        ranks = [r["saves"][i] for r in saved]
        local = max(s["local_committed_s"] for s in ranks)
        durable = max(s["durable_s"] for s in ranks)
        per_save.append({"tag": first["tag"], "stall_s": max(s["stall_s"] for s in ranks),
                         "local_committed_s": local, "durable_s": durable,
                         "durable_over_local": durable / local if local else None,
                         "drain_s": max(s["drain_s"] for s in ranks),
                         "tiers": sorted({s["tier"] for s in ranks}),
                         "steps_while_draining": first["steps_while_draining"]})
    stall = _median([s["stall_s"] for s in per_save])
    local = _median([s["local_committed_s"] for s in per_save])
    durable = _median([s["durable_s"] for s in per_save])
    last = saved[0]["saves"][-1]
    restarts = {}
    for how, (started, ranks) in report["restarts"].items():
        restarts[how] = {
            "restart_s": max(r["end"] for r in ranks) - started,
            "group_start_s": max(r["entered"] for r in ranks) - started,
            "init_s": max(r["init_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
            "load_s_per_rank": [r["load_s"] for r in ranks], "first_step_s": max(r["first_step_s"] for r in ranks),
            "bytes_read": sum(r["bytes_read"] for r in ranks),
            "bytes_downloaded": sum(r["bytes_downloaded"] for r in ranks),
            "tag": ranks[0]["tag"], "global_steps": ranks[0]["global_steps"],
            "tiers": [line for r in ranks for line in r["tiers"]],
            "first_loss_as_saved": all(r["loss"] == s["saves"][-1]["loss_after"] for r, s in zip(ranks, saved)),
        }
    base = restarts.get("local", {}).get("restart_s")
    base_load = restarts.get("local", {}).get("load_s")
    for entry in restarts.values():
        entry["vs_local"] = entry["restart_s"] / base if base else None
        entry["load_vs_local"] = entry["load_s"] / base_load if base_load else None
    return {"params": saved[0]["params"], "median_step_s": _median([max(t) for t in zip(*(r["step_s"] for r in saved))]),
            "local_bytes_per_save": sum(r["saves"][-1]["local_bytes"] for r in saved),
            "durable_bytes_per_save": sum(r["saves"][-1]["durable_bytes"] for r in saved),
            "saves": per_save, "stall_s": stall, "local_committed_s": local, "durable_s": durable,
            "durable_over_local": durable / local if durable and local else None,
            "resumed": {"tag": last["tag"], "global_steps": last["global_steps"]},
            "restarts": restarts,
            "bucket_over_local": restarts["bucket"]["vs_local"] if "bucket" in restarts else None,
            "stock_over_local": restarts["stock"]["vs_local"] if "stock" in restarts else None}


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def table(report: dict) -> str:
    s, cfg = report["summary"], report["config"]
    lines = [
        f"## Tiered checkpoints: ZeRO-{cfg['stage']} {cfg['dtype']}, {cfg['ranks']} ranks as {cfg['ranks']} simulated "
        f"nodes, model '{cfg['size']}' ({s['params'] / 1e6:.1f} M parameters), durable tier {report['target']['url']}"
        f"{' (embedded moto on 127.0.0.1)' if report['target']['embedded'] else ''}",
        "",
        f"{s['local_bytes_per_save'] / GB:.3f} GB per save on the local tiers (all nodes), "
        f"{s['durable_bytes_per_save'] / GB:.3f} GB per save drained to the durable tier; "
        f"{cfg['saves']} saves, each followed by training until durable (at least {cfg['steps_between']} steps); "
        f"median step {_fmt(s['median_step_s'], '.2f', ' s')}",
        "",
        "| save | stall | save → local commit | save → durable commit | durable / local | drain | steps while draining |",
        "|---|---|---|---|---|---|---|",
    ]
    for save in s["saves"]:
        lines.append(f"| {save['tag']} | {save['stall_s']:.3f} s | {save['local_committed_s']:.2f} s "
                     f"| {save['durable_s']:.2f} s | {_fmt(save['durable_over_local'], '.1f', 'x')} "
                     f"| {save['drain_s']:.2f} s | {save['steps_while_draining']} |")
    lines.append(f"| **median** | **{s['stall_s']:.3f} s** | **{s['local_committed_s']:.2f} s** "
                 f"| **{s['durable_s']:.2f} s** | **{_fmt(s['durable_over_local'], '.1f', 'x')}** |  |  |")
    lines += [
        "",
        f"Restart of tag {s['resumed']['tag']!r} (step {s['resumed']['global_steps']}), each in fresh processes: "
        "process start → first training step completed after the resume (slowest rank)",
        "",
        "| restart | restart time | vs local | processes + init_distributed | imports + deepspeed.initialize | load (slowest rank) "
        "| load vs local | first step | read by ranks | downloaded | resumed step | first loss as saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for how, r in s["restarts"].items():
        lines.append(
            f"| {RESTART_LABELS[how]} | {r['restart_s']:.2f} s | {_fmt(r['vs_local'], '.2f', 'x')} "
            f"| {r['group_start_s']:.2f} s | {r['init_s']:.2f} s | {r['load_s']:.2f} s "
            f"| {_fmt(r['load_vs_local'], '.2f', 'x')} | {r['first_step_s']:.2f} s | {r['bytes_read'] / GB:.3f} GB "
            f"| {r['bytes_downloaded'] / GB:.3f} GB | {r['global_steps']} | {r['first_loss_as_saved']} |")
    for how, r in s["restarts"].items():
        for line in r["tiers"]:
            lines.append(f"\n{how}: {line}")
    lines.append(f"\nrestart from the bucket / from the local tier: {_fmt(s['bucket_over_local'], '.2f', 'x')}; "
                 f"stock download + load / local tier: {_fmt(s['stock_over_local'], '.2f', 'x')}; "
                 f"save → durable / save → local commit (median): {_fmt(s['durable_over_local'], '.1f', 'x')}")
    return "\n".join(lines)


def run(cfg: BenchConfig) -> dict:
    """Run the tiered benchmark; write ``results.json`` and ``table.md`` into ``cfg.out`` and print the table."""
    from async_ckpt.bench.report import write_report
    from async_ckpt.launch import RankGroup

    workdir = cfg.workdir or tempfile.mkdtemp(prefix="async_ckpt_bench_tiered_")  # removed at the end if ours
    work = os.path.join(workdir, "tiered")
    config = {k: v for k, v in asdict(cfg).items() if k != "methods"}
    env = {"DS_ACCELERATOR": cfg.device}
    started = time.time()
    restarts: dict[str, tuple[float, list[dict]]] = {}
    target, server = None, None
    try:
        target, server = _start_target(cfg, workdir)
        os.makedirs(work, exist_ok=True)
        with RankGroup(cfg.ranks, env=env) as ranks:
            saves = ranks.run(save_rank, config, target, work, timeout_s=3600)
        for how in RESTARTS:
            if how == "bucket":
                for rank in range(cfg.ranks):
                    shutil.rmtree(node_folder(work, rank))
            t0 = time.time()
            with RankGroup(cfg.ranks, env=env) as ranks:
                restarts[how] = (t0, ranks.run(restart_rank, config, target, work, how, timeout_s=3600))
    finally:
        stop_target(target, server)
        if cfg.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    expected = (saves[0]["saves"][-1]["tag"], saves[0]["saves"][-1]["global_steps"])
    for how, (_, answers) in restarts.items():
        resumed = {(r["tag"], r["global_steps"]) for r in answers}
        assert resumed == {expected}, f"restart '{how}' resumed {sorted(resumed)}, not {expected}: not comparable"
    report = {"config": config, "machine": _machine(),
              "target": {"kind": target["kind"], "url": target["url"], "embedded": server is not None,
                         "local_tier": [node_folder(work, r) for r in range(cfg.ranks)]},
              "wall_s": time.time() - started, "saves": saves,
              "restarts": {how: [t0, answers] for how, (t0, answers) in restarts.items()}}
    report["summary"] = summarize(report)
    print(f"\nraw figures: {write_report(cfg.out, report, table(report))}")
    return report
