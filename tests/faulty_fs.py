"""An fsspec local filesystem that can hold writes behind a gate or fail them, per rank.

Registered as ``faulty://`` inside the rank processes. ``storage_options``:
``gate`` (a path: writes of ``*.pt`` files block until it exists), ``gate_ranks`` (ranks the gate applies to,
default all), ``gate_match`` (gate only paths containing this, default ``.pt.``), ``fail_ranks`` (ranks whose
writes of ``*.pt`` and ``*.bin`` files fail), ``fail_match`` (only those whose path contains this, default every one),
``fail_errno`` (the error they get: ``ENOSPC`` by default, ``EIO``, ``EACCES``...), ``fail_after_bytes``
(bytes of each such file written before the failure, default 0), ``latency_s`` (sleep
before every write of a ``*.pt`` file, on every rank), ``fail_rm`` (deletions of paths containing this fail: permission denied),
``fail_ls_ranks`` (ranks whose folder listings fail: an I/O error), ``stale_ranks``, ``stale_latest`` and
``stale_hidden`` (those ranks read ``stale_latest`` from every ``latest`` file and do not see ``stale_hidden`` in
folder listings, as a client whose NFS cache predates that tag's commit would), ``deny_ranks`` and ``deny_match``
(those ranks may not open for writing any path containing ``deny_match``: permission denied, as on a node whose
mount of that folder is read-only).
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
        self._written = 0

    def write(self, data):
        rank = int(os.environ.get("RANK", "0"))
        data_file = ".pt." in self._path or ".bin." in self._path  # torch.save files: DeepSpeed's, save_16bit_model's
        if self._fs.gate and rank in self._fs.gate_ranks and self._fs.gate_match in self._path:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not os.path.exists(self._fs.gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"test gate {self._fs.gate} never opened")
                time.sleep(0.01)
        if data_file and self._fs.latency_s:
            time.sleep(self._fs.latency_s)
        if rank in self._fs.fail_ranks and data_file and self._fs.fail_match in self._path:
            room = self._fs.fail_after_bytes - self._written
            if len(data) > room:
                if room > 0:
                    self._written += self._inner.write(memoryview(data)[:room])
                code = getattr(errno, self._fs.fail_errno)
                raise OSError(code, f"{os.strerror(code)} (injected)", self._path)
        n = self._inner.write(data)
        self._written += n if n is not None else len(data)
        return n

    def flush(self):
        self._inner.flush()

    def close(self):
        self._inner.close()


class FaultyFileSystem(LocalFileSystem):
    protocol = ("faulty",)

    def __init__(self, gate: str | None = None, gate_ranks=None, gate_match: str = ".pt.", fail_ranks=(),
                 fail_match: str = "", fail_errno: str = "ENOSPC", fail_after_bytes: int = 0, latency_s: float = 0.0, fail_rm: str | None = None,
                 fail_ls_ranks=(), stale_ranks=(), stale_latest: str | None = None, stale_hidden: str | None = None,
                 deny_ranks=(), deny_match: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.deny_ranks = set(deny_ranks)
        self.deny_match = deny_match
        self.stale_ranks = set(stale_ranks)
        self.stale_latest = stale_latest
        self.stale_hidden = stale_hidden
        self.fail_ls_ranks = set(fail_ls_ranks)
        self.fail_rm = fail_rm
        self.fail_errno = fail_errno
        self.fail_after_bytes = fail_after_bytes
        self.latency_s = latency_s
        self.gate = gate
        self.gate_match = gate_match
        self.gate_ranks = set(gate_ranks) if gate_ranks is not None else set(range(64))
        self.fail_ranks = set(fail_ranks)
        self.fail_match = fail_match

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("faulty://"):] if str(path).startswith("faulty://") else path
        return super()._strip_protocol(path)

    def rm(self, path, *args, **kwargs):
        if self.fail_rm and self.fail_rm in str(path):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", path)
        return super().rm(path, *args, **kwargs)

    def ls(self, path, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) in self.fail_ls_ranks:
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        listing = super().ls(path, *args, **kwargs)
        if int(os.environ.get("RANK", "0")) in self.stale_ranks:
            listing = [entry for entry in listing if _basename(entry) != self.stale_hidden]
        return listing

    def cat_file(self, path, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) in self.stale_ranks and os.path.basename(str(path)) == "latest":
            return self.stale_latest.encode()
        return super().cat_file(path, *args, **kwargs)

    def rm_file(self, path):
        self.rm(path)

    def open(self, path, mode="rb", **kwargs):
        if ("w" in mode and int(os.environ.get("RANK", "0")) in self.deny_ranks and self.deny_match
                and self.deny_match in str(path)):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", path)
        stream = super().open(path, mode, **kwargs)
        return _FaultyWriter(stream, self, path) if "w" in mode else stream


def _basename(entry) -> str:
    """The last component of a listing's entry (a dict with ``detail=True``, else a path)."""
    return os.path.basename(str(entry["name"] if isinstance(entry, dict) else entry))


def register() -> None:
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
