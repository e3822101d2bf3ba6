"""pull, export and to-universal against local and moto-served S3 checkpoints, judged by DeepSpeed and transformers.

A 2-rank run saves the same step with stock DeepSpeed, with async_ckpt to disk and with async_ckpt
to S3. Pulls must reproduce DeepSpeed checkpoint roots, exports must load in transformers with the
engine's logits, and universal conversions must resume on 1 rank exactly like the same conversion
of the stock checkpoint.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import time
import shutil
import subprocess
import sys
import zlib
from dataclasses import replace

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import interop_tasks
from async_ckpt import StorageError, UsageError
from async_ckpt.checksum import format_crc
from async_ckpt.cli import main
from async_ckpt.export import export_hf
from async_ckpt.layout import MANIFEST
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.pull import pull
from async_ckpt.resume import resolve
from async_ckpt.storage import LocalStorage, open_storage
from async_ckpt.storage.s3 import S3Storage
from conftest import rank_group
from s3_server import options


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


_RUNS: dict[int, dict] = {}


def _saved(stage: int, ranks, s3, tmp_path_factory) -> dict:
    """One run per ZeRO stage, shared by every test of this module."""
    if stage not in _RUNS:
        root = tmp_path_factory.mktemp(f"interop-zero{stage}")
        bucket = s3.make_bucket(f"interop-zero{stage}")
        url = f"s3://{bucket}/run"
        out = ranks.run(interop_tasks.train_and_save_everywhere, stage, str(root / "local"), url,
                        options(s3.endpoint), str(root / "stock"))
        _RUNS[stage] = {"stage": stage, "root": root, "local": root / "local", "url": url, "bucket": bucket,
                        "tag": out[0]["tags"][0], "s3_tag": out[0]["tags"][1], "logits": out[0]["logits"]}
    return _RUNS[stage]


@pytest.fixture(scope="module")
def zero3(ranks, s3, tmp_path_factory):
    return _saved(3, ranks, s3, tmp_path_factory)


@pytest.fixture(scope="module")
def zero2(ranks, s3, tmp_path_factory):
    return _saved(2, ranks, s3, tmp_path_factory)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def converted(request, ranks, s3, tmp_path_factory):
    """The S3 checkpoint converted by `to-universal` (to S3), and the stock one by ds_to_universal itself."""
    run = _saved(request.param, ranks, s3, tmp_path_factory)
    out_url = f"s3://{run['bucket']}/universal"
    code = main(["to-universal", run["url"], "--endpoint", s3.endpoint, "--tag", run["s3_tag"], "--out", out_url,
                 "--json"])
    assert code == 0
    stock_tag = (run["root"] / "stock" / "latest").read_text()
    stock_out = run["root"] / "stock_universal" / f"{stock_tag}_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(run["root"] / "stock" / stock_tag), "--output_folder", str(stock_out),
                    "--num_extract_workers", "2", "--num_merge_workers", "2", "--inject_missing_state"],
                   check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return {**run, "out_url": out_url, "stock_universal": run["root"] / "stock_universal"}


@pytest.fixture(scope="module")
def one_rank():
    yield from rank_group(1)


def _consolidated(root) -> dict[str, torch.Tensor]:
    return get_fp32_state_dict_from_zero_checkpoint(str(root))


# ---- pull -------------------------------------------------------------------------------------

def test_pull_from_s3_gives_a_deepspeed_root_with_the_same_weights(zero3, s3, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "pull", zero3["url"], "--endpoint", s3.endpoint, "--dest", str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 0 and report["files_fetched"] == len(report["files"]) and report["files_skipped"] == 0
    assert (tmp_path / "latest").read_text() == zero3["s3_tag"]
    assert (tmp_path / "zero_to_fp32.py").is_file()
    pulled, local = _consolidated(tmp_path), _consolidated(zero3["local"])
    assert pulled.keys() == local.keys() and all(torch.equal(pulled[k], local[k]) for k in local)


def test_pull_from_a_local_root_copies_and_verifies_every_file(zero3, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(tmp_path), "--json", "--quiet")
    report = json.loads(out)
    listed = resolve(open_storage(str(zero3["local"])), zero3["tag"]).files
    assert code == 0 and sorted(report["files"]) == sorted(e.path for e in listed)
    assert report["files_fetched"] == len(listed) and (tmp_path / "latest").read_text() == zero3["tag"]
    for name in report["files"]:
        assert (tmp_path / zero3["tag"] / name).read_bytes() == (zero3["local"] / zero3["tag"] / name).read_bytes()


def test_pulls_into_one_dest_at_once_fetch_each_file_one_at_a_time(zero3, tmp_path):
    """As when a launcher runs `async-ckpt pull --rank R --dest DIR` on every rank: their partial files share
    a name, so two fetches of one file at once would write into each other's."""
    import threading

    from async_ckpt.catalog import read_manifest
    from async_ckpt.pull import download

    class Counted(LocalStorage):
        active, most = 0, 0
        guard = threading.Lock()

        def get_file(self, relpath, local_path, **kwargs):
            with Counted.guard:
                Counted.active += 1
                Counted.most = max(Counted.most, Counted.active)
            try:
                time.sleep(0.2)
                return super().get_file(relpath, local_path, **kwargs)
            finally:
                with Counted.guard:
                    Counted.active -= 1

    storage = Counted(str(zero3["local"]))
    manifest = read_manifest(storage, zero3["tag"])
    entry = next(e for e in manifest.files if "model_states" in e.path)
    dest = str(tmp_path / zero3["tag"])
    reports = []

    def pull_once():
        try:
            reports.append(download(storage, manifest, [entry], dest, max_concurrency=1, resumable=True))
        except Exception as exc:  # asserted below: a thread's own raise would reach pytest as a warning only
            reports.append(exc)

    pulls = [threading.Thread(target=pull_once) for _ in range(2)]
    for thread in pulls:
        thread.start()
    for thread in pulls:
        thread.join()
    assert sorted((r.files_fetched, r.files_skipped) for r in reports) == [(0, 1), (1, 0)]
    assert Counted.most == 1  # the second found it fetched
    assert (tmp_path / zero3["tag"] / entry.path).read_bytes() == (zero3["local"] / zero3["tag"] / entry.path).read_bytes()


