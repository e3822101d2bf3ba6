"""Turn the benchmark's raw per-rank figures into ratios, a markdown table and a timeline PNG."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from async_ckpt.bench import floors, machine_cpu, writeback

GB = 1e9


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _overlaps(step: dict, spans: list[tuple[float, float]]) -> bool:
    """Whether ``step`` ran during any of the ``(start, end)`` spans."""
    return any(a < step["end"] and step["start"] < b for a, b in spans)


def next_step_over_before(steps: list[dict], method: str, saves: list[dict], before: int = 10) -> float | None:
    """How much longer the step right after a save ran than the median of the ``before`` steps just
    before that save (the same method's, on one rank, outside any of its saves' windows from the call
    to durable), median over the saves; ``None`` where no save has such steps before it.

    The run's median step drifts by tens of percent over a run on a shared machine (and on a GPU whose
    training thread is launch-bound), more than a background write slows a step; against the steps
    right before each save, what the save costs its next step shows through that drift."""
    windows = [(s["start"], s["start"] + max(s["call_s"], s.get("durable_s") or 0.0)) for s in saves]
    own = [s for s in steps if s["method"] == method]
    clean = [s for s in own if not _overlaps(s, windows)]
    extras = []
    for save in saves:
        earlier = [s["end"] - s["start"] for s in clean if s["end"] <= save["start"]][-before:]
        later = [s for s in own if s["start"] >= save["start"] + save["call_s"]]
        if earlier and later:
            extras.append(later[0]["end"] - later[0]["start"] - statistics.median(earlier))
    return _median(extras)


def _floor_gbps(ranks: list[dict], seconds_key: str) -> float | None:
    """Every rank's floor bytes over the floor's seconds (``seconds_key``), in GB/s; ``None`` where the run
    did not measure that floor. The ranks write each sample at once, so a sample takes its slowest rank's
    time; where the samples are recorded (``..._samples``, :func:`floors.local_write_floor`), the floor is
    taken from those times (:func:`floors.typical_and_best`), else from the slowest rank's ``seconds_key``."""
    if seconds_key not in ranks[0]["floor"]:
        return None
    samples_key = seconds_key.removesuffix("_s").removesuffix("_best") + "_samples"
    if samples_key in ranks[0]["floor"]:
        ways = set.intersection(*(set(r["floor"][samples_key]) for r in ranks))  # those every rank could time
        if not ways:
            return None
        together = {way: [max(times) for times in zip(*(r["floor"][samples_key][way] for r in ranks))]
                    for way in sorted(ways)}
        typical, best = floors.typical_and_best(together)
        seconds = best if seconds_key.endswith("_best_s") else typical
    else:
        seconds = max(r["floor"][seconds_key] for r in ranks)
    return sum(r["floor"]["bytes"] for r in ranks) / seconds / GB


def durable_profile(ranks: list[dict], name: str, target: str) -> dict[str, float | None] | None:
    """Where a method's time to durable goes, from async_ckpt's own save metrics: per save, the rank that
    took longest, split into its stall, its wait in the writer's queue, its start mark, its files but the
    longest, the longest file (the optimizer state's: its copy waits, its write, its fsyncs) and what came
    after the files (the rest of the copy, the commit handshake, the manifest and ``latest``); median over
    saves; and of the write, the writer's wait for the staging copy that overlaps training. Beside it, the
    target's floor for that rank's bytes (the disk's, idle and while training, or the
    S3 upload's): the longest file against it says what the writer adds to the target, the rest is what
    the save adds around it."""
    floor, busy_floor = ("s3_upload_s", None) if target == "s3" else ("local_write_s", "local_write_while_training_s")
    rows = []
    for i in range(len(ranks[0]["methods"][name]["saves"])):
        rank, save = max(((r, r["methods"][name]["saves"][i]) for r in ranks),
                         key=lambda pair: pair[1].get("durable_s") or 0.0)
        metrics = save.get("metrics") or {}
        files = metrics.get("seconds_by_file")
        if not files or "mark_s" not in metrics or save.get("durable_s") is None:
            return None  # a method without async_ckpt's metrics
        longest = max(files.values())
        row = {"stall_s": metrics.get("stall_s", 0.0), "queued_s": metrics.get("queued_s", 0.0),
               "mark_s": metrics["mark_s"], "other_files_s": sum(files.values()) - longest, "longest_file_s": longest,
               "copy_wait_s": metrics.get("copy_wait_s"),
               "floor_s": rank["floor"].get(floor),
               "floor_while_training_s": rank["floor"].get(busy_floor) if busy_floor else None}
        row["after_files_s"] = save["durable_s"] - sum(v for k, v in row.items()
                                                       if k not in ("copy_wait_s", "floor_s", "floor_while_training_s"))
        rows.append(row)
    return {key: _median([row[key] for row in rows if row[key] is not None]) for key in rows[0]} if rows else None


