"""A rank SIGKILLed mid-upload or mid-commit: nothing half-written is ever loaded, and a fresh job
resumes from the last committed tag with bitwise the same losses as the run that got there."""

from __future__ import annotations

import json
import os

import pytest

import rank_tasks
from async_ckpt.launch import RankError
from s3_server import FaultProxy, options


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


@pytest.fixture(scope="module", params=["upload", "commit"], ids=["mid-upload", "mid-commit"])
def crashed_on_s3(request, ranks, s3, tmp_path_factory):
    """A rank SIGKILLed with a request of 'doomed' in flight (rank 1's multipart upload, or rank 0's PUT of
    the manifest); a fresh job with empty caches resumes from the bucket."""
    phase = request.param
    work = tmp_path_factory.mktemp(f"kill-s3-{phase}")
    bucket = s3.make_bucket(f"kill-mid-{phase}")
    proxy = FaultProxy(s3.endpoint)
    try:
        with pytest.raises(RankError, match="died") as info:
            ranks.run(rank_tasks.killed_mid_s3_save, f"s3://{bucket}/run", options(proxy.endpoint),
                      proxy.endpoint, str(work / "result"), phase, timeout_s=180)
    finally:
        proxy.stop()
    ranks.restart()
    before = [json.loads((work / f"result.{r}.json").read_text()) for r in range(2)]
    url = f"s3://{bucket}/run"
    resumed = ranks.run(rank_tasks.resume_latest, url, options(s3.endpoint), "small", str(work / "cache"))
    return {"phase": phase, "url": url, "bucket": bucket, "before": before, "resumed": resumed,
            "error": str(info.value)}


def test_s3_kill_leaves_latest_on_the_last_commit(crashed_on_s3, s3):
    assert "died (exit code -9)" in crashed_on_s3["error"]
    client = s3.client()
    assert client.get_object(Bucket=crashed_on_s3["bucket"], Key="run/latest")["Body"].read() == b"good"
    assert client.list_objects_v2(Bucket=crashed_on_s3["bucket"],
                                  Prefix="run/doomed/async_ckpt_manifest.json").get("KeyCount") == 0


def test_s3_fresh_job_resumes_from_the_bucket_bitwise(crashed_on_s3):
    assert [r["tag"] for r in crashed_on_s3["resumed"]] == ["good", "good"]
    for rank in range(2):
        assert crashed_on_s3["resumed"][rank]["losses"] == crashed_on_s3["before"][rank]["losses_after_good"]


def test_s3_gc_removes_what_the_crash_left_behind(crashed_on_s3, s3):
    from async_ckpt.gc import collect_garbage
    from async_ckpt.storage import open_storage

    storage = open_storage(crashed_on_s3["url"], options(s3.endpoint))
    found = collect_garbage(storage, grace_s=0, dry_run=True)
    assert found.incomplete_tags == ["doomed"]
    if crashed_on_s3["phase"] == "upload":
        assert any("doomed/zero_pp_rank_1" in u for u in found.aborted_uploads)
    collect_garbage(storage, grace_s=0)
    client = s3.client()
    assert client.list_multipart_uploads(Bucket=crashed_on_s3["bucket"]).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=crashed_on_s3["bucket"], Prefix="run/doomed/").get("KeyCount") == 0
    assert client.list_objects_v2(Bucket=crashed_on_s3["bucket"], Prefix="run/good/")["KeyCount"] > 0


def test_a_result_a_rank_cannot_send_back_fails_the_call_naming_it_and_the_group_goes_on(ranks):
    with pytest.raises(RankError, match="return_a_lock returned a lock, which cannot be sent back from the rank"):
        ranks.run(rank_tasks.return_a_lock, timeout_s=60)
    assert ranks.run(rank_tasks.return_the_rank) == [0, 1]


def test_a_rank_that_hangs_is_reported_with_where_it_hangs(ranks):
    """Last in this module: it tears the group down, as any hang does."""
    with pytest.raises(RankError, match=r"ranks \[1\] did not answer within 5 s") as info:
        ranks.run(rank_tasks.hang_on_rank, 1, 120, timeout_s=5)
    assert "rank 1, which did not answer, was here" in str(info.value)
    assert "_stuck_in_a_long_wait" in str(info.value)
