"""The CUDA staging path: pinned host buffers, copies on a side stream tracked by events, DeepSpeed on a GPU.

Runs only where a GPU is visible (the CI machine has none, so there it is reported as skipped);
`benchmarks/RESULTS.md` records the run on a lent H100.
"""

from __future__ import annotations

import glob
import os
import threading

import pytest
import torch

import cuda_tasks
from rank_tasks import same_tensors
from async_ckpt.launch import RankGroup
from async_ckpt.staging import COPY_PIECE, StagingPool
from async_ckpt.storage.base import buffer_address
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")

COMBOS = [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _gpu_state() -> dict:
    flat = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    return {"module": {"w": flat[: 1 << 19].view(512, 1024), "b": flat[1 << 19:]},
            "optimizer": {"exp_avg": torch.full((4096,), 3.0, device="cuda"), "step": 5}}


def test_staged_buffers_of_gpu_tensors_are_pinned_host_memory():
    pool = StagingPool()  # its buffers are pinned while it lives
    staged = pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=False).obj
    for tensor in (staged["module"]["w"], staged["optimizer"]["exp_avg"]):
        assert tensor.device.type == "cpu"
        assert tensor.is_pinned()
    pool.close()


def test_side_stream_copy_waits_for_work_queued_on_the_compute_stream():
    source = torch.zeros(1 << 24, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the compute stream busy so the value below is written late
        big = big @ big
        big = big / big.norm()
    source.fill_(7.0)
    pool = StagingPool()
    staged = pool.snapshot({"t": source}, "m.pt", slot_key="m", defer=True)
    ticket = pool.copy(staged.deferred, background=True)
    ticket.wait()
    assert torch.equal(staged.obj["t"], torch.full((1 << 24,), 7.0))


def test_a_device_synchronize_after_a_background_copy_does_not_wait_for_pieces_not_queued_yet():
    source = torch.full((1 << 24,), 7.0, device="cuda")  # 64 MiB: two pieces
    pool = StagingPool()
    staged = pool.snapshot({"t": source}, "m.pt", slot_key="m", defer=True)
    gate = threading.Event()
    pool._helper_thread().submit(gate.wait)  # the helper queues nothing until the gate opens
    try:
        ticket = pool.copy(staged.deferred, background=True)
        torch.cuda.synchronize()  # what DeepSpeed's throughput timer does at the start of every forward
        assert torch.count_nonzero(staged.obj["t"]) == 0  # nothing was queued for it to wait for
    finally:
        gate.set()
    ticket.wait()
    assert torch.equal(staged.obj["t"], torch.full((1 << 24,), 7.0))
    pool.close()


def test_the_first_piece_of_a_background_gpu_copy_holds_its_bytes_once_the_writers_wait_for_it_returns():
    source = torch.arange(1 << 24, dtype=torch.float32, device="cuda")
    pool = StagingPool()
    staged = pool.snapshot({"t": source}, "m.pt", slot_key="m", defer=True)
    ticket = pool.copy(staged.deferred, background=True)
    address = staged.obj["t"].untyped_storage().data_ptr()
    ticket.wait_for(address, COPY_PIECE)
    head = COPY_PIECE // 4
    assert torch.equal(staged.obj["t"][:head], torch.arange(head, dtype=torch.float32))
    ticket.wait()
    assert torch.equal(staged.obj["t"], source.cpu())
    pool.close()


def test_gpu_snapshots_reuse_the_pinned_buffers_of_the_first():
    pool = StagingPool()
    pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=False)
    first = (pool.allocations, pool.allocated_bytes)
    pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=False)
    assert (pool.allocations, pool.allocated_bytes) == first


def test_the_first_gpu_snapshot_is_staged_in_the_reserve_pinned_ahead_of_it():
    pool = StagingPool()
    pool.reserve(64 << 20, pin_for=torch.device("cuda", torch.cuda.current_device()))
    pool._reserving.result()
    assert torch.frombuffer(pool._reserve, dtype=torch.uint8, count=1).is_pinned()  # before any snapshot
    staged = pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=False)
    start = buffer_address(pool._reserve)
    assert all(start <= address < start + (64 << 20) for address, _ in staged.regions)
    assert all(tensor.is_pinned() for tensor in (staged.obj["module"]["w"], staged.obj["optimizer"]["exp_avg"]))
    assert torch.equal(staged.obj["module"]["w"], _gpu_state()["module"]["w"].cpu())
    pool.close()


