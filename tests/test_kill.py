"""A rank SIGKILLed mid-upload or mid-commit: nothing half-written is ever loaded, and a fresh job
resumes from the last committed tag with bitwise the same losses as the run that got there."""

from __future__ import annotations

import json
import os

import pytest

import rank_tasks
from async_ckpt.launch import RankError


@pytest.fixture(scope="module", params=["upload", "commit"], ids=["mid-upload", "mid-commit"])
def crashed(request, ranks, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"kill-{request.param}")
    root = work / "ckpt"
    with pytest.raises(RankError, match="died") as info:
        ranks.run(rank_tasks.killed_mid_save, str(root), str(work / "gate"), request.param, str(work / "result"),
                  timeout_s=120)
    ranks.restart()
    before = [json.loads((work / f"result.{r}.json").read_text()) for r in range(2)]
    resumed = ranks.run(rank_tasks.resume_latest, str(root))
    return {"root": root, "before": before, "resumed": resumed, "error": str(info.value)}


def test_the_killed_rank_is_reported(crashed):
    assert "died (exit code -9)" in crashed["error"]


def test_the_interrupted_tag_is_not_committed_and_latest_is_unmoved(crashed):
    assert not (crashed["root"] / "doomed" / "async_ckpt_manifest.json").exists()
    assert (crashed["root"] / "latest").read_text() == "good"


def test_a_fresh_job_resumes_the_last_committed_tag(crashed):
    assert [r["tag"] for r in crashed["resumed"]] == ["good", "good"]


def test_resumed_training_matches_the_run_that_stopped_there_bitwise(crashed):
    for rank in range(2):
        assert crashed["resumed"][rank]["losses"] == crashed["before"][rank]["losses_after_good"]


def test_gc_finds_what_the_crash_left_behind(crashed):
    from async_ckpt.gc import collect_garbage
    from async_ckpt.storage import LocalStorage

    report = collect_garbage(LocalStorage(str(crashed["root"])), grace_s=0, dry_run=True)
    assert report.incomplete_tags == ["doomed"]
    assert os.path.isdir(crashed["root"] / "doomed")
