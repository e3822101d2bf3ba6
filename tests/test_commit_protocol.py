"""The commit protocol: a committed tag is never damaged, every wait is bounded, the handshake scales.

Real DeepSpeed ranks for what a user sees (post-commit faults, ``save_latest=False``, stuck saves,
corrupt manifests); ranks as threads around the real background writer and commit, sharing one
store and one storage, for the races between ranks, which need timing no training job controls.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import commit_tasks
from manifests import commit_by_hand
from async_ckpt import (ConfigError, CorruptManifestError, SaveFailedError, UnsupportedManifestError, WaitTimeoutError,
                        commit, layout)
from async_ckpt.bench.commit_scale import CountingStorage, run_save, tcp_stores
from async_ckpt.catalog import read_latest, read_manifest
from async_ckpt.checkpointer import AsyncCheckpointer
from async_ckpt.cli import main
from async_ckpt.commit import add_marks_lock, apply_retention, mark_started
from async_ckpt.config import CheckpointConfig
from async_ckpt.drain import Drainer, DrainJob, DrainTarget
from async_ckpt.gc import collect_garbage
from async_ckpt.handle import SaveHandle, SaveResult
from async_ckpt.handshake import Handshake
from async_ckpt.job import SaveJob
from async_ckpt.layout import MANIFEST
from async_ckpt.manifest import Manifest
from async_ckpt.resume import resolve
from async_ckpt.staging import CopyTicket, StagedFile
from async_ckpt.storage import LocalStorage, open_storage
from async_ckpt.writer import BackgroundWriter

# ---------------------------------------------------------------- work after the manifest


@pytest.fixture(scope="module", params=["latest", "retention"])
def post_commit(request, ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"post-commit-{request.param}") / "ckpt"
    return request.param, str(root), ranks.run(commit_tasks.post_commit_failure, str(root), request.param)


def test_a_failure_after_the_manifest_reports_the_save_committed_with_a_warning(post_commit):
    fault, _, out = post_commit
    for rank in out:
        assert rank["error"] is None
        [warning] = rank["warnings"]
        assert ("'latest'" if fault == "latest" else "retention") in warning


def test_a_failure_after_the_manifest_leaves_every_file_of_the_tag(post_commit):
    _, _, out = post_commit
    for rank in out:
        assert rank["b"] == {"committed": True, "verified": True,
                             "files": ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"]}


def test_the_tag_committed_despite_the_failure_is_the_one_load_resumes(post_commit):
    fault, _, out = post_commit
    assert [r["loaded"] for r in out] == ["b", "b"]
    if fault == "latest":
        assert all("'latest' cannot be read" in r["load_log"][0] for r in out)


def test_failed_retention_keeps_the_older_tag(post_commit):
    fault, _, out = post_commit
    if fault != "retention":
        pytest.skip("a case of retention failing")
    assert [r["a_kept"] for r in out] == [True, True]


def test_ls_lists_the_tags_when_latest_cannot_be_read(post_commit, capsys):
    fault, root, _ = post_commit
    if fault != "latest":
        pytest.skip("a case of 'latest' failing")
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "b " in out and "'latest' cannot be read" in out


# ---------------------------------------------------------------- save_latest=False


def test_a_save_with_save_latest_false_is_recorded_and_load_resumes_what_latest_names(ranks, tmp_path):
    out = ranks.run(commit_tasks.save_latest_false_then_load, str(tmp_path / "ckpt"))
    for rank in out:
        assert rank == {"latest": "a", "b_committed": True, "b_sets_latest": False, "loaded": "a"}


# ---------------------------------------------------------------- bounded waits


def test_a_second_save_of_a_tag_waits_for_the_first_to_commit_and_is_refused_as_committed(ranks, tmp_path):
    """Without the wait it found 't' not yet committed and wrote into it as the first save committed."""
    for seen in ranks.run(commit_tasks.resave_while_the_first_save_commits, str(tmp_path / "ckpt"),
                          str(tmp_path / "gate")):
        assert seen["first_error"] is None and seen["t_manifest"] is True
        assert seen["second"][0] == "TagExistsError" and "already committed" in seen["second"][1]


@pytest.fixture(scope="module")
def stuck(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("stuck")
    return ranks.run(commit_tasks.stuck_previous_save, str(root / "ckpt"), str(root / "gate"))


@pytest.mark.parametrize("call", ["save", "wait", "close"])
def test_a_stuck_previous_save_makes_the_call_give_up_naming_rank_tag_and_what_it_waited_for(stuck, call):
    for rank, seen in enumerate(stuck):
        kind, message = seen[call]
        assert kind == "WaitTimeoutError"
        assert f"rank {rank}" in message and "'first'" in message
        assert ("raise the timeout given to wait()" if call == "wait" else "raise wait_timeout_s") in message
    assert "previous save" in stuck[0]["save"][1]


def test_a_stuck_saves_handle_gives_up_with_the_same_timeout_error_naming_the_tag_and_the_timeout(stuck):
    for seen in stuck:
        kind, message = seen["result"]
        assert kind == "WaitTimeoutError" and "'first'" in message and "within 0.5 s" in message


@pytest.mark.parametrize("call,what", [("result", "committed"), ("exception", "settled"),
                                       ("local_result", "committed on its first tier")])
def test_each_blocking_call_of_a_handle_gives_up_with_a_wait_timeout_error(call, what):
    handle = SaveHandle(tag="t", url="/ckpt")
    with pytest.raises(WaitTimeoutError, match=f"tag 't' to /ckpt was not {what} within 0.01 s"):
        getattr(handle, call)(timeout=0.01)


@pytest.mark.parametrize("call", ["wait", "result", "exception", "wait_local", "local_result"])
@pytest.mark.parametrize("timeout", [float("nan"), "5", -1, 1e30, True])
def test_a_handles_bad_timeout_is_a_config_error_naming_the_call_before_it_waits(call, timeout):
    with pytest.raises(ConfigError, match=rf"{call}\(timeout=\.\.\.\) must be a number"):
        getattr(SaveHandle(tag="t", url="/ckpt"), call)(timeout=timeout)


def test_a_handles_infinite_timeout_waits_without_limit():
    handle = SaveHandle(tag="t", url="/ckpt")
    threading.Timer(0.2, handle._succeed, [SaveResult(tag="t", url="/ckpt", bytes_written=0, stall_s=0.0,
                                                      persist_s=0.0, commit_s=0.0)]).start()
    assert handle.result(timeout=float("inf")).tag == "t" and handle.wait(timeout=float("inf"))


def test_a_save_that_failed_with_a_timeout_error_of_its_own_is_re_raised_as_it_was():
    handle, error = SaveHandle(tag="t", url="/ckpt"), TimeoutError("the store timed out")
    handle._fail(error)
    with pytest.raises(TimeoutError) as raised:
        handle.result(timeout=0.01)
    assert raised.value is error and handle.exception(timeout=0.01) is error


def test_close_gives_the_engine_back_even_when_it_gives_up(stuck):
    assert [r["engine_given_back"] for r in stuck] == [True, True]


def test_the_stuck_save_still_commits_once_storage_moves_and_its_thread_ends(stuck):
    assert [(r["first_committed"], r["writer_threads_left"]) for r in stuck] == [("first", [])] * 2


def test_a_save_still_queued_when_close_gave_up_commits_with_its_tokenizer(stuck):
    assert {"config.json", "tokenizer_config.json"} <= set(stuck[0]["first_files"])


@pytest.fixture(scope="module")
def close_failures(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("close_failures")
    return ranks.run(commit_tasks.close_failures, str(root / "ckpt"), str(root / "gate"))


def test_a_with_block_that_raises_raises_its_own_error_not_the_closes(close_failures):
    assert [(r["block"], r["held"]) for r in close_failures] == [("ValueError: the block's own error", "held")] * 2


def test_a_close_whose_release_raises_still_gives_the_engine_back_and_removes_its_folder(close_failures):
    for rank in close_failures:
        assert rank["close"] == ("RuntimeError", "injected: the staging memory cannot be freed")
        assert rank["engine_given_back"] and not rank["shadow_left"]


# ---------------------------------------------------------------- corrupt manifests


def test_a_failure_the_writer_does_not_expect_fails_that_save_and_the_writer_goes_on(ranks, tmp_path):
    out = ranks.run(commit_tasks.writer_bookkeeping_fails, str(tmp_path / "ckpt"), timeout_s=240)
    for rank in out:
        kind, message = rank["a"]
        assert kind == "SaveFailedError" and "'a'" in message and "injected fault" in message
        assert rank["writer_alive"] and rank["b"] == "b"
        assert rank["latest"] == "b"


@pytest.fixture(scope="module")
def corrupt(ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corrupt") / "ckpt")
    return root, ranks.run(commit_tasks.corrupt_older_manifest, root)


def test_load_resumes_the_newest_readable_tag_and_logs_the_corrupt_one(corrupt):
    _, out = corrupt
    for rank in out:
        assert rank["loaded"] == "b"
        assert any("corrupt tag a" in line and "async_ckpt_manifest.json" in line for line in rank["log"])


def test_loading_the_corrupt_tag_by_name_is_a_typed_error_naming_the_file(corrupt):
    _, out = corrupt
    kind, message = out[0]["explicit"]
    assert kind == "CorruptManifestError" and "a/async_ckpt_manifest.json" in message


def test_ls_shows_the_corrupt_tag_and_still_lists_the_others(corrupt, capsys):
    root, _ = corrupt
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "corrupt" in out and "committed" in out and "a/async_ckpt_manifest.json" in out


def test_verify_of_the_corrupt_tag_names_the_file_and_the_parse_error(corrupt, capsys):
    root, _ = corrupt
    assert main(["verify", root, "--tag", "a"]) == 1
    out = capsys.readouterr().out
    assert "a/async_ckpt_manifest.json" in out and "JSONDecodeError" in out


def test_gc_removes_the_corrupt_tag_only_after_the_grace_period(corrupt, tmp_path):
    root = str(tmp_path / "ckpt")  # a copy: the module's other tests read the corrupt tag
    shutil.copytree(corrupt[0], root)
    storage = open_storage(root)
    assert collect_garbage(storage, grace_s=3600).corrupt_tags == []
    assert collect_garbage(storage, grace_s=0).corrupt_tags == ["a"]
    assert not os.path.exists(f"{root}/a") and os.path.exists(f"{root}/b/{MANIFEST}")


def test_an_unreadable_manifest_raises_a_typed_error():
    with pytest.raises(CorruptManifestError, match="JSONDecodeError"):
        Manifest.from_json(b"{'not': json")


# ---------------------------------------------------------------- manifests of other versions


def _rewrite_manifest(root, tag: str, **changes) -> None:
    """Commit ``tag`` by hand (one file beside the manifest, both two hours old), its manifest changed
    as another async_ckpt version would write it."""
    storage = open_storage(str(root))
    commit_by_hand(storage, tag, 1)
    path = root / tag / MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    for old in (path, root / tag / "mp_rank_00_model_states.pt"):
        os.utime(old, (time.time() - 7200,) * 2)


def test_a_manifest_field_this_version_does_not_know_is_ignored(tmp_path):
    _rewrite_manifest(tmp_path, "t", sharding={"added": "later"})
    assert read_manifest(open_storage(str(tmp_path)), "t").tag == "t"


def test_a_manifest_in_another_versions_format_is_refused_naming_the_file_and_the_fix(tmp_path):
    _rewrite_manifest(tmp_path, "t", format="async_ckpt/2")
    with pytest.raises(UnsupportedManifestError, match=r"t/async_ckpt_manifest\.json.*'async_ckpt/2'.*upgrade"):
        read_manifest(open_storage(str(tmp_path)), "t")


def test_gc_keeps_a_tag_in_another_versions_format(tmp_path):
    _rewrite_manifest(tmp_path, "t", format="async_ckpt/2")
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_unsupported == ["t"] and report.corrupt_tags == []
    assert (tmp_path / "t" / MANIFEST).is_file() and (tmp_path / "t" / "mp_rank_00_model_states.pt").is_file()


def test_retention_keeps_a_tag_in_another_versions_format(tmp_path):
    _rewrite_manifest(tmp_path, "a", format="async_ckpt/2")
    storage = open_storage(str(tmp_path))
    for step, tag in enumerate(["b", "c"], start=2):
        commit_by_hand(storage, tag, step)
    assert apply_retention(storage, "c", keep_last=1) == ["b"]
    assert (tmp_path / "a" / MANIFEST).is_file()


def test_retention_leaves_a_tag_saved_again_after_it_was_listed(tmp_path):
    """A save that overwrites a tag (overwrite_tags) may uncommit and commit it again while another commit's
    retention pass, which listed the earlier save of it as the oldest, runs."""
    storage = open_storage(str(tmp_path))
    for step, tag in enumerate(["a", "b", "c"], start=1):
        commit_by_hand(storage, tag, step)

    @contextlib.contextmanager
    def saved_again_meanwhile():
        commit_by_hand(storage, "a", 99, save_id="the save that overwrote a")
        yield True

    assert apply_retention(storage, "c", keep_last=2, allowed=saved_again_meanwhile) == []
    assert read_manifest(storage, "a").save_id == "the save that overwrote a"


def test_resume_refuses_a_latest_in_another_versions_format_rather_than_take_an_older_tag(tmp_path):
    storage = open_storage(str(tmp_path))
    commit_by_hand(storage, "older", 1)
    _rewrite_manifest(tmp_path, "newer", format="async_ckpt/2")
    (tmp_path / "latest").write_text("newer")
    with pytest.raises(UnsupportedManifestError, match="'latest' at .* names 'newer'.*upgrade"):
        resolve(storage, None)


class _SecondReadFails(LocalStorage):
    """A root whose manifest of ``tag`` reads once, then the store fails (a dropped connection)."""

    def __init__(self, root: str, tag: str) -> None:
        super().__init__(root)
        self.path, self.reads = f"{tag}/{MANIFEST}", 0

    def read_bytes(self, relpath):
        if relpath == self.path:
            self.reads += 1
            if self.reads > 1:
                raise OSError("connection reset (injected)")
        return super().read_bytes(relpath)


def test_resume_raises_a_failing_read_of_latests_manifest_rather_than_take_an_older_tag(tmp_path):
    commit_by_hand(open_storage(str(tmp_path)), "older", 1)
    _rewrite_manifest(tmp_path, "newer", format="async_ckpt/2")
    (tmp_path / "latest").write_text("newer")
    with pytest.raises(OSError, match="injected"):
        resolve(_SecondReadFails(str(tmp_path), "newer"), None)


def test_ls_shows_a_tag_in_another_versions_format_as_unsupported(tmp_path, capsys):
    _rewrite_manifest(tmp_path, "t", format="async_ckpt/2")
    assert main(["ls", str(tmp_path)]) == 0
    assert "t: unsupported: " in capsys.readouterr().out


# ---------------------------------------------------------------- gc grace


def _folder(root, tag: str, *, start_mark: bool, age_s: float = 0.0) -> None:
    """A tag folder without a manifest: with a start mark, as a save of ours leaves it when it dies;
    without, as stock DeepSpeed writes one. Every file ``age_s`` old."""
    rels = [layout.start_mark(tag, 0)] if start_mark else []
    for rel in rels + [f"{tag}/mp_rank_00_model_states.pt"]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age_s,) * 2)


def test_gc_leaves_a_dead_save_alone_during_the_grace_period(tmp_path):
    _folder(tmp_path, "global_step7", start_mark=True, age_s=60)
    storage = open_storage(str(tmp_path))
    assert collect_garbage(storage, grace_s=3600).incomplete_tags == []
    assert collect_garbage(storage, grace_s=30, dry_run=True).incomplete_tags == ["global_step7"]
    assert os.path.isdir(tmp_path / "global_step7")


def test_gc_keeps_a_folder_without_manifest_that_latest_names(tmp_path):
    """A stock DeepSpeed checkpoint in the root (written before the engine was wrapped) has no manifest."""
    _folder(tmp_path, "global_step1000", start_mark=False)
    _folder(tmp_path, "dead", start_mark=True)
    (tmp_path / "latest").write_text("global_step1000")
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_latest == ["global_step1000"] and report.incomplete_tags == ["dead"]
    assert os.path.isfile(tmp_path / "global_step1000" / "mp_rank_00_model_states.pt")
    assert not os.path.exists(tmp_path / "dead")


def test_gc_keeps_folders_without_manifest_while_latest_cannot_be_read(tmp_path):
    _folder(tmp_path, "dead", start_mark=True)
    (tmp_path / "latest").write_bytes(b"\xff\xfe not text")
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_latest == ["dead"] and report.incomplete_tags == []
    assert os.path.isfile(tmp_path / "dead" / "mp_rank_00_model_states.pt")


def test_gc_keeps_a_folder_whose_bookkeeping_folder_holds_no_start_mark(tmp_path):
    """An aborted save leaves its empty ``.async_ckpt/``; stock DeepSpeed may save that tag name later."""
    _folder(tmp_path, "global_step500", start_mark=False, age_s=7200)
    (tmp_path / "global_step500" / ".async_ckpt" / "scratch-rank0").mkdir(parents=True)
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_foreign == ["global_step500"] and report.incomplete_tags == []


class _DeletionCutShort(LocalStorage):
    """Local storage whose recursive deletes remove one file of the folder, then fail (as a crash or an
    object store's batch that fails would leave it)."""

    def delete(self, relpath, *, recursive=False):
        if not recursive:
            return super().delete(relpath)
        os.remove(_every_path(os.path.join(self.root, relpath))[0])
        raise OSError("connection reset (injected mid-deletion)")


def test_gc_finishes_a_tag_deletion_that_was_cut_short_and_removes_its_mark(tmp_path):
    for step, tag in enumerate(["old", "new"]):
        commit_by_hand(open_storage(str(tmp_path)), tag, step)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            (tmp_path / tag / name).write_bytes(b"x")
    with pytest.raises(OSError, match="mid-deletion"):
        apply_retention(_DeletionCutShort(str(tmp_path)), "new", keep_last=1)
    assert not (tmp_path / "old" / MANIFEST).exists() and len(_every_file(tmp_path / "old")) == 1
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.incomplete_tags == ["old"] and report.kept_foreign == []
    assert not (tmp_path / "old").exists() and _every_file(tmp_path / ".async_ckpt") == []


def test_gc_keeps_a_folder_made_since_under_the_name_of_a_deletion_cut_short(tmp_path):
    """The deletion mark of global_step100 stayed (the job died right after the deletion); stock DeepSpeed
    then saved global_step100 again (after a rollback, say): its files are newer than the mark."""
    (tmp_path / ".async_ckpt" / "deleting").mkdir(parents=True)
    mark = tmp_path / ".async_ckpt" / "deleting" / "global_step100"
    mark.write_bytes(b"")
    os.utime(mark, (time.time() - 7200,) * 2)
    _folder(tmp_path, "global_step100", start_mark=False, age_s=60)
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_foreign == ["global_step100"] and report.incomplete_tags == []
    assert report.bookkeeping == [".async_ckpt/deleting/global_step100"] and not mark.exists()


class _DeletionEndsMeanwhile(LocalStorage):
    """Local storage where a retention that was deleting ``old`` removes its mark just as gc looks at it."""

    def modified(self, relpath):
        if relpath == ".async_ckpt/deleting/old":
            super().delete(relpath)
        return super().modified(relpath)


def test_gc_goes_on_when_a_deletion_mark_goes_while_it_looks(tmp_path):
    (tmp_path / ".async_ckpt" / "deleting").mkdir(parents=True)
    (tmp_path / ".async_ckpt" / "deleting" / "old").write_bytes(b"")
    assert collect_garbage(_DeletionEndsMeanwhile(str(tmp_path)), grace_s=0).bookkeeping == []


def test_gc_removes_a_deletion_mark_whose_deletion_ended(tmp_path):
    (tmp_path / ".async_ckpt" / "deleting").mkdir(parents=True)
    (tmp_path / ".async_ckpt" / "deleting" / "gone").write_bytes(b"")
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.bookkeeping == [".async_ckpt/deleting/gone"]
    assert _every_file(tmp_path / ".async_ckpt") == []


def test_gc_keeps_folders_async_ckpt_did_not_start(tmp_path):
    """Stock DeepSpeed's older saves in the root, which ``latest`` no longer names: no manifest, no start mark."""
    for tag in ("global_step100", "global_step200"):
        _folder(tmp_path, tag, start_mark=False, age_s=7200)
    (tmp_path / "latest").write_text("global_step300")
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.kept_foreign == ["global_step100", "global_step200"] and report.incomplete_tags == []
    assert all(os.path.isfile(tmp_path / t / "mp_rank_00_model_states.pt") for t in report.kept_foreign)


class _WriteEndsWhileListed(LocalStorage):
    """Local storage where each ``.partial`` file takes its final name (a save's write ending) just after
    gc listed it, before gc looks at its time."""

    def modified(self, relpath):
        if relpath.endswith(".partial"):
            os.replace(os.path.join(self.root, relpath), os.path.join(self.root, relpath.removesuffix(".partial")))
        return super().modified(relpath)


def _old_partial(root, tag: str) -> None:
    partial = root / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt.partial"
    partial.write_bytes(b"x")
    os.utime(partial, (time.time() - 7200,) * 2)


def test_gc_keeps_a_folder_whose_file_a_save_renames_while_gc_looks(tmp_path):
    _folder(tmp_path, "writing", start_mark=True, age_s=7200)
    _old_partial(tmp_path, "writing")
    assert collect_garbage(_WriteEndsWhileListed(str(tmp_path)), grace_s=3600).incomplete_tags == []
    assert (tmp_path / "writing" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()


def test_gc_goes_on_past_a_committed_tags_partial_file_renamed_while_gc_looks(tmp_path):
    commit_by_hand(open_storage(str(tmp_path)), "live", 1)
    _old_partial(tmp_path, "live")
    assert collect_garbage(_WriteEndsWhileListed(str(tmp_path)), grace_s=3600).partial_files == []
    assert (tmp_path / "live" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()


def test_gc_removes_what_a_killed_process_left_at_the_root_once_old(tmp_path):
    """A `latest` cut short mid-write, a write probe never removed; a young one may be a live process's."""
    commit_by_hand(open_storage(str(tmp_path)), "live", 1)
    for name in ("latest.0123456789ab.partial", ".async_ckpt-probe-00aa", ".async_ckpt-probe-11bb"):
        (tmp_path / name).write_bytes(b"x")
    for name in ("latest.0123456789ab.partial", ".async_ckpt-probe-00aa"):
        os.utime(tmp_path / name, (time.time() - 7200,) * 2)
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=3600)
    assert report.partial_files == ["latest.0123456789ab.partial"]
    assert report.bookkeeping == [".async_ckpt-probe-00aa"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [".async_ckpt-probe-11bb"]


class _SaveReusesTheName(LocalStorage):
    """A node folder where, as gc deletes the dead folder ``dead`` (or ``live``'s old bookkeeping), a new
    save of that tag starts writing its start mark on another thread: ``landed_during`` is whether the
    mark was written within 0.5 s, while the deletion had not yet begun; ``marked`` is set once it is."""

    def __init__(self, root: str, folder: str) -> None:
        super().__init__(root)
        self.folder, self.landed_during, self.marked = folder, None, threading.Event()

    def delete(self, relpath, *, recursive=False):
        if recursive and relpath == self.folder and self.landed_during is None:
            tag = self.folder.split("/")[0]
            threading.Thread(target=lambda: (mark_started(open_storage(self.root), tag, 1, "new-save"),
                                             self.marked.set()), daemon=True).start()
            self.landed_during = self.marked.wait(0.5)
        return super().delete(relpath, recursive=recursive)


def test_gc_holds_off_a_start_mark_while_it_deletes_a_dead_save_in_a_node_folder(tmp_path):
    _folder(tmp_path, "dead", start_mark=True, age_s=7200)
    storage = _SaveReusesTheName(str(tmp_path), "dead")
    add_marks_lock(storage)
    assert collect_garbage(storage, grace_s=3600).incomplete_tags == ["dead"]
    assert storage.landed_during is False and storage.marked.wait(30)
    assert _every_file(tmp_path) == [layout.MARKS_LOCK, layout.start_mark("dead", 1)]  # the new save's, in a fresh folder


def test_gc_holds_off_a_start_mark_while_it_removes_a_committed_tags_old_bookkeeping_in_a_node_folder(tmp_path):
    storage = _SaveReusesTheName(str(tmp_path), "live/.async_ckpt")
    add_marks_lock(storage)
    commit_by_hand(storage, "live", 1)
    _folder(tmp_path, "live", start_mark=True, age_s=7200)  # a mark its commit could not remove
    assert collect_garbage(storage, grace_s=3600).bookkeeping == ["live/.async_ckpt"]
    assert storage.landed_during is False and storage.marked.wait(30)
    assert _every_file(tmp_path / "live") == [layout.MARKER_DIR + "/" + os.path.basename(layout.start_mark("live", 1)),
                                              MANIFEST, "mp_rank_00_model_states.pt"]


def test_gc_adds_no_marks_lock_to_a_local_url(tmp_path):
    _folder(tmp_path, "dead", start_mark=True, age_s=7200)
    assert collect_garbage(open_storage(str(tmp_path)), grace_s=3600).incomplete_tags == ["dead"]
    assert not (tmp_path / layout.MARKS_LOCK).exists()


# ---------------------------------------------------------------- failures raised together


def _checkpointer_state(*unreported: SaveFailedError) -> SimpleNamespace:
    """What AsyncCheckpointer._surface_errors reads of its checkpointer (on_error="raise")."""
    return SimpleNamespace(_errors_lock=threading.Lock(), _unreported=list(unreported), _raised_for_peers=set(),
                           config=SimpleNamespace(on_error="raise"))


def test_a_failure_recorded_after_the_ranks_gathered_none_waits_for_the_next_check():
    """The ranks gathered their unreported failures and none had one; this rank's drain failed since. Raised
    now it would be raised on this rank alone, the others going on into the next collective."""
    state = _checkpointer_state(SaveFailedError("the drain of 'first' failed", tag="first"))
    AsyncCheckpointer._surface_errors(state, [None, None])
    with pytest.raises(SaveFailedError, match="'first'"):
        AsyncCheckpointer._surface_errors(state)


def test_a_failure_another_rank_reported_is_raised_here_too():
    with pytest.raises(SaveFailedError, match="rank 1's drain"):
        AsyncCheckpointer._surface_errors(_checkpointer_state(), [None, ("first", "rank 1's drain of 'first' failed")])


# ---------------------------------------------------------------- configuration types


@pytest.mark.parametrize("field,value", [("max_concurrency", True), ("commit_timeout_s", "60"), ("part_size", 2**24 + 0.5),
                                         ("overlap_copy", "yes"), ("wait_timeout_s", False), ("retry_attempts", 2.0),
                                         ("synchronous", "auto"), ("synchronous", 0)])
def test_configuration_refuses_booleans_and_wrong_types_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(url="/tmp/x", **{field: value})


# ---------------------------------------------------------------- races between ranks (thread ranks)


def _thread_save(root: str, world_size: int, *, timeout_s: float, delay=lambda rank, name, path: 0.0,
                 stores=None, extras_dir: str | None = None) -> tuple[list[SaveHandle], dict]:
    """One save by ``world_size`` background writers (one per thread rank) through a shared store;
    ``extras_dir``: rank 0's tokenizer folder."""
    store = dist.HashStore() if stores is None else None
    tag, save_id = "t", uuid.uuid4().hex
    errors: dict = {}
    handles, writers = [], []
    for rank in range(world_size):
        def before(name, args, rank=rank):
            time.sleep(delay(rank, name, str(args[0]) if args else ""))
        storage = CountingStorage(open_storage(root), before=before)
        handle = SaveHandle(tag=tag, url=root)
        job = SaveJob(tag=tag, save_id=save_id, storage=storage, rank=rank, world_size=world_size,
                      files=[StagedFile(f"{tag}/rank{rank}.pt", {"rank": rank}, 0)], ticket=CopyTicket([]),
                      handle=handle, handshake=Handshake(stores[rank] if stores else store, save_id, rank, world_size),
                      save_latest=True, keep_last=None, keep_every=None, metadata={"step": 1},
                      extras_dir=extras_dir if rank == 0 else None)
        writer = BackgroundWriter(rank, timeout_s, lambda e, rank=rank: errors.setdefault(rank, e),
                                  cache_dir=os.path.join(root, ".cache"))
        writer.submit(job)
        writer.stop()
        handles.append(handle)
        writers.append(writer)
    for writer in writers:
        assert writer.join(120), "a writer thread did not end"
    return handles, errors


def _files(root) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(root, "t")) if n.endswith(".pt"))


def _every_path(folder) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(folder) for n in names)


