"""torch.save's zip with async_ckpt's CRC-32s filled in: torch's own bytes, whatever the records."""

from __future__ import annotations

import io
import threading
import zlib

import pytest
import torch

from async_ckpt import torch_zip
from async_ckpt.errors import ZipLayoutError
from async_ckpt.torch_zip import CrcFiller


class _Sink:
    """Keeps the bytes and the CRC-32 handed over with each write."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.crcs: list[object] = []

    def write(self, data, crc=None) -> int:
        self.crcs.append(crc)
        return self.out.write(data)

    def flush(self) -> None:
        pass


def _torch_bytes(obj) -> bytes:
    out = io.BytesIO()
    with torch_zip.torch_crc(True):
        torch.save(obj, out)
    return out.getvalue()


def _shared():
    base = torch.arange(3 * 1024 * 1024, dtype=torch.float32)
    return {"base": base, "head": base[:10], "tail": base[-5:]}


OBJECTS = {
    "tensors": lambda: {"a": torch.randn(1000), "b": torch.ones(3, 4, dtype=torch.bfloat16)},
    "empty_storage": lambda: {"e": torch.empty(0), "f": torch.zeros(3)},
    "views_of_one_storage": _shared,
    "no_tensor": lambda: {"step": 7, "names": ["x", "y"]},
    "nested_optimizer_like": lambda: {"state": {0: {"exp_avg": torch.randn(2048), "step": torch.tensor(4.0)}},
                                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
    # data that begin with a data descriptor's signature (PK\x07\x08): 16 or 24 bytes that read exactly like an
    # empty record's descriptor, and longer data, whose bytes 4-8 torch folds into its serialization id
    "data_like_a_descriptor": lambda: {"seed": torch.tensor([0x08074B50, 0], dtype=torch.int64),
                                       "x": torch.tensor([0x08074B50, 7, 0, 0], dtype=torch.int32),
                                       "y": torch.tensor([0x08074B50, 0, 0], dtype=torch.int64),
                                       "long": torch.cat([torch.tensor([0x08074B50, 9], dtype=torch.int32),
                                                          torch.arange(1000, dtype=torch.int32)])},
}


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_filled_crcs_give_torchs_own_bytes(name):
    obj = OBJECTS[name]()
    sink = _Sink()
    torch_zip.save(obj, sink)
    assert sink.out.getvalue() == _torch_bytes(obj)


def test_each_records_crc_comes_with_its_data():
    obj = {"a": torch.randn(5000)}
    sink = _Sink()
    torch_zip.save(obj, sink)
    assert zlib.crc32(obj["a"].numpy().tobytes()) in sink.crcs


def test_a_crc_computed_ahead_is_used_for_its_record():
    """The descriptor and the central directory hold the CRC-32 handed in, not one computed again."""
    tensor = torch.randn(4096)
    key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
    asked = []

    def ahead() -> int:
        asked.append(threading.current_thread().name)
        return 0x12345678

    sink = _Sink()
    torch_zip.save({"t": tensor}, sink, {key: ahead})
    assert asked and ahead in sink.crcs
    assert sink.out.getvalue().count((0x12345678).to_bytes(4, "little")) == 2  # descriptor + central directory


def test_data_computed_ahead_that_begin_like_a_descriptor_are_folded_once_their_copy_ends():
    """A staging buffer's bytes are final only once its CRC-32 is known: torch's fold reads them after."""
    final = torch.cat([torch.tensor([0x08074B50, 9], dtype=torch.int32), torch.arange(4094, dtype=torch.int32)])
    staged = torch.zeros_like(final)  # the copy has not run yet when torch.save writes the record
    key = (staged.untyped_storage().data_ptr(), staged.untyped_storage().nbytes())

    def copy_then_crc() -> int:
        staged.copy_(final)
        return zlib.crc32(staged.numpy().tobytes())

    class LendingSink:
        """Keeps a staging buffer's view, as async_ckpt's writer does, and reads it once its copy ended."""

        def __init__(self) -> None:
            self.parts: list = []

        def write(self, data, crc=None) -> int:
            self.parts.append((data, crc) if callable(crc) else (bytes(data), None))
            return memoryview(data).nbytes

        def flush(self) -> None:
            pass

    sink = LendingSink()
    torch_zip.save({"t": staged}, sink, {key: copy_then_crc})
    written = b""
    for data, crc in sink.parts:
        if crc is not None:
            crc()  # the copy into the buffer has ended
        written += bytes(data)
    assert written == _torch_bytes({"t": final})


def test_records_over_4_gib_get_their_zip64_crcs_like_torch():
    big = torch.empty(4 * 1024**3 + 4096, dtype=torch.uint8)
    big.fill_(7)
    big[::4096] = 3
    obj = {"big": big, "small": torch.ones(10)}

    class _Crc32:
        def __init__(self) -> None:
            self.crc = self.size = 0

        def write(self, data, crc=None) -> int:
            view = memoryview(data).cast("B")
            self.crc, self.size = zlib.crc32(view, self.crc), self.size + view.nbytes
            return view.nbytes

        def flush(self) -> None:
            pass

    expected, filled = _Crc32(), _Crc32()
    with torch_zip.torch_crc(True):
        torch.save(obj, expected)
    torch_zip.save(obj, filled)
    assert (filled.size, filled.crc) == (expected.size, expected.crc) and filled.size > 2**32


def test_torchs_crc_setting_is_left_as_it_was_on_every_thread():
    from torch.serialization import get_crc32_options

    torch_zip.save({"a": torch.ones(3)}, _Sink())
    seen = []
    other = threading.Thread(target=lambda: seen.append(get_crc32_options()))
    other.start()
    other.join()
    assert get_crc32_options() is True and seen == [True]


def test_an_unknown_zip_layout_fails_naming_what_was_expected():
    filler = CrcFiller(_Sink())
    filler.write(b"PK\x03\x04" + bytes(22) + (4).to_bytes(2, "little") + (0).to_bytes(2, "little"))
    with pytest.raises(ZipLayoutError, match="expected a record name.*Report this"):
        filler.write(b"too long for the name")


def test_where_torch_lays_out_its_zip_otherwise_torch_computes_the_crcs(monkeypatch):
    monkeypatch.setattr(torch_zip, "fills_like_torch", lambda: False)
    obj = OBJECTS["tensors"]()
    sink = _Sink()
    torch_zip.save(obj, sink)
    assert sink.out.getvalue() == _torch_bytes(obj) and set(sink.crcs) == {None}


def test_this_torch_is_filled_like_torch():
    """The once-per-process check passes here: if it did not, every save would fall back to torch's CRC pass."""
    assert torch_zip.fills_like_torch()


def test_saves_leave_the_threads_context_as_they_found_it():
    import contextvars

    torch_zip.save({"t": torch.ones(4)}, _Sink())  # the first save also checks torch's layout once
    before = len(contextvars.copy_context())
    for _ in range(5):
        torch_zip.save({"t": torch.ones(4)}, _Sink())
    assert len(contextvars.copy_context()) == before
