"""The zero-copy writer on its own: staging buffers lent to storage give torch.save's bytes and CRC-32.

Large tensor records are written to the device straight from the staging buffers (``O_DIRECT``),
their CRC-32 taken from the zip data descriptors torch.save writes; these tests pin that the files
and the manifest's checksums are exactly what the copying path produced before.
"""

from __future__ import annotations

import ast
import gc
import io
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
import zipfile
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from async_ckpt import checksum, host_memory, torch_zip
from async_ckpt.checksum import crc32_combine, format_crc
from async_ckpt.deepspeed_adapter import estimate_snapshot
from async_ckpt.handle import SaveHandle
from async_ckpt.handshake import Handshake
from async_ckpt.job import SaveJob
from async_ckpt.serialization import ChecksumWriter, Lending, record_offsets, storage_order, write_torch_file
from async_ckpt import staging
from async_ckpt.staging import PLACEMENT_ALIGN, StagingPool
from async_ckpt.storage import LocalStorage, local
from async_ckpt.storage.base import LEND_MIN, buffer_address
from async_ckpt.storage.local import DirectWriter, _open_direct
from async_ckpt.writer import BackgroundWriter

MiB = 1024 * 1024


def _state() -> dict:
    """Records above and below the lending threshold, views of one storage, an odd-sized storage."""
    torch.manual_seed(0)
    flat = torch.randn(3 * MiB // 4 + 5)  # 3 MiB + 20 bytes: lent, with a tail that is not a block
    return {"flat": flat, "views": [flat[7:11], flat[100:300].view(20, 10)], "small": torch.randn(1000),
            "moments": {"exp_avg": torch.randn(MiB // 2), "exp_avg_sq": torch.randn(MiB // 2 + 1)},
            "bf16": torch.randn(MiB + 3).to(torch.bfloat16), "step": 7}


def _storage_sizes(state: dict) -> dict[int, int]:
    """Bytes of each distinct tensor storage in :func:`_state` (the buffers a snapshot of it stages)."""
    tensors = (state["flat"], state["small"], state["bf16"], *state["moments"].values())
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _torch_save_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture()
def direct_root(tmp_path):
    fd = _open_direct(str(tmp_path / "probe"))
    if fd is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: nothing is lent there")
    os.close(fd)
    return tmp_path


@pytest.mark.parametrize("n1,n2", [(0, 5), (5, 0), (1, 1), (100, 3), (3, 100_000), (12_345, 777_777)])
def test_crc32_combine_equals_the_crc_of_the_concatenation(n1, n2):
    a, b = os.urandom(n1), os.urandom(n2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


@pytest.mark.parametrize("n,start", [(0, 0), (0, 0x1234), (1, 0), (4095, 0xDEADBEEF), (3 << 20, 0), (3 << 20, 7)])
def test_the_packages_crc32_is_zlibs_for_any_buffer_and_starting_value(n, start):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    view = memoryview(data.numpy()).cast("B")  # a tensor's memory, as the writer hands it over
    assert checksum.crc32(view, start) == zlib.crc32(data.numpy().tobytes(), start)


def test_lent_snapshot_file_and_crc_equal_torch_save_on_every_save(direct_root):
    pool, storage = StagingPool(), LocalStorage(str(direct_root / "root"))
    for _ in range(3):  # with no offsets_of the first save places nothing; the next ones are placed by it
        staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
        lending = Lending(staged.regions, staged.placements)
        entry = write_torch_file(storage, "t/x.pt", staged.obj, tag_dir="t", rank=0, lending=lending)
        expected = _torch_save_bytes(staged.obj)
        assert (direct_root / "root" / "t" / "x.pt").read_bytes() == expected
        assert (entry.size, entry.crc32) == (len(expected), format_crc(zlib.crc32(expected)))
        assert lending.lent_bytes >= 7 * MiB


def test_second_snapshot_is_placed_to_be_written_without_a_copy(direct_root):
    pool, storage = StagingPool(), LocalStorage(str(direct_root / "root"))
    copied = []
    for _ in range(2):
        staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
        lending = Lending(staged.regions, staged.placements)
        write_torch_file(storage, "t/x.pt", staged.obj, tag_dir="t", rank=0, lending=lending)
        copied.append(lending.copied_bytes)
    assert copied[1] == 0
    assert all((address - offset) % PLACEMENT_ALIGN == 0 for address, offset in staged.placements.items())


def test_the_layout_gives_the_offsets_the_writer_then_places_the_lent_buffers_at(direct_root):
    staged = StagingPool().snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    offsets = record_offsets(staged.obj, staged.regions)
    lending = Lending(staged.regions)
    write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                     lending=lending)
    assert offsets == lending.placements
    assert len(offsets) == sum(size >= LEND_MIN for _, size in staged.regions) == 4


def test_a_first_snapshot_placed_by_the_layout_is_written_without_a_copy(direct_root):
    staged = StagingPool().snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False, offsets_of=record_offsets)
    lending = Lending(staged.regions, staged.placements)
    write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                     lending=lending)
    assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(staged.obj)
    assert lending.lent_bytes >= 7 * MiB and lending.copied_bytes == 0


def test_a_first_deferred_snapshot_placed_by_the_layout_writes_ahead_without_a_copy(direct_root, monkeypatch):
    written_ahead, write_ahead = [], DirectWriter.write_ahead

    def noting_write_ahead(self, data, offset, **kwargs):
        written_ahead.append(offset)
        write_ahead(self, data, offset, **kwargs)

    monkeypatch.setattr(DirectWriter, "write_ahead", noting_write_ahead)
    pool, state = StagingPool(), _state()
    staged = pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=True, offsets_of=record_offsets)
    ticket = pool.copy(staged.deferred, background=True)
    lending = Lending(staged.regions, staged.placements)
    write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                     lending=lending, await_copy=ticket.wait_for, copy_crcs=ticket.crcs)
    assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(state)
    assert sorted(written_ahead) == sorted(staged.placements.values()) and len(written_ahead) == 4
    assert lending.copied_bytes == 0
    pool.close()