def _stall_counted(entry: dict) -> float | None:
    """A save's stall as the training time lost counts it (None: no save was timed)."""
    if entry.get("stall_in_call_s") is None:
        return None
    return entry["stall_in_call_s"] + (entry["stall_in_next_step_per_save_s"] or 0.0)


def summarize(report: dict) -> dict:
    ranks = report["ranks"]
    floor_bytes = sum(r["floor"]["bytes"] for r in ranks)
    copy_floor_s = max(r["floor"]["copy_s"] for r in ranks)
    local_floor_gbps = _floor_gbps(ranks, "local_write_s")
    s3_floor_gbps = _floor_gbps(ranks, "s3_upload_s")
    busy_floor_gbps = _floor_gbps(ranks, "local_write_while_training_s")
    best_floor_gbps = _floor_gbps(ranks, "local_write_best_s") if report["target"]["kind"] != "s3" else None
    persist_floor = s3_floor_gbps if report["target"]["kind"] == "s3" else local_floor_gbps
    rank0_steps = [s for s in ranks[0]["steps"] if s["method"] != "warmup"]
    windows: dict[str, list[tuple[float, float]]] = {}
    waited_in_windows: dict[str, float] = {}
    methods: dict[str, Any] = {}
    stock_stall = None
    for name, first in ranks[0]["methods"].items():
        if "skipped" in first:
            methods[name] = {"skipped": first["skipped"]}
            continue
        per_save_stall, per_save_call, per_save_waited, per_save_durable, windows[name] = [], [], [], [], []
        waited_in_windows[name] = 0.0
        for i, save0 in enumerate(first["saves"]):
            saves = [r["methods"][name]["saves"][i] for r in ranks]
            per_save_stall.append(max(s["call_s"] + s["extra_stall_s"] for s in saves))
            per_save_call.append(max(s["call_s"] for s in saves))
            per_save_waited.append(max(s["extra_stall_s"] for s in saves))
            if any(s["durable_s"] is None for s in saves):
                per_save_durable.append(None)
                continue
            per_save_durable.append(max(s["durable_s"] for s in saves))
            # persisting in the background: after the save call returned, until durable on every rank
            tail = max(s["durable_s"] - s["call_s"] for s in saves)
            if tail > 0:
                windows[name].append((save0["start"] + save0["call_s"], save0["start"] + save0["call_s"] + tail))
                # the stall a later step waits for (the next optimizer step's wait for the copy, DeepSpeed's
                # decoupled commit) is in the stall and in that step's time, which falls in this window
                waited_in_windows[name] += per_save_waited[-1]
        total_bytes = sum(r["methods"][name]["bytes_per_save"] for r in ranks)
        stall = _median(per_save_stall)
        durable = _median(per_save_durable)
        gbps = total_bytes / durable / GB if durable else None
        # with --rounds, each round wraps the engine anew: every round's first save is a first save
        steady = _median([stall for i, (save, stall) in enumerate(zip(first["saves"], per_save_stall))
                          if save.get("index", i) > 0])
        # a method that does not fsync (stock: the page cache only) is not durable: no ratio to a durable floor
        fsynced = first.get("durable", True)
        peaks = [r["methods"][name].get("peak_above_start") or {} for r in ranks]
        entry = {
            "stall_s": stall, "durable_s": durable,
            # the stall, as the training time lost counts it: the call's median, and the waits a save causes
            # in the next step averaged (as the steps' extra time is), so that a rare long wait counts once
            "stall_in_call_s": _median(per_save_call),
            "stall_in_next_step_per_save_s": sum(per_save_waited) / len(per_save_waited) if per_save_waited else None,
            "bytes_per_save": total_bytes, "persist_gbps": gbps,
            "fsynced": fsynced, "setup_s": max((r["methods"][name].get("setup_s") or 0.0) for r in ranks),
            "finish_wait_s": max(r["methods"][name].get("finish_wait_s", 0.0) for r in ranks),
            "peak_rss_above_start_bytes": _max_known(p.get("rss") for p in peaks),
            "peak_gpu_above_start_bytes": _max_known(p.get("gpu") for p in peaks),
            "first_stall_s": per_save_stall[0] if per_save_stall else None,
            "first_vs_steady_stall": per_save_stall[0] / steady if steady else None,
            "persist_vs_floor": gbps / persist_floor if gbps and persist_floor and fsynced else None,
            "persist_vs_floor_while_training": gbps / busy_floor_gbps if gbps and busy_floor_gbps and fsynced else None,
            "persist_vs_best_floor_sample": gbps / best_floor_gbps if gbps and best_floor_gbps and fsynced else None,
            "stall_vs_copy_floor": stall / copy_floor_s if stall is not None else None,
            "note": first.get("note", ""),
        }
        if "rss_before_save" in first:
            # from the second save on, the staging buffers exist: RSS should stay flat from there
            rss = [max(r["methods"][name]["rss_before_save"][i] for r in ranks) for i in range(len(first["rss_before_save"]))]
            entry["rss_growth_over_saves"] = (rss[-1] - rss[1]) / rss[1] if len(rss) > 2 else None
            entry["staging_bytes"] = sum(r["methods"][name]["staging_bytes"][-1] for r in ranks)
            entry["staging_flat"] = all(len(set(r["methods"][name]["staging_bytes"])) == 1 for r in ranks)
        entry["next_step_over_before_s"] = next_step_over_before(rank0_steps, name, first["saves"])
        entry["durable_profile"] = durable_profile(ranks, name, report["target"]["kind"])
        if name == "stock":
            stock_stall = stall
        methods[name] = entry
    # from each save until the kernel has written its page-cache bytes back (rank 0's machine): stock's
    # deferred writeback, which slows steps that would otherwise count as ordinary ones
    writeback_spans: dict[str, list[tuple[float, float]] | None] = {}
    for name in windows:
        spans = writeback.windows(rank0_steps, name, ranks[0]["methods"][name]["saves"])
        writeback_spans[name] = spans
        methods[name]["writeback_window_s"] = writeback.union_s(spans) if spans is not None else None
        drained = [r["methods"][name].get("written_back") for r in ranks]
        methods[name]["written_back"] = None if None in drained else all(drained)
    setup_spans = {name: [tuple(w) for w in ranks[0]["methods"][name].get("setup_windows", [])] for name in windows}
    outside_steps = [s for s in rank0_steps
                     if not any(_overlaps(s, spans or []) for spans in (*windows.values(), *writeback_spans.values(),
                                                                        *setup_spans.values()))]
    outside = [s["end"] - s["start"] for s in outside_steps]
    for name, ws in windows.items():
        inside_steps = [s for s in rank0_steps if s["method"] == name and _overlaps(s, ws)]
        inside = [s["end"] - s["start"] for s in inside_steps]
        base = _median(outside)
        # the steps the set-up's background work overlapped: their extra time, per turn (signed, as below)
        slowed = [s["end"] - s["start"] - base for s in rank0_steps
                  if s["method"] == name and _overlaps(s, setup_spans[name]) and not _overlaps(s, ws)] if base else []
        methods[name]["setup_steps"] = len(slowed)
        methods[name]["setup_steps_extra_per_turn_s"] = (sum(slowed) / len(setup_spans[name])
                                                         if slowed and setup_spans[name] else None)
        methods[name]["steps_inside_windows"] = len(inside)
        methods[name]["slowdown_while_persisting"] = (_median(inside) / base - 1) if inside and base else None
        # where that slowdown goes: the CPU time and page faults each step adds while the write runs
        for key, figure in (("extra_cpu_per_step_while_persisting_s", "cpu_s"),
                           ("extra_page_faults_per_step_while_persisting", "page_faults")):
            ins = [s[figure] for s in inside_steps if figure in s]
            outs = [s[figure] for s in outside_steps if figure in s]
            methods[name][key] = _median(ins) - _median(outs) if ins and outs else None
        methods[name]["extra_cpu_per_step_by_thread_s"] = _extra_by_thread(inside_steps, outside_steps)
        # everything a save costs the training loop: the stall plus the extra time of the steps that overlap
        # the write. Signed (a step faster than the median offsets a slower one), else step-time noise alone
        # would count as lost time for every method that writes in the background; never below zero.
        saves = len(ranks[0]["methods"][name]["saves"])
        waited = waited_in_windows[name]  # counted once, in the stall
        extra = max(0.0, sum(t - base for t in inside) - waited) / saves if base else 0.0
        stall_counted = _stall_counted(methods[name])
        if stall_counted is not None:
            methods[name]["training_time_lost_per_save_s"] = stall_counted + extra
        # the same, counting also the steps until the kernel wrote the saves' page-cache bytes back; the
        # signed extra is kept unclipped too, since over many steps it is mostly the run's step-time noise
        spans = writeback_spans[name]
        # the whole machine's CPU in each save's call and in the steps from its return until it is durable and
        # written back: the cost that step times, drifting by as much over a run, cannot settle (the kernel
        # also writes earlier saves' bytes back inside a page-cache save's call, when the dirty pages reach
        # its limit)
        calls = [{"start": c["start"], "end": c["start"] + c["call_s"], "machine_cpu_s": c.get("machine_cpu_s")}
                 for c in ranks[0]["methods"][name]["saves"]]
        costed = [s for s in rank0_steps if s["method"] == name and _overlaps(s, ws + (spans or []))]
        methods[name]["extra_machine_cpu_per_save_s"] = machine_cpu.extra_per_save(costed + calls, outside_steps, saves)
        # the same steps' wall time, where the writeback was measured
        for key in ("steps_inside_writeback_windows", "writeback_extra_signed_per_save_s",
                    "writeback_extra_signed_vs_own_steps_per_save_s", "lost_incl_writeback_per_save_s"):
            methods[name][key] = None
        if spans is not None and base:
            with_writeback = [s["end"] - s["start"] for s in costed]
            signed = (sum(t - base for t in with_writeback) - waited) / saves
            methods[name]["steps_inside_writeback_windows"] = len(with_writeback)
            methods[name]["writeback_extra_signed_per_save_s"] = signed
            # against the method's own ordinary steps instead of the run's: step time drifts between the
            # methods of one run, by as much as a save costs
            own = _median([s["end"] - s["start"] for s in outside_steps if s["method"] == name])
            if own:
                methods[name]["writeback_extra_signed_vs_own_steps_per_save_s"] = (
                    (sum(t - own for t in with_writeback) - waited) / saves)
            if stall_counted is not None:
                methods[name]["lost_incl_writeback_per_save_s"] = stall_counted + max(0.0, signed)
    stock_with_writeback = methods.get("stock", {}).get("lost_incl_writeback_per_save_s")
    stock_peak = methods.get("stock", {}).get("peak_rss_above_start_bytes")
    for name in windows:
        peak = methods[name].get("peak_rss_above_start_bytes")
        methods[name]["peak_rss_vs_stock"] = peak / stock_peak if peak is not None and stock_peak else None
        if stock_stall and methods[name].get("stall_s"):
            methods[name]["stall_reduction_vs_stock"] = stock_stall / methods[name]["stall_s"]
            lost = methods[name].get("training_time_lost_per_save_s")
            methods[name]["lost_vs_stock"] = lost / stock_stall if lost is not None else None
        if stock_with_writeback and methods[name].get("lost_incl_writeback_per_save_s") is not None:
            methods[name]["lost_incl_writeback_vs_stock"] = (methods[name]["lost_incl_writeback_per_save_s"]
                                                              / stock_with_writeback)
    return {"floor": {"bytes": floor_bytes, "copy_s": copy_floor_s, "copy_gbps": floor_bytes / len(ranks) / copy_floor_s / GB,
                      "local_write_gbps": local_floor_gbps, "local_write_while_training_gbps": busy_floor_gbps,
                      "local_write_best_sample_gbps": best_floor_gbps,
                      "s3_upload_gbps": s3_floor_gbps},
            "median_step_s_outside_saves": _median(outside), "peak_rss_bytes": max(r["peak_rss"] for r in ranks),
            "methods": methods}