def test_pull_leaves_no_lock_files_in_its_dest(zero3, capsys, tmp_path):
    from async_ckpt.storage.local import _locks_node_wide

    if not _locks_node_wide(str(tmp_path)):
        pytest.skip("pytest's temporary folders are on a filesystem other machines may mount: lock files stay")
    code, _, _ = run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(tmp_path), "--quiet")
    assert code == 0 and (tmp_path / "latest").is_file()
    assert [p.name for p in tmp_path.rglob("*") if "lock" in p.name or "fetching" in p.name] == []


def test_pull_again_fetches_nothing(zero3, s3, capsys, tmp_path):
    args = ("pull", zero3["url"], "--endpoint", s3.endpoint, "--dest", str(tmp_path), "--json")
    run_cli(capsys, *args)
    code, out, _ = run_cli(capsys, *args)
    report = json.loads(out)
    assert code == 0 and report["files"] and report["files_fetched"] == 0
    assert report["files_skipped"] == len(report["files"])


def test_interrupted_pull_resumes_with_the_parts_it_has(zero3, s3, tmp_path):
    part = 64 * 1024
    storage = S3Storage(zero3["url"], options(s3.endpoint), part_size=part)
    manifest = resolve(storage, None)
    entry = max(manifest.files, key=lambda e: e.size)
    obj = s3.client().get_object(Bucket=zero3["bucket"], Key=f"run/{manifest.tag}/{entry.path}")
    full, etag = obj["Body"].read(), obj["ETag"]
    partial = tmp_path / manifest.tag / f"{entry.path}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(full[:2 * part] + b"\0" * (len(full) - 2 * part))  # as a pull stopped after two parts
    (tmp_path / manifest.tag / f"{entry.path}.partial.parts").write_text(f"{len(full)} {part} {etag}\n0\n{part}\n")
    report = pull(storage, manifest, str(tmp_path), show_progress=False)
    assert (tmp_path / manifest.tag / entry.path).read_bytes() == full
    others = sum(e.size for e in manifest.files if e.path != entry.path)
    assert storage.stats.bytes_downloaded == others + len(full) - 2 * part
    assert report.files_fetched == len(manifest.files)


def test_pull_of_one_rank_fetches_only_its_files(zero3, s3, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "pull", zero3["url"], "--endpoint", s3.endpoint, "--dest", str(tmp_path),
                           "--rank", "1", "--json")
    pt_files = [f for f in json.loads(out)["files"] if f.endswith(".pt")]
    assert code == 0 and pt_files and all("zero_pp_rank_1_" in f for f in pt_files)


def test_pull_of_a_missing_tag_or_rank_is_a_clear_error(zero3, s3, capsys, tmp_path):
    code, _, err = run_cli(capsys, "pull", zero3["url"], "--endpoint", s3.endpoint, "--dest", str(tmp_path),
                           "--tag", "nope")
    assert code == 2 and "'nope' not found" in err
    code, _, err = run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(tmp_path), "--rank", "5")
    assert code == 2 and "rank 5 does not exist" in err


def test_pull_of_a_rank_counts_data_parallel_ranks_not_every_rank(tmp_path):
    """4 ranks, tensor-parallel 2: data-parallel ranks 0 and 1 (refused before anything is read)."""
    files = [FileEntry(f"{name}.pt", 1, "00000000", 0) for name in
             ("mp_rank_00_model_states", "mp_rank_01_model_states", "zero_pp_rank_0_mp_rank_00_optim_states",
              "zero_pp_rank_0_mp_rank_01_optim_states", "zero_pp_rank_1_mp_rank_00_optim_states",
              "zero_pp_rank_1_mp_rank_01_optim_states")]
    manifest = Manifest(tag="tp", step=1, world_size=4, zero_stage=1, dtype="fp32", files=files)
    (tmp_path / "root").mkdir()
    with pytest.raises(UsageError, match=r"rank 2 .* 2 data-parallel rank\(s\) of 4; pass --rank 0\.\.1"):
        pull(open_storage(str(tmp_path / "root")), manifest, str(tmp_path / "dest"), rank=2, show_progress=False)
    assert not (tmp_path / "dest").exists()


