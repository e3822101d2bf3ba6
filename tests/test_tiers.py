"""Tiered checkpoints: two simulated nodes (each rank sees only its own local-tier folder), the durable
tier on a real S3 API (moto). Saves commit locally, drain to the bucket; restarts read from the nearest
tier; a drain cut short by a kill is redone; a full local tier falls back to the bucket."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tier_tasks
from async_ckpt import ConfigError, SaveFailedError, commit, drain, wrap
from async_ckpt.catalog import read_latest, read_manifest
from async_ckpt.cli import main as cli_main
from async_ckpt.handle import SaveHandle, SaveResult
from async_ckpt.layout import MANIFEST, MARKS_LOCK, start_mark
from async_ckpt.launch import RankError
from async_ckpt.storage import LocalStorage, open_storage
from async_ckpt.storage.base import PROBE_PREFIX
from async_ckpt.storage.local import file_lock
from async_ckpt.tiers import (TierRoom, choose_tag, committed_view, estimate_save_bytes, holds_chosen_save,
                              node_has_room, prune_local, readable_saves, tier_room, undrained)
from conftest import rank_group
from manifests import commit_by_hand
from s3_server import FaultProxy, options


@pytest.fixture(scope="module", autouse=True)
def fresh_server(s3):
    s3.reset()


@pytest.fixture(scope="module")
def run(s3, ranks, tmp_path_factory):
    """Save a, b, c in tiers; resume in a new job; wipe node 1's folder and resume again."""
    bucket = s3.make_bucket("tiers")
    url, work = f"s3://{bucket}/run", tmp_path_factory.mktemp("tiers")
    opts = options(s3.endpoint)
    saved = ranks.run(tier_tasks.save_in_tiers, url, opts, str(work))
    listing = {rank: sorted(p.name for p in (work / f"node{rank}").iterdir()) for rank in range(2)}
    locks = {rank: (work / f"node{rank}" / MARKS_LOCK).is_file() for rank in range(2)}
    files = {rank: sorted(p.name for p in (work / f"node{rank}" / "c").iterdir())
             for rank in range(2)}
    ranks.restart()
    resumed = ranks.run(tier_tasks.resume_in_tiers, url, opts, str(work), str(work / "stock"))
    shutil.rmtree(work / "node1")
    ranks.restart()
    wiped = ranks.run(tier_tasks.resume_in_tiers, url, opts, str(work))
    full = ranks.run(tier_tasks.save_to_a_full_local_tier, f"{url}-direct", opts, str(work))
    return {"url": url, "work": work, "opts": opts, "saved": saved, "listing": listing, "locks": locks, "files": files,
            "resumed": resumed, "wiped": wiped, "full": full}


def _durable(run, url=None):
    return open_storage(url or run["url"], run["opts"])


def test_a_save_commits_on_the_local_tier_before_it_is_durable(run):
    for rank, out in enumerate(run["saved"]):
        assert out["local_done_first"] is True
        for tag in "abc":
            moments = out[tag]
            assert moments["tier"] == "local"
            assert moments["local_url"] == str(run["work"] / f"node{rank}")
            assert moments["durable_url"] == run["url"]
            assert 0 < moments["local_committed_s"] < moments["durable_s"]


