"""Bad input gets a clear, typed error before anything is written."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import pytest

import async_ckpt
import rank_tasks
from async_ckpt import CheckpointConfig, ConfigError


def _mount_type(path: str) -> str:
    """The filesystem type of the mount that holds ``path``, from /proc/self/mounts: the longest mount point
    that contains it, the last one listed where several are mounted on the same point (the one on top)."""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as mounts:
        points = [(fields[1].replace("\\040", " "), fields[2]) for fields in map(str.split, mounts)]
    inside = [(len(point), order, kind) for order, (point, kind) in enumerate(points)
              if path == point or path.startswith(point.rstrip("/") + "/")]
    return max(inside)[2]


@pytest.fixture(scope="module")
def memory_root():
    """A fresh folder on tmpfs (/dev/shm), or ``None`` where /dev/shm is not tmpfs."""
    if not os.path.isdir("/dev/shm") or _mount_type("/dev/shm") != "tmpfs":
        yield None
        return
    root = tempfile.mkdtemp(prefix="async_ckpt_test_", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def tmpfs(memory_root):
    """The tmpfs folder the outcomes were taken with; the test is skipped where there is none."""
    if memory_root is None:
        pytest.skip("/dev/shm is not a tmpfs here")
    return memory_root


@pytest.fixture(scope="module")
def outcomes(ranks, tmp_path_factory, memory_root):
    root = tmp_path_factory.mktemp("bad")
    not_a_dir = root / "plain-file"
    not_a_dir.write_text("x")
    (root / "ckpt").mkdir()
    results = ranks.run(rank_tasks.bad_inputs, str(root / "ckpt"), str(not_a_dir), memory_root)
    assert results[0].keys() == results[1].keys()
    return results


def test_wrap_chooses_synchronous_saves_where_cpu_training_saves_to_tmpfs(outcomes, tmpfs):
    """In memory the write is CPU work: written while training waits it costs training less than in the background."""
    assert [seen["synchronous_memory"] for seen in outcomes] == [True, True]


def test_wrap_does_not_warn_of_memory_where_it_chose_synchronous_saves(outcomes, tmpfs):
    assert [seen["wrap_warnings_memory"] for seen in outcomes] == [[], []]


def test_wrap_keeps_background_saves_to_tmpfs_that_a_local_tier_takes_first(outcomes, tmpfs):
    """A synchronous save would wait for the drain to the URL as well."""
    assert [seen["synchronous_memory_tiered"] for seen in outcomes] == [False, False]


def test_wrap_warns_that_a_background_save_to_tmpfs_costs_cpu_training_more(outcomes, tmpfs):
    for rank, seen in enumerate(outcomes):
        [warning] = seen["wrap_warnings_memory_background"]
        assert f"rank {rank}: {tmpfs}" in warning and "tmpfs" in warning and "synchronous=True" in warning
        assert seen["synchronous_memory_background"] is False


def test_wrap_does_not_warn_of_memory_with_synchronous_saves(outcomes, tmpfs):
    assert [seen["wrap_warnings_memory_synchronous"] for seen in outcomes] == [[], []]


def test_wrap_writes_in_the_background_and_does_not_warn_of_memory_on_a_disk(outcomes, tmp_path_factory):
    if _mount_type(str(tmp_path_factory.getbasetemp())) in ("tmpfs", "ramfs"):
        pytest.skip("pytest's temporary folders are in memory here")
    assert [(seen["wrap_warnings_disk"], seen["synchronous_disk"]) for seen in outcomes] == [([], False)] * 2


def test_wrap_warns_on_rank_0_that_deepspeeds_legacy_serialization_setting_is_not_reproduced(outcomes):
    [warning] = outcomes[0]["wrap_warnings_legacy_serialization"]
    assert "zip format" in warning
    assert outcomes[1]["wrap_warnings_legacy_serialization"] == []


@pytest.mark.parametrize("case", ["empty_tag", "slash_tag", "dotdot_tag", "parent_tag", "backslash_tag", "space_tag",
                                  "latest_tag", "script_tag", "newline_tag"])
def test_invalid_tag_is_refused_on_every_rank(outcomes, case):
    for rank in outcomes:
        assert rank[case][0] == "InvalidTagError"
        assert "tag" in rank[case][1]


def test_invalid_tags_write_nothing(outcomes):
    assert [r["written_after_bad_tags"] for r in outcomes] == [False, False]


def test_exact_bytes_to_an_object_store_with_a_cache_dir_it_cannot_write_fails_at_wrap(outcomes):
    """Each file is written there before it goes to the store: every save would fail in the background."""
    for rank in outcomes:
        kind, message = rank["exact_bytes_unwritable_cache_dir"]
        assert kind == "ConfigError" and "exact_bytes=True" in message and "plain-file" in message


def test_unwritable_destination_fails_at_wrap(outcomes):
    kind, message = outcomes[0]["unwritable_destination"]
    assert kind == "StorageError" and "plain-file" in message


@pytest.mark.parametrize("case,kind", [("bad_keep_last", "ConfigError"), ("bad_on_error", "ConfigError"),
                                       ("unknown_option", "UsageError")])
def test_invalid_option_fails_at_wrap(outcomes, case, kind):
    assert outcomes[0][case][0] == kind


def test_wrapping_an_engine_already_wrapped_is_refused_before_anything_is_written(outcomes):
    """A second wrap would stand in for the first's hooks (its optimizer-step wait among them) and give
    the engine back to the first's on close."""
    kind, message = outcomes[0]["wrap_of_a_wrapped_engine"]
    assert kind == "UsageError" and "already wrapped" in message and "close()" in message
    assert not outcomes[0]["second_root_made"]