def test_a_deferred_snapshot_with_data_that_read_like_a_zip_descriptor_is_written_as_torch_save_writes_it(
        direct_root):
    """16 bytes of data that read exactly like an empty record's descriptor, then other storages: each record
    still reaches the writer as its own buffer, in the order of the copies it waits for."""
    pool = StagingPool()
    state = {"seed": torch.tensor([0x08074B50, 0], dtype=torch.int64), **_state()}
    staged = pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=True, offsets_of=record_offsets)
    ticket = pool.copy(staged.deferred, background=True)
    write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                     lending=Lending(staged.regions, staged.placements), await_copy=ticket.wait_for,
                     copy_crcs=ticket.crcs)
    assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(state)
    pool.close()


def test_the_layout_is_asked_only_while_a_large_buffer_is_unplaced(direct_root):
    asked, pool = [], StagingPool()

    def offsets_of(obj, regions):
        asked.append(len(regions))
        return record_offsets(obj, regions)

    for _ in range(3):
        staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False, offsets_of=offsets_of)
        write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                         lending=Lending(staged.regions, staged.placements))
    assert asked == [len(staged.regions)] and pool.allocations == len(staged.regions)


def test_buffers_staged_before_for_a_target_that_places_nothing_are_placed_by_the_layout_later(direct_root):
    """A tiered save that went to S3 (its buffers are staged, not placed), then one to local disk."""
    pool = StagingPool()
    pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False, offsets_of=record_offsets)
    lending = Lending(staged.regions, staged.placements)
    write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                     lending=lending)
    assert lending.lent_bytes >= 7 * MiB and lending.copied_bytes == 0


def test_a_buffer_allocated_anew_for_a_grown_tensor_is_placed_by_the_layout_and_written_without_a_copy(direct_root):
    pool, storage, state = StagingPool(), LocalStorage(str(direct_root / "root")), _state()
    for grown in (False, True):
        if grown:
            state["moments"]["exp_avg"] = torch.randn(MiB // 2 + 12345)
        staged = pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=False, offsets_of=record_offsets)
        lending = Lending(staged.regions, staged.placements)
        write_torch_file(storage, "t/x.pt", staged.obj, tag_dir="t", rank=0, lending=lending)
        assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(state)
        assert lending.lent_bytes >= 7 * MiB and lending.copied_bytes == 0
    assert pool.allocations == len(staged.regions) + 1


def test_the_layout_reads_no_tensor_bytes_past_each_records_first_page():
    """A deferred snapshot's buffers are laid out before its copies run: reading them would read nothing
    of the state (a read of the protected pages here kills the process)."""
    code = (
        "import ctypes, mmap, torch\n"
        "from async_ckpt.serialization import record_offsets\n"
        "size = 8 << 20\n"
        "tensor = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
        "assert libc.mprotect(tensor.data_ptr() + 4096, size - 4096, 0) == 0  # PROT_NONE\n"
        "print(list(record_offsets({'t': tensor, 'step': 3}, [(tensor.data_ptr(), size)]).values()))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(ast.literal_eval(result.stdout)) == 1


def test_placing_buffers_allocates_nothing_new():
    pool = StagingPool()
    for _ in range(3):
        pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    assert pool.allocations == len(pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False).regions)


def test_files_without_lending_are_unchanged(direct_root):
    staged = StagingPool().snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    entry = write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0)
    expected = _torch_save_bytes(staged.obj)
    assert (direct_root / "root" / "t" / "x.pt").read_bytes() == expected
    assert entry.crc32 == format_crc(zlib.crc32(expected))


def test_reserved_memory_is_carved_for_the_first_snapshot():
    pool = StagingPool()
    pool.reserve(64 * MiB)
    staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    pool.trim_reserve()
    start = buffer_address(pool._reserve)
    assert all(start <= address < start + 64 * MiB for address, size in staged.regions if size >= MiB)
    assert torch.equal(staged.obj["flat"], _state()["flat"])