def test_verify_of_a_node_folder_checks_its_own_files_and_names_the_other_nodes(run, tmp_path, capsys):
    """Its manifest lists every rank's files; the folder holds only its node's: those are checked, the rest named."""
    node = tmp_path / "node0"
    shutil.copytree(run["work"] / "node0", node)
    assert cli_main(["verify", str(node), "--tag", "c", "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert {f["path"] for f in files if f["elsewhere"]} == {"zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert all(f["ok"] for f in files if not f["elsewhere"])
    for path in (node / "c").iterdir():  # every file of its own rank gone: failures, not another node's
        if path.is_file() and path.name != MANIFEST:
            path.unlink()
    assert cli_main(["verify", str(node), "--tag", "c"]) == 1
    out = capsys.readouterr().out
    assert "BAD  zero_pp_rank_0_mp_rank_00_optim_states.pt  (missing)" in out
    assert "BAD  mp_rank_00_model_states.pt  (missing)" in out


def test_a_node_folders_manifest_names_its_ranks_and_the_urls_none(run):
    assert read_manifest(open_storage(str(run["work"] / "node0")), "c").node_ranks == [0]
    assert read_manifest(_durable(run), "c").node_ranks == []


def test_every_tag_is_committed_in_the_bucket_with_latest_on_the_newest(run):
    durable = _durable(run)
    assert all(read_manifest(durable, tag) is not None for tag in "abc")
    assert read_latest(durable) == "c"


def test_the_bucket_holds_the_files_the_node_folders_committed(run):
    durable, local = _durable(run), open_storage(str(run["work"] / "node0"))
    assert read_manifest(durable, "c").files == read_manifest(local, "c").files


def test_each_node_folder_holds_what_its_ranks_read_and_no_other_ranks_shard(run):
    for rank, other in ((0, 1), (1, 0)):
        files = run["files"][rank]
        assert "mp_rank_00_model_states.pt" in files and "async_ckpt_manifest.json" in files
        assert any(f.startswith(f"zero_pp_rank_{rank}_") for f in files)
        assert not any(f.startswith(f"zero_pp_rank_{other}_") for f in files)


def test_each_node_folder_has_the_lock_its_start_marks_and_local_retention_share(run):
    assert run["locks"] == {0: True, 1: True}


def test_local_retention_keeps_local_keep_last_tags_and_the_bucket_keeps_all(run):
    for rank in range(2):
        tags = [name for name in run["listing"][rank] if name in ("a", "b", "c")]
        assert tags == ["b", "c"]


def test_a_restarted_job_resumes_the_newest_tag_from_each_nodes_own_folder(run):
    for rank, out in enumerate(run["resumed"]):
        assert out["tag"] == "c"
        assert out["losses"] == run["saved"][rank]["losses_after_c"]
        assert any(f"rank {rank} resumes c from the local tier" in line for line in out["tiers_used"])


def test_a_tag_only_in_the_bucket_resumes_from_it_bitwise_like_stock_deepspeed(run):
    for rank, out in enumerate(run["resumed"]):
        assert out["named_tag"] == "a"
        assert any(f"rank {rank} resumes a from the durable tier" in line for line in out["tiers_used"])
        assert out["losses_named"] == out["losses_stock"] == run["saved"][rank]["losses_after_a"]


def test_a_wiped_node_folder_resumes_from_the_bucket_and_the_other_node_from_its_own(run):
    wiped = run["wiped"]
    assert [out["tag"] for out in wiped] == ["c", "c"]
    assert any("rank 0 resumes c from the local tier" in line for line in wiped[0]["tiers_used"])
    assert any("rank 1 resumes c from the durable tier" in line for line in wiped[1]["tiers_used"])
    for rank in range(2):
        assert wiped[rank]["losses"] == run["saved"][rank]["losses_after_c"]


def test_a_full_local_tier_saves_straight_to_the_bucket_with_a_warning(run):
    for out in run["full"]:
        assert out["tier"] == "durable" and out["url"] == out["local_url"] == f"{run['url']}-direct"
    assert any("local_tier_max_bytes=1" in line for line in run["full"][0]["warnings"])
    assert read_manifest(_durable(run, f"{run['url']}-direct"), "direct") is not None
    assert not (run["work"] / "node0" / "direct").exists()


@pytest.fixture(scope="module")
def killed(run, s3, ranks):
    """Kill rank 1 while its drain of 'd' is held in flight by a proxy; then start the next job."""
    work, proxy = run["work"], FaultProxy(s3.endpoint)
    try:
        with pytest.raises(RankError, match="died") as info:
            ranks.run(tier_tasks.killed_mid_drain, run["url"], options(proxy.endpoint), str(work), proxy.endpoint,
                      str(work / "killed"), timeout_s=240)
    finally:
        proxy.stop()
    durable = _durable(run)
    after_kill = {"latest": read_latest(durable), "d_committed": read_manifest(durable, "d") is not None}
    ranks.restart()
    before = [json.loads((work / f"killed.{r}.json").read_text()) for r in range(2)]
    resumed = ranks.run(tier_tasks.resume_after_killed_drain, run["url"], run["opts"], str(work))
    return {"error": str(info.value), "after_kill": after_kill, "before": before, "resumed": resumed,
            "latest_after": read_latest(durable), "d_after": read_manifest(durable, "d") is not None}


def test_a_kill_mid_drain_leaves_the_buckets_latest_and_tags_unchanged(killed):
    assert "died (exit code -9)" in killed["error"]
    assert all(out["local_committed"] for out in killed["before"])
    assert killed["after_kill"] == {"latest": "c", "d_committed": False}


def test_after_a_kill_mid_drain_the_next_job_resumes_from_the_local_tiers(killed):
    for rank, out in enumerate(killed["resumed"]):
        assert out["tag"] == "d"
        assert out["losses"] == killed["before"][rank]["losses_after_d"]
        assert any(f"rank {rank} resumes d from the local tier" in line for line in out["tiers_used"])


def test_the_next_job_drains_the_tag_a_kill_cut_short(killed):
    assert any("d" in line for line in killed["resumed"][0]["resumed_drain"])
    assert killed["d_after"] is True and killed["latest_after"] == "d"


@pytest.fixture(scope="module", params=["close", "save"])
def healed(request, ranks, tmp_path_factory):
    """A drain that failed (the durable tier refused rank 1's writes), then the tier healed."""
    work = tmp_path_factory.mktemp(f"heal-by-{request.param}")
    out = ranks.run(tier_tasks.drain_fails_then_heals, str(work / "durable"), str(work), request.param)
    return {"by": request.param, "durable": work / "durable", "ranks": out}


def test_a_failed_drain_is_reported_and_leaves_the_durable_tier_unchanged(healed):
    for out in healed["ranks"]:
        assert out["local_committed"] is True
        assert "drain" in out["drain_error"] and "No space left" in out["drain_error"]
        assert out["durable_latest_after_failure"] is False


def test_a_failed_drain_leaves_the_failing_ranks_start_mark_for_gc_as_a_dead_save_of_ours(healed):
    assert [out["gc_after_failure"] for out in healed["ranks"]] == [["first"], ["first"]]


def test_a_failed_drain_removes_what_the_other_ranks_copied(healed):
    """As a failed write does: the rank whose copy was cut short keeps its start mark, for gc."""
    assert healed["ranks"][0]["durable_files_after_failure"] == ["first/.async_ckpt/started-rank1"]


def test_a_failed_drain_is_redone_by_close_or_by_the_next_save(healed):
    durable = open_storage(str(healed["durable"]))
    assert read_manifest(durable, "first") is not None
    assert not (healed["durable"] / "first" / ".async_ckpt").exists()  # the start marks went with the commit
    assert read_latest(durable) == ("second" if healed["by"] == "save" else "first")


def test_a_node_leader_that_cannot_commit_on_its_node_keeps_its_mark_for_gc(ranks, tmp_path):
    out = ranks.run(tier_tasks.node_commit_fails_on_node1, str(tmp_path / "durable"), str(tmp_path))
    assert out[0]["node_manifest"] is True and out[0]["marks"] == [] and out[0]["node_gc"] == []
    assert out[1]["node_manifest"] is False and out[1]["marks"] == ["started-rank1"]
    assert out[1]["node_gc"] == ["t"]
    assert any("could not commit it on its node's tier" in line for line in out[1]["local_warnings"])


def test_a_failed_overwrite_leaves_a_start_mark_in_every_tier_that_held_the_tag(ranks, tmp_path):
    out = ranks.run(tier_tasks.failing_overwrite_in_tiers, str(tmp_path / "durable"), str(tmp_path))
    for rank in out:
        assert "No space left" in rank["error"]
        assert rank["durable_marks"] == ["started-rank0", "started-rank1"]
    # the save wrote nothing to node 0's folder, yet rank 0 marked its copy there before uncommitting it
    assert out[0]["node_manifest"] is False and out[0]["node_marks"] == ["started-rank0"]


def test_a_rank_whose_node_holds_an_older_save_of_a_tag_resumes_it_from_the_url(ranks, tmp_path):
    out = ranks.run(tier_tasks.overwrite_past_a_full_local_tier_then_resume, str(tmp_path / "durable"),
                    str(tmp_path))
    assert out[1]["node_holds_t"] is True  # the first save of 't', on the node rank 0 cannot see
    for rank in out:
        assert rank["as_saved"] is True
        assert len(rank["tiers_used"]) == 1 and "from the durable tier" in rank["tiers_used"][0]


@pytest.mark.parametrize("on_error,refusal", [("warn", "TagExistsError"), ("raise", "SaveFailedError")])
def test_a_failed_drain_is_redone_even_when_the_save_that_finds_it_is_refused(ranks, tmp_path, on_error, refusal):
    for out in ranks.run(tier_tasks.refused_resave_after_a_failed_drain, str(tmp_path / "durable"), str(tmp_path),
                         on_error):
        assert out["refused"][0] == refusal
        assert out["drained_before_close"] is True


def test_an_overwrite_does_not_drain_the_earlier_save_of_its_tag_again(ranks, tmp_path):
    outs = ranks.run(tier_tasks.overwrite_after_a_failed_drain, str(tmp_path / "durable"), str(tmp_path))
    for out in outs:
        assert len(out["skipped"]) == 1
        assert out["url_has_the_second_save"] is True
        assert out["failures"] == 1  # the first save's drain; a redone one would fail or drain it a second time
    assert len(outs[0]["drained"]) == 1  # rank 0 logs each drain committed at the URL: only the second save's


@pytest.fixture(scope="module")
def fell_back(ranks, tmp_path_factory):
    work = tmp_path_factory.mktemp("fallback")
    return ranks.run(tier_tasks.fallback_in_tiers, str(work / "durable"), str(work))


def test_a_tag_unreadable_in_every_tier_is_refused_without_fallback(fell_back):
    for out in fell_back:
        kind, message = out["refused"]
        assert kind == "VerificationError" and "pass fallback=True" in message


def test_a_latest_in_another_versions_format_at_the_url_is_refused_not_passed_over(fell_back):
    """Rank 0 reads the URL's 'latest' and raises; every other rank learns it from rank 0."""
    kind, message = fell_back[0]["latest_unsupported"]
    assert kind == "UnsupportedManifestError" and "'latest'" in message and "'v2'" in message and "upgrade" in message
    kind, message = fell_back[1]["latest_unsupported"]
    assert kind == "StorageError" and "rank 0" in message and "UnsupportedManifestError" in message


def test_a_latest_in_another_versions_format_in_a_node_folder_is_refused_there(fell_back):
    for out in fell_back:
        kind, message = out["node_latest_unsupported"]
        assert kind == "UnsupportedManifestError" and "node" in message and "'v2'" in message


def test_a_named_tag_loads_while_latest_is_in_another_versions_format(fell_back):
    assert [out["named_past_unsupported"] for out in fell_back] == ["older", "older"]


def test_fallback_from_a_named_tag_moves_every_rank_to_an_older_tag_not_a_newer_one(fell_back):
    assert [(out["named"], out["newest_whole"]) for out in fell_back] == [("older", "newest")] * 2


def test_fallback_by_default_moves_every_rank_to_the_newest_older_readable_tag(fell_back):
    assert [(out["both_broken"], out["newer_repaired"]) for out in fell_back] == [("older", "newer")] * 2


def test_retention_paused_by_a_load_deletes_again_after_the_next_save_on_the_nodes_and_at_the_url(ranks, tmp_path):
    """keep_last == local_keep_last: the URL deletes each old tag first, and the nodes delete it after."""
    out = ranks.run(tier_tasks.load_then_save_in_tiers, str(tmp_path / "durable"), str(tmp_path))
    assert [(rank["node_tags"], rank["url_tags"]) for rank in out] == [(["c", "d"], ["c", "d"])] * 2


def test_without_verification_a_rank_whose_node_lacks_a_file_reads_the_durable_copy(ranks, tmp_path):
    out = ranks.run(tier_tasks.resume_without_verification_past_a_shard_gone_from_node1, str(tmp_path / "durable"),
                    str(tmp_path))
    assert [rank["load"] for rank in out] == [None, None]
    assert "from the local tier" in out[0]["tiers_used"][0] and "from the durable tier" in out[1]["tiers_used"][0]


@pytest.fixture(scope="module", params=[("local_tier", 1), ("drain_listing", 0)], ids=["local_tier", "drain_listing"])
def failed_wrap(request, ranks, tmp_path_factory):
    """wrap() failed on one rank only (``failing``): its local tier, or its listing of the durable tier."""
    where, failing = request.param
    work = tmp_path_factory.mktemp(f"failed-wrap-{where}")
    out = ranks.run(tier_tasks.wrap_fails_on_one_rank, str(work / "durable"), str(work), where, timeout_s=240)
    return {"failing": failing, "ranks": out}


def test_a_load_while_a_drain_failed_on_one_rank_only_raises_on_every_rank(ranks, tmp_path):
    """Before, rank 1 raised its drain's failure at once while rank 0 went on into the load's collective."""
    out = ranks.run(tier_tasks.load_while_a_drain_fails_on_one_rank, str(tmp_path / "durable"), str(tmp_path),
                    timeout_s=240)
    assert out[0]["drain_still_running"]
    for rank in out:
        kind, message = rank["load"]
        assert kind == "SaveFailedError" and "'first'" in message


def test_a_drain_that_keeps_failing_is_raised_once_not_at_every_later_save(ranks, tmp_path):
    out = ranks.run(tier_tasks.saves_past_a_drain_that_keeps_failing, str(tmp_path / "durable"), str(tmp_path),
                    timeout_s=240)
    for rank in out:
        kind, message = rank["second"]
        assert kind == "SaveFailedError" and "'first'" in message
        assert rank["wait_after_the_retry"] is None and rank["third_local"] == "third"


def test_a_tag_an_earlier_job_could_not_drain_whose_node_copy_is_lost_does_not_raise_in_the_next_job(ranks, tmp_path):
    out = ranks.run(tier_tasks.restart_past_a_tag_whose_node_copy_is_lost, str(tmp_path / "durable"), str(tmp_path),
                    timeout_s=300)
    assert any("first" in line for line in out[0]["redrained"])
    assert [rank["wait"] for rank in out] == [None, None] and [rank["second"] for rank in out] == [None, None]
    assert [set(rank["failures"]) for rank in out] == [{"first"}] * 2  # logged, on its handles: not lost from sight
    assert [rank["latest"] for rank in out] == ["second"] * 2


@pytest.mark.parametrize("shared", [True, False], ids=["one-folder", "a-folder-each"])
def test_the_ranks_that_see_one_local_tier_folder_are_one_node_whatever_their_host_names(ranks, tmp_path, shared):
    folders = [str(tmp_path / "tier")] * 2 if shared else [str(tmp_path / "tier0"), str(tmp_path / "tier1")]
    out = ranks.run(tier_tasks.nodes_found, str(tmp_path / "durable"), folders)
    assert [rank["node_ranks"] for rank in out] == ([[0, 1]] * 2 if shared else [[0], [1]])
    assert all(not any(name.startswith(PROBE_PREFIX) for name in rank["left"]) for rank in out)  # marks gone


def test_a_save_committed_locally_but_not_yet_handed_to_its_drain_is_not_listed_to_drain_again(ranks, tmp_path):
    """Listed, it would be drained twice: the second upload into a committed tag, and on ranks whose queues
    took the two in another order, a commit waiting for the other drain until its timeout."""
    out = ranks.run(tier_tasks.listing_while_a_save_is_handed_to_its_drain, str(tmp_path / "durable"),
                    str(tmp_path), timeout_s=240)
    listed = out[0]["listed"]
    assert len(listed) == 2 and all(line.endswith(": first") for line in listed)


def test_a_tiered_load_of_a_named_consolidated_tag_is_refused_as_without_tiers(ranks, tmp_path):
    """Before, the tiers' views left it out and the load said it was committed in no tier."""
    for rank in ranks.run(tier_tasks.load_of_a_consolidated_tag_in_tiers, str(tmp_path / "durable"), str(tmp_path)):
        kind, message = rank["load"]
        assert kind == "UsageError" and "is a consolidated save" in message


def test_a_tiered_load_of_a_named_tag_whose_url_manifest_is_corrupt_reads_the_node_folders_copy(ranks, tmp_path):
    for rank in ranks.run(tier_tasks.load_of_a_tag_whose_url_manifest_is_corrupt, str(tmp_path / "durable"),
                          str(tmp_path)):
        assert rank["load"] is None


def test_the_tiers_view_skips_a_tag_whose_manifest_is_corrupt_with_a_warning_naming_it(tmp_path, caplog):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        assert committed_view(LocalStorage(str(tmp_path))) == {}
    assert any("bad" in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)


def test_close_with_a_drain_held_gives_up_once_wait_timeout_s_has_passed_not_twice(ranks, tmp_path):
    """close() waited wait_timeout_s for the drain's save, then as long again for the drainer thread."""
    wait_timeout_s = 3.0
    for rank in ranks.run(tier_tasks.close_while_a_drain_is_held, str(tmp_path / "durable"), str(tmp_path / "gate"),
                          str(tmp_path), wait_timeout_s):
        assert rank["close"][0] == "WaitTimeoutError"
        assert rank["close_s"] < 1.5 * wait_timeout_s  # a bound on the give-up, not a speed: twice was 6 s


def test_a_tiered_load_that_fails_on_one_rank_with_any_error_raises_on_every_rank(ranks, tmp_path):
    """Before, an error of a type the load did not expect left the other ranks waiting in its collective."""
    out = ranks.run(tier_tasks.load_that_fails_on_rank_1_with_a_client_error, str(tmp_path / "durable"),
                    str(tmp_path), timeout_s=240)
    assert out[1]["load"] == ("RuntimeError", "injected: the storage client's own error")
    kind, message = out[0]["load"]
    assert kind == "StorageError" and "rank 1 failed to read tag 'a'" in message


@pytest.fixture(scope="module")
def one_rank():
    yield from rank_group(1)


def test_a_tag_left_undrained_by_more_ranks_is_not_drained_without_their_files(ranks, one_rank, tmp_path):
    """Two ranks committed 'first' on their nodes and could not drain it; a job of one rank finds it in
    node 0's folder. Its drain would commit at the URL a tag without rank 1's shard, and move 'latest'."""
    durable = tmp_path / "durable"
    for out in ranks.run(tier_tasks.drain_fails_for_good, str(durable), str(tmp_path)):
        assert out["local_committed"] is True and out["drained"] is False
        said = out["said_at_close"]  # close()'s own retry: no later save of the job drains it
        assert said and all("the next job's wrap() with this local_tier drains it again" in line for line in said)
    [out] = one_rank.run(tier_tasks.resume_on_fewer_ranks, str(durable), str(tmp_path))
    assert not out["committed_at_url"] and not out["latest_at_url"]
    [error] = out["errors"]
    assert "saved by 2 rank(s); this job runs 1" in error and "node folders only" in error


def test_a_wrap_that_fails_on_one_rank_raises_on_every_rank_instead_of_leaving_the_others_waiting(failed_wrap):
    failing, out = failed_wrap["failing"], failed_wrap["ranks"]
    assert out[failing]["error"] is not None
    kind, message = out[1 - failing]["error"]
    assert kind == "StorageError" and f"rank {failing} failed" in message


def test_a_wrap_that_failed_gives_the_engine_back_and_leaves_no_thread_running(failed_wrap):
    for out in failed_wrap["ranks"]:
        assert out["engine_given_back"] is True
        assert out["threads_left"] == []


@pytest.mark.parametrize("local_tier,why", [("s3://bucket/fast", "not a URL"), ("{url}/inside", "overlap")])
def test_a_local_tier_that_is_a_url_or_inside_the_durable_folder_is_refused_before_anything_is_written(
        tmp_path, local_tier, why):
    url = str(tmp_path / "durable")
    with pytest.raises(ConfigError, match=why):
        wrap(object(), url, local_tier=local_tier.format(url=url))
    assert not (tmp_path / "durable").exists()


def test_local_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="local_keep_last"):
        wrap(object(), str(tmp_path / "durable"), local_tier=str(tmp_path / "fast"), local_keep_last=0)


def test_local_retention_never_deletes_a_tag_the_durable_tier_does_not_hold_from_the_same_save(tmp_path):
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    for step, tag in enumerate(["t1", "t2", "t3", "t4", "t5"]):
        commit_by_hand(local, tag, step, save_id=f"save-{tag}")
    commit_by_hand(durable, "t1", 0, save_id="save-t1")
    commit_by_hand(durable, "t2", 1, save_id="another-save-of-t2")
    assert prune_local(local, durable, keep=2) == ["t1"]
    assert [t for t in ("t1", "t2", "t3", "t4", "t5") if read_manifest(local, t)] == ["t2", "t3", "t4", "t5"]


def test_only_tags_saved_after_the_urls_newest_are_left_to_drain(tmp_path):
    """t1 is no longer at the URL (its retention deleted it after t3 drained): it is not drained again."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    for step, tag in enumerate(["t1", "t2", "t3", "t4"], start=1):
        commit_by_hand(local, tag, 100 * step, save_id=f"save-{tag}", saved_at=1.7e9 + step)
    for step, tag in ((2, "t2"), (3, "t3")):
        commit_by_hand(durable, tag, 100 * step, save_id=f"save-{tag}", saved_at=1.7e9 + step)
    assert [m.tag for m in undrained(local, durable, in_flight=set())] == ["t4"]
    assert undrained(local, durable, in_flight={"t4"}) == []


def test_a_drain_that_fails_past_its_own_handling_fails_alone_and_the_drainer_goes_on(tmp_path, monkeypatch):
    """The durable commit of the first drain raises what the drainer does not expect there (a BaseException,
    as a bug would); the second drain still commits. One rank, drained by hand."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    for step, tag in ((1, "a"), (2, "b")):
        commit_by_hand(local, tag, step, save_id=f"save-{tag}", saved_at=1.7e9 + step)
    failures = []
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, None, None, 2, True), 60.0,
                            lambda error, job: failures.append(error))
    real_commit = drain.commit.commit

    def broken_once(*args, **kwargs):
        monkeypatch.setattr(drain.commit, "commit", real_commit)
        raise SystemExit("injected fault in the drain's commit")

    monkeypatch.setattr(drain.commit, "commit", broken_once)
    handles = []
    for tag in ("a", "b"):
        handles.append(SaveHandle(tag=tag, url=durable.url))
        drainer.submit(drain.DrainJob(manifest=read_manifest(local, tag), drain_id=f"drain-{tag}", handle=handles[-1]))
    with pytest.raises(SaveFailedError, match="drainer's bookkeeping.*injected fault"):
        handles[0].result(timeout=60)
    assert handles[1].result(timeout=60).tag == "b" and read_manifest(durable, "b") is not None
    assert [str(f) for f in failures] == [str(handles[0].exception())]
    drainer.stop()
    assert drainer.join(30)


