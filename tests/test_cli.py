"""The async-ckpt command against local and moto-served S3 checkpoints, including bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

import rank_tasks
from async_ckpt.cli import main
from async_ckpt.errors import CorruptManifestError
from async_ckpt.launch import RankError
from async_ckpt.gc import collect_garbage
from async_ckpt.layout import manifest_path
from async_ckpt.manifest import Manifest
from async_ckpt.storage import open_storage
from async_ckpt.storage.s3 import S3Storage
from s3_server import FaultProxy, options


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def local_root(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    ranks.run(rank_tasks.save_committed_tags, str(root), {}, ["first", "second"])
    return root


@pytest.fixture(scope="module")
def s3_root(ranks, s3):
    bucket = s3.make_bucket("cli-root")
    ranks.run(rank_tasks.save_committed_tags, f"s3://{bucket}/run", options(s3.endpoint), ["only"])
    return f"s3://{bucket}/run", bucket


def test_ls_lists_committed_tags_and_marks_latest(local_root, capsys):
    code, out, _ = run_cli(capsys, "ls", str(local_root))
    assert code == 0 and "first" in out and "second *" in out and "committed" in out


def test_ls_json_has_step_size_ranks_and_stage(local_root, capsys):
    code, out, _ = run_cli(capsys, "ls", str(local_root), "--json")
    data = json.loads(out)
    assert code == 0 and data["latest"] == "second"
    row = next(t for t in data["tags"] if t["tag"] == "second")
    assert row["committed"] and row["world_size"] == 2 and row["zero_stage"] == 3 and row["bytes"] > 0


def test_ls_on_s3_works_like_local(s3_root, s3, capsys):
    code, out, _ = run_cli(capsys, "ls", s3_root[0], "--endpoint", s3.endpoint, "--json")
    assert code == 0 and json.loads(out)["latest"] == "only"


def test_verify_reports_every_file_ok(local_root, capsys):
    code, out, _ = run_cli(capsys, "verify", str(local_root), "--tag", "first", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and len(data["files"]) >= 4 and all(f["ok"] for f in data["files"])


def test_verify_on_s3_reads_through_the_store(s3_root, s3, capsys):
    code, out, _ = run_cli(capsys, "verify", s3_root[0], "--endpoint", s3.endpoint)
    assert code == 0 and "files match the manifest" in out


def test_verify_names_a_corrupt_file_and_fails(local_root, capsys, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(local_root, copy)
    rank_tasks._flip_byte(str(copy / "second" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    code, out, _ = run_cli(capsys, "verify", str(copy))
    assert code == 1 and "BAD  zero_pp_rank_0_mp_rank_00_optim_states.pt" in out


def test_verify_of_a_copied_tag_folder_checks_the_copys_own_files(local_root, capsys, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(local_root, copy)
    shutil.copytree(copy / "second", copy / "best")  # "keep this one"
    code, out, _ = run_cli(capsys, "verify", str(copy), "--tag", "best")
    assert code == 0 and "best: " in out
    rank_tasks._flip_byte(str(copy / "best" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    code, out, _ = run_cli(capsys, "verify", str(copy), "--tag", "best")
    assert code == 1 and "BAD  zero_pp_rank_0_mp_rank_00_optim_states.pt" in out


@pytest.mark.parametrize("path", ["../evil.pt", "/etc/evil.pt", "a//b.pt", "a\\b.pt", "", "./a.pt", "a/../../b.pt"])
def test_a_manifest_whose_file_path_leaves_the_tag_folder_is_corrupt(path):
    manifest = Manifest(tag="t", step=1, world_size=1, zero_stage=2, dtype="fp32", files=[])
    data = json.loads(manifest.to_json())
    data["files"] = [{"path": path, "size": 1, "crc32": "00000000", "rank": 0}]
    with pytest.raises(CorruptManifestError, match="inside the tag folder"):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("field,value", [("created_unix", "2"), ("created_unix", None), ("created_unix", float("nan")),
                                         ("created_unix", 1e20), ("step", "3"), ("step", True), ("world_size", -1),
                                         ("save_id", 5), ("sets_latest", "yes"), ("files", {}),
                                         ("files", [{"path": "a.pt", "size": "1", "crc32": "0", "rank": 0}]),
                                         ("node_ranks", 0), ("node_ranks", ["0"])])
def test_ls_lists_a_manifest_with_a_field_of_the_wrong_type_as_corrupt_instead_of_failing(capsys, tmp_path, field, value):
    for tag, step in (("good", 1), ("bad", 2)):
        manifest = Manifest(tag=tag, step=step, world_size=1, zero_stage=2, dtype="fp32", files=[],
                            created_unix=float(step))
        data = json.loads(manifest.to_json())
        if tag == "bad":
            data[field] = value
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "async_ckpt_manifest.json").write_text(json.dumps(data))
    code, out, _ = run_cli(capsys, "ls", str(tmp_path), "--json")
    rows = {row["tag"]: row for row in json.loads(out)["tags"]}
    assert code == 0 and rows["good"]["committed"] and not rows["bad"]["committed"]
    assert "corrupt" in json.dumps(rows["bad"])


def test_verify_json_of_a_tag_in_another_versions_format_says_so_in_json(capsys, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "async_ckpt_manifest.json").write_text(json.dumps({"format": "async_ckpt/2", "tag": "t"}))
    code, out, _ = run_cli(capsys, "verify", str(tmp_path), "--tag", "t", "--json")
    report = json.loads(out)
    assert code == 2 and report["ok"] is False and "upgrade async_ckpt" in report["error"]


def test_verify_of_a_missing_tag_is_a_clear_error(local_root, capsys):
    code, _, err = run_cli(capsys, "verify", str(local_root), "--tag", "nope")
    assert code == 2 and "'nope' not found" in err


def test_verify_of_the_tag_latest_says_to_leave_the_tag_out(local_root, capsys):
    code, _, err = run_cli(capsys, "verify", str(local_root), "--tag", "latest")
    assert code == 2 and "leave the tag out" in err


def test_a_file_url_naming_no_folder_is_refused(capsys):
    code, _, err = run_cli(capsys, "ls", "file://")
    assert code == 2 and "names no folder" in err


def test_pull_into_an_empty_dest_is_refused(local_root, capsys):
    code, _, err = run_cli(capsys, "pull", str(local_root), "--dest", "")
    assert code == 2 and "--dest is empty" in err


def test_ls_of_an_s3_prefix_holding_nothing_says_so(s3, capsys):
    bucket = s3.make_bucket("cli-empty-prefix")
    code, out, _ = run_cli(capsys, "ls", f"s3://{bucket}/typo", "--endpoint", s3.endpoint)
    assert code == 0 and f"nothing is stored under s3://{bucket}/typo" in out


def test_wrong_url_is_a_clear_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "ls", str(tmp_path / "missing"))
    assert code == 2 and "no such folder" in err
    code, _, err = run_cli(capsys, "ls", "s3:/bucket/run")
    assert code == 2 and "malformed URL" in err


def test_gc_dry_run_lists_old_incomplete_tags_and_removes_nothing(local_root, capsys, tmp_path):
    import shutil

    copy = tmp_path / "gc"
    shutil.copytree(local_root, copy)
    (copy / "crashed" / ".async_ckpt").mkdir(parents=True)
    mark = copy / "crashed" / ".async_ckpt" / "started-rank0"  # as a save of ours that crashed leaves it
    stale = copy / "crashed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt.abc.partial"
    old = time.time() - 7200
    for path in (mark, stale):
        path.write_bytes(b"x" * 10)
        os.utime(path, (old, old))
    code, out, _ = run_cli(capsys, "gc", str(copy), "--dry-run", "--json")
    assert code == 0 and json.loads(out)["incomplete_tags"] == ["crashed"] and stale.exists()
    code, out, _ = run_cli(capsys, "gc", str(copy), "--json")
    assert code == 0 and not (copy / "crashed").exists() and (copy / "second").exists()


def test_gc_leaves_young_incomplete_tags_alone(local_root, capsys, tmp_path):
    import shutil

    copy = tmp_path / "young"
    shutil.copytree(local_root, copy)
    (copy / "in-progress" / ".async_ckpt").mkdir(parents=True)
    (copy / "in-progress" / ".async_ckpt" / "started-rank0").write_bytes(b"x")
    (copy / "in-progress" / "zero_pp_rank_0_mp_rank_00_optim_states.pt.x.partial").write_bytes(b"x")
    code, out, _ = run_cli(capsys, "gc", str(copy), "--json")
    assert code == 0 and json.loads(out)["incomplete_tags"] == [] and (copy / "in-progress").exists()


def test_gc_aborts_orphaned_multipart_uploads_on_s3(s3_root, s3, capsys):
    url, bucket = s3_root
    client = s3.client()
    client.put_object(Bucket=bucket, Key="run/crashed/.async_ckpt/started-rank0", Body=b"x")
    client.create_multipart_upload(Bucket=bucket, Key="run/crashed/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    code, out, _ = run_cli(capsys, "gc", url, "--endpoint", s3.endpoint, "--grace-s", "0", "--json")
    assert code == 0 and json.loads(out)["aborted_uploads"] == ["crashed/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_gc_keeps_a_save_whose_only_recent_activity_is_a_part_upload_on_s3(s3, capsys):
    """One rank's large file has been uploading for longer than the grace period: its start mark and its
    upload's start are older than that, its latest part is not."""
    bucket = s3.make_bucket("cli-uploading")
    url, client = f"s3://{bucket}/run", s3.client()
    key = "run/uploading/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    client.put_object(Bucket=bucket, Key="run/uploading/.async_ckpt/started-rank0", Body=b"x")
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    time.sleep(6.5)  # S3 keeps times to the second; the grace leaves gc 4 s to reach the part on a busy machine
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    code, out, _ = run_cli(capsys, "gc", url, "--endpoint", s3.endpoint, "--grace-s", "5", "--json")
    report = json.loads(out)
    assert code == 0 and report["incomplete_tags"] == [] and report["aborted_uploads"] == []
    assert [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [upload]
    assert client.get_object(Bucket=bucket, Key="run/uploading/.async_ckpt/started-rank0")["Body"].read() == b"x"


class _PartsCounted(S3Storage):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def last_part_uploaded(self, relpath, upload_id):
        self.asked.append(relpath)
        return super().last_part_uploaded(relpath, upload_id)


def test_gc_looks_into_the_parts_of_its_own_uploads_only(s3):
    bucket = s3.make_bucket("cli-parts-asked")
    client = s3.client()
    client.put_object(Bucket=bucket, Key="crashed/.async_ckpt/started-rank0", Body=b"x")
    for key in ("crashed/zero_pp_rank_0_mp_rank_00_optim_states.pt", "videos/raw.mp4"):
        client.create_multipart_upload(Bucket=bucket, Key=key)
    storage = _PartsCounted(f"s3://{bucket}", options(s3.endpoint))
    report = collect_garbage(storage, grace_s=0)
    assert report.aborted_uploads == ["crashed/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert report.kept_uploads == ["videos/raw.mp4"]
    assert storage.asked == ["crashed/zero_pp_rank_0_mp_rank_00_optim_states.pt"]


class _PartsUnreadableUnder(S3Storage):
    """S3 storage whose part listing fails (after its retries, say) for uploads under ``tag``."""

    def __init__(self, *args, tag: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag

    def last_part_uploaded(self, relpath, upload_id):
        if relpath.startswith(f"{self.tag}/"):
            raise OSError("injected: the part listing failed")
        return super().last_part_uploaded(relpath, upload_id)


def test_gc_aborts_a_dead_saves_uploads_before_it_deletes_its_folder(s3):
    """gc fails part way (at tag 'b'): the tag it deleted before ('a') left no upload that nothing owns."""
    bucket = s3.make_bucket("cli-abort-first")
    client = s3.client()
    for tag in ("a", "b"):
        client.put_object(Bucket=bucket, Key=f"{tag}/.async_ckpt/started-rank0", Body=b"x")
        client.create_multipart_upload(Bucket=bucket, Key=f"{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(OSError, match="injected"):
        collect_garbage(_PartsUnreadableUnder(f"s3://{bucket}", options(s3.endpoint), tag="b"), grace_s=0)
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [
        "b/zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_an_upload_that_ended_since_it_was_listed_counts_as_active_now(s3):
    bucket = s3.make_bucket("cli-upload-ended")
    client = s3.client()
    upload = client.create_multipart_upload(Bucket=bucket, Key="t/x.pt")["UploadId"]
    client.abort_multipart_upload(Bucket=bucket, Key="t/x.pt", UploadId=upload)
    before = time.time()
    assert S3Storage(f"s3://{bucket}", options(s3.endpoint)).last_part_uploaded("t/x.pt", upload) >= before


def test_aborting_an_upload_that_ended_since_it_was_listed_is_done(s3):
    """Two gc runs at once, or the save's own abort first: the second abort finds no upload."""
    bucket = s3.make_bucket("cli-abort-twice")
    upload = s3.client().create_multipart_upload(Bucket=bucket, Key="t/x.pt")["UploadId"]
    storage = S3Storage(f"s3://{bucket}", options(s3.endpoint))
    storage.abort_upload("t/x.pt", upload)
    storage.abort_upload("t/x.pt", upload)
    assert s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_an_upload_whose_parts_may_not_be_listed_counts_as_active_now_with_a_warning(s3, caplog):
    """Without s3:ListMultipartUploadParts gc cannot tell a live upload from a dead one: it keeps it."""
    bucket = s3.make_bucket("cli-parts-denied")
    upload = s3.client().create_multipart_upload(Bucket=bucket, Key="t/x.pt")["UploadId"]
    proxy = FaultProxy(s3.endpoint)
    proxy.deny_list_parts = True
    storage = S3Storage(f"s3://{bucket}", options(proxy.endpoint))
    try:
        before = time.time()
        assert storage.last_part_uploaded("t/x.pt", upload) >= before
    finally:
        storage.close()
        proxy.stop()
    assert "grant s3:ListMultipartUploadParts" in caplog.text


def test_gc_at_a_bucket_root_leaves_other_writers_uploads_alone(s3, capsys):
    bucket = s3.make_bucket("cli-shared")
    client = s3.client()
    others = ["videos/raw.mp4", "crashed-elsewhere/model.bin"]  # no start mark: not a save of ours
    for key in others:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    code, out, _ = run_cli(capsys, "gc", f"s3://{bucket}", "--endpoint", s3.endpoint, "--grace-s", "0", "--json")
    report = json.loads(out)
    assert code == 0 and report["aborted_uploads"] == [] and sorted(report["kept_uploads"]) == sorted(others)
    assert sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"]) == sorted(others)


COMMANDS = ["demo", "bench", "ls", "verify", "gc", "pull", "export", "to-universal"]
READERS = [("ls",), ("verify",), ("gc",), ("pull", "--dest", "{tmp}/pulled"), ("export", "--out", "{tmp}/exported")]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0 and f"usage: async-ckpt {command}" in capsys.readouterr().out


def test_json_on_stdout_parses_when_run_as_a_fresh_process(local_root):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "async_ckpt", "ls", str(local_root), "--json"],
                          capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(done.stdout)["latest"] == "second"  # DeepSpeed's log lines go to stderr


@pytest.mark.parametrize("argv", READERS, ids=[r[0] for r in READERS])
def test_a_missing_bucket_is_a_clear_error_not_a_traceback(argv, s3, capsys, tmp_path):
    args = [a.format(tmp=tmp_path) for a in argv]
    code, _, err = run_cli(capsys, args[0], "s3://no-such-bucket-here/run", *args[1:], "--endpoint", s3.endpoint)
    assert code == 2 and "s3://no-such-bucket-here/run" in err and "NoSuchBucket" in err


def test_an_unreachable_endpoint_is_a_clear_error(capsys):
    from async_ckpt.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    code, _, err = run_cli(capsys, "ls", "s3://bucket/run", "--endpoint", dead,
                           "--storage-options", json.dumps({"config_kwargs": {"retries": {"max_attempts": 1}}}))
    assert code == 2 and "cannot read s3://bucket/run" in err and "Check the URL" in err


@pytest.mark.parametrize("argv,flag", [(("pull", "{root}", "--dest", "{tmp}/p", "--concurrency", "0"), "--concurrency"),
                                       (("pull", "{root}", "--dest", "{tmp}/p", "--rank", "-1"), "--rank"),
                                       (("to-universal", "{root}", "--out", "{tmp}/u", "--workers", "0"), "--workers"),
                                       (("export", "{root}", "--out", "{tmp}/e", "--max-shard-gb", "0"), "--max-shard-gb"),
                                       (("gc", "{root}", "--grace-s", "-1"), "--grace-s"),
                                       (("export", "{root}", "--out", "{tmp}/e", "--max-shard-gb", "inf"), "--max-shard-gb"),
                                       (("export", "{root}", "--out", "{tmp}/e", "--max-shard-gb", "1e300"),
                                        "--max-shard-gb"),
                                       (("demo", "--steps", "0"), "--steps"),
                                       (("bench", "--quick", "--ranks", "0"), "--ranks"),
                                       (("bench", "--quick", "--saves", "-1"), "--saves"),
                                       (("bench", "--quick", "--steps-between", "0"), "--steps-between"),
                                       (("bench", "--quick", "--rounds", "0"), "--rounds")])
def test_an_out_of_range_number_is_refused_naming_the_flag(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(root=tmp_path, tmp=tmp_path) for a in argv])
    assert exit_info.value.code == 2 and f"argument {flag}: must be at least" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_bench_refuses_an_unknown_method_as_bad_input(capsys, tmp_path):
    code, _, err = run_cli(capsys, "bench", "--quick", "--methods", "stock,bogus", "--out", str(tmp_path / "out"))
    assert code == 2 and "unknown method(s) ['bogus']" in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,error", [(("--steps", "12", "--save-every", "5"), "not a multiple of --save-every"),
                                        (("--dir", "{tmp}"), "is not empty")])
def test_demo_refuses_arguments_it_would_fail_on_later(argv, error, capsys, tmp_path):
    (tmp_path / "earlier").mkdir()
    code, _, err = run_cli(capsys, "demo", *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and error in err and os.listdir(tmp_path) == ["earlier"]


def _root_with(tmp_path, **kind) -> str:
    """A root whose one tag ``t``'s manifest says it is ``kind`` (universal or consolidated); no files."""
    storage = open_storage(str(tmp_path / "root"))
    storage.write_bytes(manifest_path("t"), Manifest(tag="t", step=1, world_size=1, zero_stage=2, dtype="fp32",
                                                     files=[], **kind).to_json())
    return str(tmp_path / "root")


def test_export_refuses_a_universal_tag_before_reading_it(capsys, tmp_path):
    code, _, err = run_cli(capsys, "export", _root_with(tmp_path, universal=True), "--tag", "t", "--out",
                           str(tmp_path / "hf"))
    assert code == 2 and "universal checkpoint, which zero_to_fp32 cannot consolidate" in err
    assert not (tmp_path / "hf").exists()


def test_a_root_of_universal_checkpoints_only_names_them_and_the_flag_when_no_tag_is_given(capsys, tmp_path):
    code, _, err = run_cli(capsys, "verify", _root_with(tmp_path, universal=True))
    assert code == 2 and "it holds universal checkpoint(s) only: t. Name one by tag (--tag)" in err


def test_to_universal_refuses_a_consolidated_tag_before_reading_it(capsys, tmp_path):
    code, _, err = run_cli(capsys, "to-universal", _root_with(tmp_path, consolidated=True), "--tag", "t", "--out",
                           str(tmp_path / "u"))
    assert code == 2 and "consolidated save" in err and "ds_to_universal cannot convert" in err
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("flag", ["--storage-options", "--out-storage-options"])
def test_storage_options_that_are_not_a_json_object_are_refused_naming_the_flag(flag, local_root, capsys, tmp_path):
    code, _, err = run_cli(capsys, "to-universal", str(local_root), "--out", str(tmp_path / "u"), flag, "[1]")
    assert code == 2 and f"{flag} must be a JSON object" in err
    assert os.listdir(tmp_path) == []


def test_storage_options_that_are_not_json_are_refused_naming_the_flag(local_root, capsys):
    code, _, err = run_cli(capsys, "ls", "s3://bucket/run", "--storage-options", "{bad")
    assert code == 2 and "--storage-options is not valid JSON" in err


@pytest.mark.parametrize("flag", [("--storage-options", '{"anon": true}'), ("--endpoint", "http://127.0.0.1:9")])
def test_storage_options_for_a_local_root_are_refused_naming_the_flags(flag, local_root, capsys):
    code, _, err = run_cli(capsys, "ls", str(local_root), *flag)
    assert code == 2 and "--storage-options and --endpoint are for an object store" in err


def test_to_universal_from_a_local_root_gives_the_endpoint_to_an_object_store_out(local_root, capsys, monkeypatch):
    from async_ckpt import universal

    opened = {}

    def convert(source, manifest, dest, **kwargs):
        opened.update(source=source.local_dir(), dest=dest.fs.endpoint_url)
        return universal.UniversalReport(manifest.tag, "u", dest.url, 0, 0, 0.0)

    monkeypatch.setattr(universal, "to_universal", convert)
    code, _, _ = run_cli(capsys, "to-universal", str(local_root), "--out", "s3://bucket/u", "--endpoint",
                         "http://127.0.0.1:9")
    assert code == 0 and opened == {"source": str(local_root), "dest": "http://127.0.0.1:9"}


def test_an_empty_url_is_refused(capsys):
    code, _, err = run_cli(capsys, "ls", "")
    assert code == 2 and "the checkpoint URL is empty" in err


def test_s3_options_the_client_refuses_are_a_clear_error_not_a_traceback(capsys):
    code, _, err = run_cli(capsys, "ls", "s3://bucket/run", "--storage-options", '{"endpoint": "http://127.0.0.1:9"}')
    assert code == 2 and "storage_options for s3://bucket/run are invalid" in err and "endpoint_url" in err


@pytest.mark.parametrize("argv", [("export", "--out"), ("pull", "--dest")])
def test_an_output_folder_that_is_a_file_is_refused_naming_the_flag(argv, local_root, capsys, tmp_path):
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    code, _, err = run_cli(capsys, argv[0], str(local_root), argv[1], str(plain))
    assert code == 2 and f"{argv[1]} {plain} is a file" in err
    assert plain.read_text() == "x"


@pytest.mark.parametrize("argv", [("export", "--out"), ("pull", "--dest")])
def test_an_output_folder_given_as_an_object_store_url_is_refused_naming_the_flag(argv, local_root, capsys, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a URL taken for a path would become a folder named 's3:'
    code, _, err = run_cli(capsys, argv[0], str(local_root), argv[1], "s3://bucket/out")
    assert code == 2 and f"{argv[1]} s3://bucket/out is a URL" in err
    assert os.listdir(tmp_path) == []


def test_a_pull_into_a_file_url_writes_into_the_folder_it_names(local_root, capsys, tmp_path):
    code, _, _ = run_cli(capsys, "pull", str(local_root), "--dest", f"file://{tmp_path}/pulled", "--quiet")
    assert code == 0 and (tmp_path / "pulled" / "latest").read_text() == "second"


def test_to_universal_into_an_unwritable_out_fails_before_converting(local_root, capsys, tmp_path, monkeypatch):
    from async_ckpt import universal

    def convert(*args):
        raise AssertionError("ds_to_universal ran before --out was found unwritable")

    monkeypatch.setattr(universal, "_run_ds_to_universal", convert)
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    code, _, err = run_cli(capsys, "to-universal", str(local_root), "--out", str(plain / "universal"))
    assert code == 2 and f"cannot write checkpoints to {plain / 'universal'}" in err


def test_a_conversion_deepspeed_refuses_names_the_tag_and_root_not_its_temporary_copy(capsys, tmp_path):
    root = _root_with(tmp_path)  # a committed tag without its shards: ds_to_universal finds no checkpoint
    code, _, err = run_cli(capsys, "to-universal", root, "--tag", "t", "--out", str(tmp_path / "u"))
    assert code != 0 and f"ds_to_universal failed (exit 1) on tag 't' of {root}" in err
    assert "async_ckpt_universal_" not in err.splitlines()[0]


def test_pull_shows_a_byte_progress_bar_on_stderr(local_root, capsys, tmp_path):
    code, out, err = run_cli(capsys, "pull", str(local_root), "--dest", str(tmp_path / "pulled"))
    assert code == 0 and "pulled second" in out
    assert "pull second" in err and "100%" in err


def test_demo_refuses_a_file_as_its_folder(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, "demo", "--dir", str(tmp_path / "file"))
    assert code == 2 and "--dir" in err and "is a file" in err and "Traceback" not in err


def test_demo_refuses_a_url_as_its_folder_before_its_ranks_start(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "demo", "--dir", "s3://bucket/demo")
    assert code == 2 and "--dir s3://bucket/demo is a URL" in err and os.listdir(tmp_path) == []


def test_the_demo_into_a_memory_folder_counts_its_synchronous_writes_as_training_stalled(capsys):
    """wrap() writes each save while training waits where the folder is in memory (tmpfs) and training runs
    on the CPU: the demo must not show a few milliseconds of stall beside a "background" write."""
    if subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"], capture_output=True, text=True).stdout.strip() != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    root = tempfile.mkdtemp(prefix="async_ckpt_demo_test_", dir="/dev/shm")
    try:
        code, out, _ = run_cli(capsys, "demo", "--dir", root, "--steps", "2", "--save-every", "2", "--size", "tiny")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    row = next(line.split() for line in out.splitlines() if line.startswith("  global_step2 "))
    assert code == 0 and "chose synchronous saves" in out and "synchronous write" in out
    assert float(row[1]) >= float(row[3])  # training stalled for at least the write


def test_demo_refuses_a_folder_it_cannot_make_before_its_ranks_start(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, "demo", "--dir", str(tmp_path / "file" / "ckpt"))
    assert code == 2 and "--dir" in err and "cannot be made" in err and "Traceback" not in err


def test_a_demo_that_cannot_write_its_folder_says_so_without_naming_an_endpoint(capsys, monkeypatch):
    import async_ckpt.demo

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/ro/ckpt")

    monkeypatch.setattr(async_ckpt.demo, "run_demo", refused)
    code, _, err = run_cli(capsys, "demo", "--dir", "/ro/ckpt")
    assert code == 2 and "Permission denied: '/ro/ckpt'" in err and "endpoint" not in err


def test_a_bench_that_failed_on_a_rank_exits_as_a_failure_not_as_bad_input(capsys, monkeypatch, tmp_path):
    import async_ckpt.bench.save_bench

    def failed(cfg):
        raise RankError("rank 1 failed: RuntimeError: out of memory")

    monkeypatch.setattr(async_ckpt.bench.save_bench, "run", failed)
    code, _, err = run_cli(capsys, "bench", "--quick", "--out", str(tmp_path / "out"))
    assert code == 1 and "failed on a rank: rank 1 failed" in err


MISSING_TAG = [("verify",), ("pull", "--dest", "{tmp}/pulled"), ("export", "--out", "{tmp}/exported"),
               ("to-universal", "--out", "{tmp}/universal")]


@pytest.mark.parametrize("argv", MISSING_TAG, ids=[r[0] for r in MISSING_TAG])
def test_a_missing_tag_is_a_clear_error_for_every_command(argv, local_root, capsys, tmp_path):
    args = [a.format(tmp=tmp_path) for a in argv]
    code, _, err = run_cli(capsys, args[0], str(local_root), *args[1:], "--tag", "nope")
    assert code == 2 and "'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, s3_modules", [
    ([], ()),  # local disk: no S3 floor, no embedded server
    (["--target", "s3"], ("boto3", "moto")),
    (["--url", "s3://bucket/run"], ("boto3",)),  # --url alone targets S3; its server is the user's
    (["--target", "tiered"], ("boto3", "moto")),
])
def test_bench_asks_for_the_s3_packages_only_where_the_run_targets_s3(argv, s3_modules):
    from async_ckpt.cli import _bench_modules, build_parser

    needed = _bench_modules(build_parser().parse_args(["bench", *argv]))
    assert tuple(m for m in needed if m in ("boto3", "moto")) == s3_modules
    assert {"transformers", "tokenizers", "psutil", "matplotlib"} <= set(needed)


@pytest.mark.parametrize("argv", [("export", "--out"), ("to-universal", "--out")])
def test_a_conversion_from_a_local_root_refuses_a_damaged_file_before_deepspeeds_tools_read_it(
        argv, local_root, capsys, tmp_path):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(local_root, root)
    shard = sorted((root / "second").glob("*optim_states.pt"))[0]
    rank_tasks._flip_byte(str(shard), offset=shard.stat().st_size - 1000)  # in the tensor data, past the pickle
    code, _, err = run_cli(capsys, argv[0], str(root), "--tag", "second", argv[1], str(tmp_path / "out"))
    assert code == 2 and f"{shard.name} of tag 'second'" in err and "does not match its manifest" in err
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) == []
