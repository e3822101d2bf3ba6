"""Readers in the same process see a save once it is committed: loads and DeepSpeed's tools wait for it."""

from __future__ import annotations

import glob
import multiprocessing
import os
import queue
import tempfile

import pytest

import reader_tasks
from async_ckpt.launch import free_port
from commit_tasks import _tag_state


def test_a_new_engine_loading_right_after_save_waits_for_the_commit_and_loads_it(ranks, tmp_path):
    out = ranks.run(reader_tasks.load_on_a_new_engine_right_after_save, str(tmp_path / "ckpt"))
    for rank in out:
        assert rank["in_flight_at_load"] is True
        assert rank["loaded"] == "fresh" and rank["steps"] == rank["expected_steps"]


def test_ds_to_universal_right_after_save_waits_for_the_commit(ranks, tmp_path):
    out = ranks.run(reader_tasks.ds_to_universal_right_after_save, str(tmp_path / "ckpt"), str(tmp_path / "universal"))
    assert out[0]["in_flight_at_convert"] is True and out[0]["converted"]


def test_zero_to_fp32_imported_before_wrap_waits_for_the_commit(ranks, tmp_path):
    out = ranks.run(reader_tasks.zero_to_fp32_imported_before_wrap_right_after_save, str(tmp_path / "ckpt"))
    for rank in out:
        assert rank["in_flight"] is True and rank["tensors"] > 0


def test_wait_all_waits_for_every_save_in_flight(ranks, tmp_path):
    out = ranks.run(reader_tasks.wait_all_right_after_save, str(tmp_path / "ckpt"))
    for rank in out:
        assert rank == {"in_flight": True, "done_after_wait_all": True, "latest": "a"}


def test_a_synchronous_save_returns_with_its_files_committed(ranks, tmp_path):
    for rank in ranks.run(reader_tasks.synchronous_save_then_read_the_files, str(tmp_path / "ckpt")):
        assert rank["module_keys"] > 0 and rank["latest"] == "sync"


def test_a_synchronous_save_that_fails_raises_in_the_save_call_on_every_rank(ranks, tmp_path):
    for rank in ranks.run(reader_tasks.synchronous_save_that_fails, str(tmp_path / "ckpt")):
        assert rank["failed"][0] == "SaveFailedError" and "'bad'" in rank["failed"][1]
        assert rank["latest"] == "good"


@pytest.fixture(scope="module", params=[(1, "bf16"), (2, "fp32"), (3, "fp32")], ids=["zero1-bf16", "zero2-fp32", "zero3-fp32"])
def synchronous_saves(request, ranks, tmp_path_factory):
    """One step saved by the defaults (staged, in the background) and synchronously to buffered and O_DIRECT files."""
    stage, dtype = request.param
    root = tmp_path_factory.mktemp(f"sync-zero{stage}-{dtype}")
    return root, ranks.run(reader_tasks.default_and_synchronous_saves_of_one_step, str(root), stage, dtype)


