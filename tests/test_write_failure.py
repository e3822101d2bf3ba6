"""A failing background write fails the tag on every rank, keeps 'latest', and is surfaced."""

from __future__ import annotations

import errno
import os

import pytest

import rank_tasks


FAULTS = [("warn", "ENOSPC", 0), ("raise", "ENOSPC", 0), ("warn", "EIO", 100_000), ("warn", "EACCES", 100_000)]


@pytest.fixture(scope="module", params=FAULTS, ids=[f"{m}-{e}-after{n}" for m, e, n in FAULTS])
def failed(request, ranks, tmp_path_factory):
    """Rank 1's optimizer-file write fails: at once (disk full), or mid-file (I/O error, permission denied)."""
    mode, fail_errno, after_bytes = request.param
    root = tmp_path_factory.mktemp(f"fail-{mode}-{fail_errno}")
    out = ranks.run(rank_tasks.failing_write_keeps_previous, str(root), mode, fail_errno, after_bytes)
    return mode, out, os.strerror(getattr(errno, fail_errno))


def test_every_rank_handle_reports_the_failure(failed):
    _, out, _ = failed
    for rank in out:
        kind, message = rank["handle_error"]
        assert kind == "SaveFailedError" and "'bad'" in message and "rank 1" in message
        assert message.count("'latest' are unchanged") == 1


def test_failing_rank_error_names_file_and_cause(failed):
    _, out, cause = failed
    message = out[1]["handle_error"][1]
    assert "optim_states.pt" in message and cause in message


def test_latest_still_names_the_previous_tag(failed):
    _, out, _ = failed
    assert [r["latest"] for r in out] == ["good", "good"]
    assert out[0]["bad_manifest"] is False


def test_retention_keeps_the_previous_tag_when_the_newer_save_fails(failed):
    _, out, _ = failed
    assert [r["good_manifest"] for r in out] == [True, True]  # keep_last=1, yet the only committed tag stays


def test_failed_tag_leaves_no_partial_data_files(failed):
    _, out, _ = failed
    assert out[1]["bad_data_files"] == []


def test_a_failed_tag_leaves_only_the_failing_ranks_start_mark_for_gc(failed):
    """Rank 0 removed its files and its mark; rank 1's write was cut short, which may leave what its own
    cleanup cannot see (on S3, an upload whose abort failed), so its mark stays for gc."""
    _, out, _ = failed
    assert [r["bad_files"] for r in out] == [["bad/.async_ckpt/started-rank1"]] * 2


def test_a_failed_save_leaves_no_tokenizer_or_config_behind_in_the_shadow_folder(failed):
    _, out, _ = failed
    assert [r["extras_left"] for r in out] == [[], []]


def test_next_save_raises_only_when_on_error_is_raise(failed):
    mode, out, _ = failed
    for rank in out:
        if mode == "raise":
            assert rank["next_save"][0] == "SaveFailedError"
        else:
            assert rank["next_save"] is None


@pytest.fixture(scope="module")
def known_to_one_rank_first(ranks, tmp_path_factory):
    """The failing rank knows of its failure before the others learn it from the commit."""
    root = tmp_path_factory.mktemp("fail-known-first")
    return ranks.run(rank_tasks.failure_known_to_one_rank_first, str(root / "ckpt"), timeout_s=180)


def test_a_failure_one_rank_knows_first_is_raised_by_every_rank_at_the_next_save(known_to_one_rank_first):
    assert [rank["knew_before_next_save"] for rank in known_to_one_rank_first] == [False, True]
    for rank in known_to_one_rank_first:
        kind, message = rank["next_save"]
        assert kind == "SaveFailedError" and "'bad'" in message and "rank 1" in message


def test_a_failure_raised_for_another_rank_is_not_raised_again(known_to_one_rank_first):
    for rank in known_to_one_rank_first:
        assert rank["wait_after"] is None and rank["close"] is None


def test_slow_storage_delays_durability_not_training(ranks, tmp_path):
    out = ranks.run(rank_tasks.save_to_slow_storage, str(tmp_path))
    for rank in out:
        assert rank["steps"] == 2 and rank["done_after_steps"] is False
        assert rank["tag"] == "slow" and rank["latest"] == "slow"


def test_a_failed_overwrite_says_the_tag_stays_uncommitted_not_that_the_checkpoint_is_unchanged(ranks, tmp_path):
    for rank in ranks.run(rank_tasks.failing_overwrite_of_a_committed_tag, str(tmp_path / "ckpt")):
        assert rank["t_committed"] is False
        assert "'latest' are unchanged" not in rank["handle_error"]
        assert "'t' was committed before this save uncommitted it" in rank["handle_error"]


def test_a_failed_overwrite_keeps_every_ranks_start_mark_for_gc(ranks, tmp_path):
    """Rank 0's write did not fail, yet files of the old tag that this save did not rewrite may stay."""
    for rank in ranks.run(rank_tasks.failing_overwrite_of_a_committed_tag, str(tmp_path / "ckpt")):
        assert rank["t_marks"] == ["started-rank0", "started-rank1"]


