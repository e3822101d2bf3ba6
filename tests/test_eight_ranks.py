"""ZeRO-3 on 8 ranks, more than any other module runs (8 processes on this machine's 2 cores): every
rank's partition is written and committed under one manifest, the files are stock DeepSpeed's byte for
byte, DeepSpeed's zero_to_fp32 consolidates them bitwise, and a fresh 8-rank job resumes bitwise."""

from __future__ import annotations

import json

import pytest
import torch

import rank_tasks
from conftest import rank_group
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

WORLD = 8


@pytest.fixture(scope="module")
def eight_ranks():
    yield from rank_group(WORLD)


@pytest.fixture(scope="module")
def saved(eight_ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3-8-ranks")
    out = eight_ranks.run(rank_tasks.save_stock_and_async, 3, "fp32", str(root), timeout_s=600)
    resumed = eight_ranks.run(rank_tasks.resume_and_train, 3, "fp32", str(root / "async"), True, timeout_s=600)
    return {"root": root, "tag": out[0]["tag"], "ranks": out, "resumed": resumed}


def test_every_ranks_files_are_stock_deepspeeds_byte_for_byte(saved):
    stock = sorted((saved["root"] / "stock" / saved["tag"]).glob("*.pt"))
    assert len(stock) == 2 * WORLD  # a model-states and an optimizer file per rank under ZeRO-3
    assert [p.name for p in stock if (saved["root"] / "async" / saved["tag"] / p.name).read_bytes()
            != p.read_bytes()] == []


def test_the_manifest_lists_every_ranks_files(saved):
    manifest = json.loads((saved["root"] / "async" / saved["tag"] / "async_ckpt_manifest.json").read_text())
    assert manifest["world_size"] == WORLD
    assert {f["rank"] for f in manifest["files"]} == set(range(WORLD))
    stock_files = {p.name for p in (saved["root"] / "stock" / saved["tag"]).glob("*.pt")}
    assert stock_files <= {f["path"] for f in manifest["files"]}


def test_zero_to_fp32_consolidates_all_eight_partitions_like_stocks(saved):
    stock = get_fp32_state_dict_from_zero_checkpoint(str(saved["root"] / "stock"))
    ours = get_fp32_state_dict_from_zero_checkpoint(str(saved["root"] / "async"))
    assert stock.keys() == ours.keys()
    assert [k for k in stock if not torch.equal(stock[k], ours[k])] == []


def test_a_fresh_job_resumes_on_every_rank_bitwise(saved):
    assert [r["tag"] for r in saved["resumed"]] == [saved["tag"]] * WORLD
    assert [r["losses"] for r in saved["resumed"]] == [r["losses_after"] for r in saved["ranks"]]
