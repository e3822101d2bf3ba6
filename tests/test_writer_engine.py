"""The zero-copy writer under real DeepSpeed (2 ranks, gloo): its files are the files of before.

async_ckpt's default files are torch.save's stream output, the bytes DeepSpeed's FastPersist engine
writes. The 'small' model's optimizer records are megabytes, so they are lent to the O_DIRECT writer
straight from the staging buffers, placed so that nothing is copied: the first save's by the
layout torch.save will give the file, the next ones' by where the previous save wrote them.
DeepSpeed's own loader and zero_to_fp32 judge the result, for ZeRO-1/2/3, fp32 and bf16, and the
same step saved to S3 (moto) must give the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import rank_tasks
from s3_server import options

COMBOS = [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]
IDS = [f"zero{s}-{d}" for s, d in COMBOS]


@pytest.fixture(scope="module")
def saved(ranks, s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("lent")
    bucket = s3.make_bucket("lent-writes")
    out = ranks.run(rank_tasks.lent_saves_against_fast_persist, COMBOS, str(root), f"s3://{bucket}/run",
                    options(s3.endpoint))
    return {"root": root, "bucket": bucket, "ranks": out, "s3": s3}


def _files(folder):
    files = sorted(p for p in folder.glob("*.pt"))
    assert files, folder
    return files


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_the_first_save_stages_every_tensor_in_the_memory_wrap_reserved(saved, index):
    """Else the first save maps (and on a GPU pins) the buffers that did not fit in its stall."""
    assert [rank[index]["outside_reserve"] for rank in saved["ranks"]] == [0, 0]


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_wrap_estimates_each_ranks_staged_bytes_to_within_one_percent(saved, index):
    """Over, the unused tail is pinned on a GPU and trimmed after the first save; under, buffers fall
    outside the reserve. ZeRO-3 saves its parameters as empty placeholders, and under ZeRO-1/2 only
    the first rank saves the module."""
    for rank in saved["ranks"]:
        assert abs(rank[index]["estimated"] - rank[index]["staged"]) <= rank[index]["staged"] / 100


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_only_the_first_local_save_asks_torch_saves_layout(saved, index):
    """The layout pass places the first save's buffers; the second save's are placed by where the first
    wrote them. exact_bytes files go through a scratch file, and S3 parts copy whatever they hold: there
    no buffer needs placing, and no save pays the pass."""
    for rank in saved["ranks"]:
        layouts = rank[index]["layouts"]
        assert layouts["first"] >= 1 and layouts["second"] == 0
        assert layouts["exact_bytes"] == 0 and layouts["s3"] == 0
        assert "outside a save" not in layouts


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_the_first_and_second_saves_write_the_optimizer_records_without_a_copy(saved, index):
    for rank in saved["ranks"]:
        assert [lent >= rank[index]["first_bytes"] // 2 for lent in rank[index]["zero_copy_bytes"]] == [True, True]


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_lent_files_are_byte_for_byte_fast_persists_files(saved, index):
    base = saved["root"] / IDS[index]
    for path in _files(base / "fast" / "second"):
        assert (base / "async" / "second" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_s3_files_are_byte_for_byte_the_local_files(saved, index):
    import boto3

    client = boto3.client("s3", **options(saved["s3"].endpoint))
    base = saved["root"] / IDS[index] / "async" / "second"
    for path in _files(base):
        key = f"run/{IDS[index]}/second/{path.name}"
        assert client.get_object(Bucket=saved["bucket"], Key=key)["Body"].read() == path.read_bytes(), key


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_deepspeed_consolidates_lent_files_like_fast_persists(saved, index):
    base = saved["root"] / IDS[index]
    ours = get_fp32_state_dict_from_zero_checkpoint(str(base / "async"), tag="second")
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(base / "fast"), tag="second")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=IDS)
def test_deepspeed_loads_lent_files_and_trains_on_bitwise(saved, index):
    for rank in saved["ranks"]:
        assert rank[index]["loaded_losses"] == rank[index]["losses"]
