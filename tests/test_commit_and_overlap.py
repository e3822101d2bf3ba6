"""Training goes on while a save persists; nothing is committed before every rank's data is durable."""

from __future__ import annotations

import pytest
import torch

import rank_tasks


def test_training_steps_complete_while_the_write_is_held(ranks, tmp_path):
    out = ranks.run(rank_tasks.save_while_storage_is_gated, str(tmp_path / "ckpt"), str(tmp_path / "gate"))
    for rank in out:
        assert rank["steps_done"] == 3
        assert rank["done_during_steps"] is False
        assert rank["latest_during_steps"] is False


def test_commit_lands_after_the_held_write_completes(ranks, tmp_path):
    out = ranks.run(rank_tasks.save_while_storage_is_gated, str(tmp_path / "ckpt"), str(tmp_path / "gate"))
    assert [r["latest_after"] for r in out] == [out[0]["tag"]] * 2


@pytest.fixture(scope="module")
def one_rank_held(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    return ranks.run(rank_tasks.commit_waits_for_every_rank, str(root / "ckpt"), str(root / "gate"))[0]


def test_latest_is_absent_while_another_rank_is_still_writing(one_rank_held):
    assert one_rank_held["rank0_waiting"] is True
    assert one_rank_held["rank0_durable"] is True
    assert one_rank_held["latest_before"] is False
    assert one_rank_held["manifest_before"] is False


def test_latest_names_the_tag_once_every_rank_is_durable(one_rank_held):
    assert one_rank_held["latest_after"] == "first"


def test_tokenizer_lands_with_the_commit(one_rank_held):
    assert one_rank_held["rank0_waiting"] is True
    assert one_rank_held["tokenizer_before"] is False
    assert one_rank_held["tokenizer_after"] is True


def _optimizer_files(root, tag):
    return sorted((root / tag).glob("*_optim_states.pt")) + sorted((root / tag).glob("*_model_states.pt"))


def _assert_same_tensors(a, b, path="") -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        for key in a:
            if key not in ("ds_config",):
                _assert_same_tensors(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensors(x, y, f"{path}[{i}]")


@pytest.mark.parametrize("mode", ["mutate-by-hand", "overlapped-copy-then-step", "steps-in-backward"])
def test_state_changed_after_save_does_not_leak_into_the_checkpoint(ranks, tmp_path, mode):
    tag = ranks.run(rank_tasks.snapshot_ignores_later_mutation, str(tmp_path), mode)[0]["tag"]
    reference = _optimizer_files(tmp_path / "reference", tag)
    ours = _optimizer_files(tmp_path / "async", tag)
    assert [p.name for p in ours] == [p.name for p in reference] and reference
    for ref, got in zip(reference, ours):
        _assert_same_tensors(torch.load(ref, weights_only=False), torch.load(got, weights_only=False), ref.name)


def test_staging_memory_stays_one_saves_when_client_state_keys_change_every_save(ranks, tmp_path):
    """Buffers are named by their tensor's path: one whose key changes every save is freed once unused."""
    for rank_out in ranks.run(rank_tasks.client_state_keyed_by_step, str(tmp_path), 4):
        assert rank_out["staged"][-1] == rank_out["staged"][0] > 0
        assert rank_out["loaded"] == {0: {"step0": [0.0]}, 3: {"step3": [3.0]}}


def test_on_save_done_callback_gets_every_finished_save_and_cannot_break_saving(ranks, tmp_path):
    out = ranks.run(rank_tasks.save_done_callback, str(tmp_path))
    for rank_out in out:
        assert [s["tag"] for s in rank_out["seen"]] == ["one"]
        assert rank_out["seen"][0]["done"] and rank_out["seen"][0]["ok"]
        assert {"stall_s", "persist_s", "copy_wait_s", "bytes_written", "durable_s"} <= set(rank_out["seen"][0]["metrics"])
        assert rank_out["committed_despite_raising_callback"] == "two"


def test_a_zero3_load_without_optimizer_states_does_not_wait_for_saves_inside_deepspeeds_reader(ranks, tmp_path):
    """It reads through zero_to_fp32, hooked to wait for saves: with a local tier, drains would hold it."""
    for rank_out in ranks.run(rank_tasks.waits_inside_a_zero3_load_without_optimizer_states, str(tmp_path)):
        assert rank_out == {"loaded": "a", "waits": 0}


def test_waiting_for_saves_in_a_save_done_callback_is_refused_saying_where_it_runs(ranks, tmp_path):
    """The callback runs on the thread that writes the saves it would wait for."""
    for rank_out in ranks.run(rank_tasks.waits_in_a_save_done_callback, str(tmp_path)):
        for call in ("wait_all", "wait", "close"):
            kind, message = rank_out[call]
            assert kind == "UsageError" and f"{call}(): called in an on_save_done callback" in message
        assert rank_out["saves_after"] == "b"


def test_a_save_done_callback_reads_the_committed_checkpoint_through_deepspeeds_hooked_reader(ranks, tmp_path):
    for rank_out in ranks.run(rank_tasks.waits_in_a_save_done_callback, str(tmp_path)):
        assert rank_out["read"] > 0


def test_durable_time_counts_from_the_save_call_through_the_stall_the_write_and_the_commit(ranks, tmp_path):
    for rank_out in ranks.run(rank_tasks.save_done_callback, str(tmp_path)):
        metrics = rank_out["seen"][0]["metrics"]
        assert metrics["durable_s"] >= metrics["stall_s"] + metrics["persist_s"] + metrics.get("commit_s", 0.0)


def test_durable_time_is_told_apart_into_the_stall_the_queue_the_write_and_rank_0s_commit_steps(ranks, tmp_path):
    rank0, rank1 = (out["seen"][0]["metrics"] for out in ranks.run(rank_tasks.save_done_callback, str(tmp_path)))
    commit_steps = ("ranks_wait_s", "extras_s", "commit_s", "after_commit_s")  # rank 0's alone
    assert all(rank0[k] >= 0 for k in commit_steps) and not set(commit_steps) & set(rank1)
    for metrics in (rank0, rank1):
        parts = ("stall_s", "queued_s", "persist_s", *commit_steps)
        assert 0 <= metrics["queued_s"] and sum(metrics.get(k, 0.0) for k in parts) <= metrics["durable_s"]


def test_the_write_is_told_apart_into_the_start_mark_and_each_file(ranks, tmp_path):
    for out in ranks.run(rank_tasks.save_done_callback, str(tmp_path)):
        metrics = out["seen"][0]["metrics"]
        files = metrics["seconds_by_file"]
        assert files and all(path.startswith("one/") and path.endswith(".pt") for path in files)
        assert any(path.endswith("_optim_states.pt") for path in files) and min(files.values()) > 0
        assert 0 < metrics["mark_s"] and metrics["mark_s"] + sum(files.values()) <= metrics["persist_s"]


@pytest.fixture(scope="module")
def second_save_during_first(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("back-to-back")
    return ranks.run(rank_tasks.save_while_previous_persists, str(root / "ckpt"), str(root / "gate"))


def test_save_while_the_previous_one_persists_waits_for_its_write(second_save_during_first):
    for rank in second_save_during_first:
        assert rank["first_written_when_second_returned"] is True
        assert rank["buffer_wait_s"] > 0


@pytest.fixture(scope="module")
def one_rank_stuck(ranks, tmp_path_factory):
    """Rank 1's previous write is held past wait_timeout_s while the ranks save, then export."""
    root = tmp_path_factory.mktemp("one-rank-stuck")
    return ranks.run(rank_tasks.save_while_one_ranks_previous_write_is_stuck, str(root / "ckpt"), str(root / "gate"),
                     timeout_s=300)


def test_a_rank_that_cannot_wait_for_its_previous_save_stops_the_next_save_on_every_rank(one_rank_stuck):
    first, second = one_rank_stuck
    assert second["second"][0] == "WaitTimeoutError" and "rank 1: waited" in second["second"][1]
    assert "(tag 'first' to faulty://" in second["second"][1] and "-own)" in second["second"][1]  # where it goes
    assert first["second"][0] == "WaitTimeoutError"
    assert first["first_committed"] and second["first_committed"]
    assert "rank 1 could not wait for its earlier saves, so no rank saves tag 'second'" in first["second"][1]


def test_a_rank_that_cannot_wait_for_its_previous_save_stops_an_export_on_every_rank_as_a_timeout(one_rank_stuck):
    first, second = one_rank_stuck
    assert second["export"][0] == "WaitTimeoutError" and "rank 1: waited" in second["export"][1]
    assert first["export"][0] == "WaitTimeoutError"
    assert "rank 1 failed to open" in first["export"][1]
    assert "or to wait for the previous save to free the staging buffers" in first["export"][1]


@pytest.fixture(scope="module")
def one_rank_denied(ranks, tmp_path_factory):
    """The engine's saves into a folder other than wrap()'s, which rank 1 may not write."""
    return ranks.run(rank_tasks.save_into_a_folder_one_rank_may_not_write, str(tmp_path_factory.mktemp("denied")),
                     timeout_s=300)


@pytest.mark.parametrize("call", ["save_checkpoint", "save_16bit_model"])
def test_a_save_folder_one_rank_cannot_write_fails_the_save_on_every_rank_naming_that_rank(one_rank_denied, call):
    first, second = one_rank_denied
    assert second[call][0] == "StorageError" and "cannot write checkpoints to" in second[call][1]
    assert first[call][0] == "StorageError" and "rank 1 failed to open" in first[call][1]
    assert "Permission denied" in first[call][1]


def test_saves_go_on_after_a_save_folder_one_rank_cannot_write(one_rank_denied):
    assert [rank["then"] for rank in one_rank_denied] == [None, None]


def test_a_save_into_a_file_url_takes_no_storage_options_of_wraps_url(one_rank_denied):
    """They are for wrap()'s filesystem (here faulty://); a local folder refuses any."""
    assert [rank["into_a_file_url"] for rank in one_rank_denied] == [None, None]
    assert [rank["committed_there"] for rank in one_rank_denied] == [True, True]


def test_back_to_back_saves_never_mix_tensors_between_tags(second_save_during_first):
    for rank in second_save_during_first:
        assert rank["steps_differ"] is True
        assert rank["tags_hold_their_own_step"] == [True, True]