def _failing_drain(manifest, drain_id, url):
    """A drain of ``manifest``, committed on the local tier, that fails on this rank (as one whose commit
    record is unknown here does)."""
    handle = SaveHandle(tag=manifest.tag, url=url)
    handle._commit_local(SaveResult(tag=manifest.tag, url="node0", bytes_written=0, stall_s=0.0, persist_s=0.0,
                                    commit_s=0.0))
    return drain.DrainJob(manifest=manifest, drain_id=drain_id, handle=handle,
                          error="injected: this rank cannot drain it")


def test_a_drain_queued_again_while_its_failed_attempt_settles_stays_in_flight(tmp_path):
    """A save that sees a drain fail queues it again, which can happen before the failed attempt's
    bookkeeping has ended: once it has, the tag still counts as in flight (else a listing of what to drain
    would queue it a third time, and local retention could delete it while queued)."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    commit_by_hand(local, "a", 1, saved_at=1.7e9)
    manifest, in_flight_when_done, again = read_manifest(local, "a"), [], []

    def queue_it_again(error, job):
        if not again:
            again.append(_failing_drain(manifest, "again", durable.url))
            drainer.submit(again[0])

    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, None, None, 2, True), 60.0,
                            queue_it_again, on_done=lambda handle: in_flight_when_done.append(drainer.in_flight()))
    first = _failing_drain(manifest, "first", durable.url)
    drainer.submit(first)
    try:
        with pytest.raises(SaveFailedError, match="injected"):
            first.handle.result(timeout=60)
        with pytest.raises(SaveFailedError, match="injected"):  # queued by the callback before ``first`` failed
            again[0].handle.result(timeout=60)
    finally:
        drainer.stop()
        assert drainer.join(30)
    assert in_flight_when_done == [{"a"}, set()]


@pytest.mark.parametrize("second", ["the same save", "a later save of the tag"])
def test_a_tag_whose_drain_failed_twice_is_retried_once_for_its_last_attempt(tmp_path, second):
    """Two retries would both upload into the tag, the second after the first committed; and a later save
    of the tag replaced the earlier save's files in the node folder."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    commit_by_hand(local, "a", 1, saved_at=1.7e9)
    first = read_manifest(local, "a")
    if second != "the same save":
        commit_by_hand(local, "a", 2, saved_at=1.7e9 + 1, save_id="a-saved-again")
    failed = []
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, None, None, 2, True), 60.0,
                            lambda error, job: failed.append(job.drain_id))
    try:
        for manifest, drain_id in ((first, "first"), (read_manifest(local, "a"), "second")):
            job = _failing_drain(manifest, drain_id, durable.url)
            drainer.submit(job)
            with pytest.raises(SaveFailedError):
                job.handle.result(timeout=60)
        retries = drainer.retry_failed()
        assert len(retries) == 1
        with pytest.raises(SaveFailedError):
            retries[0].result(timeout=60)
        assert failed == ["first", "second", f"{read_manifest(local, 'a').save_id}-retry"]
    finally:
        drainer.stop()
        assert drainer.join(30)


