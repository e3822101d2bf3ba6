"""The bench counts the whole machine's CPU by kind in the steps a save's write and writeback overlap."""

from __future__ import annotations

import os

import pytest

from async_ckpt.bench.machine_cpu import delta, extra_per_save, machine_cpu
from async_ckpt.bench.report import summarize, table

GIB = 1024**3
TICK = os.sysconf("SC_CLK_TCK")


def test_machine_cpu_sums_proc_stats_columns_into_user_system_steal_and_idle(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {TICK * 10} {TICK} {TICK * 2} {TICK * 50} {TICK * 5} 0 {TICK} {TICK * 3} 0 0\n"
                    "cpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert machine_cpu(str(stat)) == {"user": 11.0, "system": 3.0, "steal": 3.0, "idle": 55.0}


def test_machine_cpu_is_unmeasured_without_a_usable_proc_stat(tmp_path):
    assert machine_cpu(str(tmp_path / "missing")) is None
    short = tmp_path / "stat"
    short.write_text("cpu  1 2 3 4\n")
    assert machine_cpu(str(short)) is None
    assert delta(None, {"user": 1.0}) is None


def _step(method: str, start: float, seconds: float, **cpu: float) -> dict:
    used = {"user": 2.0 * seconds, "system": 0.0, "steal": 0.0, "idle": 0.0}  # two busy cores
    return {"method": method, "start": start, "end": start + seconds, "machine_cpu_s": {**used, **cpu}}


def test_extra_per_save_is_what_the_steps_used_beyond_the_ordinary_rate_in_the_same_time():
    outside = [_step("x", 0.0, 1.0, system=0.1), _step("x", 1.0, 1.0, system=0.1)]
    inside = [_step("x", 2.0, 2.0, user=3.2, system=0.6, steal=0.4)]
    extra = extra_per_save(inside, outside, saves=2)
    assert extra == pytest.approx({"user": -0.4, "system": 0.2, "steal": 0.2, "idle": 0.0})


def test_a_few_ordinary_steps_with_steal_do_not_set_the_ordinary_rate():
    # a method's first step after the previous one's checkpoints were deleted: one second of steal
    outside = [_step("x", float(t), 1.0) for t in range(4)] + [_step("x", 4.0, 1.0, user=1.0, steal=1.0)]
    inside = [_step("x", 5.0, 1.0, user=1.5, steal=0.5)]
    assert extra_per_save(inside, outside, saves=1) == pytest.approx({"user": -0.5, "system": 0.0, "steal": 0.5,
                                                                      "idle": 0.0})


def test_extra_per_save_is_unmeasured_without_readings_on_both_sides():
    reading = _step("x", 0.0, 1.0)
    assert extra_per_save([reading], [{**reading, "machine_cpu_s": None}], saves=1) is None
    assert extra_per_save([], [reading], saves=1) is None


def test_the_bench_charges_stocks_writeback_and_async_ckpts_write_their_machine_cpu():
    """Stock's save call takes 0.2 s of steal (the kernel writing earlier bytes back) and leaves 2 GiB dirty;
    their writeback adds 0.3 s of system and 0.5 s of steal to the next two steps. async_ckpt's O_DIRECT write
    adds 0.2 s of system and 0.6 s of steal to one step."""
    steps = [_step("stock", 0.0, 1.0), _step("stock", 1.0, 1.0)]
    for step in steps:
        step["dirty_bytes"] = 0
    stock_save = {"start": 2.0, "call_s": 1.0, "durable_s": 1.0, "extra_stall_s": 0.0, "dirty_before": 0,
                  "dirty_after": 2 * GIB, "machine_cpu_s": _step("stock", 2.0, 1.0, user=1.8, steal=0.2)["machine_cpu_s"]}
    for i, dirty in enumerate((2 * GIB, GIB, 0)):
        slowed = _step("stock", 3.0 + i, 1.0, system=0.15, steal=0.25) if dirty else _step("stock", 3.0 + i, 1.0)
        steps.append({**slowed, "dirty_bytes": dirty})
    ours_save = {"start": 6.0, "call_s": 0.1, "durable_s": 0.9, "extra_stall_s": 0.0, "dirty_before": 0,
                 "dirty_after": 0}
    for i, cpu in enumerate(({"system": 0.2, "steal": 0.6}, {}, {})):
        steps.append({**_step("async_ckpt", 6.1 + i, 1.0, **cpu), "dirty_bytes": 0})
    rank = {"floor": {"bytes": GIB, "copy_s": 0.1, "local_write_s": 1.0}, "steps": steps, "peak_rss": GIB,
            "methods": {"stock": {"saves": [stock_save], "bytes_per_save": GIB, "written_back": True},
                        "async_ckpt": {"saves": [ours_save], "bytes_per_save": GIB, "written_back": True}}}
    report = {"ranks": [rank], "target": {"kind": "local"}, "config": {"stage": 3, "dtype": "fp32", "ranks": 1,
              "size": "tiny", "saves": 1, "steps_between": 2}}
    report["summary"] = summarize(report)
    stock = report["summary"]["methods"]["stock"]["extra_machine_cpu_per_save_s"]
    ours = report["summary"]["methods"]["async_ckpt"]["extra_machine_cpu_per_save_s"]
    assert stock == pytest.approx({"user": -0.2, "system": 0.3, "steal": 0.7, "idle": 0.0})
    assert ours == pytest.approx({"user": 0.0, "system": 0.2, "steal": 0.6, "idle": 0.0})
    assert "| stock | -0.20 s | +0.30 s | +0.70 s | +0.00 s | +1.00 s |" in table(report)
