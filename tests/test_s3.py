"""Object storage against a real S3 HTTP API on 127.0.0.1 (moto server): save, resume, faults, bad input."""

from __future__ import annotations

import glob
import io
import os
import time

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import s3_tasks
from rank_tasks import same_tensors
from s3_server import FaultProxy, options


@pytest.fixture(scope="module", autouse=True)
def fresh_server(s3):
    s3.reset()


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def in_bucket(request, s3, ranks, tmp_path_factory):
    """Train and save to s3:// (and, at the same step, stock DeepSpeed to local disk), then resume
    in a new process group with an empty cache on every rank."""
    stage = request.param
    bucket = s3.make_bucket(f"resume-zero{stage}")
    url = f"s3://{bucket}/run1"
    work = tmp_path_factory.mktemp(f"s3-zero{stage}")
    saved = ranks.run(s3_tasks.save_to_bucket, stage, url, options(s3.endpoint), str(work / "stock"))
    ranks.restart()
    resumed = ranks.run(s3_tasks.resume_from_bucket, stage, url, options(s3.endpoint), str(work / "cache"))
    return {"stage": stage, "bucket": bucket, "work": work, "saved": saved, "resumed": resumed}


def test_resume_from_bucket_continues_bitwise_like_the_uninterrupted_run(in_bucket):
    for rank in range(2):
        assert in_bucket["resumed"][rank]["losses"] == in_bucket["saved"][rank]["losses_after"]


def test_uploader_memory_is_reported_and_bounded_by_the_window(in_bucket):
    for rank in in_bucket["saved"]:
        assert 0 < rank["upload_buffer_peak_bytes"] <= rank["upload_buffer_bound"]


def test_each_rank_fetches_only_its_own_shard(in_bucket):
    for rank, out in enumerate(in_bucket["resumed"]):
        shards = [p for p in out["first"]["files"] if "zero_pp_rank_" in p]
        assert shards and all(f"zero_pp_rank_{rank}_" in p for p in shards)
        assert out["first"]["files_fetched"] == len(out["first"]["files"])


def test_bytes_read_per_rank_are_only_the_files_it_needs(in_bucket, s3):
    client = s3.client()
    for out in in_bucket["resumed"]:
        sizes = [client.head_object(Bucket=in_bucket["bucket"], Key=f"run1/{out['tag']}/{p}")["ContentLength"]
                 for p in out["first"]["files"]]
        assert out["bytes_read"] == sum(sizes) == out["first"]["bytes_fetched"]


def test_second_resume_with_valid_cache_downloads_nothing(in_bucket):
    for out in in_bucket["resumed"]:
        assert out["second"]["files_fetched"] == 0
        assert out["second"]["files_skipped"] == len(out["second"]["files"])


def test_cache_entry_failing_verification_is_fetched_again(in_bucket):
    for out in in_bucket["resumed"]:
        assert out["after_corruption"]["files_fetched"] == 1


def test_committed_objects_are_plain_s3_objects(in_bucket, s3):
    tag = in_bucket["saved"][0]["tag"]
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=in_bucket["bucket"], Prefix="run1/")["Contents"]}
    assert {"run1/latest", f"run1/{tag}/async_ckpt_manifest.json", "run1/zero_to_fp32.py"} <= keys
    assert sum(k.endswith("_optim_states.pt") for k in keys) == 2
    assert not any(".async_ckpt" in k or k.endswith(".partial") for k in keys)