def test_a_reserve_of_the_state_bytes_and_its_buffer_count_holds_every_buffer():
    """Each buffer carved from the reserve takes room for its placement beyond its bytes: a reserve of the
    bytes alone left the last buffers to mappings of their own (pinned in the first GPU save's stall)."""
    state = _state()
    storages = _storage_sizes(state)
    pool = StagingPool()
    pool.reserve(sum(storages.values()), buffers=len(storages))
    pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=False)
    assert pool.buffers_outside_reserve == 0
    pool.close()


def test_the_first_save_starts_no_thread_after_the_reservation():
    """Starting a thread takes milliseconds on a busy machine: the copies and the trim run on the helper
    thread the reservation started."""
    pool = StagingPool()
    pool.reserve(64 * MiB)
    threads = set(threading.enumerate())  # by identity: a thread of an earlier test's pool may end meanwhile
    state, staged = _deferred_snapshot(pool)
    ticket = pool.copy(staged.deferred, background=True)
    pool.trim_reserve()
    assert set(threading.enumerate()) - threads == set()
    ticket.wait()
    assert torch.equal(staged.obj["flat"], state["flat"])
    pool.close()


def test_a_reserve_that_cannot_be_pinned_serves_the_first_snapshot_unpinned_with_a_warning(monkeypatch, caplog):
    """Pinning for CUDA can fail (a locked-memory limit): saves go on with pageable staging and the
    warning says what to raise."""
    monkeypatch.setattr(host_memory, "register", lambda mapping, length, device: "out of memory")
    pool = StagingPool()
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        pool.reserve(64 * MiB, pin_for=torch.device("cuda", 0))
        staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    start = buffer_address(pool._reserve)
    assert all(start <= address < start + 64 * MiB for address, size in staged.regions if size >= MiB)
    assert torch.equal(staged.obj["flat"], _state()["flat"])
    assert "could not pin" in caplog.text and "out of memory" in caplog.text and "ulimit -l" in caplog.text
    pool.close()


def test_a_pinned_reserve_is_unpinned_before_its_tail_is_released_and_again_at_close(monkeypatch):
    """The CUDA runtime's side recorded (no GPU here): pages stay locked for the life of the process
    unless unpinned before they are released or unmapped, and what the first snapshot uses is pinned
    again once the unused tail is gone."""
    calls = []
    release_tail = host_memory.release_tail
    monkeypatch.setattr(host_memory, "register", lambda mapping, length, device: calls.append(
        ("pin", buffer_address(mapping), length)))
    monkeypatch.setattr(host_memory, "unregister", lambda address, device: calls.append(("unpin", address)))
    monkeypatch.setattr(host_memory, "release_tail", lambda mapping, start: (
        calls.append(("release", buffer_address(mapping), start)), release_tail(mapping, start)))
    pool = StagingPool()
    pool.reserve(64 * MiB, pin_for=torch.device("cuda", 0))
    reserve = buffer_address(pool._reserve)
    pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    pool.trim_reserve()
    pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)  # waits for the pinning after the trim
    pool.close()
    head = next(call[2] for call in calls if call[0] == "release")
    assert calls == [("pin", reserve, 64 * MiB), ("unpin", reserve), ("release", reserve, head),
                     ("pin", reserve, head), ("unpin", reserve)]
    assert 0 < head < 64 * MiB


def test_a_pinned_reserve_the_first_snapshot_nearly_fills_stays_pinned_whole_until_close(monkeypatch):
    """Trimming it would unpin gigabytes and pin the used head again on the helper thread, while training
    runs the steps after the first save; a small tail is not worth that."""
    calls = []
    monkeypatch.setattr(host_memory, "register", lambda mapping, length, device: calls.append(
        ("pin", buffer_address(mapping), length)))
    monkeypatch.setattr(host_memory, "unregister", lambda address, device: calls.append(("unpin", address)))
    state = _state()
    storages = _storage_sizes(state)
    pool = StagingPool()
    pool.reserve(sum(storages.values()), buffers=len(storages), pin_for=torch.device("cuda", 0))
    reserve, length = buffer_address(pool._reserve), len(pool._reserve)
    pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=False)
    pool.trim_reserve()
    staged = pool.snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    assert torch.equal(staged.obj["flat"], _state()["flat"])
    pool.close()
    assert calls == [("pin", reserve, length), ("unpin", reserve)]


