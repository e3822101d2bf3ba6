"""Consolidated saves (the whole model gathered to rank 0), non-blocking: save_consolidated and save_16bit_model.

One 2-rank run per ZeRO stage (ZeRO-3 fp32, ZeRO-2 bf16) makes every save these tests judge: a
regular save, save_16bit_model and save_consolidated held at the storage while training goes on,
and a consolidated save to moto S3. transformers and safetensors judge the folders; DeepSpeed's
own save_16bit_model, run on the same step before wrap, judges the weights.
"""

from __future__ import annotations

import json

import consolidated_tasks
import pytest
import torch
from s3_server import options
from safetensors.torch import load_file

from async_ckpt.consolidated import floating_dtype
from async_ckpt.manifest import Manifest

_RUNS: dict[int, dict] = {}
_DTYPES = {3: "fp32", 2: "bf16"}


def _run(stage: int, ranks, s3, tmp_path_factory) -> dict:
    """One run per ZeRO stage, shared by every test of this module."""
    if stage not in _RUNS:
        work = tmp_path_factory.mktemp(f"consolidated-zero{stage}")
        bucket = s3.make_bucket(f"consolidated-zero{stage}")
        out = ranks.run(consolidated_tasks.consolidated_saves, stage, _DTYPES[stage], str(work / "ckpt"),
                        f"s3://{bucket}/run", options(s3.endpoint), str(work))
        _RUNS[stage] = {"stage": stage, "root": work / "ckpt", "work": work, "bucket": bucket, "ranks": out,
                        **out[0]}
    return _RUNS[stage]


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3-fp32", "zero2-bf16"])
def run(request, ranks, s3, tmp_path_factory):
    return _run(request.param, ranks, s3, tmp_path_factory)


@pytest.fixture(scope="module")
def zero3(ranks, s3, tmp_path_factory):
    return _run(3, ranks, s3, tmp_path_factory)


def _manifest(folder) -> Manifest:
    return Manifest.from_json((folder / "async_ckpt_manifest.json").read_bytes())


def _hf_logits(folder) -> tuple[torch.Tensor, torch.dtype]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto").eval()
    with torch.no_grad():
        return model(input_ids=consolidated_tasks.PROBE_IDS).logits, model.dtype


def _stock_16bit(run) -> dict[str, torch.Tensor]:
    return torch.load(run["work"] / "stock16" / "pytorch_model.bin", weights_only=True)