def _max_known(values: Any) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _extra_by_thread(inside: list[dict], outside: list[dict]) -> dict[str, float] | None:
    """Per thread name, the median CPU of the steps inside the write minus that outside (a thread absent
    from a step used none in it): which threads the extra CPU per step went to. ``None`` without figures."""
    inside = [s["threads_cpu_s"] for s in inside if "threads_cpu_s" in s]
    outside = [s["threads_cpu_s"] for s in outside if "threads_cpu_s" in s]
    if not inside or not outside:
        return None
    names = {name for step in inside + outside for name in step}
    return {name: _median([s.get(name, 0.0) for s in inside]) - _median([s.get(name, 0.0) for s in outside])
            for name in sorted(names)}


def _threads(ranks: list[dict]) -> str:
    """" (N PyTorch threads each)" where the ranks recorded it (runs before it was recorded did not)."""
    threads = {r["threads"] for r in ranks if "threads" in r}
    if len(threads) != 1:
        return ""
    n = threads.pop()
    return f" ({n} PyTorch thread{'' if n == 1 else 's'} each)"


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def table(report: dict) -> str:
    s = report["summary"]
    cfg = report["config"]
    floor = s["floor"]
    lines = [
        f"## Save benchmark: ZeRO-{cfg['stage']} {cfg['dtype']}, {cfg['ranks']} ranks"
        f"{_threads(report['ranks'])}, "
        f"workload {cfg.get('workload', 'gpt')} '{cfg['size']}'"
        f"{'' if cfg.get('micro_batch') is None else ' at micro-batch ' + str(cfg['micro_batch'])}, "
        f"target {report['target']['kind']}, {cfg['saves']} saves x {cfg['steps_between']} steps"
        f"{'' if cfg.get('rounds', 1) == 1 else ' in each of ' + str(cfg['rounds']) + ' rounds (the methods taking turns)'}",
        "",
        f"checkpoint {floor['bytes'] / GB:.3f} GB per save (all ranks); floors: copy {floor['copy_s'] * 1000:.1f} ms "
        f"({floor['copy_gbps']:.1f} GB/s per rank), local write+fsync {floor['local_write_gbps']:.2f} GB/s"
        + (f" (the best way's median; the fastest sample of any way {floor['local_write_best_sample_gbps']:.2f} GB/s)"
           if floor.get("local_write_best_sample_gbps") else "")
        + (f" ({floor['local_write_while_training_gbps']:.2f} GB/s while training)"
           if floor.get("local_write_while_training_gbps") else "")
        + (f", boto3 TransferManager {floor['s3_upload_gbps']:.3f} GB/s" if floor["s3_upload_gbps"] else "")
        + f"; median step outside saves {_fmt(s['median_step_s_outside_saves'], '.3f', ' s')}",
        "",
        "| method | stall / save | vs copy floor | stall reduction vs stock | time to durable | persist GB/s | vs floor "
        "| vs floor while training | vs the floor's best sample | slowdown while persisting | step after a save vs the 10 before | training time lost / save "
        "| lost vs stock | first-save stall | first / steady stall | GB / save |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in s["methods"].items():
        if "skipped" in m:
            lines.append(f"| {name} | not run: {m['skipped'][:120]} |" + "  |" * 14)
            continue
        lines.append(
            f"| {name} | {_fmt(m['stall_s'], '.3f', ' s')} | {_fmt(m['stall_vs_copy_floor'], '.2f', 'x')} "
            f"| {_fmt(m.get('stall_reduction_vs_stock'), '.1f', 'x')} | {_fmt(m['durable_s'], '.2f', ' s')}"
            f"{'' if m.get('fsynced', True) else ' (not fsynced)'} "
            f"| {_fmt(m['persist_gbps'], '.3f')} | {_fmt(m['persist_vs_floor'], '.0%')} "
            f"| {_fmt(m.get('persist_vs_floor_while_training'), '.0%')} "
            f"| {_fmt(m.get('persist_vs_best_floor_sample'), '.0%')} "
            f"| {_fmt(m.get('slowdown_while_persisting'), '+.0%')}"
            f"{'' if m.get('steps_inside_windows') is None else ' (' + str(m['steps_inside_windows']) + ' steps)'} "
            f"| {_fmt(m.get('next_step_over_before_s'), '+.3f', ' s')} "
            f"| {_fmt(m.get('training_time_lost_per_save_s', m['stall_s']), '.3f', ' s')} "
            f"| {_fmt(m.get('lost_vs_stock'), '.2f', 'x')} | {_fmt(m.get('first_stall_s'), '.3f', ' s')} "
            f"| {_fmt(m.get('first_vs_steady_stall'), '.1f', 'x')} | {m['bytes_per_save'] / GB:.3f} |")
    ran = {name: m for name, m in s["methods"].items() if m.get("writeback_window_s") is not None}
    if ran:
        lines += ["", "Counting also the steps until the kernel wrote the saves' page-cache bytes back (rank 0's "
                  "machine; a save that writes with `O_DIRECT` and fsync leaves none). Over many steps the signed "
                  "extra is mostly the run's step-time noise:", "",
                  "| method | page-cache bytes waiting (s, all saves) | steps counted | signed extra / save "
                  "| the same against the method's own ordinary steps | lost / save incl. writeback "
                  "| vs stock's incl. writeback |", "|---|---|---|---|---|---|---|"]
        for name, m in ran.items():
            lines.append(f"| {name} | {m['writeback_window_s']:.1f} s"
                         f"{' (not all written back within the cap)' if m['written_back'] is False else ''} "
                         f"| {_fmt(m['steps_inside_writeback_windows'], 'd')} "
                         f"| {_fmt(m['writeback_extra_signed_per_save_s'], '+.3f', ' s')} "
                         f"| {_fmt(m['writeback_extra_signed_vs_own_steps_per_save_s'], '+.3f', ' s')} "
                         f"| {_fmt(m['lost_incl_writeback_per_save_s'], '.3f', ' s')} "
                         f"| {_fmt(m.get('lost_incl_writeback_vs_stock'), '.2f', 'x')} |")
    costed = {name: m["extra_machine_cpu_per_save_s"] for name, m in s["methods"].items()
              if m.get("extra_machine_cpu_per_save_s")}
    if costed:
        lines += ["", "The whole machine's CPU (`/proc/stat`, all cores) in each save's call and in rank 0's steps "
                  "from its return until it was durable and written back, beyond what ordinary steps used in the "
                  "same time, per save (what a save costs outside the training: the kernel's writeback, the other "
                  "rank's writer, the hypervisor's `steal`; by kind, since training's share only moves between them):",
                  "",
                  "| method | " + " | ".join(machine_cpu.KINDS) + " | system + steal |",
                  "|---|" + "---|" * (len(machine_cpu.KINDS) + 1)]
        for name, extra in costed.items():
            lines.append(f"| {name} | " + " | ".join(f"{extra[k]:+.2f} s" for k in machine_cpu.KINDS)
                         + f" | {extra['system'] + extra['steal']:+.2f} s |")
    measured = {name: m for name, m in s["methods"].items() if m.get("peak_rss_above_start_bytes") is not None}
    if measured:
        lines += ["", "Memory and set-up, per method's turn (max over ranks): the peak of the resident set above "
                  "its size at the turn's start (the kernel's high-water mark, reset then: training's own peak "
                  "within a step is in every method's), the time to construct the method (`wrap()` for "
                  "async_ckpt), and the extra time of the steps that ran while what the set-up left in the "
                  "background did (async_ckpt's staging reserve being faulted in, or on a GPU pinned), per turn; "
                  "those steps do not count as ordinary ones:", "",
                  "| method | peak RSS above start | vs stock | peak GPU memory above start | set-up "
                  "| steps during the set-up's background work: extra per turn |",
                  "|---|---|---|---|---|---|"]
        for name, m in measured.items():
            lines.append(f"| {name} | {m['peak_rss_above_start_bytes'] / GB:.3f} GB "
                         f"| {_fmt(m.get('peak_rss_vs_stock'), '.2f', 'x')} "
                         f"| {_fmt(m['peak_gpu_above_start_bytes'] and m['peak_gpu_above_start_bytes'] / GB, '.3f', ' GB')} "
                         f"| {m['setup_s']:.3f} s "
                         f"| {_fmt(m.get('setup_steps_extra_per_turn_s'), '+.3f', ' s')} ({m.get('setup_steps', 0)} steps) |")
    profiled = {name: m["durable_profile"] for name, m in s["methods"].items() if m.get("durable_profile")}
    if profiled:
        lines += ["", "Where the time to durable goes (per save the slowest rank's, median over saves; the longest "
                  "file is the optimizer state's, with its copy waits and fsyncs; after the files: the commit, the "
                  "manifest and `latest`), beside the target's floor for that rank's bytes:", "",
                  "| method | stall | queued | start mark | other files | longest file | of the write, waiting for "
                  "the overlapped copy | after the files | floor: idle | floor: while training |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, p in profiled.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(p[key], '.3f', ' s') for key in (
                "stall_s", "queued_s", "mark_s", "other_files_s", "longest_file_s", "copy_wait_s", "after_files_s",
                "floor_s", "floor_while_training_s")) + " |")
    for name, m in s["methods"].items():
        if (m.get("finish_wait_s") or 0.0) > 0.05:
            lines.append(f"\n{name}: its last save was still writing when its turn ended: {m['finish_wait_s']:.2f} s "
                         "of it (all rounds) ran with training stopped, charged to no step")
        if "staging_bytes" in m:
            lines.append(f"\n{name}: staging {m['staging_bytes'] / GB:.3f} GB (flat across saves: {m['staging_flat']}), "
                         f"RSS growth from the 2nd to the last save {_fmt(m['rss_growth_over_saves'], '+.1%')}")
        if m.get("extra_cpu_per_step_while_persisting_s") is not None:
            lines.append(f"\n{name}: each step while persisting, rank 0 (all its threads) "
                         f"{m['extra_cpu_per_step_while_persisting_s']:+.3f} s of CPU and "
                         f"{m['extra_page_faults_per_step_while_persisting']:+.0f} page faults against the steps outside saves")
        if m.get("extra_cpu_per_step_by_thread_s"):
            by_thread = sorted(m["extra_cpu_per_step_by_thread_s"].items(), key=lambda kv: -abs(kv[1]))
            lines.append(f"\n{name}: that CPU by thread (median inside minus outside): "
                         + ", ".join(f"{thread} {extra:+.3f} s" for thread, extra in by_thread))
        if m.get("note"):
            lines.append(f"\n{name}: {m['note']}")
    lines.append(f"\nRSS sampled after each step, largest (max over ranks) {s['peak_rss_bytes'] / GB:.2f} GB")
    return "\n".join(lines)


def timeline_png(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank0 = report["ranks"][0]
    t0 = rank0["steps"][0]["start"]
    fig, ax = plt.subplots(figsize=(12, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [n for n, m in rank0["methods"].items() if "saves" in m]
    for i, name in enumerate(names):
        for save in rank0["methods"][name]["saves"]:
            end = save["start"] + (save["durable_s"] or save["call_s"])
            ax.axvspan(save["start"] - t0, end - t0, color=colors[i % len(colors)], alpha=0.25,
                       label=name if save is rank0["methods"][name]["saves"][0] else None)
    xs = [s["end"] - t0 for s in rank0["steps"]]
    ys = [s["end"] - s["start"] for s in rank0["steps"]]
    ax.plot(xs, ys, "k.-", label="step time (rank 0)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Training steps and save windows (save call → durable)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: str, report: dict, text: str) -> str:
    """``results.json`` (the raw figures) and ``table.md`` (``text``) into ``out``; print the table.
    Returns the path of ``results.json``."""
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, "results.json")
    with open(results, "w") as fh:
        json.dump(report, fh, indent=1)
    with open(os.path.join(out, "table.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return results