def test_nvme_optimizer_offload_is_refused_at_wrap_naming_what_to_use(outcomes):
    """DeepSpeed copies its swap files into the save folder outside the checkpoint engine: they would be lost."""
    kind, message = outcomes[0]["nvme_offload"]
    assert kind == "UsageError" and "NVMe optimizer offload" in message and "Offload to 'cpu'" in message


def test_load_without_any_checkpoint_says_so(outcomes):
    kind, message = outcomes[0]["load_when_empty"]
    assert kind == "CheckpointNotFoundError" and "latest" in message


def test_load_of_a_missing_tag_lists_the_committed_ones(outcomes):
    kind, message = outcomes[0]["load_missing_tag"]
    assert kind == "CheckpointNotFoundError" and "'nope'" in message and "good" in message


def test_load_of_an_uncommitted_tag_is_refused(outcomes):
    kind, message = outcomes[1]["load_uncommitted_tag"]
    assert kind == "NotCommittedError" and "partial" in message


def test_saving_a_committed_tag_again_is_refused(outcomes):
    assert [r["resave_committed_tag"][0] for r in outcomes] == ["TagExistsError"] * 2


def test_saving_into_a_folder_async_ckpt_did_not_start_is_refused_and_writes_nothing(outcomes):
    """A stock DeepSpeed checkpoint of that tag name, say: its files would mix with the new save's."""
    for rank in outcomes:
        kind, message = rank["save_into_a_foreign_folder"]
        assert kind == "TagExistsError" and "'partial'" in message and "start mark" in message
        assert rank["foreign_folder_after"] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_a_tag_whose_earlier_save_aborted_can_be_saved_again(outcomes):
    assert [r["save_over_an_aborted_save"] for r in outcomes] == [None, None]


def test_a_save_over_a_dead_save_of_its_tag_leaves_none_of_that_saves_files_in_the_committed_folder(outcomes):
    assert [r["save_over_a_dead_save"] for r in outcomes] == [None, None]
    after = outcomes[0]["dead_folder_after"]
    assert [name for name in after if name.endswith("_states.pt")] == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # not the dead save's rank-5 shard


def test_a_snapshot_failing_on_one_rank_fails_the_save_on_every_rank_without_hanging_the_others(outcomes):
    (kind0, message0), (kind1, message1) = [rank["unsnapshottable_client_state"] for rank in outcomes]
    assert kind0 == "UsageError" and "lock" in message0
    assert kind1 in ("SaveFailedError", "StorageError") and "rank 0" in message1
    assert [rank["latest_after_unsnapshottable"] for rank in outcomes] == ["dead"] * 2  # the save before
    assert [rank["save_after_unsnapshottable"] for rank in outcomes] == [None, None]


@pytest.mark.parametrize("case", ["save_after_close", "wait_after_close"])
def test_use_after_close_is_refused(outcomes, case):
    assert outcomes[0][case][0] == "CheckpointerClosedError"