def test_a_local_tier_folder_that_is_gone_has_no_room_rather_than_raising(tmp_path):
    """Checked on each rank before the save's collective: a raise on one node would hang the others."""
    room = tier_room(str(tmp_path / "wiped"), 1, None)
    fits, why = node_has_room(str(tmp_path / "wiped"), [room, TierRoom(1, free=10**12)], None)
    assert not fits and "cannot check the room in" in why and "wiped" in why


def test_a_node_folder_must_hold_the_bytes_of_every_rank_that_shares_it():
    """8 ranks of 20 GB each do not fit in 100 GB free, though each rank's 20 GB would."""
    rooms = [TierRoom(20 * 10**9, free=100 * 10**9)] * 8
    fits, why = node_has_room("/nvme/ckpt", rooms, None)
    assert not fits and "176.00 GB needed by its 8 rank(s)" in why
    assert node_has_room("/nvme/ckpt", rooms[:4], None) == (True, "")


def test_the_local_tier_quota_bounds_the_node_folder_not_each_rank():
    rooms = [TierRoom(40, free=10**6, held=10)] * 2
    fits, why = node_has_room("/nvme/ckpt", rooms, max_bytes=80)
    assert not fits and "local_tier_max_bytes=80" in why and "holds 0.00 GB" in why
    assert node_has_room("/nvme/ckpt", rooms[:1], max_bytes=80) == (True, "")