def test_pull_refuses_a_dest_holding_files_of_another_save_of_the_tag(zero3, capsys, tmp_path):
    stale = tmp_path / zero3["tag"] / "zero_pp_rank_7_mp_rank_00_optim_states.pt"
    stale.parent.mkdir()
    stale.write_bytes(b"an older save's shard")
    code, _, err = run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(tmp_path), "--tag", zero3["tag"])
    assert code == 2 and "zero_pp_rank_7_mp_rank_00_optim_states.pt" in err and "another --dest" in err
    assert sorted(os.listdir(stale.parent)) == [stale.name] and not (tmp_path / "latest").exists()


def test_pull_makes_each_file_durable_before_it_takes_its_name(zero3, tmp_path, monkeypatch):
    """Stock DeepSpeed reads a pulled folder without checking it: a crash must not leave a name on a
    file whose bytes never reached the disk."""
    pulling = importlib.import_module("async_ckpt.pull")
    synced, fsync_path = [], pulling.fsync_path
    monkeypatch.setattr(pulling, "fsync_path", lambda path: synced.append(path) or fsync_path(path))
    storage = open_storage(str(zero3["local"]))
    manifest = resolve(storage, zero3["tag"])
    pull(storage, manifest, str(tmp_path), show_progress=False)
    partials = sorted(path.removesuffix(".partial") for path in synced if path.endswith(".partial"))
    assert partials == sorted(str(tmp_path / manifest.tag / entry.path) for entry in manifest.files
                              if entry.path != MANIFEST)


def test_pull_fetches_whole_a_file_whose_kept_part_is_of_another_save(zero3, capsys, tmp_path):
    """An interrupted pull kept the start of a file; the tag was saved again before the pull was rerun."""
    storage = open_storage(str(zero3["local"]))
    manifest = resolve(storage, zero3["tag"])
    entry = max(manifest.files, key=lambda e: e.size)
    partial = tmp_path / manifest.tag / f"{entry.path}.partial"
    partial.parent.mkdir()
    partial.write_bytes(b"\xff" * 4096)
    pull(storage, manifest, str(tmp_path), show_progress=False)
    assert (tmp_path / manifest.tag / entry.path).read_bytes() == (zero3["local"] / manifest.tag / entry.path).read_bytes()
    assert not partial.exists()