def _every_file(folder) -> list[str]:
    return [os.path.relpath(path, folder) for path in _every_path(folder)]


def _manifest_held(seconds: float):
    return lambda rank, name, path: seconds if rank == 0 and name == "write_bytes" and path.endswith(MANIFEST) else 0.0


def test_a_peer_whose_wait_runs_out_while_rank_0_writes_the_manifest_reports_the_commit(tmp_path):
    handles, errors = _thread_save(str(tmp_path), 2, timeout_s=1.0, delay=_manifest_held(2.5))
    assert errors == {}
    assert [h.result().tag for h in handles] == ["t", "t"]
    assert _files(tmp_path) == ["rank0.pt", "rank1.pt"]


def test_a_peer_that_gives_up_while_rank_0_is_stuck_committing_keeps_its_files(tmp_path):
    # rank 1 gives up 2 s after its report, sees rank 0's commit decision (taken well within those 2 s
    # even on a loaded machine), waits 2 s more, then finds no manifest: rank 0 holds it for 6 s
    handles, errors = _thread_save(str(tmp_path), 2, timeout_s=1.0, delay=_manifest_held(6.0))
    assert handles[0].exception() is None and "stay for `async-ckpt gc`" in str(errors[1])
    assert _files(tmp_path) == ["rank0.pt", "rank1.pt"]  # the tag rank 0 committed is whole
    assert os.path.exists(tmp_path / "t" / MANIFEST)