def test_the_first_saves_estimate_counts_zero3s_partitioned_parameters():
    """ZeRO-3 frees a partitioned parameter to an empty tensor; its size stays in ds_numel."""
    module = torch.nn.Linear(100, 10)
    for param in module.parameters():
        param.ds_numel = param.numel()
        param.data = torch.empty(0)
    engine = type("Engine", (), {"module": module})()
    assert estimate_save_bytes(engine, world_size=2, previous=0) == 16 * 1010 // 2


def test_a_tag_a_later_save_overwrites_is_not_retried_from_its_earlier_save(tmp_path):
    """The overwrite may go straight to the URL (a full local tier): a retry at close would copy the earlier
    save's files, still in the node folder, over it there."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    commit_by_hand(local, "a", 1, saved_at=1.7e9)
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, None, None, 2, True), 60.0,
                            lambda error, job: None)
    try:
        job = _failing_drain(read_manifest(local, "a"), "first", durable.url)
        drainer.submit(job)
        with pytest.raises(SaveFailedError):
            job.handle.result(timeout=60)
        assert drainer.failed_tags() == {"a"}
        drainer.supersede("a")
        assert drainer.retry_failed() == [] and drainer.failed_tags() == set()
    finally:
        drainer.stop()
        assert drainer.join(30)


def test_a_drain_submitted_after_the_drainer_stopped_fails_its_handle_naming_where_the_tag_is(tmp_path):
    """A save still being written when close() gave up commits on the local tier after the drainer stopped."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    commit_by_hand(local, "a", 1, saved_at=1.7e9)
    recorded = []
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, None, None, 2, True), 60.0,
                            lambda error, job: recorded.append(job.tag))
    drainer.stop()
    assert drainer.join(30)
    handle = SaveHandle(tag="a", url=durable.url)
    drainer.submit(drain.DrainJob(manifest=read_manifest(local, "a"), drain_id="d", handle=handle))
    with pytest.raises(SaveFailedError, match="closed before its drain") as failed:
        handle.result(timeout=5)
    assert local.url in str(failed.value) and "next wrap()" in str(failed.value)
    assert recorded == ["a"] and drainer.in_flight() == set()


