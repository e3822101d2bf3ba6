"""Staging + serialization on their own: a snapshot written by async_ckpt is the file torch.save writes."""

from __future__ import annotations

import os

import pytest
import torch

from async_ckpt.serialization import write_torch_file
from async_ckpt.staging import StagingPool
from async_ckpt.storage import LocalStorage


def _deepspeed_like_state() -> dict:
    """The tensor shapes DeepSpeed hands over: views of one flat buffer, empty ZeRO-3 placeholders,
    a flat group carrying a ``ds_id`` attribute, a Parameter, the same tensor twice; and parameter groups
    sharing one ``betas`` tuple (torch.save pickles it once), as MoE's split groups do."""
    betas = (0.9, 0.999)
    flat = torch.arange(64, dtype=torch.float32)
    group = torch.ones(8, requires_grad=True)
    group.ds_id = "0_27"
    weight = flat[8:24].view(4, 4)
    return {
        "module": {"w": weight, "b": flat[24:28], "tied": weight, "placeholder": torch.empty(0)},
        "optimizer": {"fp32_flat_groups": [group], "master": torch.nn.Parameter(torch.zeros(5)),
                      "step": torch.tensor(3), "bf16": torch.zeros(6, dtype=torch.bfloat16),
                      "param_groups": [{"betas": betas, "params": [0]}, {"betas": betas, "params": [1]}]},
        "global_steps": 3,
    }


def _write(tmp_path, folder: str, obj, exact_bytes: bool = True) -> bytes:
    scratch = str(tmp_path / "scratch") if exact_bytes else None
    write_torch_file(LocalStorage(str(tmp_path / folder)), "tag/mp_rank_00_model_states.pt", obj,
                     tag_dir="tag", rank=0, scratch_dir=scratch)
    return (tmp_path / folder / "tag" / "mp_rank_00_model_states.pt").read_bytes()


def test_written_snapshot_equals_torch_save_to_the_same_file_name(tmp_path):
    state = _deepspeed_like_state()
    (tmp_path / "stock").mkdir()
    torch.save(state, tmp_path / "stock" / "mp_rank_00_model_states.pt")
    staged = StagingPool().snapshot(state, "tag/mp_rank_00_model_states.pt", slot_key="m", defer=False)
    assert _write(tmp_path, "ours", staged.obj) == (tmp_path / "stock" / "mp_rank_00_model_states.pt").read_bytes()


def test_lazily_conjugated_and_negated_views_are_written_as_torch_save_writes_them(tmp_path):
    """Their storage holds the values before the conjugation: the staged view must keep the flag."""
    x, y = torch.randn(8, dtype=torch.cfloat), torch.randn(8, dtype=torch.cfloat)
    state = {"conj": x.conj(), "neg": y.conj().imag}
    (tmp_path / "stock").mkdir()
    torch.save(state, tmp_path / "stock" / "mp_rank_00_model_states.pt")
    for defer in (False, True):
        pool = StagingPool()
        staged = pool.snapshot(state, "tag/mp_rank_00_model_states.pt", slot_key="m", defer=defer)
        pool.copy(staged.deferred, background=False, checksum=False)
        assert torch.equal(staged.obj["conj"], state["conj"]) and torch.equal(staged.obj["neg"], state["neg"])
        ours = _write(tmp_path, f"ours-{defer}", staged.obj)
        assert ours == (tmp_path / "stock" / "mp_rank_00_model_states.pt").read_bytes()


def test_views_of_one_storage_share_one_staged_storage():
    state = _deepspeed_like_state()
    module = StagingPool().snapshot(state, "m.pt", slot_key="m", defer=False).obj["module"]
    assert module["w"].untyped_storage().data_ptr() == module["b"].untyped_storage().data_ptr()
    assert module["tied"] is module["w"]
    assert module["w"].untyped_storage().nbytes() == 64 * 4


def test_staged_buffers_are_reused_by_the_next_snapshot():
    pool = StagingPool()
    pool.snapshot(_deepspeed_like_state(), "m.pt", slot_key="m", defer=False)
    first = pool.allocations
    pool.snapshot(_deepspeed_like_state(), "m.pt", slot_key="m", defer=False)
    assert pool.allocations == first


def test_tensors_that_appear_in_a_later_snapshot_leave_the_others_in_their_buffers():
    """A save before the first step has no Adam moments; the next one has: the flat groups keep their buffers."""
    flat = torch.randn(1000)
    before_step = {"state": {}, "fp32_flat_groups": [flat], "step": 0}
    after_step = {"state": {0: {"exp_avg": torch.randn(1000), "exp_avg_sq": torch.randn(1000)}},
                  "fp32_flat_groups": [flat], "step": 1}
    pool = StagingPool()
    first = pool.snapshot(before_step, "o.pt", slot_key="o", defer=False).obj["fp32_flat_groups"][0]
    allocations = pool.allocations
    second = pool.snapshot(after_step, "o.pt", slot_key="o", defer=False).obj
    assert second["fp32_flat_groups"][0].data_ptr() == first.data_ptr()
    assert pool.allocations == allocations + 2
    assert torch.equal(second["state"][0]["exp_avg"], after_step["state"][0]["exp_avg"])


