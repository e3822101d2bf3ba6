"""How the ranks of a job agree on one save's outcome: through the job's c10d key-value store.

The background writers must not run collectives on the training process group (from a second
thread they deadlock against the training loop's own), and polling the checkpoint storage does not
scale: a thousand ranks listing one prefix every half second exceed what S3 serves per prefix.
The store that ``torch.distributed`` already runs for the job (a TCPStore, served by rank 0 or by
torchrun's agent) is neither: it is a key-value server that any thread may use through a client of
its own (``Store.clone()``), and its ``wait`` blocks without polling. Each rank makes O(1) store
requests per save; rank 0 reads every rank's file list with one ``multi_get``. The storage sees no
request from the handshake at all.

Keys, under ``async_ckpt/{save_id}/`` (the save id is fresh per save, so an earlier attempt at the
same tag never mixes in):

- ``rank/{r}``: rank r's report, ``{"entries": [...]}`` or ``{"error": "..."}``;
- ``finished`` (a counter) and ``wake``: set by the last rank to report, or at once by a rank that
  failed, so that rank 0 wakes up;
- ``error``: the first failure (``compare_set``: the first writer wins);
- ``decision``: ``commit`` or ``abort``, taken with ``compare_set`` so exactly one wins. Rank 0
  takes ``commit`` right before it writes the manifest; a rank that gives up waiting takes
  ``abort``. Whoever loses learns the winner's choice: a peer that gave up never deletes files of a
  tag rank 0 is committing, and rank 0 never commits a tag a peer gave up on;
- ``outcome``: rank 0's verdict, read by every other rank;
- ``acked``: a counter; the last rank to read the outcome removes the save's keys.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from async_ckpt.manifest import FileEntry

COMMIT, ABORT = "commit", "abort"


def job_store(world_size: int) -> Any:
    """A store client of this thread's own for the job's default store (an in-process store for one rank).

    ``_get_default_store`` is the store the default process group was initialized with; cloning
    it gives a new connection, so our blocking waits never hold the lock of the client that the
    training process group uses.
    """
    if world_size == 1 or not dist.is_initialized():
        return dist.HashStore()
    store = dist.distributed_c10d._get_default_store()
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):  # a store type without clients of its own (e.g. a FileStore)
        return store


@dataclass
class Outcome:
    """Rank 0's verdict on one save, as every rank reads it."""

    committed: bool
    error: str | None = None
    #: Work after the manifest that failed (``latest``, retention): the save is committed regardless.
    warnings: list[str] = field(default_factory=list)
    #: Whether ranks may delete their files of the tag: only when no manifest can ever appear.
    cleanup: bool = False
    #: The committed manifest (JSON), for ranks that must write it into a tier of their own (a
    #: node-local tier that rank 0 cannot see) and drain the tag from it.
    manifest: str | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Outcome":
        return cls(**json.loads(raw))


class HandshakeTimeout(Exception):
    """A wait on the store ran out of time (or the store is gone); ``str`` says what was awaited."""


class HandshakeFailed(Exception):
    """Rank 0 learned that the save cannot commit: a rank failed or did not report in time."""


class Handshake:
    """One save's agreement between ``world_size`` ranks through ``store``."""

    def __init__(self, store: Any, save_id: str, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._prefix = f"async_ckpt/{save_id}/"
        #: This rank's part is over (it failed, published or read the outcome): it may acknowledge.
        self._settled = False

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _wait(self, name: str, timeout_s: float, what: str) -> bytes:
        try:
            self.store.wait([self._key(name)], datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return self.store.get(self._key(name))
        except Exception as exc:  # DistStoreError on timeout; DistNetworkError once the job's store is gone
            raise HandshakeTimeout(f"{what} ({brief(exc)})") from exc

    # ------------------------------------------------------------------ every rank
    def report(self, entries: list[FileEntry] | None = None, error: str | None = None) -> None:
        """Tell rank 0 this rank's files are durable (``entries``), or that it failed (``error``)."""
        payload = {"error": error} if error is not None else {"entries": [asdict(e) for e in entries or []]}
        self.store.set(self._key(f"rank/{self.rank}"), json.dumps(payload))
        if error is not None:
            self.store.compare_set(self._key("error"), "", f"rank {self.rank}: {error}")
            self._settled = True
        finished = self.store.add(self._key("finished"), 1)
        if error is not None or finished == self.world_size:
            self.store.set(self._key("wake"), "1")

    def decide(self, choice: str) -> str:
        """Propose ``commit`` or ``abort``; return the decision that holds (the first one taken)."""
        return self.store.compare_set(self._key("decision"), "", choice).decode()

    def await_outcome(self, timeout_s: float) -> Outcome:
        """Block until rank 0 publishes the outcome; :class:`HandshakeTimeout` after ``timeout_s``."""
        outcome = Outcome.decode(self._wait("outcome", timeout_s,
                                            f"rank 0's outcome did not arrive within {timeout_s:.0f} s"))
        self._settled = True
        return outcome

    def acknowledge(self) -> None:
        """This rank is done with the save; the last rank to say so removes the save's keys.

        A rank that gave up waiting does not acknowledge: rank 0 may still read its report. The
        few keys of such a failed save stay in the store (which ends with the job).
        """
        if not self._settled:
            return
        self.store.delete_key(self._key(f"rank/{self.rank}"))
        if self.store.add(self._key("acked"), 1) == self.world_size:
            for name in ("finished", "wake", "error", "decision", "outcome", "acked"):
                self.store.delete_key(self._key(name))

    # ------------------------------------------------------------------ rank 0
    def gather(self, timeout_s: float) -> list[FileEntry]:
        """Every rank's file entries once all reported; :class:`HandshakeFailed` if any failed."""
        try:
            self._wait("wake", timeout_s, "")
        except HandshakeTimeout:
            try:
                missing = [r for r in range(self.world_size) if not self.store.check([self._key(f"rank/{r}")])]
            except Exception as gone:
                raise HandshakeFailed(f"the job's c10d store is unreachable ({brief(gone)})") from None
            raise HandshakeFailed(f"rank(s) {_ranges(missing)} did not finish writing within {timeout_s:.0f} s "
                                  "(a rank crashed or its storage stalled); raise commit_timeout_s if writes are "
                                  "this slow") from None
        if self.store.check([self._key("error")]):
            raise HandshakeFailed(self.store.get(self._key("error")).decode())
        reports = self.store.multi_get([self._key(f"rank/{r}") for r in range(self.world_size)])
        return [FileEntry.from_dict(e) for raw in reports for e in json.loads(raw)["entries"]]

    def publish(self, outcome: Outcome) -> None:
        self.store.set(self._key("outcome"), outcome.encode())
        self._settled = True


def brief(exc: BaseException) -> str:
    """``Type: first line``: c10d errors carry a C++ stack trace after their first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``: a short list of ranks, even of ten thousand."""
    parts: list[str] = []
    start = None
    for i, rank in enumerate(ranks):
        start = rank if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(rank) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)