def test_a_restart_takes_the_newest_tag_every_rank_can_read_from_some_tier():
    view = {"old": (1, 1.0, True, "a"), "mid": (2, 2.0, True, "b"), "new": (3, 3.0, True, "c")}
    only_rank0_has_new = [dict(view), {k: v for k, v in view.items() if k != "new"}]
    assert choose_tag(None, only_rank0_has_new, {"old": view["old"]}) == ("mid", "")
    assert choose_tag(None, only_rank0_has_new, {"new": view["new"]}) == ("new", "")
    assert choose_tag(None, [{}, {}], {}) == (None, "no tag is committed at the durable URL or in every node's "
                                                    "local tier")
    tag, why = choose_tag("new", only_rank0_has_new, {})
    assert tag is None and "only rank(s) [0]" in why


def test_a_fallback_takes_the_newest_readable_tag_older_than_the_one_that_failed_latest_or_not():
    view = {"old": (1, 1.0, True, "a"), "unlisted": (2, 2.0, False, "b"), "new": (3, 3.0, True, "c"),
            "newer": (4, 4.0, True, "d")}
    assert choose_tag(None, [dict(view), dict(view)], {}, older_than="new") == ("unlisted", "")
    assert choose_tag(None, [dict(view), {"old": view["old"], "new": view["new"]}], {}, older_than="new") == ("old", "")
    tag, why = choose_tag(None, [dict(view), dict(view)], {}, older_than="old")
    assert tag is None and "no tag older than 'old'" in why