@pytest.mark.parametrize("case", ["wait_nan_timeout", "wait_text_timeout"])
def test_a_wait_timeout_that_is_not_a_number_of_seconds_is_refused_naming_it(outcomes, case):
    for rank in outcomes:
        assert rank[case][0] == "ConfigError" and "wait(timeout=...) must be a number" in rank[case][1]


@pytest.mark.parametrize("timeout", [float("nan"), "5", -1])
def test_wait_all_refuses_a_timeout_that_is_not_a_number_of_seconds(timeout):
    with pytest.raises(ConfigError, match=r"wait_all\(timeout=...\) must be a number"):
        async_ckpt.wait_all(timeout=timeout)


def test_an_infinite_wait_timeout_means_no_limit(monkeypatch):
    """wait_all hands each open checkpointer's wait() the time left: here, all of it, not none."""
    from async_ckpt import inflight

    asked = []

    class Open:  # an open checkpointer, as far as wait_all reaches into it
        def wait(self, timeout):
            asked.append(timeout)

    opened = Open()
    monkeypatch.setattr(inflight, "_OPEN", {opened})
    async_ckpt.wait_all(timeout=float("inf"))
    assert asked == [float("inf")]


@pytest.mark.parametrize("kwargs", [dict(url=""), dict(url="x", part_size=1024), dict(url="x", max_concurrency=0),
                                    dict(url="x", upload_threads=0), dict(url="x", upload_threads=True),
                                    dict(url="x", commit_timeout_s=0), dict(url="x", keep_last=True),
                                    dict(url="x", part_size=5 * 1024**3 + 1)])
def test_config_is_validated_at_construction(kwargs):
    with pytest.raises(ConfigError):
        CheckpointConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(url="file://"), dict(url="local://"),
                                    dict(url="s3://bucket/run", local_tier="file://")])
def test_a_url_naming_no_folder_is_refused_rather_than_taken_for_the_working_directory(kwargs):
    with pytest.raises(ConfigError, match="names no folder"):
        CheckpointConfig(**kwargs)


def test_a_command_line_count_too_large_for_a_float_is_parsed_not_a_traceback():
    from async_ckpt.arguments import COUNT

    assert COUNT("1" + "0" * 400) == 10**400