def test_zero_to_fp32_on_a_plain_download_equals_stock(in_bucket, s3):
    client = s3.client()
    local = in_bucket["work"] / "download"
    for obj in client.list_objects_v2(Bucket=in_bucket["bucket"], Prefix="run1/")["Contents"]:
        dest = local / obj["Key"][len("run1/"):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(in_bucket["bucket"], obj["Key"], str(dest))
    ours = get_fp32_state_dict_from_zero_checkpoint(str(local))
    stock = get_fp32_state_dict_from_zero_checkpoint(str(in_bucket["work"] / "stock"))
    assert ours.keys() == stock.keys()
    assert all(torch.equal(ours[k], stock[k]) for k in stock)


def test_optimizer_state_in_the_bucket_equals_stock_deepspeeds_at_the_same_step(in_bucket, s3):
    """Adam's moments included, which zero_to_fp32 does not read."""
    client, tag = s3.client(), in_bucket["saved"][0]["tag"]
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        body = client.get_object(Bucket=in_bucket["bucket"], Key=f"run1/{tag}/{name}")["Body"].read()
        ours = torch.load(io.BytesIO(body), weights_only=False)["optimizer_state_dict"]
        stock_path, = glob.glob(str(in_bucket["work"] / "stock" / "*" / name))
        stock = torch.load(stock_path, weights_only=False)["optimizer_state_dict"]
        assert same_tensors(ours, stock) and same_tensors(stock, ours)


@pytest.fixture(scope="module")
def through_faults(s3, ranks):
    bucket = s3.make_bucket("faults")
    proxy = FaultProxy(s3.endpoint)
    try:
        out = ranks.run(s3_tasks.save_through_fault_proxy, f"s3://{bucket}/run", options(proxy.endpoint), proxy.endpoint)
    finally:
        proxy.stop()
    return {"bucket": bucket, "ranks": out}


def test_transient_part_failures_are_retried(through_faults):
    assert through_faults["ranks"][0]["injected_while_transient"] == 3  # every fault was met, and retried
    assert [r["transient"] for r in through_faults["ranks"]] == [None, None]


def test_permanent_failure_fails_the_save_naming_the_object(through_faults):
    for rank in through_faults["ranks"]:
        kind, message = rank["permanent"]
        assert kind == "SaveFailedError" and "'bad'" in message
    assert any("s3://" in r["permanent"][1] and "SlowDown" in r["permanent"][1] for r in through_faults["ranks"])


def test_permanent_failure_leaves_no_multipart_upload(through_faults, s3):
    uploads = s3.client().list_multipart_uploads(Bucket=through_faults["bucket"]).get("Uploads", [])
    assert uploads == []


def test_upload_threads_are_stopped_when_the_checkpointer_closes(through_faults):
    for rank in through_faults["ranks"]:
        assert any(name.startswith("async_ckpt-s3-lane") for name in rank["threads_open"])
        assert rank["threads_closed"] == []


def test_permanent_failure_keeps_latest_on_the_previous_tag(through_faults):
    assert [r["latest"] for r in through_faults["ranks"]] == ["good", "good"]


def test_saves_into_new_folders_do_not_keep_the_earlier_folders_upload_threads(s3, ranks):
    bucket = s3.make_bucket("new-folders")
    for rank in ranks.run(s3_tasks.save_into_new_folders, f"s3://{bucket}/run", options(s3.endpoint), 4):
        assert rank["lane_threads"][0] > 0 and len(set(rank["lane_threads"])) == 1, rank["lane_threads"]


def test_a_synchronous_save_to_a_bucket_writes_in_place_byte_for_byte_the_default_files(s3, ranks):
    bucket = s3.make_bucket("in-place")
    for rank in ranks.run(s3_tasks.default_and_synchronous_saves_to_bucket, f"s3://{bucket}/run", options(s3.endpoint)):
        assert rank["in_place_bytes"] > 0
    client = s3.client()
    staged = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/staged/t/")["Contents"]
              if o["Key"].endswith(".pt")]
    assert len(staged) == 4  # ZeRO-3: model and optimizer states of each rank
    for key in staged:
        ours = client.get_object(Bucket=bucket, Key=key.replace("/staged/", "/in_place/"))["Body"].read()
        assert ours == client.get_object(Bucket=bucket, Key=key)["Body"].read(), key


@pytest.fixture(scope="module")
def losses(s3, ranks, tmp_path_factory):
    bucket = s3.make_bucket("losses")
    cache = tmp_path_factory.mktemp("losses-cache")
    return ranks.run(s3_tasks.resume_after_losses_in_the_bucket, f"s3://{bucket}/run", options(s3.endpoint), str(cache))


def test_a_file_gone_from_the_bucket_is_refused_naming_it(losses):
    for rank in losses:
        kind, message = rank["named"]
        assert kind == "VerificationError" and "zero_pp_rank_1_" in message and "missing from storage" in message


def test_a_file_gone_from_the_bucket_falls_back_to_the_older_tag(losses):
    assert [rank["fallback"] for rank in losses] == ["older", "older"]


def test_a_tag_saved_again_is_fetched_into_a_cache_folder_of_its_own_save(losses):
    for rank in losses:
        assert rank["resaved"] == "older" and rank["second_fetch"] != rank["first_fetch"]
        assert os.path.dirname(rank["second_fetch"]) != os.path.dirname(rank["first_fetch"])


def test_a_resume_removes_the_other_saves_cached_for_its_url_once_untouched_for_an_hour(losses):
    for rank in losses:
        assert rank["first_kept_while_recent"] is True  # another job or rank may still be loading it
        assert rank["first_after_it_was_old"] is False


def test_pruning_the_resume_cache_keeps_the_saves_a_load_began_using_within_the_hour(tmp_path):
    from async_ckpt.resume import prune_cache

    hours_ago = time.time() - 7200
    for save in ("loaded", "old", "old_but_in_use"):
        (tmp_path / save / "t").mkdir(parents=True)
        for path in (tmp_path / save / "t" / "shard.pt", tmp_path / save / "latest"):
            path.write_bytes(b"x")
            os.utime(path, (hours_ago, hours_ago))
    (tmp_path / "old_but_in_use" / ".in-use").write_bytes(b"")  # another job's load of it has begun
    removed = prune_cache(str(tmp_path / "loaded"))
    assert removed == [str(tmp_path / "old")] and sorted(os.listdir(tmp_path)) == ["loaded", "old_but_in_use"]


