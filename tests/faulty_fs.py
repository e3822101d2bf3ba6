"""An fsspec local filesystem that can hold writes behind a gate or fail them, per rank.

Registered as ``faulty://`` inside the rank processes. ``storage_options``:
``gate`` (a path: writes of ``*.pt`` files block until it exists), ``gate_ranks`` (ranks the gate applies to,
default all), ``gate_match`` (gate only paths containing this, default ``.pt.``), ``fail_ranks`` (ranks whose writes of ``*.pt`` files raise ENOSPC).
"""

from __future__ import annotations

import errno
import os
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

GATE_TIMEOUT_S = 120


class _FaultyWriter:
    def __init__(self, inner, fs: "FaultyFileSystem", path: str) -> None:
        self._inner = inner
        self._fs = fs
        self._path = path

    def write(self, data):
        rank = int(os.environ.get("RANK", "0"))
        data_file = ".pt." in self._path
        if self._fs.gate and rank in self._fs.gate_ranks and self._fs.gate_match in self._path:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not os.path.exists(self._fs.gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"test gate {self._fs.gate} never opened")
                time.sleep(0.01)
        if rank in self._fs.fail_ranks and data_file:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self._path)
        return self._inner.write(data)

    def flush(self):
        self._inner.flush()

    def close(self):
        self._inner.close()


class FaultyFileSystem(LocalFileSystem):
    protocol = ("faulty",)

    def __init__(self, gate: str | None = None, gate_ranks=None, gate_match: str = ".pt.", fail_ranks=(),
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate = gate
        self.gate_match = gate_match
        self.gate_ranks = set(gate_ranks) if gate_ranks is not None else set(range(64))
        self.fail_ranks = set(fail_ranks)

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("faulty://"):] if str(path).startswith("faulty://") else path
        return super()._strip_protocol(path)

    def open(self, path, mode="rb", **kwargs):
        stream = super().open(path, mode, **kwargs)
        return _FaultyWriter(stream, self, path) if "w" in mode else stream


def register() -> None:
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
