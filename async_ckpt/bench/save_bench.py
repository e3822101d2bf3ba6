"""Save benchmark: every way of saving the same DeepSpeed ZeRO state, side by side in one run.

Run ``async-ckpt bench`` (or ``python -m async_ckpt.bench.save_bench``); ``--quick`` for a smoke run,
``--target s3`` for an embedded moto S3 server on 127.0.0.1 (or ``--url``/``--endpoint``),
``--target tiered`` for tiered checkpoints (local tier, then S3) and restarts (:mod:`async_ckpt.bench.tiered`).
``--workload mlp`` trains a stack of large Linear layers instead of the small GPT model: long, CPU-heavy
steps and ~0.9 GB of ZeRO-3 fp32 state per save (see :data:`async_ckpt.workload.MLP_SIZES`).
Methods run one after the other on the same engine and steps, so ratios hold on a noisy machine; with
``--rounds N`` they take turns N times (each round wraps the engine anew), so that the drift in step time
over a run, often as large as what a save costs, falls on every method alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from async_ckpt.arguments import COUNT, SECONDS, make_writable_folder
from async_ckpt.errors import UsageError
from async_ckpt.workload import MLP_SIZES, SIZES
from async_ckpt.bench.methods import METHODS, ON_REQUEST, remove_url_folder
from async_ckpt.bench.writeback import DRAIN_CAP_S

ALL_METHODS = list(METHODS)
#: What a run without --methods compares: every method but the prototypes run on request only.
DEFAULT_METHODS = [m for m in METHODS if m not in ON_REQUEST]
WORKLOADS = ("gpt", "mlp")


@dataclass
class BenchConfig:
    stage: int = 3
    dtype: str = "fp32"
    device: str = "cpu"
    ranks: int = 2
    size: str = "bench"
    saves: int = 3
    steps_between: int = 3
    target: str = "local"
    url: str | None = None
    endpoint: str | None = None
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    out: str = "bench_out"
    workdir: str | None = None
    workload: str = "gpt"  # "mlp": async_ckpt.workload.make_mlp_engine, sized by `size` in MLP_SIZES
    micro_batch: int | None = None  # None: the workload's (2 for gpt, the size's for mlp)
    # PyTorch threads per rank. None: PyTorch's default (every CPU in every rank, as DeepSpeed's launcher
    # leaves it without --bind_cores_to_rank); CPUs / ranks shares them out as that option does.
    threads_per_rank: int | None = None
    # after each method's last save, train on until the kernel has written its page-cache bytes back, for
    # at most this long (async_ckpt.bench.writeback); the smoke run waits less, for a suite whose other
    # tests write beside it
    writeback_cap_s: float = DRAIN_CAP_S
    # how many times the methods take turns, each time with `saves` saves (results gather every round's)
    rounds: int = 1
    # each way of writing the disk's floor is timed this many times (floors.local_write_floor): the floor is
    # the median of the best way, as the saves' time to durable is a median
    floor_samples: int = 5

    @classmethod
    def quick(cls, **overrides: Any) -> "BenchConfig":
        return cls(**{"size": "tiny", "saves": 2, "steps_between": 2, "writeback_cap_s": 5.0, "floor_samples": 1,
                      **overrides})


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch", "async_ckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)


def bench_rank(cfg: dict, target: dict) -> dict:
    """Runs on every rank: train, and save with each method in turn; returns raw figures."""
    _quiet()
    import psutil
    import torch
    import torch.distributed as dist

    from async_ckpt import workload
    from async_ckpt.bench import floors, machine_cpu, peak_memory
    from async_ckpt.bench.thread_cpu import cpu_delta, thread_cpu, with_ended
    from async_ckpt.bench.writeback import dirty_bytes, train_until_written_back

    rank = dist.get_rank()
    proc = psutil.Process()
    if cfg["threads_per_rank"] is not None:
        torch.set_num_threads(cfg["threads_per_rank"])
    if cfg["workload"] == "mlp":
        engine = workload.make_mlp_engine(cfg["stage"], cfg["dtype"], size=cfg["size"], micro_batch=cfg["micro_batch"])
        tokens = None  # the MLP trains on random inputs
    else:
        engine = workload.make_engine(cfg["stage"], cfg["dtype"], size=cfg["size"], micro_batch=cfg["micro_batch"])
        tokens = workload.token_stream()
    peak_rss = proc.memory_info().rss
    steps: list[dict] = []

    def step(method: str, round_: int = 0) -> None:
        # the rank's CPU time over all its threads (the writer's too) and its page faults, per step:
        # what a background write adds to the steps it overlaps, on a machine with no idle core
        # (and by thread: the training thread's, the writer's pools', PyTorch's and gloo's native threads);
        # and the whole machine's, by kind: what a write costs outside this process (the kernel's writeback,
        # the other rank's writer, the hypervisor)
        nonlocal peak_rss
        before, threads_before = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
        machine_before = machine_cpu.machine_cpu()
        started = time.time()
        workload.train(engine, 1, tokens, rank)
        end = time.time()
        machine_after = machine_cpu.machine_cpu()
        after, threads_after = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
        cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        steps.append({"method": method, "round": round_, "start": started, "end": end, "cpu_s": cpu_s,
                      "page_faults": after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt,
                      "threads_cpu_s": with_ended(cpu_delta(threads_before, threads_after), cpu_s),
                      "dirty_bytes": dirty_bytes(), "machine_cpu_s": machine_cpu.delta(machine_before, machine_after)})
        peak_rss = max(peak_rss, proc.memory_info().rss)

    def agree(waiting: bool) -> bool:  # True while any rank still waits
        flag = torch.tensor([float(waiting)], device=engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def turn(name: str, round_: int) -> dict:
        """One turn of method ``name``: wrap, ``saves`` saves with their steps, drain, unwrap; its raw figures."""
        dist.barrier()
        memory = peak_memory.start(engine.device)
        setup_started = time.time()
        try:
            method = METHODS[name](engine, target, rank)
        except Exception as exc:
            return {"skipped": f"{type(exc).__name__}: {exc}"}
        setup_s = time.time() - setup_started
        saves = []
        for i in range(cfg["saves"]):
            for _ in range(cfg["steps_between"]):
                step(name, round_)
                method.poll()
            dirty_before, machine_before = dirty_bytes(), machine_cpu.machine_cpu()
            started = time.time()
            method.save(f"{name}-{round_}-{i}")
            saves.append({"start": started, "call_s": time.time() - started, "dirty_before": dirty_before,
                          "dirty_after": dirty_bytes(), "round": round_, "index": i,
                          "machine_cpu_s": machine_cpu.delta(machine_before, machine_cpu.machine_cpu())})
        for _ in range(cfg["steps_between"]):
            step(name, round_)
            method.poll()
        finish_started = time.time()
        method.finish()
        finish_wait_s = time.time() - finish_started
        # a save that left its bytes in the page cache is not done with the disk: train on until the kernel
        # has written them back, so that its writeback slows this method's steps, not the next method's
        written_back = train_until_written_back(lambda: step(name, round_), saves[0]["dirty_before"] if saves else None,
                                                agree, cap_s=cfg["writeback_cap_s"])
        entry = {"note": method.note, "finish_wait_s": finish_wait_s, "bytes_per_save": method.bytes_per_save,
                 "written_back": written_back, "durable": method.durable, "setup_s": setup_s,
                 # from the set-up until what it left running in the background ended (async_ckpt: its staging
                 # reserve faulted in or pinned): steps in it are the method's cost, not ordinary steps
                 "setup_windows": [[setup_started, max(method.setup_done_at or 0.0, setup_started + setup_s)]]}
        for i, save in enumerate(saves):
            save["durable_s"] = method.durable_s[i] if i < len(method.durable_s) else None
            save["extra_stall_s"] = method.extra_stall_s[i] if i < len(method.extra_stall_s) else 0.0
            if i < len(method.save_metrics):
                save["metrics"] = method.save_metrics[i]
        entry["saves"] = saves
        if hasattr(method, "settings"):
            entry["settings"] = method.settings
        if hasattr(method, "rss_before_save"):
            entry["rss_before_save"] = method.rss_before_save
            entry["staging_bytes"] = method.staging_bytes
        method.close()
        entry["peak_above_start"] = peak_memory.peak_above(memory, engine.device)
        discard_started = time.time()
        method.discard()
        # deleting the checkpoints leaves work for the device (on a disk mounted with online discard, trims at
        # the next journal commit); synced here, so that it is done before the next method trains
        os.sync()
        entry["discard_s"] = time.time() - discard_started
        return entry

    step("warmup")
    results: dict[str, Any] = {}
    for round_ in range(cfg["rounds"]):
        # ABBA: the methods' order reversed every other round, so that the run's drift in step time does
        # not fall on whichever method always runs in one place
        for name in cfg["methods"] if round_ % 2 == 0 else cfg["methods"][::-1]:
            if "skipped" in results.get(name, {}):
                continue
            entry = turn(name, round_)
            if name not in results:
                results[name] = entry
            elif "skipped" in entry:  # an earlier round ran: keep its figures, say why this one did not
                results[name].setdefault("skipped_rounds", {})[round_] = entry["skipped"]
            else:
                _gather_round(results[name], entry)
            peak_rss = max(peak_rss, proc.memory_info().rss)
    # this rank's share of a checkpoint: async_ckpt's, else stock's split over the ranks (rank 0 measures it)
    ours = next((entry["bytes_per_save"] for name, entry in results.items()
                 if name.startswith("async_ckpt") and entry.get("bytes_per_save")), None)
    stock = torch.tensor([float(results.get("stock", {}).get("bytes_per_save") or 0)], device=engine.device)
    dist.all_reduce(stock, op=dist.ReduceOp.MAX)
    nbytes = ours or int(stock.item()) // dist.get_world_size() or 64 * 1024 * 1024
    floor_dir = os.path.join(target["local_dir"], "floor")
    floor = {"bytes": nbytes, "copy_s": floors.copy_floor_s(nbytes, engine.device)}
    idle_and_busy: list[tuple[str, Callable[[], None] | None]] = [("", None)]
    if target["kind"] == "local":
        idle_and_busy.append(("_while_training", lambda: workload.train(engine, 1, tokens, rank)))
    for suffix, train_step in idle_and_busy:
        samples = floors.local_write_floor(nbytes, floor_dir, cfg["floor_samples"], train_step, engine.device)
        typical, best = floors.typical_and_best(samples)
        floor.update({f"local_write{suffix}_s": typical, f"local_write{suffix}_best_s": best,
                      f"local_write{suffix}_samples": samples})
    if target["kind"] == "s3":
        floor["s3_upload_s"] = floors.s3_upload_floor_s(nbytes, target["url"], target["storage_options"])
    return {"rank": rank, "methods": results, "floor": floor, "steps": steps, "peak_rss": peak_rss,
            "micro_batch": engine.train_micro_batch_size_per_gpu(), "threads": torch.get_num_threads()}


def _gather_round(into: dict, entry: dict) -> None:
    """Add a later round's raw figures of one method (``entry``) to its first round's (``into``): every save,
    the finish waits and deletions summed, written back only where every round's was, set-up time and peak memory the
    largest. Staging and RSS stay the first round's: each round wraps the engine anew, so its first save allocates
    staging again."""
    into["saves"] += entry["saves"]
    into["finish_wait_s"] += entry["finish_wait_s"]
    into["discard_s"] += entry["discard_s"]
    into["setup_s"] = max(into["setup_s"], entry["setup_s"])
    into["setup_windows"] += entry["setup_windows"]
    for key, peak in entry["peak_above_start"].items():
        if peak is not None and into["peak_above_start"][key] is not None:
            into["peak_above_start"][key] = max(into["peak_above_start"][key], peak)
    drained = (into["written_back"], entry["written_back"])
    into["written_back"] = None if None in drained else all(drained)


def _machine() -> dict:
    import deepspeed
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def check_run_arguments(cfg: BenchConfig) -> None:
    """Refuse what the run would fail on, or silently ignore, before it starts (it may take an hour);
    then make ``--out``, where it writes its results only at the end."""
    if cfg.endpoint and not cfg.url:
        raise UsageError(f"--endpoint {cfg.endpoint} is the S3 endpoint of --url: pass --url s3://bucket/prefix "
                         "with it, or drop --endpoint to benchmark an embedded moto server")
    make_writable_folder(cfg.out, "--out", "pass a folder you can write to, for the results")


def _start_target(cfg: BenchConfig, workdir: str) -> tuple[dict, Any]:
    """Where the run saves, and the embedded S3 server it started (None: none). With ``--url``, each run
    saves under a new folder of it, so that no run meets an earlier one's tags; :func:`stop_target` removes it."""
    if cfg.target == "local":
        return {"kind": "local", "local_dir": workdir, "url": workdir, "storage_options": {}}, None
    server = None
    endpoint = cfg.endpoint
    url = cfg.url
    if url is not None:
        url = f"{url.rstrip('/')}/bench-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        _check_writable(url, {"endpoint_url": endpoint} if endpoint else {}, cfg.url)
    else:
        from moto.server import ThreadedMotoServer

        from async_ckpt.launch import free_port

        for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ.setdefault(key, value)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        except BaseException:
            server.stop()
            raise
        url = "s3://bench/run"
    options = {"endpoint_url": endpoint} if endpoint else {}
    return {"kind": "s3", "local_dir": workdir, "url": url, "storage_options": options}, server


