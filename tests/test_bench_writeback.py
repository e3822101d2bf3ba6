"""The bench charges a save the steps that the kernel's deferred writeback of its page-cache bytes slows, and
the steps a save's own wait slowed only once."""

from __future__ import annotations

import pytest

from async_ckpt.bench.report import summarize
from async_ckpt.bench.writeback import SLACK_BYTES, dirty_bytes, train_until_written_back, union_s, windows

GIB = 1024**3


def _steps(method: str, start: float, durations: list[float], dirty: list[int]) -> tuple[list[dict], float]:
    out = []
    for d, level in zip(durations, dirty):
        out.append({"method": method, "start": start, "end": start + d, "dirty_bytes": level})
        start += d
    return out, start


def test_dirty_bytes_adds_the_dirty_and_under_writeback_pages_of_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nDirty:              100 kB\nWriteback:           28 kB\n")
    assert dirty_bytes(str(meminfo)) == 128 * 1024
    assert dirty_bytes(str(tmp_path / "missing")) is None
    meminfo.write_text("MemTotal:       24683656 kB\n")
    assert dirty_bytes(str(meminfo)) is None  # not measured, rather than clean


def test_a_save_that_left_its_bytes_in_the_page_cache_is_open_until_a_step_finds_them_written_back():
    steps, _ = _steps("stock", 10.0, [1.0, 1.0, 1.0, 1.0], [2 * GIB, 2 * GIB, 0, 0])
    save = {"start": 9.0, "call_s": 1.0, "dirty_before": 0, "dirty_after": 2 * GIB}
    assert windows(steps, "stock", [save]) == [(10.0, 13.0)]


def test_a_save_whose_bytes_were_never_written_back_in_its_round_is_open_to_that_rounds_last_step_only():
    first, t = _steps("stock", 10.0, [1.0, 1.0], [2 * GIB, 2 * GIB])  # capped: still dirty at the round's end
    second, _ = _steps("stock", t + 50.0, [1.0, 1.0], [0, 0])  # the next round, after other methods' turns
    for step in second:
        step["round"] = 1
    save = {"start": 9.0, "call_s": 1.0, "dirty_before": 0, "dirty_after": 2 * GIB, "round": 0}
    assert windows(first + second, "stock", [save]) == [(10.0, 12.0)]


def test_a_save_made_while_an_earlier_ones_bytes_are_written_back_is_open_until_all_are():
    # the second save returns with fewer dirty bytes than before it: older ones were written back meanwhile
    steps, _ = _steps("stock", 10.0, [1.0, 1.0, 1.0, 1.0, 1.0], [2 * GIB, 3 * GIB, 2 * GIB, 0, 0])
    first = {"start": 9.0, "call_s": 1.0, "dirty_before": 0, "dirty_after": 2 * GIB}
    second = {"start": 11.0, "call_s": 0.5, "dirty_before": 3 * GIB, "dirty_after": 2 * GIB}
    spans = windows(steps, "stock", [first, second])
    assert spans == [(10.0, 14.0), (11.5, 14.0)] and union_s(spans) == 4.0


def test_a_background_write_through_the_page_cache_is_open_until_a_step_finds_its_bytes_written_back():
    steps, _ = _steps("buffered", 10.0, [1.0, 1.0, 1.0], [GIB, 0, 0])
    save = {"start": 9.0, "call_s": 1.0, "dirty_before": 0, "dirty_after": 0}
    assert windows(steps, "buffered", [save]) == [(10.0, 12.0)]


def test_a_save_that_left_nothing_in_the_page_cache_has_no_writeback_window():
    steps, _ = _steps("async_ckpt", 10.0, [1.0, 1.0], [0, 0])
    save = {"start": 9.0, "call_s": 1.0, "dirty_before": 0, "dirty_after": SLACK_BYTES}
    assert windows(steps, "async_ckpt", [save]) == []


def test_a_method_that_recorded_no_dirty_bytes_has_its_writeback_unmeasured_not_clean():
    steps = [{"method": "stock", "start": 10.0, "end": 11.0, "dirty_bytes": None}]
    assert windows(steps, "stock", [{"start": 9.0, "call_s": 1.0, "dirty_before": None, "dirty_after": None}]) is None
    assert train_until_written_back(lambda: None, None, lambda waiting: waiting) is None


def test_training_goes_on_until_the_dirty_bytes_are_back_to_the_level_before_the_saves():
    levels = iter([2 * GIB, GIB, 0])
    stepped = []
    assert train_until_written_back(lambda: stepped.append(1), 0, lambda waiting: waiting, dirty=lambda: next(levels))
    assert len(stepped) == 2


