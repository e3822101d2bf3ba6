"""After a crash, load() finds the newest committed tag, verifies what it reads, and refuses mismatches."""

from __future__ import annotations

import os

import pytest

import rank_tasks


@pytest.fixture(scope="module")
def recovered(ranks, tmp_path_factory):
    return ranks.run(rank_tasks.recovery_after_crashes, str(tmp_path_factory.mktemp("recovery") / "ckpt"))


@pytest.mark.parametrize("case", ["stale_latest", "dangling_latest", "missing_latest"])
def test_load_picks_the_newest_committed_tag_when_latest_is_wrong(recovered, case):
    assert [r[case] for r in recovered] == ["newer", "newer"]


WHY = {"stale_latest": "'latest' names 'older' (step 1) but a newer tag is committed",
       "dangling_latest": "'latest' names 'deleted-tag', which is missing, corrupt or was never committed",
       "missing_latest": "'latest' is missing"}


@pytest.mark.parametrize("case", list(WHY))
def test_load_says_which_tag_it_chose_and_why(recovered, case):
    for rank in recovered:
        [line] = rank[f"{case}_log"]
        assert "resuming from newer" in line and WHY[case] in line


def test_corrupt_shard_is_refused_on_every_rank_naming_file_and_checksums(recovered):
    for rank in recovered:
        kind, message = rank["corrupt_shard"]
        assert kind == "VerificationError"
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in message and "crc32" in message


def test_corrupt_shard_with_fallback_loads_the_previous_committed_tag(recovered):
    assert [r["corrupt_shard_fallback"] for r in recovered] == ["older", "older"]


def test_truncated_shard_is_refused_naming_expected_and_actual_size(recovered):
    for rank in recovered:
        kind, message = rank["truncated_shard"]
        assert kind == "VerificationError" and "size 1000 != expected" in message


def test_a_refused_tag_says_to_load_another_or_fall_back(recovered):
    for rank in recovered:
        assert rank["truncated_shard"][1].endswith("; load another tag or pass fallback=True")


def test_a_fallback_with_no_older_tag_says_so_and_not_to_pass_fallback(recovered):
    for rank in recovered:
        kind, message = rank["truncated_shard_fallback"]
        assert kind == "VerificationError" and "size 1000 != expected" in message
        assert message.endswith("; no older committed tag to fall back to") and "pass fallback" not in message


def test_missing_shard_is_refused_naming_the_file(recovered):
    for rank in recovered:
        kind, message = rank["missing_shard"]
        assert kind == "VerificationError" and "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in message


def test_manifest_from_another_world_size_is_refused(ranks, tmp_path):
    out = ranks.run(rank_tasks.load_manifest_from_other_layout, str(tmp_path / "ckpt"), "world_size", 4)
    kind, message = out[0]["load"]
    assert kind == "UsageError" and "4 rank(s)" in message and "to-universal" in message


def test_manifest_from_another_zero_stage_is_refused(ranks, tmp_path):
    out = ranks.run(rank_tasks.load_manifest_from_other_layout, str(tmp_path / "ckpt"), "zero_stage", 1)
    kind, message = out[0]["load"]
    assert kind == "UsageError" and "ZeRO-1" in message and "ZeRO-2" in message


def test_a_fallback_to_a_tag_from_another_world_size_is_refused_naming_it(ranks, tmp_path):
    out = ranks.run(rank_tasks.load_manifest_from_other_layout, str(tmp_path / "ckpt"), "world_size", 4,
                    as_fallback=True)
    for rank in out:
        kind, message = rank["load"]
        assert kind == "UsageError" and "tag 't' was saved by 4 rank(s)" in message


def test_a_load_that_fails_on_one_rank_raises_on_every_rank_instead_of_leaving_the_others_waiting(ranks, tmp_path):
    out = ranks.run(rank_tasks.load_fails_on_one_rank, str(tmp_path / "ckpt"), timeout_s=240)
    assert out[1]["load"][0] == "OSError" and "injected" in out[1]["load"][1]
    kind, message = out[0]["load"]
    assert kind == "StorageError" and "rank 1 failed to find the tag to load" in message


def test_ranks_that_find_different_latest_tags_are_refused_rather_than_each_loading_its_own(ranks, tmp_path):
    out = ranks.run(rank_tasks.load_sees_a_stale_root_on_one_rank, str(tmp_path / "ckpt"), timeout_s=240)
    for rank in out:
        kind, message = rank["load"]
        assert kind == "StorageError" and "different checkpoints" in message
        assert "(a (save " in message and ", b (save " in message


def test_keep_last_deletes_older_committed_tags_after_newer_commits(ranks, tmp_path):
    out = ranks.run(rank_tasks.retention, str(tmp_path / "ckpt"), 2, None)[0]
    assert out["tags"] == ["global_step4", "global_step5"] and out["latest"] == "global_step5"


def test_keep_last_never_deletes_the_tag_latest_names(ranks, tmp_path):
    out = ranks.run(rank_tasks.retention_spares_the_latest_tag, str(tmp_path / "ckpt"))[0]
    assert out["latest"] == "a" and out["tags"] == ["a", "c"]


def test_keep_every_protects_tags_from_retention(ranks, tmp_path):
    out = ranks.run(rank_tasks.retention, str(tmp_path / "ckpt"), 2, 2)[0]
    assert out["tags"] == ["global_step2", "global_step4", "global_step5"]


@pytest.mark.parametrize("save_id", ["../../escape", "/abs/path", "", "a" * 65])
def test_a_cached_save_stays_in_its_urls_cache_folder_whatever_the_manifests_save_id(save_id, tmp_path):
    from async_ckpt.manifest import Manifest
    from async_ckpt.resume import cache_root

    manifest = Manifest(tag="t", step=1, world_size=2, zero_stage=2, dtype="fp32", files=[], save_id=save_id,
                        created_unix=5.0)
    root = cache_root(str(tmp_path), "s3://bucket/run", manifest)
    assert os.path.dirname(os.path.dirname(root)) == str(tmp_path) and "/" not in os.path.basename(root)
    assert ".." not in os.path.basename(root) and os.path.basename(root) != save_id