@pytest.mark.parametrize("reserve_pinned", [True, False], ids=["reserve-pinned", "offload-reserve-unpinned"])
def test_gpu_buffers_lie_in_a_reserve_pinned_for_their_device_else_in_a_mapping_pinned_of_their_own(
        monkeypatch, reserve_pinned):
    """Without ZeRO-Offload the reserve is pinned for the GPU and GPU buffers are carved from it; with it,
    the reserve (the host partitions' copies) is not pinned, so a GPU buffer gets pinned memory of its
    own. The CUDA runtime's side is recorded (no GPU here)."""
    pinned = []
    monkeypatch.setattr(host_memory, "register", lambda mapping, length, device: pinned.append(
        (buffer_address(mapping), length)))
    monkeypatch.setattr(host_memory, "unregister", lambda address, device: None)
    pool = StagingPool()
    pool.reserve(64 * MiB, pin_for=torch.device("cuda", 0) if reserve_pinned else None)
    pool._reserving.result()
    reserve = buffer_address(pool._reserve)
    address = pool._buffer_for(("m", 0), 4 * MiB, torch.device("cuda", 0)).data_ptr()
    in_reserve = reserve <= address < reserve + 64 * MiB
    assert in_reserve == reserve_pinned
    assert pinned == ([(reserve, 64 * MiB)] if reserve_pinned else [(address - address % PLACEMENT_ALIGN,
                                                                     4 * MiB + PLACEMENT_ALIGN)])
    pool.close()


def test_the_reserve_estimate_names_where_the_fp32_partitions_live():
    """wrap() pins the reserve only where the partitions are on CUDA: with ZeRO-Offload they are on the
    CPU, and pinning them would lock tens of GB for copies that do not need it."""
    engine = SimpleNamespace(optimizer=SimpleNamespace(single_partition_of_fp32_groups=[torch.empty(1000)]),
                             module=torch.nn.Linear(10, 10))
    assert estimate_snapshot(engine) == (3 * 4000 + 110 * 4, torch.device("cpu"), 4 * 1 + 2)
    engine.optimizer.single_partition_of_fp32_groups = [torch.empty(1000, device="meta")]
    assert estimate_snapshot(engine).device == torch.device("meta")


def test_a_rank_that_writes_no_model_states_file_reserves_nothing_for_the_module():
    """Under ZeRO-1/2 only the first data-parallel rank saves the module (DeepSpeed's
    ``save_non_zero_checkpoint``); a reserve for it elsewhere would be pinned on a GPU for nothing."""
    engine = SimpleNamespace(optimizer=SimpleNamespace(single_partition_of_fp32_groups=[torch.empty(1000)]),
                             module=torch.nn.Linear(10, 10), save_non_zero_checkpoint=False)
    assert estimate_snapshot(engine) == (3 * 4000, torch.device("cpu"), 4 * 1)


def test_a_pool_never_closed_unpins_its_memory_when_collected(monkeypatch):
    """Else its locked pages would stay locked for the life of the process."""
    unpinned = []
    monkeypatch.setattr(host_memory, "register", lambda mapping, length, device: None)
    monkeypatch.setattr(host_memory, "unregister", lambda address, device: unpinned.append(address))
    pool = StagingPool()
    pool.reserve(4 * MiB, pin_for=torch.device("cuda", 0))
    pool._reserving.result()
    reserve = buffer_address(pool._reserve)
    pool._helper.shutdown(wait=True)
    del pool
    gc.collect()
    assert unpinned.count(reserve) == 1


@pytest.mark.parametrize("misalign", [0, 64], ids=["aligned", "misaligned"])
def test_direct_writer_lent_buffer_round_trips(direct_root, misalign):
    """The lent buffer follows a 66-byte header: at memory offset 66 its address is aligned like its file offset."""
    payload = os.urandom(5 * MiB + 4321)
    memory = mmap.mmap(-1, len(payload) + 2 * PLACEMENT_ALIGN)
    start = 66 + misalign
    memory[start:start + len(payload)] = payload
    path = direct_root / "lent.bin"
    fd = _open_direct(str(path))
    writer = DirectWriter(fd, buffer_bytes=1 * MiB)
    try:
        writer.write(b"header" * 11)  # the lent buffer starts off a block boundary
        with memoryview(memory) as view:
            writer.write_borrowed(view[start:start + len(payload)])
            writer.write(b"trailer")
            writer.finish()
    finally:
        writer.release()
        os.close(fd)
    assert path.read_bytes() == b"header" * 11 + payload + b"trailer"
    assert (writer.copied_bytes == 0) == (misalign == 0)


def test_lent_records_are_checksummed_on_the_crc_threads_not_the_writer_thread(direct_root, monkeypatch):
    threads = []
    piece = checksum._crc_of_piece

    def noted(*args):
        threads.append(threading.current_thread().name)
        return piece(*args)

    monkeypatch.setattr(checksum, "_crc_of_piece", noted)
    staged = StagingPool().snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    entry = write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                             lending=Lending(staged.regions, staged.placements))
    written = (direct_root / "root" / "t" / "x.pt").read_bytes()
    assert written == _torch_save_bytes(staged.obj) and entry.crc32 == format_crc(zlib.crc32(written))
    assert len(threads) >= 4 and all(name.startswith("async_ckpt-crc") for name in threads)


def test_lent_records_are_checksummed_at_the_end_where_torch_computes_the_crcs(direct_root, monkeypatch):
    monkeypatch.setattr(torch_zip, "fills_like_torch", lambda: False)
    staged = StagingPool().snapshot(_state(), "t/x.pt", slot_key="x.pt", defer=False)
    lending = Lending(staged.regions, staged.placements)
    entry = write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                             lending=lending)
    written = (direct_root / "root" / "t" / "x.pt").read_bytes()
    assert lending.lent_bytes and written == _torch_save_bytes(staged.obj)
    assert entry.crc32 == format_crc(zlib.crc32(written))