def test_rank_0_never_commits_a_tag_a_peer_gave_up_on(tmp_path):
    slow = lambda rank, name, path: 2.0 if rank != 1 and name == "open_write" else 0.0  # noqa: E731
    handles, errors = _thread_save(str(tmp_path), 3, timeout_s=0.3, delay=slow)
    assert sorted(errors) == [0, 1, 2] and "gave up" in str(errors[1])
    assert not os.path.exists(tmp_path / "t" / MANIFEST)
    assert _files(tmp_path) == []  # no manifest can appear: every rank removed its files


def test_a_tag_a_peer_gave_up_on_after_rank_0_wrote_the_tokenizer_leaves_no_file(tmp_path):
    """Not even the tokenizer rank 0 wrote into the tag, nor the start marks (gc would need them for any file left)."""
    extras = tmp_path / "extras"
    extras.mkdir()
    (extras / "tokenizer.json").write_text("{}")
    def held(rank, name, path):
        return 2.0 if name == "open_write" and path.endswith("tokenizer.json") else 0.0
    handles, errors = _thread_save(str(tmp_path / "root"), 2, timeout_s=0.5, delay=held, extras_dir=str(extras))
    assert sorted(errors) == [0, 1] and "gave up waiting before rank 0 could commit" in str(errors[0])
    assert os.path.isdir(tmp_path / "root" / "t") and _every_file(tmp_path / "root" / "t") == []