def test_training_goes_on_while_another_rank_still_waits_for_its_writeback():
    other_rank_waiting = iter([True, True, False])
    stepped = []
    assert train_until_written_back(lambda: stepped.append(1), 0, lambda waiting: waiting or next(other_rank_waiting),
                                    dirty=lambda: 0)
    assert len(stepped) == 2


def test_training_stops_waiting_for_writeback_at_the_cap_and_says_so():
    stepped = []
    assert not train_until_written_back(lambda: stepped.append(1), 0, lambda waiting: waiting,
                                        dirty=lambda: 2 * GIB, cap_s=0.0)
    assert stepped == []


def _report(steps: list[dict], methods: dict[str, list[dict]]) -> dict:
    rank = {"floor": {"bytes": GIB, "copy_s": 0.1, "local_write_s": 1.0}, "steps": steps, "peak_rss": GIB,
            "methods": {name: {"saves": saves, "bytes_per_save": GIB, "written_back": True}
                        for name, saves in methods.items()}}
    return {"ranks": [rank], "target": {"kind": "local"}}


@pytest.fixture
def page_cache_vs_direct():
    """Stock saves at 2 s and leaves 2 GiB in the page cache, whose writeback slows its next five steps by
    0.5 s each (most of the run's steps: counted as ordinary ones, they would be the median); async_ckpt
    saves at 11.5 s with O_DIRECT (nothing left dirty) and writes until 13.6 s, slowing its next two steps
    by 0.2 s each. Every other step takes 1 s."""
    before, t = _steps("stock", 0.0, [1.0, 1.0], [0, 0])
    stock_save = {"start": t, "call_s": 1.0, "durable_s": 1.0, "extra_stall_s": 0.0, "dirty_before": 0,
                  "dirty_after": 2 * GIB}
    after, t = _steps("stock", t + 1.0, [1.5] * 5 + [1.0], [2 * GIB] * 4 + [0, 0])
    ours_save = {"start": t, "call_s": 0.1, "durable_s": 2.1, "extra_stall_s": 0.0, "dirty_before": 0,
                 "dirty_after": 0}
    ours, _ = _steps("async_ckpt", t + 0.1, [1.2, 1.2, 1.0], [0] * 3)
    return summarize(_report(before + after + ours, {"stock": [stock_save], "async_ckpt": [ours_save]}))


def test_a_page_cache_saves_writeback_is_charged_to_it_in_lost_incl_writeback(page_cache_vs_direct):
    stock = page_cache_vs_direct["methods"]["stock"]
    assert stock["training_time_lost_per_save_s"] == pytest.approx(1.0)  # the figure: the stall alone
    assert stock["lost_incl_writeback_per_save_s"] == pytest.approx(1.0 + 5 * 0.5)
    assert stock["writeback_window_s"] == pytest.approx(7.5) and stock["steps_inside_writeback_windows"] == 5
    assert stock["writeback_extra_signed_per_save_s"] == pytest.approx(5 * 0.5)


def test_steps_slowed_by_a_writeback_are_not_the_baseline_of_any_method(page_cache_vs_direct):
    assert page_cache_vs_direct["median_step_s_outside_saves"] == pytest.approx(1.0)
    ours = page_cache_vs_direct["methods"]["async_ckpt"]
    assert ours["training_time_lost_per_save_s"] == pytest.approx(0.1 + 2 * 0.2)


def test_a_save_written_with_o_direct_costs_the_same_with_or_without_the_writeback_counted(page_cache_vs_direct):
    ours = page_cache_vs_direct["methods"]["async_ckpt"]
    assert ours["lost_incl_writeback_per_save_s"] == pytest.approx(ours["training_time_lost_per_save_s"])
    assert ours["writeback_window_s"] == 0.0
    assert ours["lost_incl_writeback_vs_stock"] == pytest.approx(0.5 / 3.5)


def test_without_dirty_byte_readings_lost_incl_writeback_is_not_reported():
    steps, t = _steps("stock", 0.0, [1.0, 1.0, 1.0], [None] * 3)
    save = {"start": 1.0, "call_s": 0.5, "durable_s": 0.5, "extra_stall_s": 0.0}
    stock = summarize(_report(steps, {"stock": [save]}))["methods"]["stock"]
    assert stock["writeback_window_s"] is None and stock["lost_incl_writeback_per_save_s"] is None