def test_gpu_snapshots_after_the_reserve_is_trimmed_stay_pinned_and_exact():
    pool = StagingPool()
    pool.reserve(64 << 20, pin_for=torch.device("cuda", torch.cuda.current_device()))
    first = pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=True)
    pool.copy(first.deferred, background=True)
    pool.trim_reserve()  # unpins once those copies are done, then pins what they use again
    again = pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=True)
    pool.copy(again.deferred, background=True).wait()
    assert again.obj["module"]["w"].is_pinned()
    assert torch.equal(again.obj["module"]["w"], _gpu_state()["module"]["w"].cpu())
    pool.close()


def test_gpu_buffers_beyond_the_pinned_reserve_are_pinned_on_their_own():
    pool = StagingPool()
    pool.reserve(1 << 20, pin_for=torch.device("cuda", torch.cuda.current_device()))  # too small for the state
    staged = pool.snapshot(_gpu_state(), "m.pt", slot_key="m", defer=False)
    assert staged.obj["module"]["w"].is_pinned()
    assert torch.equal(staged.obj["module"]["w"], _gpu_state()["module"]["w"].cpu())
    pool.close()


@pytest.fixture(scope="module")
def gpu_rank():
    group = RankGroup(1, env={"DS_ACCELERATOR": "cuda"})
    yield group
    group.close()


@pytest.fixture(scope="module", params=COMBOS, ids=[f"zero{s}-{d}" for s, d in COMBOS])
def saved(request, gpu_rank, tmp_path_factory):
    stage, dtype = request.param
    root = tmp_path_factory.mktemp(f"gpu-zero{stage}-{dtype}")
    out = gpu_rank.run(cuda_tasks.save_overlapped_on_gpu, stage, dtype, str(root))[0]
    return {"stage": stage, "dtype": dtype, "root": root, "out": out}


def test_engine_trains_on_the_gpu(saved):
    assert saved["out"]["device"].startswith("cuda")


def test_overlapped_gpu_save_consolidates_to_the_stock_weights_bitwise(saved):
    tag = saved["out"]["tag"]  # the async root has later saves too
    stock = get_fp32_state_dict_from_zero_checkpoint(str(saved["root"] / "stock"), tag)
    ours = get_fp32_state_dict_from_zero_checkpoint(str(saved["root"] / "async"), tag)
    assert stock.keys() == ours.keys()
    assert [k for k in stock if not torch.equal(stock[k], ours[k])] == []


def test_optimizer_state_holds_the_values_at_save_time_though_training_went_on(saved):
    tag = saved["out"]["tag"]
    stock = sorted(glob.glob(str(saved["root"] / "stock" / tag / "*.pt")))
    assert stock
    for path in stock:
        ours = saved["root"] / "async" / tag / os.path.basename(path)
        assert same_tensors(torch.load(path, weights_only=False), torch.load(ours, weights_only=False)), ours.name


def test_later_gpu_saves_reuse_the_staging_memory_of_the_first(saved):
    first, last = saved["out"]["allocations"]
    assert first > 0 and last == first
    assert saved["out"]["staging_bytes"][0] == saved["out"]["staging_bytes"][1] > 0


def test_gpu_resume_continues_bitwise_like_stock_resume_and_the_uninterrupted_run(saved, gpu_rank):
    args = (saved["stage"], saved["dtype"])
    tag = saved["out"]["tag"]
    ours = gpu_rank.run(cuda_tasks.resume_on_gpu, *args, str(saved["root"] / "async"), tag, True)[0]
    stock = gpu_rank.run(cuda_tasks.resume_on_gpu, *args, str(saved["root"] / "stock"), tag, False)[0]
    assert ours["on_gpu"]
    assert ours["losses"] == stock["losses"] == saved["out"]["losses_after"]