def test_buffers_a_files_latest_snapshot_did_not_use_are_freed():
    pool = StagingPool()
    for step in range(4):  # a key that changes every save
        pool.snapshot({f"step{step}": torch.randn(1000)}, "m.pt", slot_key="m", defer=False)
        pool.release_stale()
    assert pool.allocated_bytes == 1000 * 4


def test_a_file_left_out_of_a_save_keeps_its_buffers():
    """A consolidated export made now and then: its buffers wait for its next save."""
    pool = StagingPool()
    pool.snapshot({"w": torch.randn(1000)}, "m.pt", slot_key="m", defer=False)
    pool.snapshot({"w": torch.randn(500)}, "export", slot_key="export", defer=False)
    pool.release_stale()
    pool.snapshot({"w": torch.randn(1000)}, "m.pt", slot_key="m", defer=False)
    pool.release_stale()
    assert pool.allocated_bytes == 1500 * 4


def test_two_files_of_one_save_keep_their_buffers_apart_and_neither_frees_the_others():
    """The same tensor path in two files of one save (one file name in two folders of the tag)."""
    pool = StagingPool()
    first = pool.snapshot({"a": torch.ones(1000)}, "t/x/m.pt", slot_key="x/m.pt", defer=False).obj
    second = pool.snapshot({"a": torch.full((1000,), 2.0)}, "t/y/m.pt", slot_key="y/m.pt", defer=False).obj
    pool.release_stale()
    assert pool.allocated_bytes == 2000 * 4
    assert first["a"].eq(1).all() and second["a"].eq(2).all()


def test_dict_keys_of_one_repr_get_buffers_of_their_own():
    """Tensors as keys (an optimizer's state keyed by parameter): equal reprs, different tensors."""
    first, second = torch.zeros(3), torch.zeros(3)
    state = {first: torch.ones(4), second: torch.full((4,), 2.0)}
    staged = StagingPool().snapshot(state, "o.pt", slot_key="o", defer=False).obj
    assert [v.tolist() for v in staged.values()] == [[1.0] * 4, [2.0] * 4]


def test_stream_mode_writes_the_same_tensors_under_archive_records(tmp_path):
    state = _deepspeed_like_state()
    data = _write(tmp_path, "stream", state, exact_bytes=False)
    assert b"archive/data.pkl" in data
    loaded = torch.load(tmp_path / "stream" / "tag" / "mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(loaded["module"]["w"], state["module"]["w"])


def test_serialization_failure_publishes_nothing_and_leaves_no_scratch_file(tmp_path):
    with pytest.raises(Exception, match="pickle|Can't|lambda"):
        _write(tmp_path, "bad", {"weights": torch.ones(3), "hook": lambda: None})
    assert not (tmp_path / "bad" / "tag" / "mp_rank_00_model_states.pt").exists()
    assert os.listdir(tmp_path / "scratch") == []


def _layer_state() -> dict:
    """What a pipeline layer or an MoE expert hands over: views of flat buffers, a transposed view,
    a Parameter, the same tensor under two names, a tuple."""
    flat = torch.arange(40, dtype=torch.float32)
    weight = torch.nn.Parameter(flat[:16].view(4, 4))
    return {"weight": weight, "weight_t": flat[16:32].view(4, 4).t(), "bias": flat[32:36], "tied": weight,
            "pair": (flat[36:38], torch.tensor(7)), "name": "layer"}


def test_compact_snapshot_equals_deepspeeds_clone_before_save(tmp_path):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    (tmp_path / "stock").mkdir()
    torch.save(clone_tensors_for_torch_save(_layer_state()), tmp_path / "stock" / "mp_rank_00_model_states.pt")
    staged = StagingPool().snapshot(_layer_state(), "m.pt", slot_key="layer", defer=False, compact=True)
    assert _write(tmp_path, "ours", staged.obj) == (tmp_path / "stock" / "mp_rank_00_model_states.pt").read_bytes()


def test_compact_snapshot_of_a_state_dict_drops_its_metadata_as_deepspeeds_clone_does(tmp_path):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    module_state = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).state_dict()  # has _metadata
    (tmp_path / "stock").mkdir()
    torch.save(clone_tensors_for_torch_save(module_state), tmp_path / "stock" / "mp_rank_00_model_states.pt")
    staged = StagingPool().snapshot(module_state, "m.pt", slot_key="module", defer=False, compact=True)
    assert _write(tmp_path, "ours", staged.obj) == (tmp_path / "stock" / "mp_rank_00_model_states.pt").read_bytes()


def test_compact_snapshot_stages_only_the_tensors_not_their_flat_buffers():
    staged = StagingPool().snapshot(_layer_state(), "m.pt", slot_key="layer", defer=False, compact=True)
    assert staged.nbytes == (16 + 16 + 4 + 16 + 2) * 4 + 8
    assert staged.obj["weight"].untyped_storage().nbytes() == 16 * 4