@pytest.mark.parametrize("guess", [66, 66 + 4096, 10 * MiB], ids=["right", "wrong", "past_the_end"])
def test_writes_ahead_at_any_guessed_offset_leave_the_exact_file(direct_root, guess):
    """A buffer written ahead where the previous save had it: right, it is not written again; wrong
    (overlapping what comes after it, or past the file's end), the file is still exactly the stream."""
    payload, trailer = os.urandom(5 * MiB + 4321), os.urandom(3000) * 2000
    memory = mmap.mmap(-1, len(payload) + 2 * PLACEMENT_ALIGN)
    memory[66:66 + len(payload)] = payload  # aligned like file offset 66 (after the header below)
    path = direct_root / "ahead.bin"
    fd = _open_direct(str(path))
    writer = DirectWriter(fd, buffer_bytes=1 * MiB)
    try:
        with memoryview(memory) as view:
            lent = view[66:66 + len(payload)]
            writer.write_ahead(lent, guess)
            writer.write(b"header" * 11)
            writer.write_borrowed(lent)
            writer.write(trailer)  # 6 MB after it, over the wrong guess's bytes
            writer.finish()
    finally:
        writer.release()
        os.close(fd)
    assert path.read_bytes() == b"header" * 11 + payload + trailer


def _deferred_snapshot(pool: StagingPool):
    """A snapshot whose copies have not run: its buffers hold no bytes of the state yet."""
    state = _state()
    staged = pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=True)
    return state, staged


class _CopyOnDemand:
    """Runs each deferred copy only when the writer asks for its buffer, noting how far the file had got:
    a storage torch.save read before asking would be written with the buffer's stale bytes."""

    def __init__(self, pairs, sink_size=lambda: 0):
        self.pairs = {dst.untyped_storage().data_ptr(): (dst, src) for dst, src in pairs}
        self.asked: list[int] = []
        self.file_size_when_asked: list[int] = []
        self.sink_size = sink_size
        self._lock = threading.Lock()  # the writer and the I/O threads writing ahead ask at once

    def __call__(self, address: int, end: int | None = None) -> None:
        with self._lock:
            if address in self.pairs and address not in self.asked:
                self.asked.append(address)
                self.file_size_when_asked.append(self.sink_size())
                dst, src = self.pairs[address]
                dst.copy_(src)


def test_storage_order_is_the_order_torch_save_writes_the_records():
    state = _state()
    order = storage_order(state)
    archive = zipfile.ZipFile(io.BytesIO(_torch_save_bytes(state)))
    records = [info for info in archive.infolist() if "/data/" in info.filename]  # in the order written
    storages = {t.data_ptr(): torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes() for t in
                [state["flat"], state["small"], state["bf16"], *state["moments"].values()]}
    assert len(order) == len(records) == 5
    assert [storages[address] for address in order] == [archive.read(info) for info in records]


@pytest.fixture()
def memory_root():
    """A fresh folder on tmpfs that accepts ``O_DIRECT`` (Linux 6.6+), else the test is skipped."""
    if local.memory_filesystem("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    root = tempfile.mkdtemp(prefix="async_ckpt_test_", dir="/dev/shm")
    fd = _open_direct(os.path.join(root, "probe"))
    if fd is None:
        shutil.rmtree(root)
        pytest.skip("this kernel's tmpfs refuses O_DIRECT: nothing is lent there")
    os.close(fd)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_file_in_memory_is_written_by_one_thread_per_io_pool_with_torch_saves_bytes(memory_root, monkeypatch):
    """tmpfs serializes the writes to one file: a second thread per I/O pool would only spin on its lock."""
    monkeypatch.setattr(local, "_CHUNK", 256 * 1024)  # many positioned writes per lent buffer
    writers: set[str] = set()
    write_all = local.pwrite_all

    def recorded(fd, view, offset):
        writers.add(threading.current_thread().name)
        write_all(fd, view, offset)

    monkeypatch.setattr(local, "pwrite_all", recorded)
    pool, storage = StagingPool(), LocalStorage(memory_root)
    try:
        for tag in ("t1", "t2"):  # the second save is placed: its buffers are lent, and written ahead of their copy
            state, staged = _deferred_snapshot(pool)
            ticket = pool.copy(staged.deferred, background=True)
            write_torch_file(storage, f"{tag}/x.pt", staged.obj, tag_dir=tag, rank=0,
                             lending=Lending(staged.regions, staged.placements), await_copy=ticket.wait_for)
            assert open(os.path.join(memory_root, tag, "x.pt"), "rb").read() == _torch_save_bytes(state)
    finally:
        pool.close()
    stream_threads = {name for name in writers if name.startswith("async_ckpt-direct-io")}
    ahead_threads = {name for name in writers if name.startswith("async_ckpt-direct-ahead")}
    assert storage.memory_filesystem == "tmpfs" and len(stream_threads) == 1 and len(ahead_threads) == 1


def test_a_buffer_lent_to_a_file_in_memory_is_written_from_any_address_without_a_copy(memory_root):
    """tmpfs takes O_DIRECT writes at any alignment (they are buffered writes): nothing is copied to align them."""
    payload = os.urandom(3 * MiB + 5)
    memory = mmap.mmap(-1, len(payload) + 8)
    memory[3:3 + len(payload)] = payload
    with LocalStorage(memory_root).open_write("t/odd.bin") as stream, memoryview(memory) as view:
        stream.write(b"h" * 7)
        stream.write_borrowed(view[3:3 + len(payload)])
        copied = stream.copied_bytes
    assert copied == 0
    assert open(os.path.join(memory_root, "t", "odd.bin"), "rb").read() == b"h" * 7 + payload


def test_each_storage_is_copied_before_torch_save_reads_it(direct_root):
    pool = StagingPool()
    for _ in range(2):  # the second save is placed: its buffers are also written ahead, each once its copy is done
        state, staged = _deferred_snapshot(pool)
        copy_on_demand = _CopyOnDemand(staged.deferred)
        write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                         lending=Lending(staged.regions, staged.placements), await_copy=copy_on_demand)
        assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(state)
        assert len(copy_on_demand.asked) == len(staged.deferred)