def test_an_overwrite_rank_0_cannot_uncommit_fails_on_every_rank_and_leaves_the_tag_committed(ranks, tmp_path):
    """Before, rank 0 alone raised after the save's collective and the other ranks went on into DeepSpeed's."""
    for rank, seen in enumerate(ranks.run(rank_tasks.overwrite_that_cannot_uncommit_the_tag, str(tmp_path / "ckpt"))):
        kind, message = seen["raised"]
        assert kind == ("PermissionError" if rank == 0 else "StorageError") and "Permission denied" in message
        assert seen["t_committed"] and seen["after"] == "u"


def test_a_save_that_raises_on_one_rank_after_the_agreement_fails_at_once_on_the_others(ranks, tmp_path):
    """Before, the other ranks' writers waited for that rank's files until the commit timed out (2 x
    commit_timeout_s), with the saves queued behind it."""
    out = ranks.run(rank_tasks.save_that_rank_0_fails_after_the_agreement, str(tmp_path / "ckpt"))
    assert "No space left on device (injected)" in out[0]["raised"] and out[0]["failed"] is None
    assert "failed on rank 0 during save() on the training thread" in out[1]["failed"]
    assert [rank["after"] for rank in out] == ["after"] * 2 and out[0]["bad_files"] == []
    assert [rank["done"] for rank in out] == [["after"], ["bad", "after"]]  # rank 0's save() raised it


# ---------------------------------------------------------------- a save DeepSpeed fails; a failing model-states file


@pytest.fixture(scope="module")
def deepspeed_failed(ranks, tmp_path_factory):
    """DeepSpeed's save_checkpoint raises after it handed over the model states."""
    return ranks.run(rank_tasks.deepspeed_failing_after_the_model_states, str(tmp_path_factory.mktemp("ds-fails")))


@pytest.fixture(scope="module")
def model_states_failed(ranks, tmp_path_factory):
    """Rank 1's write of its model-states file fails (disk full)."""
    return ranks.run(rank_tasks.deepspeed_failing_after_the_model_states,
                     str(tmp_path_factory.mktemp("model-states-fails")), True)


def test_a_save_deepspeed_fails_raises_deepspeeds_error_from_save(deepspeed_failed):
    for rank in deepspeed_failed:  # the premise: it fails once the model states were handed over
        assert [name for name in rank["handed_over"] if name.endswith("_model_states.pt")] != []
    assert [rank["raised"] for rank in deepspeed_failed] == [("RuntimeError", "optimizer state_dict failed (injected)")] * 2


def test_a_save_deepspeed_fails_leaves_nothing_of_its_tag_and_latest_as_it_was(deepspeed_failed):
    assert [(rank["bad_files"], rank["latest_after_bad"]) for rank in deepspeed_failed] == [([], "good")] * 2


def test_the_same_checkpointer_saves_and_commits_after_deepspeed_failed_a_save(deepspeed_failed):
    assert [(rank["next_save"], rank["latest"]) for rank in deepspeed_failed] == [(None, "after")] * 2


def test_a_model_states_file_that_fails_fails_the_tag_naming_it(model_states_failed):
    kind, message = model_states_failed[1]["raised"]
    assert kind == "SaveFailedError" and "rank 1" in message
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in message and os.strerror(errno.ENOSPC) in message
    assert model_states_failed[0]["raised"][0] == "SaveFailedError"


def test_a_model_states_file_that_fails_leaves_only_the_failing_ranks_start_mark_and_latest_as_it_was(
        model_states_failed):
    assert [(rank["bad_files"], rank["latest_after_bad"]) for rank in model_states_failed] == \
        [(["bad/.async_ckpt/started-rank1"], "good")] * 2


def test_the_save_after_a_failed_model_states_file_commits(model_states_failed):
    assert [(rank["next_save"], rank["latest"]) for rank in model_states_failed] == [(None, "after")] * 2


def test_several_failures_surfaced_at_once_raise_the_first_naming_the_others():
    import threading
    from types import SimpleNamespace

    from async_ckpt.checkpointer import AsyncCheckpointer
    from async_ckpt.errors import SaveFailedError

    ckpt = AsyncCheckpointer.__new__(AsyncCheckpointer)  # the error bookkeeping alone: no engine, no ranks
    ckpt.__dict__.update(config=SimpleNamespace(on_error="raise"), _errors_lock=threading.Lock(), _errors=[],
                         _unreported=[], _raised_for_peers=set())
    for tag in ("a", "b", "c"):
        ckpt._record_failure(SaveFailedError(f"save of {tag} failed", tag=tag))
    with pytest.raises(SaveFailedError, match="save of a failed") as raised:
        ckpt._surface_errors()
    assert raised.value.__notes__ == ["2 later save(s) failed too, of tag(s) ['b', 'c']; every failure is in failures"]
    assert ckpt._unreported == [] and len(ckpt._errors) == 3