def test_when_rank_0s_tokenizer_write_fails_its_start_mark_stays_for_gc(tmp_path):
    """The write cut short may have left what rank 0's cleanup cannot see; rank 1 removed its files and mark."""
    extras = tmp_path / "extras"
    extras.mkdir()
    (extras / "tokenizer.json").write_text("{}")

    def fail(rank, name, path):
        if name == "open_write" and path.endswith("tokenizer.json"):
            raise OSError(28, "No space left on device (injected)")
        return 0.0
    handles, errors = _thread_save(str(tmp_path / "root"), 2, timeout_s=30, delay=fail, extras_dir=str(extras))
    assert sorted(errors) == [0, 1] and "tokenizer" in str(errors[1])
    assert _every_file(tmp_path / "root" / "t") == [".async_ckpt/started-rank0"]


def test_a_rank_whose_write_fails_fails_the_tag_on_every_rank_without_waiting(tmp_path):
    def fail(rank, name, path):
        if rank == 1 and name == "open_write":
            raise OSError(28, "No space left on device (injected)")
        return 0.0
    # a timeout no test waits out: a rank that waited for it would outlast _thread_save's joins
    handles, errors = _thread_save(str(tmp_path), 3, timeout_s=3600, delay=fail)
    assert sorted(errors) == [0, 1, 2] and all("rank 1" in str(e) and "No space left" in str(e) for e in errors.values())
    assert not os.path.exists(tmp_path / "t" / MANIFEST) and _files(tmp_path) == []