def test_writing_starts_before_the_last_copy_is_done(tmp_path):
    """The writer asks for each storage's copy only when the records before it are written."""
    state, staged = _deferred_snapshot(StagingPool())
    sink = io.BytesIO()
    copy_on_demand = _CopyOnDemand(staged.deferred, sink_size=lambda: len(sink.getbuffer()))
    writer = ChecksumWriter(sink, await_copy=copy_on_demand, order=storage_order(staged.obj))
    torch.save(staged.obj, writer)
    assert sink.getvalue() == _torch_save_bytes(state)
    assert copy_on_demand.asked == storage_order(staged.obj)
    sizes = copy_on_demand.file_size_when_asked
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes) and sizes[-1] > 7 * MiB


def test_a_storage_met_out_of_the_predicted_order_fails_the_file(direct_root):
    _, staged = _deferred_snapshot(StagingPool())
    reversed_order = storage_order(staged.obj)[::-1]
    with pytest.raises(RuntimeError, match="out of the order async_ckpt predicted"):
        with LocalStorage(str(direct_root / "root")).open_write("t/x.pt") as stream:
            writer = ChecksumWriter(stream, await_copy=_CopyOnDemand(staged.deferred), order=reversed_order)
            try:
                torch.save(staged.obj, writer)
            except RuntimeError:
                raise writer.error from None
    assert os.listdir(direct_root / "root" / "t") == []


def test_background_copies_complete_buffer_by_buffer(monkeypatch):
    """The first buffer is ready while a later copy is still held back."""
    release = threading.Event()
    copy = staging._copy_and_checksum
    pool = StagingPool()
    state, staged = _deferred_snapshot(pool)
    first = staged.deferred[0][0]

    def held_back(dst, src):
        if dst is not first:
            assert release.wait(30)
        return copy(dst, src)

    monkeypatch.setattr(staging, "_copy_and_checksum", held_back)
    ticket = pool.copy(staged.deferred, background=True)
    ticket.wait_for(first.untyped_storage().data_ptr())
    assert torch.equal(first, staged.deferred[0][1]) and not ticket.done
    release.set()
    ticket.wait()
    assert torch.equal(staged.obj["moments"]["exp_avg_sq"], state["moments"]["exp_avg_sq"])
    pool.close()


def test_a_large_buffer_is_ready_piece_by_piece_as_its_copy_goes(monkeypatch):
    """The first piece of a buffer is ready while the copy of its later pieces is still held back."""
    monkeypatch.setattr(staging, "COPY_PIECE", MiB)
    release = threading.Event()
    copy = staging._copy_and_checksum
    pool = StagingPool()
    state, staged = _deferred_snapshot(pool)
    flat = next(dst for dst, _ in staged.deferred if dst.numel() > 3 * MiB)  # "flat": 4 pieces
    address = flat.untyped_storage().data_ptr()

    def held_back(dst, src):
        if dst.data_ptr() != address:  # every piece but the first of "flat", and every other buffer
            assert release.wait(30)
        return copy(dst, src)

    monkeypatch.setattr(staging, "_copy_and_checksum", held_back)
    ticket = pool.copy(staged.deferred, background=True)
    ticket.wait_for(address, MiB)
    source = dict((d.untyped_storage().data_ptr(), s) for d, s in staged.deferred)[address]
    assert torch.equal(flat[:MiB], source[:MiB]) and not torch.equal(flat[MiB:], source[MiB:])
    release.set()
    ticket.wait_for(address)
    assert torch.equal(flat, source)
    ticket.wait()
    assert torch.equal(staged.obj["flat"], state["flat"])
    pool.close()


