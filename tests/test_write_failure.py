"""A failing background write fails the tag on every rank, keeps 'latest', and is surfaced."""

from __future__ import annotations

import pytest

import rank_tasks


@pytest.fixture(scope="module", params=["warn", "raise"])
def failed(request, ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fail-{request.param}")
    return request.param, ranks.run(rank_tasks.failing_write_keeps_previous, str(root), request.param)


def test_every_rank_handle_reports_the_failure(failed):
    _, out = failed
    for rank in out:
        kind, message = rank["handle_error"]
        assert kind == "SaveFailedError" and "'bad'" in message and "rank 1" in message


def test_failing_rank_error_names_file_and_cause(failed):
    _, out = failed
    message = out[1]["handle_error"][1]
    assert "optim_states.pt" in message and "No space left" in message


def test_latest_still_names_the_previous_tag(failed):
    _, out = failed
    assert [r["latest"] for r in out] == ["good", "good"]
    assert out[0]["bad_manifest"] is False


def test_failed_tag_leaves_no_partial_data_files(failed):
    _, out = failed
    assert out[1]["bad_data_files"] == []


def test_next_save_raises_only_when_on_error_is_raise(failed):
    mode, out = failed
    for rank in out:
        if mode == "raise":
            assert rank["next_save"][0] == "SaveFailedError"
        else:
            assert rank["next_save"] is None