def test_when_the_jobs_store_is_gone_the_save_fails_clearly_instead_of_hanging(tmp_path):
    server, stores = tcp_stores(2)
    del server  # the job is being torn down: its store stops answering
    handles, errors = _thread_save(str(tmp_path), 2, timeout_s=5, stores=stores)  # a hang outlasts its joins
    assert sorted(errors) == [0, 1] and all("c10d store" in str(e) for e in errors.values())
    assert not os.path.exists(tmp_path / "t" / MANIFEST)


def test_the_commit_costs_each_rank_a_number_of_storage_requests_independent_of_the_world_size(tmp_path):
    counts = {}
    for world_size in (4, 32):
        server, stores = tcp_stores(world_size)
        storage = open_storage(str(tmp_path / f"w{world_size}"))
        runs = run_save(lambda rank: CountingStorage(storage), stores, "t")
        assert all(r.outcome.committed for r in runs), [r.error for r in runs]
        counts[world_size] = (sum(runs[0].requests.values()), max(sum(r.requests.values()) for r in runs[1:]))
        del server
    assert counts[4] == counts[32] and counts[4][1] == 0


def test_the_handshake_leaves_no_keys_in_the_store(tmp_path):
    server, stores = tcp_stores(4)
    runs = run_save(lambda rank: CountingStorage(open_storage(str(tmp_path))), stores, "t")
    assert all(r.outcome.committed for r in runs)
    assert [key for key in server.list_keys() if "async_ckpt/" in key] == []