def test_a_background_copy_gives_the_crc32_of_each_staged_storage(monkeypatch):
    """Pieces of the copy and the cached pieces checksummed within them both end at odd offsets."""
    monkeypatch.setattr(staging, "COPY_PIECE", MiB)
    monkeypatch.setattr(staging, "CACHED_PIECE", 100_000)
    pool = StagingPool()
    _, staged = _deferred_snapshot(pool)
    ticket = pool.copy(staged.deferred, background=True)
    buffers = {dst.untyped_storage().data_ptr(): dst for dst, _ in staged.deferred}
    assert set(ticket.crcs) == set(buffers)
    for address, crc in ticket.crcs.items():
        assert crc() == zlib.crc32(buffers[address].numpy().tobytes())
    pool.close()


def test_an_elementwise_copy_gives_no_crc32_and_a_byte_copy_does():
    """A compact snapshot's float tensor is copied element by element (torch's copy_), its bytes checksummed by
    the writer; a uint8 one is copied as bytes and checksummed as it is copied."""
    pool = StagingPool()
    state = {"w": torch.randn(64, 64).t(), "b": torch.arange(5000, dtype=torch.int32).view(torch.uint8)}
    staged = pool.snapshot(state, "t/x.pt", slot_key="x.pt", defer=True, compact=True)
    ticket = pool.copy(staged.deferred, background=True)
    ticket.wait()
    byte_copy = staged.obj["b"]
    assert list(ticket.crcs) == [byte_copy.untyped_storage().data_ptr()]
    assert ticket.crcs[byte_copy.untyped_storage().data_ptr()]() == zlib.crc32(state["b"].numpy().tobytes())
    pool.close()


def test_a_byte_copy_into_part_of_a_buffer_is_not_checksummed_as_the_buffer():
    buffer, source = torch.zeros(100, dtype=torch.uint8), torch.ones(100, dtype=torch.uint8)
    assert staging._whole_flat_storage(buffer, source)
    assert not staging._whole_flat_storage(buffer[10:], source[10:])
    assert not staging._whole_flat_storage(buffer[:90], source[:90])


def test_a_copy_told_not_to_checksum_gives_no_crc32():
    """exact_bytes: torch.save computes the CRC-32s of the scratch file it writes; the copy's would go unread."""
    pool = StagingPool()
    _, staged = _deferred_snapshot(pool)
    ticket = pool.copy(staged.deferred, background=True, checksum=False)
    ticket.wait()
    assert ticket.crcs == {}
    pool.close()


def _count_crc_pieces(monkeypatch) -> list:
    """The (memory, start, ...) of every piece the writer's CRC threads checksum from now on."""
    checksummed = []
    piece = checksum._crc_of_piece
    monkeypatch.setattr(checksum, "_crc_of_piece", lambda *args: checksummed.append(args) or piece(*args))
    return checksummed


def test_lent_records_take_their_crc32_from_the_copy_and_start_no_crc_threads(direct_root, monkeypatch):
    assert torch_zip.fills_like_torch()  # else torch computes the CRC-32s and nothing here is asked for
    checksummed = _count_crc_pieces(monkeypatch)
    pool = StagingPool()
    for tag in ("t1", "t2"):  # the second save is placed: its buffers are written ahead of their copy
        state, staged = _deferred_snapshot(pool)
        ticket = pool.copy(staged.deferred, background=True)
        entry = write_torch_file(LocalStorage(str(direct_root / "root")), f"{tag}/x.pt", staged.obj, tag_dir=tag,
                                 rank=0, lending=Lending(staged.regions, staged.placements),
                                 await_copy=ticket.wait_for, copy_crcs=ticket.crcs)
        written = (direct_root / "root" / tag / "x.pt").read_bytes()
        assert written == _torch_save_bytes(state) and entry.crc32 == format_crc(zlib.crc32(written))
    pool.close()
    assert checksummed == []


def test_a_buffer_its_copy_did_not_checksum_is_checksummed_on_the_crc_threads(direct_root, monkeypatch):
    assert torch_zip.fills_like_torch()
    checksummed = _count_crc_pieces(monkeypatch)
    pool = StagingPool()
    state, staged = _deferred_snapshot(pool)
    ticket = pool.copy(staged.deferred, background=True)
    lent = {address for address, size in staged.regions if size >= LEND_MIN}
    given = sorted(lent)[0]
    entry = write_torch_file(LocalStorage(str(direct_root / "root")), "t/x.pt", staged.obj, tag_dir="t", rank=0,
                             lending=Lending(staged.regions, staged.placements), await_copy=ticket.wait_for,
                             copy_crcs={given: ticket.crcs[given]})
    written = (direct_root / "root" / "t" / "x.pt").read_bytes()
    assert written == _torch_save_bytes(state) and entry.crc32 == format_crc(zlib.crc32(written))
    assert {buffer_address(memory) for memory, *_ in checksummed} == lent - {given}
    pool.close()


