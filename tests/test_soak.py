"""Soak: many consecutive saves in one run, to local disk and to S3 — all verifiable, memory flat,
no leaked threads, fds, files or multipart uploads."""

from __future__ import annotations

import pytest

import rank_tasks
from s3_server import options

LOCAL_SAVES, S3_SAVES, S3_KEEP = 50, 20, 3


@pytest.fixture(scope="module", params=["local", "s3"])
def soaked(request, ranks, tmp_path_factory, s3):
    if request.param == "local":
        return {"saves": LOCAL_SAVES, "kept": LOCAL_SAVES, "ranks": ranks.run(
            rank_tasks.soak, str(tmp_path_factory.mktemp("soak") / "ckpt"), LOCAL_SAVES)}
    # a model whose shards are several 5 MiB parts, so every save runs multipart uploads on the upload threads
    bucket = s3.make_bucket("soak")
    return {"saves": S3_SAVES, "kept": S3_KEEP, "ranks": ranks.run(
        rank_tasks.soak, f"s3://{bucket}/run", S3_SAVES, options(s3.endpoint), size="small",
        part_size=5 * 1024 * 1024, keep_last=S3_KEEP)}


def test_every_save_is_committed_and_the_kept_ones_verify(soaked):
    for rank in soaked["ranks"]:
        assert rank["tags"] == rank["committed"] == soaked["kept"]
        assert rank["bad_files"] == []


def test_resident_memory_stays_flat(soaked):
    # RSS read with freed blocks handed back at once (rank_tasks._return_freed_blocks_at_once) grew
    # 0.08-0.15 % here; one 5 MiB part kept per save would add about 14 % on S3
    for rank in soaked["ranks"]:
        assert rank["rss_growth"] < 0.01


def test_handles_of_ended_saves_are_let_go_without_a_wait(soaked):
    for rank in soaked["ranks"]:
        assert rank["ended_handles_kept"] == 0


def test_staging_buffers_are_allocated_once_and_reused(soaked):
    for rank in soaked["ranks"]:
        assert rank["allocations_after_first"] > 0
        assert rank["allocations_after_last"] == rank["allocations_after_first"]


def test_threads_do_not_grow_with_saves_and_stop_on_close(soaked, request):
    for rank in soaked["ranks"]:
        assert rank["threads_after_last_save"] == rank["threads_after_first_save"]
        assert any("writer" in name for name in rank["threads_after_first_save"])
        if "s3" in request.node.callspec.id:
            assert any(name.startswith("async_ckpt-s3-lane") for name in rank["threads_after_first_save"])
        assert rank["threads_after_close"] == []


def test_no_file_descriptors_temporary_files_or_uploads_leak(soaked):
    for rank in soaked["ranks"]:
        assert rank["fds_leaked"] <= 0
        assert rank["leftovers"] == []
        assert rank["shadow_dirs_left"] == []