def _check_writable(url: str, options: dict, given: str) -> None:
    """Refuse (UsageError) a ``--url`` this run cannot write into, before its ranks start: a wrong bucket,
    endpoint or credentials would otherwise fail each rank's first save. The probe ``wrap()`` runs."""
    from async_ckpt.storage import open_storage

    try:
        storage = open_storage(url, options)
        try:
            storage.probe()
        finally:
            storage.close()
    except Exception as exc:
        raise UsageError(f"--url {given}: cannot write there ({type(exc).__name__}: {exc}); check --url, "
                         "--endpoint and the credentials") from exc


def stop_target(target: dict | None, server: Any) -> None:
    """Stop the embedded S3 server, or remove what this run left under its folder of the user's ``--url``."""
    if server is not None:
        server.stop()
    elif target is not None and target["kind"] != "local":
        remove_url_folder(target["url"], target["storage_options"])


def run(cfg: BenchConfig) -> dict:
    """Run the benchmark; write ``results.json``, ``timeline.png`` and print the table."""
    if cfg.workload not in WORKLOADS:
        raise UsageError(f"unknown workload {cfg.workload!r}; choose from {list(WORKLOADS)}")
    sizes = MLP_SIZES if cfg.workload == "mlp" else SIZES
    if cfg.size not in sizes:
        raise UsageError(f"--workload {cfg.workload} has no size {cfg.size!r}; choose from {list(sizes)}")
    for flag, value in (("--threads-per-rank", cfg.threads_per_rank), ("--micro-batch", cfg.micro_batch),
                        ("--rounds", cfg.rounds), ("--ranks", cfg.ranks), ("--saves", cfg.saves),
                        ("--steps-between", cfg.steps_between)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{flag} must be a positive integer, got {value!r}")
    if cfg.target == "tiered":
        if cfg.workload != "gpt" or cfg.rounds != 1:
            raise UsageError("--target tiered trains the gpt workload only, in one round (drop --workload/--rounds)")
        check_run_arguments(cfg)
        from async_ckpt.bench.tiered import run as run_tiered

        return run_tiered(cfg)
    from async_ckpt.launch import RankGroup
    from async_ckpt.bench.report import summarize, table, timeline_png, write_report

    unknown = set(cfg.methods) - set(METHODS)
    if unknown:
        raise UsageError(f"unknown method(s) {sorted(unknown)}; choose from {ALL_METHODS}")
    check_run_arguments(cfg)
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="async_ckpt_bench_")  # removed at the end if ours
    target, server = None, None
    started = time.time()
    try:
        target, server = _start_target(cfg, workdir)
        with RankGroup(cfg.ranks, daemon=False, env={"DS_ACCELERATOR": cfg.device}) as ranks:
            raw = ranks.run(bench_rank, asdict(cfg), target, timeout_s=3600)
    finally:
        stop_target(target, server)
        if cfg.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"config": asdict(cfg), "machine": _machine(), "target": {k: v for k, v in target.items()
                                                                         if k != "storage_options"},
              "wall_s": time.time() - started, "ranks": raw}
    report["summary"] = summarize(report)
    results = write_report(cfg.out, report, table(report))
    timeline_png(report, os.path.join(cfg.out, "timeline.png"))
    print(f"\nraw figures: {results}   timeline: {os.path.join(cfg.out, 'timeline.png')}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 saves: a smoke run")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one rank per GPU over NCCL, pinned staging on a side stream")
    parser.add_argument("--ranks", type=COUNT, default=None, help="default: 2 on cpu, every visible GPU on cuda")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="gpt",
                        help="gpt: the small GPT model; mlp: 8 x Linear(3072) at micro-batch 64, long CPU-heavy "
                             "steps (--quick: 2 x Linear(256), batch 8)")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help=f"model size (--workload mlp: one of {list(MLP_SIZES)})")
    parser.add_argument("--micro-batch", type=COUNT, default=None,
                        help="micro-batch per rank (default: 2 for gpt, the size's for mlp); on a GPU the gpt "
                             "default leaves steps bound by kernel launches and noisy, a larger one quiets them")
    parser.add_argument("--threads-per-rank", type=COUNT, default=None,
                        help="PyTorch threads per rank (default: PyTorch's, every CPU in every rank; CPUs / ranks "
                             "shares them out as DeepSpeed's launcher with --bind_cores_to_rank does)")
    parser.add_argument("--saves", type=COUNT, default=None, help="saves per method")
    parser.add_argument("--steps-between", type=COUNT, default=None)
    parser.add_argument("--rounds", type=COUNT, default=1,
                        help="how many times the methods take turns (each with --saves saves), so that the run's "
                             "drift in step time falls on every method alike")
    parser.add_argument("--floor-samples", type=COUNT, default=None,
                        help="times each way of writing the disk's floor is timed; the floor is the best way's median, "
                             "as a save's time to durable is a median (default 5, 1 with --quick)")
    parser.add_argument("--writeback-cap-s", type=SECONDS, default=None,
                        help=f"after each method's last save, train on at most this long until the kernel has written "
                             f"its page-cache bytes back (default {DRAIN_CAP_S:g}, 5 with --quick)")
    parser.add_argument("--target", choices=["local", "s3", "tiered"], default="local",
                        help="tiered: saves to a node-local tier drained to S3 (moto, or --url), and restart times")
    parser.add_argument("--url", default=None, help="s3://bucket/prefix (default: an embedded moto server); each run "
                                                    "saves under a new folder of it and removes it at the end")
    parser.add_argument("--endpoint", default=None, help="S3 endpoint URL for --url")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated subset of {ALL_METHODS} (default: all but {', '.join(ON_REQUEST)})")
    parser.add_argument("--out", default="bench_out", help="folder for results.json and timeline.png")
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp folder)")


def _default_ranks(device: str) -> int:
    if device == "cpu":
        return 2
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible")
    return torch.cuda.device_count()


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base = BenchConfig.quick() if args.quick else BenchConfig()
    overrides = {k: v for k, v in {"size": args.size, "saves": args.saves, "steps_between": args.steps_between,
                                   "writeback_cap_s": args.writeback_cap_s,
                                   "floor_samples": args.floor_samples}.items() if v is not None}
    return BenchConfig(**{**asdict(base), **overrides, "stage": args.stage, "dtype": args.dtype, "device": args.device,
                          "ranks": args.ranks if args.ranks is not None else _default_ranks(args.device),
                          "target": "s3" if args.url and args.target != "tiered" else args.target,
                          "url": args.url, "endpoint": args.endpoint,
                          "methods": [m for m in args.methods.split(",") if m], "out": args.out,
                          "workdir": args.workdir, "workload": args.workload, "micro_batch": args.micro_batch,
                          "threads_per_rank": args.threads_per_rank, "rounds": args.rounds})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_ckpt.bench.save_bench", description=__doc__)
    add_arguments(parser)
    try:
        run(config_from_args(parser.parse_args(argv)))
    except UsageError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