@pytest.mark.parametrize("value", [float("inf"), 1e15])
@pytest.mark.parametrize("name", ["commit_timeout_s", "wait_timeout_s", "retry_base_delay_s"])
def test_endless_durations_are_refused_naming_the_field(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be a number .* and at most"):
        CheckpointConfig(url="x", **{name: value})


@pytest.mark.parametrize("kwargs,needed", [(dict(keep_every=10), "set keep_last too"),
                                           (dict(local_tier_max_bytes=10**9), "set local_tier too")])
def test_an_option_that_needs_another_is_refused_without_it(kwargs, needed):
    with pytest.raises(ConfigError, match=needed):
        CheckpointConfig(url="x", **kwargs)


@pytest.mark.parametrize("url", ["my-bucket/run1", "/tmp/run1", "file:///tmp/run1"])
def test_storage_options_with_a_local_url_are_refused_naming_the_missing_scheme(url):
    with pytest.raises(ConfigError, match="is a local path, where they would be ignored: write the URL with its scheme"):
        CheckpointConfig(url=url, storage_options={"endpoint_url": "http://127.0.0.1:9000"})


def test_storage_options_all_unset_with_a_local_url_mean_none():
    """A script that passes {"endpoint_url": os.environ.get("S3_ENDPOINT")} also saves to a local folder."""
    assert CheckpointConfig(url="/tmp/run1", storage_options={"endpoint_url": None}).storage_options == {}


def test_storage_options_with_a_local_url_are_refused_when_any_is_set():
    with pytest.raises(ConfigError, match="is a local path"):
        CheckpointConfig(url="/tmp/run1", storage_options={"endpoint_url": None, "key": "AKIA..."})


@pytest.mark.parametrize("url", [" /tmp/run1", "/tmp/run1 ", "s3://bucket/run1\n"])
def test_a_url_with_surrounding_whitespace_is_refused(url):
    with pytest.raises(ConfigError, match="whitespace"):
        CheckpointConfig(url=url)


def test_synchronous_saves_with_a_local_tier_are_refused():
    with pytest.raises(ConfigError, match="drop one of them"):
        CheckpointConfig(url="s3://bucket/run1", synchronous=True, local_tier="/tmp/tier")


def test_the_default_resume_cache_is_made_readable_by_its_user_only(tmp_path, monkeypatch):
    from async_ckpt import resume

    cache = str(tmp_path / "async_ckpt_cache-1000")
    monkeypatch.setattr(resume, "default_cache_dir", lambda: cache)
    assert resume.owned_cache_dir(cache) == cache and os.stat(cache).st_mode & 0o077 == 0


def test_a_default_resume_cache_others_may_write_into_is_refused_before_a_file_is_fetched(tmp_path, monkeypatch):
    """Its name in the shared temporary folder is predictable: another user could have made it first."""
    from async_ckpt import resume

    cache = tmp_path / "async_ckpt_cache-1000"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setattr(resume, "default_cache_dir", lambda: str(cache))
    with pytest.raises(ConfigError, match="belongs to another user or others may write into it.*Set cache_dir"):
        resume.owned_cache_dir(str(cache))
    assert os.listdir(cache) == []


@pytest.mark.parametrize("cache_dir", ["s3://bucket/cache", "  ", "", " /tmp/cache"])
def test_a_cache_dir_that_is_not_a_local_folder_is_refused(cache_dir):
    with pytest.raises(ConfigError, match="cache_dir must be a local folder path"):
        CheckpointConfig(url="s3://bucket/run1", cache_dir=cache_dir)


@pytest.mark.parametrize("local_tier", [" /tmp/tier", "/tmp/tier "])
def test_a_local_tier_with_surrounding_whitespace_is_refused(local_tier):
    with pytest.raises(ConfigError, match="local_tier must be a local folder path, with no surrounding whitespace"):
        CheckpointConfig(url="s3://bucket/run1", local_tier=local_tier)


def test_a_file_url_cache_dir_is_kept_as_its_path():
    assert CheckpointConfig(url="s3://bucket/run1", cache_dir="file:///tmp/cache").cache_dir == "/tmp/cache"


def test_a_cache_dir_under_home_or_relative_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(url="s3://bucket/run1", cache_dir="~/c").cache_dir == str(tmp_path / "c")
    assert CheckpointConfig(url="s3://bucket/run1", cache_dir="rel").cache_dir == str(tmp_path / "rel")


def test_the_default_cache_dir_is_this_users_own(monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert CheckpointConfig(url="s3://bucket/run1").cache_dir.endswith(f"async_ckpt_cache-{os.getuid()}")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert CheckpointConfig(url="s3://bucket/run1").cache_dir == "/xdg/async_ckpt_cache"


def test_s3s_largest_part_is_a_valid_part_size():
    assert CheckpointConfig(url="s3://bucket/run1", part_size=5 * 1024**3).part_size == 5 * 1024**3


def test_a_local_tier_inside_a_file_url_is_refused_as_overlapping():
    with pytest.raises(ConfigError, match="overlap"):
        CheckpointConfig(url="file:///tmp/ckpt", local_tier="/tmp/ckpt/tier")


def test_wait_timeout_outlasts_a_raised_commit_timeout_by_default():
    assert CheckpointConfig(url="x").effective_wait_timeout_s == 4000
    assert CheckpointConfig(url="x", commit_timeout_s=3000).effective_wait_timeout_s > 2 * 3000


def test_a_lowered_commit_timeout_leaves_the_default_wait_timeout():
    assert CheckpointConfig(url="x", commit_timeout_s=60).effective_wait_timeout_s == 4000


def test_an_explicit_wait_timeout_is_kept():
    assert CheckpointConfig(url="x", commit_timeout_s=3000, wait_timeout_s=2).effective_wait_timeout_s == 2


def test_a_copy_with_a_raised_commit_timeout_gets_its_own_default_wait_timeout():
    copy = dataclasses.replace(CheckpointConfig(url="x"), commit_timeout_s=3000)
    assert copy.wait_timeout_s is None and copy.effective_wait_timeout_s > 2 * 3000


def test_errors_share_one_base_class():
    assert issubclass(async_ckpt.InvalidTagError, async_ckpt.AsyncCkptError)
    assert issubclass(async_ckpt.SaveFailedError, async_ckpt.AsyncCkptError)
