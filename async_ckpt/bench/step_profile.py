"""Where the steps around a save spend their time: a ``torch.profiler`` trace, one row per step.

The save benchmark says *that* the steps after a save run slower than the others (its "training
time lost per save"); this says *why*. It trains one rank of the bench's workload, saves with
async_ckpt's defaults, and profiles a few steps before each save, the save call and the steps
after it: CPU operators, the CUDA runtime calls of every thread (the writer's and the staging
helper's too), kernels and copies. Each window's trace is reduced to one row per step:

- ``wall_ms``: the step, as the training thread saw it;
- ``gpu_busy_ms`` / ``copy_ms``: the time the GPU ran kernels, and copies (the staging's D2H);
- ``ops_ms``: the time the training thread was inside a profiled operator; the rest of the step
  (``outside_ops_ms``) is Python, or waiting for the GIL that another thread holds;
- ``cuda_api_ms`` / ``cuda_api_top``: the training thread's CUDA runtime calls, longest first by
  total (a call that waits on a lock another thread's call holds shows up here);
- ``others_cuda_api``: what other threads called in the CUDA runtime during the step;
- ``gap_ms`` / ``gap_in``: the GPU's longest idle stretch inside the step, and what the training
  thread was in meanwhile;
- ``threads_cpu_ms``: the CPU time each thread used during the step (from ``/proc``, by Python
  thread name): how much the writer's threads took from the cores training runs on.

The profiler adds its own cost to every step, so compare the rows with each other (the steps
before a save are the baseline), not with the bench's step times. The first window's trace is kept
(gzipped) for a viewer such as Perfetto.
Run: ``python -m async_ckpt.bench.step_profile --device cuda --stage 2 --dtype bf16 --size large --out OUT``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import time
from typing import Any, Iterable

from async_ckpt.bench.thread_cpu import as_rows, cpu_delta, thread_cpu

STEP = "async_ckpt.step"
SAVE = "async_ckpt.save"
_GPU_WORK = ("kernel", "gpu_memset")
_CUDA_API = ("cuda_runtime", "cuda_driver")


def _union(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``intervals`` clipped to ``[lo, hi]``, as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if a >= b:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _top(events: list[dict], lo: float, hi: float, n: int = 3) -> list[list[Any]]:
    """``[name, total ms inside [lo, hi]]`` of the ``n`` names with the most time, longest first."""
    totals: dict[str, float] = {}
    for e in events:
        overlap = min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
        if overlap > 0:
            totals[e["name"]] = totals.get(e["name"], 0.0) + overlap
    return [[name, round(us / 1e3, 2)] for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:n]]


def reduce_trace(trace: dict) -> list[dict]:
    """One row per ``async_ckpt.step``/``async_ckpt.save`` annotation of a Chrome trace (see the module's doc).

    GPU columns are ``None`` where the trace holds no kernel at all (a CPU run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"] in (STEP, SAVE)),
                   key=lambda e: e["ts"])
    if not marks:
        raise ValueError(f"the trace has no {STEP!r} or {SAVE!r} annotation: profile with record_function")
    train = (marks[0]["pid"], marks[0]["tid"])
    gpu = [e for e in events if e.get("cat") in _GPU_WORK]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    api = [e for e in events if e.get("cat") in _CUDA_API]
    own_api = [e for e in api if (e["pid"], e["tid"]) == train]
    other_api = [e for e in api if (e["pid"], e["tid"]) != train]
    ops = [e for e in events if e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) == train]
    rows = []
    for mark in marks:
        lo, hi = mark["ts"], mark["ts"] + mark["dur"]
        ops_us = _length(_union(((e["ts"], e["ts"] + e["dur"]) for e in ops), lo, hi))
        row: dict[str, Any] = {
            "kind": "save" if mark["name"] == SAVE else "step", "wall_ms": round(mark["dur"] / 1e3, 2),
            "ops_ms": round(ops_us / 1e3, 2), "outside_ops_ms": round((mark["dur"] - ops_us) / 1e3, 2),
            "cuda_api_ms": round(_length(_union(((e["ts"], e["ts"] + e["dur"]) for e in own_api), lo, hi)) / 1e3, 2),
            "cuda_api_top": _top(own_api, lo, hi), "others_cuda_api": _top(other_api, lo, hi),
            "gpu_busy_ms": None, "copy_ms": None, "gap_ms": None, "gap_in": []}
        if gpu:
            busy = _union(((e["ts"], e["ts"] + e["dur"]) for e in gpu), lo, hi)
            row["gpu_busy_ms"] = round(_length(busy) / 1e3, 2)
            row["copy_ms"] = round(_length(_union(((e["ts"], e["ts"] + e["dur"]) for e in copies), lo, hi)) / 1e3, 2)
            edges = [lo] + [t for interval in busy for t in interval] + [hi]
            gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
            a, b = max(gaps, key=lambda g: g[1] - g[0])
            row["gap_ms"] = round((b - a) / 1e3, 2)
            row["gap_in"] = _top(ops + own_api, a, b)
        rows.append(row)
    return rows