def test_a_tag_the_nodes_hold_from_different_saves_is_not_readable_from_the_node_folders():
    first, second = (1, 1.0, True, "save-1"), (1, 2.0, True, "save-2")
    assert choose_tag(None, [{"t": first}, {"t": second}], {}) == (None, "no tag is committed at the durable URL "
                                                                         "or in every node's local tier")
    assert choose_tag(None, [{"t": second}, {"t": first}], {"t": second}) == ("t", "")
    tag, why = choose_tag("t", [{"t": first}, {"t": second}], {})
    assert tag is None and "different saves of it" in why


def test_a_rank_reads_a_tag_only_from_the_tiers_that_hold_the_save_every_rank_can_read():
    first, second = (1, 1.0, True, "save-1"), (1, 2.0, True, "save-2")
    views = [{"t": second}, {"t": first}]  # node 1 kept an older save that an overwrite replaced at the URL
    assert holds_chosen_save("t", views[0], views, {"t": second}) == (True, True)
    assert holds_chosen_save("t", views[1], views, {"t": second}) == (False, True)
    assert holds_chosen_save("t", {}, views, {"t": second}) == (False, True)
    assert holds_chosen_save("t", views[1], views, {}) == (False, False)  # readable nowhere


def test_a_save_every_node_holds_wins_over_an_older_save_of_the_tag_at_the_url():
    """The drain of the tag's earlier save committed at the URL after an overwrite began."""
    first, second = (1, 1.0, True, "save-1"), (1, 2.0, True, "save-2")
    nodes = [{"t": second}, {"t": second}]
    assert readable_saves(nodes, {"t": first}) == {"t": second}
    assert holds_chosen_save("t", nodes[0], nodes, {"t": first}) == (True, False)
    assert readable_saves([{"t": second}, {}], {"t": first}) == {"t": first}  # a wiped node: the URL's save


def test_local_retention_deletes_a_node_copy_the_url_holds_a_later_save_of(tmp_path):
    local, durable = open_storage(str(tmp_path / "node1")), open_storage(str(tmp_path / "durable"))
    for step, tag in enumerate(["t1", "t2", "t3"]):
        commit_by_hand(local, tag, step)
    commit_by_hand(durable, "t2", 1, saved_at=50.0, save_id="the-overwrite")  # a later save of t2
    commit_by_hand(durable, "t3", 2, saved_at=0.5, save_id="an-earlier-save")  # older than the node's t3
    local.write_bytes("latest", b"t2")
    assert prune_local(local, durable, keep=2) == []  # never the tag the node's 'latest' names
    local.write_bytes("latest", b"t3")
    assert prune_local(local, durable, keep=2) == ["t2"]
    assert [t for t in ("t1", "t2", "t3") if read_manifest(local, t)] == ["t1", "t3"]


def _drain_by_hand(drainer, local, durable, tag):
    handle = SaveHandle(tag=tag, url=durable.url)
    drainer.submit(drain.DrainJob(manifest=read_manifest(local, tag), drain_id=f"drain-{tag}", handle=handle))
    assert handle.result(timeout=60).tag == tag


def test_a_load_pauses_drains_retention_until_resumed_and_the_next_drain_deletes_what_it_skipped(tmp_path):
    """A load reads tags that the retention of a drain ending meanwhile would delete (a rollback to an older
    tag while drains run): paused, neither the node folder's retention nor keep_last at the URL deletes any;
    resumed, the next drain's passes delete them."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    tags = ("t1", "t2", "t3", "t4")
    for step, tag in enumerate(tags):
        commit_by_hand(local, tag, step, save_id=f"save-{tag}", saved_at=1.7e9 + step)
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, 2, None, 2, True), 60.0,
                            lambda error, job: None)
    try:
        drainer.pause_retention()
        for tag in ("t1", "t2", "t3"):
            _drain_by_hand(drainer, local, durable, tag)
        assert [t for t in tags if read_manifest(local, t)] == ["t1", "t2", "t3", "t4"]
        assert [t for t in tags if read_manifest(durable, t)] == ["t1", "t2", "t3"]
        drainer.resume_retention()
        _drain_by_hand(drainer, local, durable, "t4")
        assert [t for t in tags if read_manifest(local, t)] == ["t3", "t4"]
        assert [t for t in tags if read_manifest(durable, t)] == ["t3", "t4"]
    finally:
        drainer.stop()
        assert drainer.join(30)


def test_local_retention_ends_its_pass_at_the_first_deletion_not_allowed(tmp_path):
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    for step, tag in enumerate(["t1", "t2", "t3", "t4"]):
        commit_by_hand(local, tag, step, save_id=f"save-{tag}")
        commit_by_hand(durable, tag, step, save_id=f"save-{tag}")
    answers = iter([True, False])
    assert prune_local(local, durable, keep=1, allowed=lambda: contextlib.nullcontext(next(answers))) == ["t1"]
    assert [t for t in ("t1", "t2", "t3", "t4") if read_manifest(local, t)] == ["t2", "t3", "t4"]


def _node_and_url_after_url_retention(tmp_path):
    """t1..t4 committed on the node and drained; the URL's keep_last=2 then deleted t1 and t2 there."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    for step, tag in enumerate(["t1", "t2", "t3", "t4"], start=1):
        commit_by_hand(local, tag, step)
        if tag in ("t3", "t4"):
            commit_by_hand(durable, tag, step)
    return local, durable


def test_local_retention_deletes_what_the_urls_own_retention_deleted_there_first(tmp_path):
    """keep_last no larger than local_keep_last: the URL deletes a tag before the node folder does; the node
    folder must not keep it for good."""
    local, durable = _node_and_url_after_url_retention(tmp_path)
    assert prune_local(local, durable, keep=2, url_keep_last=2) == ["t1", "t2"]


