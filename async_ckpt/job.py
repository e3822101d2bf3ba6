"""One save in flight: everything the background writer and the commit need, owned by the job."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from async_ckpt.handle import SaveHandle
from async_ckpt.handshake import Handshake
from async_ckpt.staging import CopyTicket, StagedFile
from async_ckpt.storage.base import Storage


@dataclass
class SaveJob:
    tag: str
    save_id: str
    storage: Storage
    rank: int
    world_size: int
    files: list[StagedFile]
    ticket: CopyTicket
    handle: SaveHandle
    handshake: Handshake
    save_latest: bool
    keep_last: int | None
    keep_every: int | None
    metadata: dict[str, Any]
    extras_dir: str | None = None
    #: A consolidated save (see :mod:`async_ckpt.consolidated`): its manifest says so, and it gets
    #: no recovery scripts (there are no ZeRO shards to recover).
    consolidated: bool = False
    #: ``None``: every staged file is torch.saved as DeepSpeed handed it over. A number: the one
    #: staged dict is a whole model, written as safetensors shards of at most this many bytes.
    max_shard_bytes: int | None = None
    #: A save to the node-local tier (see :mod:`async_ckpt.tiers`): rank 0 publishes the manifest with
    #: the outcome, and once committed the tag is drained to the durable tier.
    tiered: bool = False
    #: With a local tier: the ranks that share this rank's node folder (the first one, if not rank 0,
    #: writes the published manifest there).
    node_ranks: tuple[int, ...] = ()
    #: The tag was a committed checkpoint, uncommitted for this save to overwrite (``overwrite_tags``, or
    #: an export replacing an earlier one): should the save fail, the tag stays uncommitted.
    overwrites: bool = False
    #: Should the save abort, this rank's start mark stays for gc even once its files are removed: a write
    #: of this rank was cut short and may have left what its cleanup cannot see (an upload whose abort
    #: failed, an object whose completion's reply was lost, a consolidated file's earlier shards).
    keep_mark: bool = False
    #: The tag's folder held files async_ckpt did not start (an export into a folder of the user's files):
    #: no start mark is written there, so that gc, which removes a marked folder without a manifest whole,
    #: never takes those files for a failed save's. A failed save's own files are removed as ever.
    unmarked: bool = False
    #: ``keep_last`` retention runs each deletion inside ``retention_allowed()``, and only where it yields
    #: true (a drain's commit while a tiered load reads: :meth:`~async_ckpt.drain.Drainer.pause_retention`).
    retention_allowed: Callable[[], ContextManager[bool]] | None = None
    #: Why ``save()`` raised on this rank after the save was agreed: the writer fails the save through the
    #: commit handshake, so that rank 0 aborts it at once instead of waiting for this rank's files until
    #: the commit times out. The failure is not recorded again: the training thread raised it.
    abandoned: str | None = None
    started: float = field(default_factory=time.perf_counter)
    buffers_free: threading.Event = field(default_factory=threading.Event)
    _reads: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reads_abandoned: bool = False

    @property
    def tier_leader(self) -> bool:
        return bool(self.node_ranks) and self.node_ranks[0] == self.rank

    @property
    def staged_bytes(self) -> int:
        return sum(f.nbytes for f in self.files if not f.in_place)

    @property
    def in_place_bytes(self) -> int:
        return sum(f.nbytes for f in self.files if f.in_place)

    @property
    def reads_abandoned(self) -> bool:
        return self._reads_abandoned

    def release_buffers(self) -> bool:
        """The staged tensors are no longer read: the next save may overwrite them. False where training
        stopped waiting before the files written in place were read to the end (:meth:`abandon_reads`):
        training may have changed them meanwhile, so what was written must not be committed."""
        with self._reads:
            self.files = []
            self.buffers_free.set()
            return not self._reads_abandoned

    def abandon_reads(self) -> bool:
        """Training stops waiting for this save (a timeout, an interrupt) and goes on changing its state:
        if files are still being read from that state in place, the save is marked to fail rather than
        commit bytes that may mix two steps. Whether it was."""
        with self._reads:
            if self.buffers_free.is_set() or not any(f.in_place for f in self.files):
                return False
            self._reads_abandoned = True
            return True