def test_the_background_writer_takes_a_deferred_snapshots_crc32s_from_its_copy(direct_root, monkeypatch):
    assert torch_zip.fills_like_torch()
    checksummed = _count_crc_pieces(monkeypatch)
    pool, root = StagingPool(), str(direct_root / "root")
    state, staged = _deferred_snapshot(pool)
    handle, errors = SaveHandle(tag="t", url=root), []
    job = SaveJob(tag="t", save_id=uuid.uuid4().hex, storage=LocalStorage(root), rank=0, world_size=1,
                  files=[staged], ticket=pool.copy(staged.deferred, background=True), handle=handle,
                  handshake=Handshake(dist.HashStore(), "s", 0, 1), save_latest=True, keep_last=None,
                  keep_every=None, metadata={"step": 1}, extras_dir=None)
    writer = BackgroundWriter(0, 60, errors.append, cache_dir=str(direct_root / "cache"))
    writer.submit(job)
    writer.stop()
    assert writer.join(60) and not errors and handle.result(0).tag == "t"
    assert (direct_root / "root" / "t" / "x.pt").read_bytes() == _torch_save_bytes(state)
    assert checksummed == []
    pool.close()


def test_a_write_ahead_writes_each_piece_once_its_own_bytes_are_there(direct_root):
    """The first 32 MiB piece of a buffer written ahead reaches the file while the next piece still waits."""
    payload = os.urandom(2 * 32 * MiB)
    memory = mmap.mmap(-1, len(payload))
    memory[:] = payload
    rest_copied, asked = threading.Event(), []
    path = direct_root / "pieces.bin"
    fd = _open_direct(str(path))
    writer = DirectWriter(fd, buffer_bytes=1 * MiB)

    def ready(end):
        asked.append(end)
        if end > 32 * MiB:
            assert rest_copied.wait(60)

    try:
        with memoryview(memory) as view:
            writer.write_ahead(view, 0, ready=ready)
            with open(path, "rb") as reader:
                for _ in range(300):
                    if reader.read(32 * MiB) == payload[:32 * MiB]:
                        break
                    reader.seek(0)
                    threading.Event().wait(0.1)
                else:
                    pytest.fail("the first piece was not written while the second waited for its copy")
            assert os.path.getsize(path) == 32 * MiB  # the second piece is not there yet
            rest_copied.set()
            writer.write_borrowed(view)  # the stream reaches the buffer where it was written ahead
            writer.finish()
    finally:
        rest_copied.set()
        writer.release()
        os.close(fd)
    assert sorted(asked) == [32 * MiB, 64 * MiB]
    assert path.read_bytes() == payload


@pytest.mark.parametrize("wrong", ["second", "first"])
def test_a_buffer_written_ahead_in_place_is_written_again_where_a_wrong_write_ahead_overlaps_it(direct_root, wrong):
    """Two 4 MiB buffers, one written ahead at its offset and the other ahead at a wrong one (2 MiB) that
    overlaps it, whose bytes land last: the file still holds each buffer where it belongs."""
    first, second = os.urandom(4 * MiB), os.urandom(4 * MiB)
    memory = mmap.mmap(-1, 8 * MiB)
    memory[:4 * MiB], memory[4 * MiB:] = first, second
    copied = threading.Event()
    path = direct_root / "overlap.bin"
    fd = _open_direct(str(path))
    writer = DirectWriter(fd, buffer_bytes=1 * MiB)
    try:
        with memoryview(memory) as view:
            buffers = {"first": (view[:4 * MiB], 0), "second": (view[4 * MiB:], 4 * MiB)}
            writer.write_ahead(*buffers["first" if wrong == "second" else "second"])
            writer.write_ahead(buffers[wrong][0], 2 * MiB, ready=lambda end: copied.wait(60))  # lands last
            threading.Timer(0.5, copied.set).start()
            writer.write_borrowed(view[:4 * MiB])
            writer.write_borrowed(view[4 * MiB:])
            writer.finish()
    finally:
        copied.set()
        writer.release()
        os.close(fd)
    assert path.read_bytes() == first + second


def test_writes_ahead_waiting_for_their_copy_do_not_hold_up_the_stream(direct_root):
    """Two chunks written ahead wait for a copy that has not run: the stream's own writes still go out."""
    payload = os.urandom(2 * 32 * MiB + 5000)  # more chunks than the writer has I/O threads
    memory = mmap.mmap(-1, len(payload) + PLACEMENT_ALIGN)
    memory[:len(payload)] = payload
    copied = threading.Event()
    path = direct_root / "ahead.bin"
    fd = _open_direct(str(path))
    writer = DirectWriter(fd, buffer_bytes=1 * MiB)
    stream = os.urandom(3 * MiB + 17)
    try:
        with memoryview(memory) as view:
            writer.write_ahead(view[:len(payload)], 64 * MiB, ready=lambda end: copied.wait(60))
            streaming = threading.Thread(target=writer.write, args=(stream,))
            streaming.start()
            streaming.join(30)  # three 1 MiB bounce buffers: each waits for the write of the one before
            assert not streaming.is_alive()
            copied.set()
            writer.finish()
    finally:
        copied.set()
        writer.release()
        os.close(fd)
    assert path.read_bytes() == stream