# ---------------------------------------------------------------- drains and 'latest' (one thread rank)


def _save_one_rank(root: str, tag: str, step: int, storage=None) -> None:
    """A save of ``tag`` at ``step`` by one rank's background writer, committed in ``root`` (through
    ``storage`` if given)."""
    save_id = uuid.uuid4().hex
    job = SaveJob(tag=tag, save_id=save_id, storage=storage or open_storage(root), rank=0, world_size=1,
                  files=[StagedFile(f"{tag}/rank0.pt", {"step": step}, 0)], ticket=CopyTicket([]),
                  handle=SaveHandle(tag=tag, url=root), handshake=Handshake(dist.HashStore(), save_id, 0, 1),
                  save_latest=True, keep_last=None, keep_every=None, metadata={"step": step})
    writer = BackgroundWriter(0, 30, lambda e: None, cache_dir=os.path.join(root, ".cache"))
    writer.submit(job)
    writer.stop()
    assert writer.join(60)
    job.handle.result(timeout=0)


def _drain_one_rank(local_root: str, durable_root: str, tag: str, durable=None) -> None:
    """Drain ``tag``, committed in the node folder ``local_root``, to ``durable_root`` (through ``durable``
    if given)."""
    local, durable = open_storage(local_root), durable or open_storage(durable_root)
    target = DrainTarget(local=local, durable=durable, keep_last=None, keep_every=None, local_keep_last=10,
                         tier_leader=True)
    drainer = Drainer(0, 1, dist.HashStore(), target, 30, lambda error, job: None)
    handle = SaveHandle(tag=tag, url=durable_root)
    drainer.submit(DrainJob(manifest=read_manifest(local, tag), drain_id=uuid.uuid4().hex, handle=handle))
    drainer.stop()
    assert drainer.join(60)
    handle.result(timeout=0)