def _same_files(root, name: str) -> None:
    staged = sorted((root / "staged" / "t").glob("*.pt"))
    assert len(staged) >= 3
    for path in staged:
        assert (root / name / "t" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_synchronous_save_to_buffered_files_writes_the_host_state_in_place_byte_for_byte_the_default_files(
        synchronous_saves):
    """There the write copies the bytes from wherever they are: a staging copy would only add one."""
    root, out = synchronous_saves
    for rank in out:
        saved = rank["in_place"]
        assert 0 < saved["in_place_bytes"] <= saved["bytes_written"] and saved["staging_bytes"] < saved["in_place_bytes"]
    _same_files(root, "in_place")


def test_a_synchronous_save_with_o_direct_is_staged_byte_for_byte_the_default_files(synchronous_saves):
    """There the staged copy, placed like the file, is what lets the write lend its memory without a copy."""
    root, out = synchronous_saves
    assert [rank["direct"]["in_place_bytes"] for rank in out] == [0, 0]
    _same_files(root, "direct")


def test_a_synchronous_save_reports_its_wait_for_the_commit_apart_from_the_stall(synchronous_saves):
    _, out = synchronous_saves
    assert all(rank[name]["commit_wait_s"] > 0 for rank in out for name in ("in_place", "direct"))


def test_a_synchronous_save_given_up_while_reading_the_state_in_place_fails_instead_of_committing(ranks, tmp_path):
    """Training went on while the files were still read from its state: they may mix two steps."""
    out = ranks.run(reader_tasks.synchronous_save_given_up_while_it_reads_the_state, str(tmp_path / "ckpt"),
                    str(tmp_path / "gate"))
    for rank in out:
        assert rank["gave_up"][0] == "WaitTimeoutError"
        assert rank["failed"][0] == "SaveFailedError" and "'torn'" in rank["failed"][1]
        assert rank["latest"] == "good" and rank["torn_committed"] is False
    assert any("training stopped waiting" in rank["failed"][1] for rank in out)


_PER_RANK: dict[str, list] = {}


@pytest.fixture(scope="module")
def per_rank(ranks, tmp_path_factory):
    """``per_rank(mode)``: each rank saves its own tag under checkpoint.tag_validation=mode (run once per mode)."""
    def run(mode: str) -> list:
        if mode not in _PER_RANK:
            root = tmp_path_factory.mktemp(f"per-rank-{mode}") / "ckpt"
            _PER_RANK[mode] = ranks.run(reader_tasks.per_rank_tags, str(root), mode)
        return _PER_RANK[mode]
    return run


def test_per_rank_tags_allowed_by_tag_validation_are_saved_as_deepspeed_saves_them(per_rank):
    for rank, seen in enumerate(per_rank("WARN")):  # IGNORE takes the same path, without DeepSpeed's warning
        assert seen["error"] is None
        assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in seen["own_tag_files"]


def test_per_rank_tags_under_tag_validation_fail_raise_deepspeeds_own_assertion(per_rank):
    assert [seen["error"][0] for seen in per_rank("FAIL")] == ["AssertionError", "AssertionError"]


def test_ckpt_save_refuses_per_rank_tags_whatever_tag_validation_says(per_rank):
    assert [seen["api_error"][0] for seen in per_rank("WARN")] == ["TagMismatchError", "TagMismatchError"]


def test_an_empty_save_dir_is_deepspeeds_value_error(per_rank):
    for seen in per_rank("WARN"):
        assert seen["empty_dir"][0] == "ConfigError" and "save_dir must be a non-empty string" in seen["empty_dir"][1]


@pytest.fixture(scope="module")
def resaved(ranks, tmp_path_factory):
    return ranks.run(reader_tasks.resave_a_committed_tag, str(tmp_path_factory.mktemp("resave") / "ckpt"))


def test_saving_a_committed_tag_again_is_refused_and_names_the_switch(resaved):
    for seen in resaved:
        assert seen["refused"][0] == "TagExistsError" and "overwrite_tags=True" in seen["refused"][1]


def test_overwrite_tags_lets_a_tag_be_saved_again_as_deepspeed_does(resaved):
    for seen in resaved:
        assert seen["resaved_steps"] > seen["first_steps"]
        assert seen["loaded_steps"] == seen["resaved_steps"] and seen["latest"] == "t"


def test_destroying_the_process_group_right_after_save_waits_for_the_commit(ranks, tmp_path):
    try:
        out = ranks.run(reader_tasks.save_then_destroy_the_process_group, str(tmp_path / "ckpt"))
    finally:
        ranks.restart()  # its ranks have no process group any more
    for rank in out:
        assert rank["in_flight"] is True
        assert rank["latest"] == "before_destroy" and rank["committed"] and rank["verified"]


def test_destroying_the_process_group_after_a_failed_save_raises_the_failure_and_destroys_it(ranks, tmp_path):
    try:
        out = ranks.run(reader_tasks.save_failing_then_destroy_the_process_group, str(tmp_path / "ckpt"))
    finally:
        ranks.restart()
    for rank in out:
        assert rank["raised"][0] == "SaveFailedError"
        assert rank["group_left"] is False


def test_destroying_the_process_group_while_a_save_outlasts_the_wait_keeps_the_group_for_its_commit(ranks, tmp_path):
    try:
        out = ranks.run(reader_tasks.save_held_then_destroy_the_process_group, str(tmp_path / "ckpt"),
                        str(tmp_path / "gate"))
    finally:
        ranks.restart()
    for rank in out:
        assert rank["raised"][0] == "WaitTimeoutError"
        assert rank["group_kept"] is True and rank["latest"] == "held"


@pytest.fixture(scope="module")
def exited(tmp_path_factory):
    """Two ranks, started as multiprocessing children of their own (no RankGroup: its ranks destroy the
    process group before they end), each saves and returns; then what the tag looks like on disk."""
    root = str(tmp_path_factory.mktemp("exited") / "ckpt")
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    shadows_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "async_ckpt_shadow_*")))
    procs = [ctx.Process(target=reader_tasks.save_and_exit, args=(root, rank, 2, port, answers)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        if proc.exitcode is None:
            proc.kill()
    got = []
    while True:
        try:
            got.append(answers.get(timeout=1))
        except queue.Empty:
            break
    shadows_left = set(glob.glob(os.path.join(tempfile.gettempdir(), "async_ckpt_shadow_*"))) - shadows_before
    return {"exitcodes": [p.exitcode for p in procs], "ranks": sorted(got, key=lambda a: a["rank"]),
            "shadow_folders_made": sorted({p for a in got for p in a["shadow_folders"]} - shadows_before),
            "shadow_folders_left": sorted(shadows_left),
            "latest": reader_tasks._read_latest(root), **_tag_state(root, "before_exit")}


def test_a_process_that_ends_right_after_save_commits_the_save_first(exited):
    assert exited["exitcodes"] == [0, 0]
    assert [rank["in_flight"] for rank in exited["ranks"]] == [True, True]
    assert exited["latest"] == "before_exit" and exited["committed"] and exited["verified"]


def test_a_process_that_ends_without_closing_its_checkpointer_leaves_no_shadow_folder(exited):
    assert exited["exitcodes"] == [0, 0]
    assert len(exited["shadow_folders_made"]) == 2  # one per rank, while its save was in flight
    assert exited["shadow_folders_left"] == []


def test_a_forked_child_of_a_process_with_a_save_in_flight_ends_without_waiting_for_it(exited):
    for rank in exited["ranks"]:
        assert rank["forked_child_s"] is not None  # it ended within its join's wait
        assert rank["in_flight_after_fork"] is True  # the save outlasted the child
