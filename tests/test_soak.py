"""Soak: 50 consecutive saves in one run — all verifiable, memory flat, no leaked threads, fds or files."""

from __future__ import annotations

import pytest

import rank_tasks

SAVES = 50


@pytest.fixture(scope="module")
def soaked(ranks, tmp_path_factory):
    return ranks.run(rank_tasks.soak, str(tmp_path_factory.mktemp("soak") / "ckpt"), SAVES)


def test_every_one_of_the_saves_is_committed_and_verifies(soaked):
    for rank in soaked:
        assert rank["tags"] == SAVES
        assert rank["bad_files"] == []


def test_resident_memory_stays_flat(soaked):
    for rank in soaked:
        assert rank["rss_growth"] < 0.05


def test_staging_buffers_are_allocated_once_and_reused(soaked):
    for rank in soaked:
        assert rank["allocations_after_first"] > 0
        assert rank["allocations_after_last"] == rank["allocations_after_first"]


def test_threads_are_stopped_on_close(soaked):
    for rank in soaked:
        assert rank["threads_during"] == [rank["threads_during"][0]] and "writer" in rank["threads_during"][0]
        assert rank["threads_after"] == []


def test_no_file_descriptors_or_temporary_files_leak(soaked):
    for rank in soaked:
        assert rank["fds_leaked"] <= 0
        assert rank["partial_files"] == []
        assert rank["shadow_dirs_left"] == []