def test_a_drain_that_ends_after_a_later_save_reached_the_url_leaves_latest_on_the_later_save(tmp_path):
    local, durable = str(tmp_path / "node"), str(tmp_path / "bucket")
    _save_one_rank(local, "a", step=10)  # committed on the node, its drain still queued
    _save_one_rank(durable, "b", step=20)  # the node folder was full: straight to the URL
    _drain_one_rank(local, durable, "a")
    assert read_manifest(open_storage(durable), "a") is not None
    assert read_latest(open_storage(durable)) == "b"


def test_a_drain_and_a_later_save_committing_at_one_root_at_once_leave_latest_on_the_later_save(tmp_path,
                                                                                                monkeypatch):
    """Rank 0's drainer has checked 'latest' for the older tag 'a' when its writer commits 'b' straight to
    the URL (the local tier was full), through the same storage: 'b' waits for the drain's steps after its
    commit, and does not write 'latest' in between the drain's check and its write."""
    local, durable_root = str(tmp_path / "node"), str(tmp_path / "bucket")
    _save_one_rank(local, "a", step=10)
    durable, checked, b_saved = open_storage(durable_root), threading.Event(), threading.Event()
    check = commit._later_save_named_by_latest

    def slow_check(job, manifest):
        later = check(job, manifest)
        if job.tag == "a":
            checked.set()
            b_saved.wait(2)  # without the lock 'b' commits meanwhile; with it, 'b' waits for this drain
        return later

    monkeypatch.setattr(commit, "_later_save_named_by_latest", slow_check)
    drain = threading.Thread(target=_drain_one_rank, args=(local, durable_root, "a"), kwargs={"durable": durable})
    drain.start()
    assert checked.wait(30)
    _save_one_rank(durable_root, "b", step=20, storage=durable)
    b_saved.set()
    drain.join(60)
    assert not drain.is_alive() and read_manifest(durable, "a") is not None  # the drain of 'a' committed
    assert read_latest(durable) == "b"