def test_pull_copies_the_manifest_as_stored_with_fields_this_version_does_not_know(zero3, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(zero3["local"] / zero3["tag"], root / zero3["tag"])
    stored = root / zero3["tag"] / MANIFEST
    stored.write_text(json.dumps({**json.loads(stored.read_text()), "added_by_a_later_version": [1, 2]}))
    storage = open_storage(str(root))
    pull(storage, resolve(storage, zero3["tag"]), str(tmp_path / "dest"), show_progress=False)
    assert (tmp_path / "dest" / zero3["tag"] / MANIFEST).read_bytes() == stored.read_bytes()


def test_pull_of_a_tag_saved_again_meanwhile_fails_rather_than_label_its_files_with_the_new_save(zero3, tmp_path):
    storage = open_storage(str(zero3["local"]))
    pulled = replace(resolve(storage, zero3["tag"]), save_id="the-save-whose-files-were-pulled")
    with pytest.raises(StorageError, match="saved again while it was pulled"):
        pull(storage, pulled, str(tmp_path), show_progress=False)
    assert not (tmp_path / zero3["tag"] / MANIFEST).exists() and not (tmp_path / "latest").exists()


class _ManifestGoneAfterwards(LocalStorage):
    """A root whose tag was deleted (by retention, say) once its files were pulled."""

    def read_bytes(self, relpath):
        if relpath.endswith(MANIFEST):
            raise FileNotFoundError(relpath)
        return super().read_bytes(relpath)


def test_pull_of_a_tag_deleted_after_its_files_were_pulled_completes(zero3, tmp_path):
    manifest = resolve(open_storage(str(zero3["local"])), zero3["tag"])
    pull(_ManifestGoneAfterwards(str(zero3["local"])), manifest, str(tmp_path), show_progress=False)
    assert Manifest.from_json((tmp_path / zero3["tag"] / MANIFEST).read_bytes()) == manifest
    assert (tmp_path / "latest").read_text() == zero3["tag"]


def _saved_again(zero3, root, *, changed: bool):
    """``root`` holding the tag as saved again: another save id, and a shard that differs from the old
    save's stored corrupt (its committed CRC-32 matches neither), so a pull of it fails. With ``changed``,
    rank 0's optimizer states differ too (intact), so the pull replaces that file before it fails."""
    tag = zero3["tag"]
    shutil.copytree(zero3["local"] / tag, root / tag)
    stored = root / tag / MANIFEST
    saved_again = json.loads(stored.read_text())
    for entry in saved_again["files"]:
        if entry["path"] == "zero_pp_rank_1_mp_rank_00_optim_states.pt":
            entry["crc32"] = "00000000"
        if entry["path"] == "zero_pp_rank_0_mp_rank_00_optim_states.pt" and changed:
            other = root / tag / entry["path"]
            other.write_bytes(other.read_bytes() + b"saved again")
            entry.update(size=other.stat().st_size, crc32=format_crc(zlib.crc32(other.read_bytes())))
    stored.write_text(json.dumps({**saved_again, "save_id": "the-next-save"}))
    return root


def _pulled(zero3, dest):
    tag = zero3["tag"]
    pull(open_storage(str(zero3["local"])), resolve(open_storage(str(zero3["local"])), tag), str(dest),
         show_progress=False)
    return dest


def test_a_pull_of_another_save_cut_short_leaves_no_label_of_the_earlier_one(zero3, capsys, tmp_path):
    """The folder holds a whole pull of one save of the tag; the tag was saved again, and the pull of the
    new save fails half way: neither the old manifest nor 'latest' names the mix of both saves' files."""
    tag, dest = zero3["tag"], _pulled(zero3, tmp_path / "dest")
    root = _saved_again(zero3, tmp_path / "root", changed=True)
    code, _, err = run_cli(capsys, "pull", str(root), "--dest", str(dest), "--tag", tag)
    assert code == 2 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in err
    assert (dest / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes().endswith(b"saved again")
    assert not (dest / tag / MANIFEST).exists() and not (dest / "latest").exists()


def test_a_pull_of_another_save_that_fails_before_replacing_a_file_leaves_the_earlier_pull_labelled(
        zero3, capsys, tmp_path):
    tag, dest = zero3["tag"], _pulled(zero3, tmp_path / "dest")
    held = (dest / tag / MANIFEST).read_bytes()
    code, _, _ = run_cli(capsys, "pull", str(_saved_again(zero3, tmp_path / "root", changed=False)), "--dest",
                         str(dest), "--tag", tag)
    assert code == 2 and (dest / tag / MANIFEST).read_bytes() == held and (dest / "latest").read_text() == tag
    assert run_cli(capsys, "verify", str(dest), "--tag", tag)[0] == 0


def test_a_pull_of_one_rank_into_a_pull_of_another_save_is_refused_leaving_it_as_it_was(zero3, capsys, tmp_path):
    """Its manifest would list the other ranks' files of the earlier save, which this pull does not fetch."""
    tag, dest = zero3["tag"], _pulled(zero3, tmp_path / "dest")
    held = (dest / tag / MANIFEST).read_bytes()
    root = _saved_again(zero3, tmp_path / "root", changed=True)
    code, _, err = run_cli(capsys, "pull", str(root), "--dest", str(dest), "--tag", tag, "--rank", "0")
    assert code == 2 and "holds a pull of another save" in err and "no --rank" in err
    assert (dest / tag / MANIFEST).read_bytes() == held and (dest / "latest").read_text() == tag
    assert run_cli(capsys, "verify", str(dest), "--tag", tag)[0] == 0


def test_a_pull_of_one_rank_into_a_pull_of_the_same_save_adds_its_files(zero3, capsys, tmp_path):
    tag, dest = zero3["tag"], tmp_path / "dest"
    assert run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(dest), "--rank", "1", "--quiet")[0] == 0
    assert run_cli(capsys, "pull", str(zero3["local"]), "--dest", str(dest), "--rank", "0", "--quiet")[0] == 0
    assert run_cli(capsys, "verify", str(dest), "--tag", tag)[0] == 0


def test_pull_and_export_into_a_home_relative_folder_write_under_home(zero3, capsys, tmp_path, monkeypatch):
    """``--dest=~/x`` reaches the program with its ``~``: the shell expands it only at a word's start."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert run_cli(capsys, "pull", str(zero3["local"]), "--dest=~/ckpt", "--quiet")[0] == 0
    assert run_cli(capsys, "export", str(zero3["local"]), "--out=~/hf")[0] == 0
    assert run_cli(capsys, "verify", str(tmp_path / "home" / "ckpt"))[0] == 0
    assert list((tmp_path / "home" / "hf").glob("*.safetensors"))
    assert not (tmp_path / "~").exists()


def test_a_pull_of_an_older_tag_beside_a_newer_one_warns_that_load_takes_the_newer(zero3, tmp_path, caplog):
    """'latest' names the tag pulled last, which stock DeepSpeed loads; async_ckpt's load() takes the newest."""
    tag, dest = zero3["tag"], _pulled(zero3, tmp_path / "dest")
    shutil.copytree(zero3["local"] / tag, tmp_path / "root" / "older")
    stored = json.loads((tmp_path / "root" / "older" / MANIFEST).read_text())
    (tmp_path / "root" / "older" / MANIFEST).write_text(json.dumps(
        {**stored, "tag": "older", "save_id": "older-save", "created_unix": stored["created_unix"] - 60}))
    with caplog.at_level("WARNING", logger="async_ckpt"):
        pull(open_storage(str(tmp_path / "root")), resolve(open_storage(str(tmp_path / "root")), "older"), str(dest),
             show_progress=False)
    assert (dest / "latest").read_text() == "older" and resolve(open_storage(str(dest)), None).tag == tag
    assert any(f"async_ckpt's load() without a tag takes {tag}" in r.getMessage() for r in caplog.records)


def test_a_pull_cut_short_into_a_stock_root_of_the_tag_leaves_latest_naming_nothing(zero3, capsys, tmp_path):
    """The dest is a stock DeepSpeed root holding the tag (its files and 'latest', no manifest); the pull
    of another save of the tag fails half way."""
    tag = zero3["tag"]
    shutil.copytree(zero3["local"] / tag, tmp_path / "dest" / tag, ignore=shutil.ignore_patterns(MANIFEST))
    (tmp_path / "dest" / "latest").write_text(tag)
    root = _saved_again(zero3, tmp_path / "root", changed=True)
    code, _, _ = run_cli(capsys, "pull", str(root), "--dest", str(tmp_path / "dest"), "--tag", tag)
    assert code == 2 and not (tmp_path / "dest" / "latest").exists()


def test_pull_of_a_corrupt_object_fails_verification_and_publishes_nothing(zero3, s3, capsys, tmp_path):
    client = s3.client()
    bucket = s3.make_bucket("interop-corrupt")
    listing = client.list_objects_v2(Bucket=zero3["bucket"], Prefix="run/")["Contents"]
    for obj in listing:
        body = client.get_object(Bucket=zero3["bucket"], Key=obj["Key"])["Body"].read()
        if obj["Key"].endswith("zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            body = body[:500] + bytes([body[500] ^ 0xFF]) + body[501:]
        client.put_object(Bucket=bucket, Key=obj["Key"], Body=body)
    code, _, err = run_cli(capsys, "pull", f"s3://{bucket}/run", "--endpoint", s3.endpoint, "--dest", str(tmp_path))
    assert code == 2 and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err and "crc32" in err
    assert not (tmp_path / zero3["s3_tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


# ---- export -----------------------------------------------------------------------------------

def _hf_logits(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=interop_tasks.PROBE_IDS).logits.float()


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def saved(request, ranks, s3, tmp_path_factory):
    return _saved(request.param, ranks, s3, tmp_path_factory)


def test_export_loads_in_transformers_with_the_engines_logits(saved, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "export", str(saved["local"]), "--out", str(tmp_path / "hf"), "--json")
    report = json.loads(out)
    assert code == 0 and report["shards"] == ["model-00001-of-00001.safetensors"]
    assert torch.equal(_hf_logits(tmp_path / "hf"), saved["logits"])


def test_export_without_safetensors_writes_bin_shards_that_load_with_the_engines_logits(zero3, capsys, tmp_path):
    out_dir = tmp_path / "hf"
    code, out, _ = run_cli(capsys, "export", str(zero3["local"]), "--out", str(out_dir), "--no-safetensors", "--json")
    report = json.loads(out)
    assert code == 0 and report["shards"] == ["pytorch_model-00001-of-00001.bin"]
    index = json.loads((out_dir / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"].values()) == {"pytorch_model-00001-of-00001.bin"}
    assert not list(out_dir.glob("*.safetensors"))
    assert torch.equal(_hf_logits(out_dir), zero3["logits"])


def test_export_from_s3_in_bf16_writes_bf16_shards_an_index_and_the_tokenizer(zero3, s3, capsys, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    out_dir = tmp_path / "hf"
    code, out, _ = run_cli(capsys, "export", zero3["url"], "--endpoint", s3.endpoint, "--out", str(out_dir),
                           "--dtype", "bf16", "--max-shard-gb", "0.0002", "--json")
    report = json.loads(out)
    assert code == 0 and len(report["shards"]) > 1
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == report["shards"]
    with safe_open(str(out_dir / report["shards"][0]), "pt") as shard:
        assert all(shard.get_tensor(k).dtype == torch.bfloat16 for k in shard.keys())
    assert AutoTokenizer.from_pretrained(str(out_dir))("checkpoint")["input_ids"]
    torch.testing.assert_close(_hf_logits(out_dir), zero3["logits"], atol=0.1, rtol=0.05)


def test_export_without_safetensors_writes_each_tensor_once_across_shards(saved, capsys, tmp_path):
    """zero_to_fp32 gives views of one flat buffer per parameter group; torch.save of a view writes its
    whole buffer, so each shard would hold the whole model."""
    out_dir = tmp_path / "hf"
    code, out, _ = run_cli(capsys, "export", str(saved["local"]), "--out", str(out_dir), "--no-safetensors",
                           "--max-shard-gb", "0.0002", "--json")
    report = json.loads(out)
    assert code == 0 and len(report["shards"]) > 1
    written = sum((out_dir / name).stat().st_size for name in report["shards"])
    assert written < report["total_bytes"] * 1.1 + 4096 * report["tensors"]


def test_export_casts_floating_point_tensors_only():
    from async_ckpt.export import cast

    cast_to = cast({"w": torch.ones(2), "steps": torch.tensor([257, 2049]), "mask": torch.tensor([True])}, "bf16")
    assert {name: t.dtype for name, t in cast_to.items()} == {"w": torch.bfloat16, "steps": torch.int64,
                                                               "mask": torch.bool}
    assert cast_to["steps"].tolist() == [257, 2049]


def test_an_export_that_fails_leaves_no_folder_under_its_name_and_names_tmpdir(zero3, capsys, tmp_path, monkeypatch):
    from async_ckpt import export

    def disk_full(source, dest):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", dest)

    monkeypatch.setattr(export.shutil, "copyfile", disk_full)  # the tokenizer's files, after the shards
    code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "hf"))
    assert code == 2 and "No space left on device" in err and "TMPDIR" in err
    assert os.listdir(tmp_path) == []


def test_an_export_failing_among_its_final_renames_leaves_no_shard_without_its_index(zero3, capsys, tmp_path,
                                                                                      monkeypatch):
    from async_ckpt import export

    rename = os.replace

    def index_not_renamed(source, dest):
        if str(dest).endswith(".index.json"):
            raise OSError(errno.EIO, "Input/output error (injected)", dest)
        rename(source, dest)

    (tmp_path / "hf").mkdir()
    monkeypatch.setattr(export.os, "replace", index_not_renamed)
    code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "hf"), "--max-shard-gb",
                           "0.001")
    assert code == 2 and "Input/output error" in err
    assert os.listdir(tmp_path / "hf") == []


def test_export_into_an_empty_folder_given_through_a_symlink_fills_it(zero3, capsys, tmp_path):
    """A folder given (a mount point, a symlink, '.') is filled, not replaced: renaming onto it fails."""
    (tmp_path / "volume").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "volume")
    code, out, _ = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "out"), "--json")
    assert code == 0 and sorted(os.listdir(tmp_path / "volume")) == sorted(
        json.loads(out)["shards"] + json.loads(out)["extra_files"] + ["model.safetensors.index.json"])
    assert (tmp_path / "out").is_symlink()