def _activities(device: str) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def profile_rank(cfg: dict, out: str) -> list[dict]:
    """Runs on the rank: train, then profile ``cfg['saves']`` windows around a save; returns their rows."""
    from async_ckpt.bench.save_bench import _quiet

    _quiet()
    from torch.profiler import profile, record_function

    import async_ckpt
    from async_ckpt import workload

    if cfg["workload"] == "mlp":
        engine = workload.make_mlp_engine(cfg["stage"], cfg["dtype"], size=cfg["size"], micro_batch=cfg["micro_batch"])
        tokens = None
    else:
        engine = workload.make_engine(cfg["stage"], cfg["dtype"], size=cfg["size"], micro_batch=cfg["micro_batch"])
        tokens = workload.token_stream()
    workdir = tempfile.mkdtemp(prefix="async_ckpt_profile_")
    windows = []
    try:
        ckpt = async_ckpt.wrap(engine, workdir)
        try:
            workload.train(engine, cfg["warmup"], tokens, 0)  # meanwhile wrap()'s staging reserve is faulted in and pinned
            for i in range(cfg["saves"]):
                walls, cpu = [], []
                with profile(activities=_activities(cfg["device"])) as prof:
                    for n in range(cfg["before"] + 1 + cfg["after"]):
                        started, used = time.perf_counter(), thread_cpu()
                        if n == cfg["before"]:
                            with record_function(SAVE):
                                handle = ckpt.save(tag=f"profile-{i}")
                        else:
                            with record_function(STEP):
                                workload.train(engine, 1, tokens, 0)
                        walls.append(time.perf_counter() - started)
                        cpu.append(as_rows(cpu_delta(used, thread_cpu())))
                path = os.path.join(out, f"trace_save{i}.json")
                prof.export_chrome_trace(path)
                with open(path) as fh:
                    rows = reduce_trace(json.load(fh))
                if i == 0:
                    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                os.remove(path)
                handle.result()
                for n, row in enumerate(rows):
                    row["index"] = n - cfg["before"]
                    row["threads_cpu_ms"] = cpu[n] if n < len(cpu) else []
                windows.append({"save": i, "durable_s": handle.metrics.get("durable_s"),
                                "stall_s": handle.metrics.get("stall_s"), "rows": rows,
                                "walls_ms": [round(w * 1e3, 2) for w in walls]})
                workload.train(engine, cfg["steps_between"], tokens, 0)
        finally:
            ckpt.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return windows


def table(windows: list[dict]) -> str:
    """The rows of every window as one markdown table."""
    lines = ["| save | step | wall ms | GPU busy ms | D2H copy ms | in ops ms | outside ops ms | CUDA API ms "
             "| training thread's CUDA calls | other threads' CUDA calls | longest GPU gap ms (in) | CPU ms by thread |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def calls(top: list[list[Any]]) -> str:
        return ", ".join(f"{name} {ms}" for name, ms in top) or "–"

    for window in windows:
        for row in window["rows"]:
            label = "save" if row["kind"] == "save" else f"{row['index']:+d}"
            gap = "–" if row["gap_ms"] is None else f"{row['gap_ms']} ({calls(row['gap_in'])})"
            lines.append(f"| {window['save']} | {label} | {row['wall_ms']} | {row['gpu_busy_ms'] if row['gpu_busy_ms'] is not None else '–'} "
                         f"| {row['copy_ms'] if row['copy_ms'] is not None else '–'} | {row['ops_ms']} | {row['outside_ops_ms']} "
                         f"| {row['cuda_api_ms']} | {calls(row['cuda_api_top'])} | {calls(row['others_cuda_api'])} | {gap} "
                         f"| {calls(row.get('threads_cpu_ms', []))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from async_ckpt.launch import RankGroup
    from async_ckpt.workload import SIZES

    parser = argparse.ArgumentParser(prog="python -m async_ckpt.bench.step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--workload", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="micro-batch (default: 2 for gpt, the size's for mlp); a larger one quiets GPU steps")
    parser.add_argument("--saves", type=int, default=3, help="profiled windows, one save each")
    parser.add_argument("--before", type=int, default=3, help="profiled steps before each save (the baseline)")
    parser.add_argument("--after", type=int, default=8, help="profiled steps after each save")
    parser.add_argument("--steps-between", type=int, default=10, help="unprofiled steps between windows")
    parser.add_argument("--warmup", type=int, default=5,
                        help="unprofiled steps after wrap() before the first window: enough for wrap() to reserve "
                             "(and on a GPU pin) the staging memory, or the first save waits for it")
    parser.add_argument("--out", default="profile_out")
    args = parser.parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    os.makedirs(args.out, exist_ok=True)
    with RankGroup(1, daemon=False, env={"DS_ACCELERATOR": args.device}) as ranks:
        windows = ranks.run(profile_rank, cfg, os.path.abspath(args.out), timeout_s=3600)[0]
    text = table(windows)
    with open(os.path.join(args.out, "profile.json"), "w") as fh:
        json.dump({"config": cfg, "windows": windows}, fh, indent=1)
    with open(os.path.join(args.out, "profile.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