def test_the_writeback_extra_is_also_measured_against_the_methods_own_ordinary_steps():
    # the run drifts: stock's ordinary steps take 2 s, async_ckpt's 1 s; stock's writeback adds 0.5 s to each of two
    before, t = _steps("stock", 0.0, [2.0, 2.0, 2.0], [0] * 3)
    save = {"start": t, "call_s": 1.0, "durable_s": 1.0, "extra_stall_s": 0.0, "dirty_before": 0, "dirty_after": GIB}
    after, t = _steps("stock", t + 1.0, [2.5, 2.5, 2.0], [GIB, 0, 0])
    ours, _ = _steps("async_ckpt", t, [1.0] * 9, [0] * 9)
    ours_save = {"start": ours[4]["start"], "call_s": 0.0, "durable_s": 0.0, "extra_stall_s": 0.0,
                 "dirty_before": 0, "dirty_after": 0}
    stock = summarize(_report(before + after + ours, {"stock": [save], "async_ckpt": [ours_save]}))["methods"]["stock"]
    assert stock["writeback_extra_signed_vs_own_steps_per_save_s"] == pytest.approx(2 * 0.5)
    assert stock["writeback_extra_signed_per_save_s"] == pytest.approx(2 * 1.5)  # against the run's 1 s median


def test_steps_during_a_set_up_left_in_the_background_are_charged_to_it_not_the_baseline():
    """async_ckpt's wrap() at 0 s leaves its staging reserve faulting in until 2.5 s: its first three steps
    take 2 s each; every other step takes 1 s. Its save at 8 s is durable by 8.5 s."""
    steps, t = _steps("async_ckpt", 0.0, [2.0, 2.0, 2.0, 1.0, 1.0], [0] * 5)
    save = {"start": t + 1.0, "call_s": 0.1, "durable_s": 0.5, "extra_stall_s": 0.0, "dirty_before": 0,
            "dirty_after": 0}
    after, _ = _steps("async_ckpt", t, [1.0, 1.0, 1.0], [0] * 3)
    report = _report(steps + after, {"async_ckpt": [save]})
    report["ranks"][0]["methods"]["async_ckpt"]["setup_windows"] = [[0.0, 2.5]]
    summary = summarize(report)
    ours = summary["methods"]["async_ckpt"]
    assert summary["median_step_s_outside_saves"] == pytest.approx(1.0)
    assert ours["setup_steps"] == 2 and ours["setup_steps_extra_per_turn_s"] == pytest.approx(2.0)


def test_a_wait_inside_the_step_after_a_save_counts_once_in_the_training_time_lost():
    """DeepSpeed's decoupled save returns in 0.1 s and commits, blocking for 0.5 s, inside the next step:
    that step takes 1.5 s where the others take 1 s. The save cost training 0.1 + 0.5 s, not 0.1 + 0.5 + 0.5."""
    before, t = _steps("ds_decoupled", 0.0, [1.0, 1.0, 1.0], [0] * 3)
    save = {"start": t, "call_s": 0.1, "durable_s": 0.6, "extra_stall_s": 0.5, "dirty_before": 0, "dirty_after": 0}
    after, _ = _steps("ds_decoupled", t + 0.1, [1.5, 1.0, 1.0], [0] * 3)
    decoupled = summarize(_report(before + after, {"ds_decoupled": [save]}))["methods"]["ds_decoupled"]
    assert decoupled["stall_s"] == pytest.approx(0.6)
    assert decoupled["training_time_lost_per_save_s"] == pytest.approx(0.6)
    assert decoupled["lost_incl_writeback_per_save_s"] == pytest.approx(0.6)


def test_a_rare_long_wait_after_one_save_of_several_counts_once_in_the_training_time_lost():
    """Four saves return in 0.1 s; the step after the first waits 1 s more (its commit, or its copy): each
    save cost training 0.1 s, plus that one second spread over the four: 0.35 s, not the median's 0.1 s."""
    steps, t, saves = [], 0.0, []
    for i in range(4):
        before, t = _steps("ds_decoupled", t, [1.0, 1.0, 1.0], [0] * 3)
        wait = 1.0 if i == 0 else 0.0
        saves.append({"start": t, "call_s": 0.1, "durable_s": 0.1 + wait + 0.05, "extra_stall_s": wait,
                      "dirty_before": 0, "dirty_after": 0})
        after, t = _steps("ds_decoupled", t + 0.1, [1.0 + wait], [0])
        steps += before + after
    decoupled = summarize(_report(steps, {"ds_decoupled": saves}))["methods"]["ds_decoupled"]
    assert decoupled["stall_s"] == pytest.approx(0.1)
    assert decoupled["training_time_lost_per_save_s"] == pytest.approx(0.35)
    assert decoupled["lost_incl_writeback_per_save_s"] == pytest.approx(0.35)