def test_pruning_the_resume_cache_removes_what_fetches_killed_an_hour_ago_left_in_the_loaded_save(tmp_path):
    from async_ckpt.resume import prune_cache

    hours_ago = time.time() - 7200
    tag = tmp_path / "loaded" / "t"
    tag.mkdir(parents=True)
    names = ["shard.pt", "shard.pt.1f2e.partial", "shard.pt.1f2e.partial.parts", "other.pt.9a8b.partial"]
    for name in names:
        (tag / name).write_bytes(b"x")
        if name != "other.pt.9a8b.partial":  # a fetch still writing this one
            os.utime(tag / name, (hours_ago, hours_ago))
    prune_cache(str(tmp_path / "loaded"))
    assert sorted(os.listdir(tag)) == ["other.pt.9a8b.partial", "shard.pt"]


def test_under_elastic_checkpoint_each_rank_fetches_every_optimizer_shard_and_loads_as_stock_does(
        s3, ranks, tmp_path_factory):
    # DeepSpeed 0.19's own load of an elastic ZeRO-2 checkpoint with torch's Adam fails (its step count is
    # missing from the shards): the load from the bucket must end exactly as stock's, not short of files first
    bucket = s3.make_bucket("elastic")
    cache = tmp_path_factory.mktemp("elastic-cache")
    for rank in ranks.run(s3_tasks.resume_elastic_from_bucket, f"s3://{bucket}/run", options(s3.endpoint), str(cache)):
        assert rank["load_error"] == rank["stock_load_error"]
        assert [p for p in rank["fetched"] if "optim_states" in p] == [
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def test_ranks_sharing_a_cache_fetch_a_file_they_both_read_once(s3, ranks, tmp_path_factory):
    bucket = s3.make_bucket("shared-cache")
    cache = tmp_path_factory.mktemp("shared-cache")
    fetches = ranks.run(s3_tasks.resume_with_a_cache_shared_by_the_ranks, f"s3://{bucket}/run", options(s3.endpoint),
                        str(cache))
    assert [sorted(f["files"]) for f in fetches] == [
        ["mp_rank_00_model_states.pt", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] for r in (0, 1)]
    # each rank its own shard; the model states by one rank, found cached by the other
    assert sum(f["files_fetched"] for f in fetches) == 3 and sum(f["files_skipped"] for f in fetches) == 1


@pytest.fixture(scope="module")
def bad_destinations(s3, ranks):
    bucket = s3.make_bucket("bad-input")
    return ranks.run(s3_tasks.wrap_with_bad_destinations, s3.endpoint, bucket)[0]


def test_malformed_url_is_refused_at_wrap(bad_destinations):
    assert bad_destinations["malformed"][0] == "ConfigError"
    assert bad_destinations["no_bucket_name"][0] == "ConfigError"


def test_missing_bucket_is_refused_at_wrap(bad_destinations):
    kind, message = bad_destinations["missing_bucket"]
    assert kind == "StorageError" and "no-such-bucket-here" in message and "NoSuchBucket" in message


@pytest.mark.skipif(bool(os.environ.get("ASYNC_CKPT_TEST_S3_ENDPOINT")), reason="uses moto's IAM simulation")
def test_wrong_credentials_are_refused_at_wrap_without_leaking_the_secret(s3, ranks):
    from moto.core.authorization import enable_iam_authentication

    bucket = s3.make_bucket("creds")
    with enable_iam_authentication():
        kind, message = ranks.run(s3_tasks.wrap_with_wrong_credentials, s3.endpoint, bucket)[0]["wrong_credentials"]
    assert kind == "StorageError" and "InvalidAccessKeyId" in message
    assert "s3cr3t-never-printed" not in message


@pytest.fixture(scope="module")
def saved_with_credentials(s3, ranks):
    """A save whose credentials come in storage_options (a distinctive secret; moto takes any)."""
    bucket = s3.make_bucket("with-credentials")
    key, secret = ("AKIAEXAMPLEKEY000001", "s3cr3t-kept-out-of-everything") if not s3.external else (
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    out = ranks.run(s3_tasks.save_with_credentials_in_options, s3.endpoint, bucket, key, secret)
    return {"bucket": bucket, "secret": secret, "ranks": out}


def test_credentials_never_appear_in_the_log(saved_with_credentials):
    lines = [line for rank in saved_with_credentials["ranks"] for line in rank["logs"]]
    assert any("creds" in line for line in lines)  # the save was logged at all
    assert [line for line in lines if saved_with_credentials["secret"] in line] == []


def test_credentials_never_appear_in_the_config_or_result_repr(saved_with_credentials):
    shown = [text for rank in saved_with_credentials["ranks"] for text in rank["shown"]]
    assert [text for text in shown if saved_with_credentials["secret"] in text] == []


def test_credentials_never_appear_in_the_manifest_or_commit_files(saved_with_credentials, s3):
    client, bucket = s3.client(), saved_with_credentials["bucket"]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"] if not o["Key"].endswith(".pt")]
    assert "run/creds/async_ckpt_manifest.json" in keys and "run/latest" in keys
    secret = saved_with_credentials["secret"].encode()
    assert [k for k in keys if secret in client.get_object(Bucket=bucket, Key=k)["Body"].read()] == []