def _safetensors_weights(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(load_file(folder / shard))
    return weights


# ---- save_consolidated ------------------------------------------------------------------------

def test_save_consolidated_returns_before_its_write_and_commits_on_every_rank(run):
    assert [rank["done_at_return"] for rank in run["ranks"]] == [False, False]
    assert [rank["tag"] for rank in run["ranks"]] == ["global_step2_consolidated"] * 2
    assert _manifest(run["root"] / run["tag"]).consolidated
    assert run["failures"] == []


def test_consolidated_folder_loads_in_transformers_with_the_engines_logits(run):
    logits, dtype = _hf_logits(run["root"] / run["tag"])
    assert dtype == run["logits"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[_DTYPES[run["stage"]]]
    assert torch.equal(logits, run["logits"])


def test_consolidated_weights_are_deepspeeds_gathered_weights_without_tied_aliases(run):
    ours, stock = _safetensors_weights(run["root"] / run["tag"]), _stock_16bit(run)
    assert "lm_head.weight" in stock and "lm_head.weight" not in ours
    assert ours.keys() == stock.keys() - {"lm_head.weight"}
    assert all(torch.equal(ours[name], stock[name]) for name in ours)


def test_consolidated_shards_are_named_and_indexed_as_save_pretrained_does(run):
    folder = run["root"] / run["tag"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weights = _safetensors_weights(folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())


def test_consolidated_manifest_lists_every_file_with_its_size(run):
    folder = run["root"] / run["tag"]
    manifest = _manifest(folder)
    on_disk = {p.name for p in folder.iterdir()} - {"async_ckpt_manifest.json"}
    assert {f.path for f in manifest.files} == on_disk
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= on_disk
    assert all(f.size == (folder / f.path).stat().st_size and f.rank == 0 for f in manifest.files)


def test_consolidated_save_leaves_latest_and_resume_on_the_regular_tag(run):
    assert run["latest"] == "regular" and run["loaded"] == "regular"


def test_load_refuses_a_consolidated_tag_and_points_to_from_pretrained(run):
    kind, message = run["load_consolidated"]
    assert kind == "UsageError" and run["tag"] in message and "from_pretrained" in message


def test_save_consolidated_refuses_a_committed_tag(run):
    kind, message = run["tag_reused"]
    assert kind == "TagExistsError" and run["tag"] in message


def test_consolidated_save_to_s3_loads_in_transformers_after_a_pull(run):
    logits, _ = _hf_logits(run["work"] / "pulled" / "on_s3")
    assert run["s3_tag"] == "on_s3" and torch.equal(logits, run["s3_logits"])


def test_consolidated_save_writes_no_recovery_scripts_and_no_latest(run, s3):
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=run["bucket"], Prefix="run/")["Contents"]}
    assert "run/on_s3/async_ckpt_manifest.json" in keys
    assert not {"run/zero_to_fp32.py", "run/latest"} & keys


# ---- save_16bit_model after wrap --------------------------------------------------------------

def test_save_16bit_model_after_wrap_returns_true_before_the_file_is_written(run):
    assert run["save_16bit_model"] is True and run["bin_written_at_return"] is False


def test_save_16bit_model_after_wrap_writes_deepspeeds_file(run):
    ours = torch.load(run["root"] / "export16" / "pytorch_model.bin", weights_only=True)
    stock = _stock_16bit(run)
    assert list(ours) == list(stock)
    assert all(torch.equal(ours[name], stock[name]) and ours[name].dtype == stock[name].dtype for name in stock)


def test_save_16bit_model_after_wrap_commits_a_consolidated_manifest(run):
    manifest = _manifest(run["root"] / "export16")
    assert manifest.consolidated and [f.path for f in manifest.files] == ["pytorch_model.bin"]


def test_save_16bit_model_writes_into_a_folder_holding_the_users_files_and_keeps_them(run):
    assert run["export_folder"] == ["async_ckpt_manifest.json", "pytorch_model.bin", "tokenizer_config.json"]


def test_save_16bit_model_into_a_path_with_dot_dot_writes_where_deepspeed_does_and_commits_it_there(run):
    assert run["dotted_folder"] == ["async_ckpt_manifest.json", "pytorch_model.bin"]
    assert not run["bin_beside_the_tags"]
    assert [f.path for f in _manifest(run["root"] / "dotted").files] == ["pytorch_model.bin"]


def test_save_16bit_model_into_a_file_url_writes_into_that_folder(run):
    assert run["file_url_folder"] == ["async_ckpt_manifest.json", "pytorch_model.bin"]
    assert [f.path for f in _manifest(run["root"] / "file_url").files] == ["pytorch_model.bin"]


def test_save_16bit_model_may_overwrite_its_earlier_export_as_deepspeed_does(run):
    assert run["resaved_16bit"] is True and run["failures"] == []


def test_save_16bit_model_into_a_committed_zero_checkpoint_folder_is_refused(run):
    kind, message = run["16bit_into_a_zero_tag"]
    assert kind == "TagExistsError" and "'regular'" in message
    assert not _manifest(run["root"] / "regular").consolidated


def test_save_16bit_model_into_a_committed_zero_checkpoint_folder_is_refused_with_overwrite_tags_too(run):
    """overwrite_tags lets a save replace a tag; an export would turn a ZeRO checkpoint into a consolidated one."""
    kind, message = run["16bit_into_a_zero_tag_overwrite_tags"]
    assert kind == "TagExistsError" and "is a committed ZeRO checkpoint" in message
    assert not _manifest(run["root"] / "regular").consolidated


def test_save_16bit_model_into_a_folder_whose_name_is_no_tag_is_refused_naming_save_dir(run):
    kind, message = run["16bit_into_a_folder_no_tag_can_name"]
    assert kind == "InvalidTagError" and "save_16bit_model(save_dir=" in message and "my model" in message
    assert not (run["root"] / "my model").exists()


def test_save_16bit_model_under_zero3_without_gathering_returns_false_and_writes_nothing(zero3):
    assert zero3["16bit_without_gather"] is False and zero3["16bit_without_gather_wrote"] is False


def test_save_16bit_model_whose_snapshot_fails_on_rank_0_raises_on_every_rank(ranks, tmp_path):
    first, second = ranks.run(consolidated_tasks.save_16bit_model_whose_snapshot_fails_on_rank_0, str(tmp_path),
                              timeout_s=300)
    assert first["outcome"][0] == "UsageError" and "cannot snapshot" in first["outcome"][1]
    assert second["outcome"][0] == "StorageError" and "rank 0 failed" in second["outcome"][1]


@pytest.mark.parametrize("again", [False, True], ids=["first-export", "export-again"])
def test_gc_after_a_failed_export_into_a_folder_of_the_users_files_keeps_those_files(ranks, tmp_path, again):
    first, _ = ranks.run(consolidated_tasks.failed_export_into_a_folder_of_the_users_files, str(tmp_path), again,
                         timeout_s=300)
    assert first["failed"] == ["final"]
    # the failed save's own files gone, the user's kept (and the earlier export's file it did not replace)
    assert first["left"] == (["config.json", "pytorch_model.bin"] if again else ["config.json"])


def test_close_gives_the_engine_its_own_save_16bit_model_back(run):
    assert run["save_16bit_model_restored"] is True


def test_the_configs_dtype_is_the_one_most_of_the_weights_bytes_are_in():
    """A small fp32 buffer listed before bf16 weights: the config says bfloat16, so dtype="auto" keeps them bf16."""
    state = {"rotary.inv_freq": torch.zeros(8), "wte.weight": torch.zeros(64, 16, dtype=torch.bfloat16),
             "steps": torch.zeros(1, dtype=torch.int64)}
    assert floating_dtype(state) == torch.bfloat16
    assert floating_dtype({"steps": torch.zeros(1, dtype=torch.int64)}) is None