def test_export_into_a_folder_a_killed_export_left_its_partial_folder_in_goes_ahead(zero3, capsys, tmp_path):
    leftover = tmp_path / "out" / ".async_ckpt-export.partial-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"half")
    code, _, _ = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "out"))
    assert code == 0 and not leftover.exists() and (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_export_into_a_folder_another_export_is_still_writing_in_is_refused_and_leaves_its_files(
        zero3, capsys, tmp_path):
    from async_ckpt import export

    running = tmp_path / "out" / ".async_ckpt-export.partial-0badf00d"
    running.mkdir(parents=True)
    (running / "model-00001-of-00002.safetensors").write_bytes(b"being written")
    with export._held(str(running)):
        code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "out"))
    assert code == 2 and "another export is writing into" in err
    assert os.listdir(tmp_path / "out") == [running.name]
    assert sorted(os.listdir(running)) == [".lock", "model-00001-of-00002.safetensors"]


def test_an_export_whose_folder_got_other_files_meanwhile_moves_none_of_its_own_there(zero3, capsys, tmp_path,
                                                                                      monkeypatch):
    from async_ckpt import export

    write_shards = export._write_shards

    def another_writer_meanwhile(*args, **kwargs):
        (tmp_path / "out" / "model.safetensors.index.json").write_text("{}")  # another export's, say
        write_shards(*args, **kwargs)

    monkeypatch.setattr(export, "_write_shards", another_writer_meanwhile)
    code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path / "out"))
    assert code == 2 and "while this export ran" in err
    assert os.listdir(tmp_path / "out") == ["model.safetensors.index.json"]
    assert (tmp_path / "out" / "model.safetensors.index.json").read_text() == "{}"