def test_local_retention_keeps_a_node_copy_the_urls_retention_would_keep_or_that_is_being_drained(tmp_path):
    local, durable = _node_and_url_after_url_retention(tmp_path)
    assert prune_local(local, durable, keep=2) == []  # without keep_last the URL lacks them for another reason
    assert prune_local(local, durable, keep=2, url_keep_last=3) == []  # the URL holds only 2 newer: not its doing
    assert prune_local(local, durable, keep=1, url_keep_last=1, url_keep_every=2, in_flight={"t3"}) == ["t1"]


@pytest.mark.parametrize("marked", ["node folder", "url"])
def test_local_retention_leaves_an_old_node_copy_alone_while_an_overwrite_of_it_is_under_way(tmp_path, marked):
    """An overwrite of t1 has begun: rank 0 marked (and uncommitted) it at the URL, or a rank marked its node
    folder, whose old manifest stays committed until the node's commit; deleting it would delete the new files."""
    local, durable = _node_and_url_after_url_retention(tmp_path)
    commit.mark_started(local if marked == "node folder" else durable, "t1", 1, "the-overwrite")
    assert prune_local(local, durable, keep=2, url_keep_last=2) == ["t2"]
    assert read_manifest(local, "t1") is not None


def test_local_retention_waits_for_a_start_mark_being_written_and_then_leaves_that_tag(tmp_path):
    """An overwrite's rank is writing its first mark into t1 (inside mark_started: the node folder's lock,
    shared) just as retention comes to delete t1: retention waits for the mark, sees it and leaves t1."""
    local, durable = _node_and_url_after_url_retention(tmp_path)
    commit.add_marks_lock(local)
    reached, deleted = threading.Event(), []

    @contextlib.contextmanager
    def allowed():
        reached.set()
        yield True

    with file_lock(os.path.join(local.local_dir(), MARKS_LOCK), shared=True):
        pruning = threading.Thread(target=lambda: deleted.extend(
            prune_local(local, durable, keep=2, url_keep_last=2, allowed=allowed)))
        pruning.start()
        assert reached.wait(30)
        time.sleep(0.2)  # without the lock, retention checks t1 and deletes it meanwhile
        local.write_bytes(start_mark("t1", 1), b"the-overwrite")
    pruning.join(30)
    assert deleted == ["t2"]
    assert read_manifest(local, "t1") is not None


def test_local_retention_leaves_a_tag_that_an_overwrite_committed_on_the_node_during_its_pass(tmp_path):
    """The pass listed t1 from its old save; before its deletion the overwrite wrote, committed and removed
    its marks: the new copy stays (its drain reads it; the URL's old copy was uncommitted)."""
    local, durable = _node_and_url_after_url_retention(tmp_path)
    first = iter([True])

    @contextlib.contextmanager
    def allowed():
        if next(first, False):
            commit_by_hand(local, "t1", 5, saved_at=99.0, save_id="the-overwrite")
        yield True

    assert prune_local(local, durable, keep=2, url_keep_last=2, allowed=allowed) == ["t2"]
    assert read_manifest(local, "t1").save_id == "the-overwrite"


def test_a_start_mark_waits_while_local_retention_checks_and_deletes(tmp_path):
    local = open_storage(str(tmp_path / "node0"))
    commit.add_marks_lock(local)
    marked = threading.Event()
    with commit.no_new_marks(local):
        threading.Thread(target=lambda: (commit.mark_started(local, "t1", 1, "save-1"), marked.set()),
                         daemon=True).start()
        assert not marked.wait(0.5)
        assert not local.exists(start_mark("t1", 1))
    assert marked.wait(30)
    assert local.read_bytes(start_mark("t1", 1)) == b"save-1"


def test_local_retention_makes_the_marks_lock_again_in_a_wiped_node_folder(tmp_path):
    local = open_storage(str(tmp_path / "node0"))
    commit.add_marks_lock(local)
    shutil.rmtree(tmp_path / "node0")
    with commit.no_new_marks(local):
        assert local.exists(MARKS_LOCK)


def test_a_local_url_gets_no_marks_lock(tmp_path):
    """Only node folders have one: at a local URL no pass holds marks off (gc tries, and finds no lock file)."""
    url = open_storage(str(tmp_path / "url"))
    commit.mark_started(url, "t1", 0, "save-1")
    assert not url.exists(MARKS_LOCK)


def test_a_save_resumes_the_drains_retention_without_waiting_for_a_deletion_in_progress(tmp_path):
    """Every save resumes it (rank 0's drains may be deleting a tag at the URL, for seconds): no stall."""
    local, durable = open_storage(str(tmp_path / "node0")), open_storage(str(tmp_path / "durable"))
    drainer = drain.Drainer(0, 1, dist.HashStore(), drain.DrainTarget(local, durable, 2, None, 2, True), 60.0,
                            lambda error, job: None)
    resumed = threading.Event()
    try:
        with drainer._retention_allowed():  # what a deletion in progress holds
            threading.Thread(target=lambda: (drainer.resume_retention(), resumed.set()), daemon=True).start()
            assert resumed.wait(10)
    finally:
        drainer.stop()
        assert drainer.join(30)


def test_local_retention_leaves_a_node_copy_alone_while_another_save_writes_into_it_whatever_the_url_holds(
        tmp_path):
    """t3 (also at the URL, from the same save) is being overwritten on this node; t1 holds a stale start
    mark of its own committed save (a rank died before removing it), which is no write under way."""
    local, durable = _node_and_url_after_url_retention(tmp_path)
    commit.mark_started(local, "t3", 1, "the-overwrite")
    commit.mark_started(local, "t1", 1, "save-t1")
    assert prune_local(local, durable, keep=1, url_keep_last=2) == ["t1", "t2"]
    assert read_manifest(local, "t3") is not None