def test_a_drain_of_the_newest_save_moves_latest_at_the_url(tmp_path):
    local, durable = str(tmp_path / "node"), str(tmp_path / "bucket")
    _save_one_rank(durable, "a", step=10)
    _save_one_rank(local, "b", step=20)
    _drain_one_rank(local, durable, "b")
    assert read_latest(open_storage(durable)) == "b"


def test_a_drained_manifest_keeps_the_time_of_its_save(tmp_path):
    local, durable = str(tmp_path / "node"), str(tmp_path / "bucket")
    _save_one_rank(local, "a", step=10)
    time.sleep(0.05)
    _drain_one_rank(local, durable, "a")
    saved, drained = read_manifest(open_storage(local), "a"), read_manifest(open_storage(durable), "a")
    assert drained.created_unix == saved.created_unix


# ---------------------------------------------------------------- DeepSpeed's recovery scripts


def test_a_recovery_script_the_filesystem_will_not_make_executable_does_not_fail_the_commit(tmp_path, monkeypatch,
                                                                                            caplog):
    """As on SMB and Azure file shares, or a script another user owns in a shared root."""
    from async_ckpt.commit import _write_recovery_scripts

    def refused(path, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted", path)

    monkeypatch.setattr(os, "chmod", refused)
    _write_recovery_scripts(open_storage(str(tmp_path)))
    assert (tmp_path / "zero_to_fp32.py").is_file()
    assert "could not make" in caplog.text and "run it with python" in caplog.text


def test_recovery_scripts_already_in_the_root_are_left_as_they_are(tmp_path):
    from async_ckpt.commit import _write_recovery_scripts

    storage = open_storage(str(tmp_path))
    _write_recovery_scripts(storage)
    script = tmp_path / "zero_to_fp32.py"
    os.utime(script, (1_000_000, 1_000_000))  # a write would move the modification time
    _write_recovery_scripts(storage)
    assert os.stat(script).st_mtime == 1_000_000 and os.access(script, os.X_OK)


def test_recovery_scripts_missing_or_changed_in_the_root_are_written_again(tmp_path):
    from async_ckpt.commit import _write_recovery_scripts
    from async_ckpt.layout import installed_recovery_scripts

    storage = open_storage(str(tmp_path))
    _write_recovery_scripts(storage)
    (tmp_path / "zero_to_fp32.py").write_text("edited\n")
    (tmp_path / "zero_to_torch.py").unlink()
    _write_recovery_scripts(storage)
    for script, installed in installed_recovery_scripts().items():
        assert (tmp_path / script).read_bytes() == open(installed, "rb").read()
        assert os.access(tmp_path / script, os.X_OK)