def test_export_of_a_missing_tag_is_a_clear_error(zero3, capsys, tmp_path):
    code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--tag", "nope", "--out", str(tmp_path / "hf"))
    assert code == 2 and "'nope' not found" in err and not (tmp_path / "hf").exists()


def _root_with_files_no_manifest_lists(run, tmp_path) -> str:
    """A copy of the local root whose tag folder also holds what its manifest does not list: a killed
    save's .partial file and the shards of an earlier save of the tag by 4 ranks (then saved again by 2
    with overwrite_tags), which DeepSpeed's tools, reading every matching name, would take for the checkpoint's."""
    root = tmp_path / "root"
    shutil.copytree(run["local"], root)
    tag_dir = root / run["tag"]
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt.0123456789ab.partial").write_bytes(b"cut short")
    for rank in (2, 3):
        for kind in ("model", "optim"):  # ZeRO-3 has a model-states file per rank, ZeRO-2 one mp_rank_00 file
            if (tag_dir / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt").is_file():
                shutil.copyfile(tag_dir / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt",
                                tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    return str(root)


def test_export_from_a_local_root_reads_only_the_files_its_manifest_lists(zero3, capsys, tmp_path):
    root = _root_with_files_no_manifest_lists(zero3, tmp_path)
    code, _, err = run_cli(capsys, "export", root, "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert torch.equal(_hf_logits(tmp_path / "hf"), zero3["logits"])


def test_to_universal_from_a_local_root_reads_only_the_files_its_manifest_lists(zero2, capsys, tmp_path):
    """ZeRO-2: ds_to_universal takes every file whose name starts with zero_pp_rank_ (ZeRO-3's globs .pt names)."""
    root = _root_with_files_no_manifest_lists(zero2, tmp_path)
    code, out, err = run_cli(capsys, "to-universal", root, "--out", str(tmp_path / "universal"), "--json")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "verify", str(tmp_path / "universal"), "--tag", json.loads(out)["tag"], "--json")
    assert code == 0 and json.loads(out)["ok"]


def test_export_of_a_tag_saved_without_zero_says_where_its_weights_are(tmp_path):
    """ZeRO stage 0 (fp32): one mp_rank_00 file, no shards for zero_to_fp32 (its param_shapes are None)."""
    manifest = Manifest(tag="t", step=1, world_size=1, zero_stage=0, dtype="fp32",
                        files=[FileEntry("mp_rank_00_model_states.pt", 10, format_crc(0), 0)], versions={},
                        created_unix=1.0, save_id="s")
    with pytest.raises(UsageError, match="stage 0.*mp_rank_00_model_states.pt"):
        export_hf(LocalStorage(str(tmp_path)), manifest, str(tmp_path / "hf"), show_progress=False)
    assert not (tmp_path / "hf").exists()


def test_export_into_a_non_empty_folder_is_refused(zero3, capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "export", str(zero3["local"]), "--out", str(tmp_path))
    assert code == 2 and "not empty" in err and (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["s3", "a local root whose latest names another tag"])
def test_a_zero3_load_without_optimizer_states_gets_the_saved_weights(zero3, ranks, s3, where, tmp_path):
    """DeepSpeed rebuilds the weights from every rank's shards of the tag the root's 'latest' names."""
    if where == "s3":
        source, opts, tag = zero3["url"], options(s3.endpoint), zero3["s3_tag"]
    else:
        source, opts, tag = str(tmp_path / "root"), None, zero3["tag"]
        shutil.copytree(zero3["local"] / tag, tmp_path / "root" / tag)
        (tmp_path / "root" / "latest").write_text("an_older_tag")
    for rank in ranks.run(interop_tasks.load_weights_only, source, opts, tag, str(tmp_path / "cache")):
        torch.testing.assert_close(rank["logits"], zero3["logits"])


@pytest.mark.parametrize("optimizer_states", [False, True], ids=["every-shard", "own-shard"])
def test_a_tag_folder_read_in_place_with_shards_of_another_save(zero3, ranks, tmp_path, optimizer_states):
    """A killed save of the tag in another layout left a shard its manifest does not list. A load that reads
    every rank's shards (DeepSpeed globs them: here ZeRO-3 without optimizer states) is refused naming it;
    one that reads each rank's own shards by name goes on."""
    tag = zero3["tag"]
    shutil.copytree(zero3["local"] / tag, tmp_path / "root" / tag)
    (tmp_path / "root" / tag / "zero_pp_rank_7_mp_rank_00_optim_states.pt").write_bytes(b"an older save's shard")
    for rank in ranks.run(interop_tasks.load_tag, str(tmp_path / "root"), tag, optimizer_states):
        if optimizer_states:
            assert rank["load"] is None
        else:
            kind, message = rank["load"]
            assert kind == "VerificationError" and "zero_pp_rank_7_mp_rank_00_optim_states.pt" in message


def test_verify_fails_on_a_shard_in_the_tag_folder_its_manifest_does_not_list(zero3, capsys, tmp_path):
    """The listed files all match, yet DeepSpeed's tools would read the other one with them."""
    tag = zero3["tag"]
    shutil.copytree(zero3["local"] / tag, tmp_path / tag)
    (tmp_path / tag / "zero_pp_rank_7_mp_rank_00_optim_states.pt").write_bytes(b"an older save's shard")
    code, out, _ = run_cli(capsys, "verify", str(tmp_path), "--tag", tag, "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and all(f["ok"] for f in report["files"])
    assert [f["path"] for f in report["unlisted"]] == ["zero_pp_rank_7_mp_rank_00_optim_states.pt"]


def test_a_load_of_a_tag_folder_holding_a_model_states_file_it_does_not_list_is_refused_naming_it(zero3, ranks,
                                                                                                 tmp_path):
    """DeepSpeed globs mp_rank_*_model_states.pt on every load, one of its own optimizer shard included."""
    tag = zero3["tag"]
    shutil.copytree(zero3["local"] / tag, tmp_path / "root" / tag)
    folder = tmp_path / "root" / tag  # ZeRO-3: each rank globs zero_pp_rank_<its rank>_mp_rank_*_model_states.pt
    shutil.copy(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", folder / "zero_pp_rank_0_mp_rank_01_model_states.pt")
    rank0, rank1 = ranks.run(interop_tasks.load_tag, str(tmp_path / "root"), tag, True)
    assert rank0["load"][0] == "VerificationError" and "zero_pp_rank_0_mp_rank_01_model_states.pt" in rank0["load"][1]
    assert rank1["load"] is not None  # refused on every rank


# ---- universal --------------------------------------------------------------------------------

def test_to_universal_commits_a_manifest_and_latest_universal(converted, s3):
    client = s3.client()
    latest = client.get_object(Bucket=converted["bucket"], Key="universal/latest_universal")["Body"].read().decode()
    manifest = json.loads(client.get_object(Bucket=converted["bucket"],
                                            Key=f"universal/{latest}/async_ckpt_manifest.json")["Body"].read())
    assert latest == f"{converted['s3_tag']}_universal" and manifest["universal"]
    assert any(f["path"].startswith("zero/") for f in manifest["files"])


def test_universal_resume_on_one_rank_matches_the_stock_conversion(converted, one_rank, s3):
    ours = one_rank.run(interop_tasks.resume_universal, converted["stage"], converted["out_url"],
                        options(s3.endpoint), True)[0]
    stock = one_rank.run(interop_tasks.resume_universal, converted["stage"], str(converted["stock_universal"]),
                         None, False)[0]
    assert ours["world_size"] == 1 and ours["step"] == stock["step"]
    assert ours["state"].keys() == stock["state"].keys()
    mismatched = [name for name in ours["state"]
                  if not all(torch.equal(a, b) for a, b in zip(ours["state"][name], stock["state"][name]))]
    assert mismatched == []
    assert ours["losses"] == stock["losses"]


def test_universal_weights_equal_the_saved_weights(converted, one_rank, s3):
    ours = one_rank.run(interop_tasks.resume_universal, converted["stage"], converted["out_url"],
                        options(s3.endpoint), True)[0]
    saved = _consolidated(converted["local"])
    assert all(torch.equal(ours["state"][name][0], saved[name]) for name in ours["state"])


def test_loading_a_universal_tag_without_load_universal_is_refused(converted, ranks, s3):
    import rank_tasks

    out = ranks.run(rank_tasks.load_outcome, converted["stage"], converted["out_url"], options(s3.endpoint),
                    f"{converted['s3_tag']}_universal")
    kind, message = out[0]
    assert kind == "UsageError" and "load_universal" in message


def test_to_universal_works_local_to_local(zero3, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "to-universal", str(zero3["local"]), "--out", str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 0 and report["tag"] == f"{zero3['tag']}_universal"
    assert (tmp_path / "latest_universal").read_text() == report["tag"]
    code, out, _ = run_cli(capsys, "verify", str(tmp_path), "--tag", report["tag"], "--json")
    assert code == 0 and json.loads(out)["ok"]
    assert not (tmp_path / report["tag"] / ".async_ckpt").exists()  # its start mark went with the commit


def test_to_universal_into_the_folder_of_a_conversion_that_did_not_commit_removes_that_ones_files_first(
        zero3, capsys, tmp_path):
    """A killed conversion of another layout left a file this one does not write, which DeepSpeed would glob."""
    from async_ckpt.commit import mark_started

    tag = f"{zero3['tag']}_universal"
    mark_started(open_storage(str(tmp_path)), tag, 0, "killed-conversion")
    (tmp_path / tag / "mp_rank_01_model_states.pt").write_bytes(b"of a conversion that did not commit")
    assert run_cli(capsys, "to-universal", str(zero3["local"]), "--out", str(tmp_path), "--json")[0] == 0
    assert not (tmp_path / tag / "mp_rank_01_model_states.pt").exists()
    assert run_cli(capsys, "verify", str(tmp_path), "--tag", tag)[0] == 0


def test_to_universal_refuses_an_output_folder_it_did_not_write(zero3, capsys, tmp_path):
    """A conversion DeepSpeed's own ds_to_universal wrote there, say: a push would mix into it."""
    theirs = tmp_path / f"{zero3['tag']}_universal" / "zero"
    theirs.mkdir(parents=True)
    (theirs / "optimizer_state.pt").write_bytes(b"x")
    code, _, err = run_cli(capsys, "to-universal", str(zero3["local"]), "--out", str(tmp_path))
    assert code == 2 and "did not write" in err
    assert os.listdir(theirs) == ["optimizer_state.pt"]


def test_a_conversion_cut_short_leaves_a_folder_gc_removes(zero3, capsys, tmp_path, monkeypatch):
    from async_ckpt import universal
    from async_ckpt.gc import collect_garbage
    from async_ckpt.storage import open_storage

    copy, pushed = universal.copy_local_file, []

    def fails_on_the_second_file(*args, **kwargs):
        if pushed:
            raise OSError(28, "No space left on device (injected)")
        pushed.append(copy(*args, **kwargs))
        return pushed[-1]
    monkeypatch.setattr(universal, "copy_local_file", fails_on_the_second_file)
    code, _, err = run_cli(capsys, "to-universal", str(zero3["local"]), "--out", str(tmp_path))
    assert code != 0 and "No space left" in err
    report = collect_garbage(open_storage(str(tmp_path)), grace_s=0)
    assert report.incomplete_tags == [f"{zero3['tag']}_universal"] and report.kept_foreign == []


def test_to_universal_refuses_a_universal_tag_and_an_existing_output(converted, s3, capsys):
    universal_tag = f"{converted['s3_tag']}_universal"
    code, _, err = run_cli(capsys, "to-universal", converted["out_url"], "--endpoint", s3.endpoint, "--tag", universal_tag,
                           "--out", converted["out_url"], "--out-tag", "again")
    assert code == 2 and "already a universal checkpoint" in err
    code, _, err = run_cli(capsys, "to-universal", converted["url"], "--endpoint", s3.endpoint, "--tag",
                           converted["s3_tag"], "--out", converted["out_url"])
    assert code == 2 and "already exists" in err
