"""The user-facing checkpointer: ``async_ckpt.wrap(engine, url)`` and the save/wait/load/close API.

A save runs in two phases. On the training thread, ``save()`` drives DeepSpeed's own
``save_checkpoint`` (so DeepSpeed still decides every file and every byte) with the adapter in
place, which snapshots each file into reused host buffers instead of writing it; ``save()``
returns once the snapshot is safe. On the rank's background writer thread, the snapshot is
streamed to storage and committed (see :mod:`async_ckpt.commit`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import deepspeed
import torch
import torch.distributed as dist

from async_ckpt import __version__ as _version
from async_ckpt import commit, inflight
from async_ckpt.catalog import holds_files, read_manifest, refuse_unsupported_latest, started_here
from async_ckpt.config import CheckpointConfig, OnError, local_path, timeout_argument
from async_ckpt.consolidated import (DEFAULT_SHARD_BYTES, floating_dtype, gather_state_dict, refuse_partial_export,
                                     set_config_dtype)
from async_ckpt.deepspeed_adapter import AsyncCheckpointEngine, CloneRequest, deferred_clones, estimate_snapshot
from async_ckpt.drain import Drainer, DrainJob, DrainTarget
from async_ckpt.errors import (CheckpointerClosedError, CheckpointNotFoundError, ConfigError, CorruptManifestError,
                               InvalidTagError, SaveFailedError, StorageError, TagExistsError, TagMismatchError,
                               UnsupportedManifestError, UsageError, VerificationError, WaitTimeoutError)
from async_ckpt.handle import SaveHandle, SaveResult
from async_ckpt.handshake import Handshake, Outcome, brief, job_store
from async_ckpt.job import SaveJob
from async_ckpt.layout import LATEST, MANIFEST, manifest_path, model_parallel_size, validate_tag
from async_ckpt.manifest import Manifest
from async_ckpt.pull import PullReport
from async_ckpt.resume import (check_for_rank, check_no_other_save, fetch_for_rank, older_committed, prune_cache,
                               rank_files, resolve)
from async_ckpt.serialization import in_place, record_offsets
from async_ckpt.staging import CopyTicket, StagedFile, StagingPool
from async_ckpt.storage import RetryPolicy, Storage, open_storage
from async_ckpt.tiers import (Node, TierRoom, choose_tag, committed_view, estimate_save_bytes,
                              holds_chosen_save, log_tier, node_has_room, nodes_from, ranks_sharing, tier_room,
                              undrained)
from async_ckpt.writer import BackgroundWriter, lower_thread_priority, remote_scratch_dir

logger = logging.getLogger("async_ckpt")

#: How often a long wait for background work logs that it is still waiting.
_PROGRESS_EVERY_S = 60.0
#: How long close() lets the writer and drainer threads take to end once every save has settled, however
#: little of wait_timeout_s is left: they only finish their callbacks (on_save_done) then.
_SETTLED_JOIN_S = 10.0


class _Proposal(NamedTuple):
    """Rank 0's part of :meth:`AsyncCheckpointer._agree`: what it found in the storage."""

    save_id: str
    committed: bool  # the tag has a manifest already
    replaceable: bool  # ... of an earlier consolidated save, which an export may replace
    redrain: list[tuple[str, str]]  # (drain id, manifest) of drains to resume (tiered)
    foreign: bool = False  # the tag's folder holds files async_ckpt did not start


class _View(NamedTuple):
    """What each rank brings to :meth:`AsyncCheckpointer._agree`'s one collective."""

    tag: str
    proposal: _Proposal | None  # rank 0 only
    room: TierRoom | None  # with a local tier: this rank's bytes for it, and what its node folder has room for
    failure: tuple[str | None, str] | None  # what this rank would raise (on_error="raise")
    problem: str | None  # rank 0 only: why its checks of the storage failed
    stuck: str | None  # why this rank could not wait for its earlier saves (WaitTimeoutError)


class _Agreement(NamedTuple):
    """The outcome of :meth:`AsyncCheckpointer._agree`, the same on every rank."""

    save_id: str
    local: bool  # the save goes to the local tier
    overwrites: bool  # the tag was committed and is uncommitted for this save
    buffer_wait_s: float  # this rank's wait for the previous save to free the staging buffers
    # the tag's folder holds files async_ckpt did not start (an export into a folder of the user's files,
    # an overwrite_tags save into stock DeepSpeed's): no start mark there, by which gc would delete them too
    unmarked: bool = False


@dataclass
class _Session:
    """The save currently being snapshotted on the training thread."""

    storage: Storage
    files: list[StagedFile] = field(default_factory=list)
    snapshot_s: float = 0.0
    #: The folder DeepSpeed's file paths are taken relative to, as the storage's paths are to its
    #: root: the shadow folder (``None``) for save_checkpoint, the export's parent for save_16bit_model.
    base: str | None = None
    #: Why a file's snapshot failed: raised once DeepSpeed's save returns. Raised from inside it, it would
    #: skip DeepSpeed's closing barrier, where the ranks whose snapshots succeeded would wait until the timeout.
    failure: Exception | None = None


def _remove_folder(path: str, owner_pid: int) -> None:
    """Remove ``path`` unless this process is a fork of its owner (the folder is still the parent's)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def _steps_in_backward(engine: Any) -> bool:
    """Whether the engine updates its optimizer state before ``engine.step()``: SuperOffload's ZeRO-3 runs
    the CPU optimizer's step on each partition as backward finishes its gradients (without gradient
    clipping), so a copy of the optimizer state overlapping the next backward would read it mid-update."""
    super_offload = getattr(engine, "super_offload", None)  # the config's flag, which DeepSpeed honours under ZeRO-3
    return callable(super_offload) and bool(super_offload()) and engine.zero_optimization_stage() == 3


def _normalize(url: str) -> str:
    """One spelling per root: ``file:///ckpt``, ``/ckpt/`` and ``ckpt`` (run from ``/``) are one folder, whose
    saves must share one storage (and its lock on ``latest``)."""
    path = local_path(url)
    return os.path.abspath(os.path.expanduser(path)) if path is not None else url.rstrip("/")


class AsyncCheckpointer:
    """Non-blocking saves, commit and resume for one DeepSpeed engine. Create it with :func:`wrap`.

    Every rank creates one and calls ``save``/``wait``/``load`` together, as with DeepSpeed.
    After wrapping, the engine's own ``save_checkpoint`` and ``save_16bit_model`` are non-blocking too.
    ``synchronous`` says whether saves return only once committed: the config's setting, or what wrap()
    chose for it (see :class:`~async_ckpt.CheckpointConfig`).
    """

    def __init__(self, engine: Any, config: CheckpointConfig, *, tokenizer: Any = None) -> None:
        if not all(hasattr(engine, a) for a in ("save_checkpoint", "load_checkpoint", "checkpoint_engine")):
            raise UsageError(f"wrap() needs the DeepSpeedEngine returned by deepspeed.initialize, "
                             f"got {type(engine).__name__}")
        if isinstance(engine.checkpoint_engine, AsyncCheckpointEngine):
            raise UsageError("this engine is already wrapped by an async_ckpt checkpointer that is still open: use the "
                             "checkpointer that wrap() returned, or close() it before wrapping the engine again")
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            raise UsageError(f"tokenizer must have a save_pretrained(dir) method, got {type(tokenizer).__name__}")
        if getattr(engine, "zero_nvme_offload_optimizer", lambda: False)():
            raise UsageError("ZeRO-Infinity's NVMe optimizer offload (offload_optimizer.device 'nvme') is not "
                             "supported yet: DeepSpeed copies its swap files into the save folder itself, outside the "
                             "checkpoint engine, so the tags async_ckpt commits would lack the optimizer state. "
                             "Offload to 'cpu', or save with DeepSpeed's own save_checkpoint")
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._shadow = tempfile.mkdtemp(prefix="async_ckpt_shadow_")
        # close() removes it; so do the process's exit and the collection of a checkpointer never
        # closed (HF Trainer and DeepSpeed's own tests never close theirs): no process leaves one behind.
        self._remove_shadow = weakref.finalize(self, _remove_folder, self._shadow, os.getpid())
        self._pool = StagingPool(copier_init=functools.partial(lower_thread_priority, config.writer_nice))
        self._storages: dict[str, Storage] = {}
        self._session: _Session | None = None
        self._last_job: SaveJob | None = None
        self._staging: CopyTicket | None = None
        self._handles: list[SaveHandle] = []
        self._errors: list[SaveFailedError] = []
        self._unreported: list[SaveFailedError] = []
        self._raised_for_peers: set[str | None] = set()  # tags of failures raised before this rank learnt them
        self._errors_lock = threading.Lock()
        self._closed = False
        self.last_fetch: PullReport | None = None
        self._store: Any = None
        self._local: Storage | None = None
        self._drainer: Drainer | None = None
        self._writer: BackgroundWriter | None = None
        self._node_ranks: tuple[int, ...] = ()  # with a local tier: the ranks sharing this rank's folder
        self._nodes: list[Node] = []  # with a local tier: every node's ranks
        self._drain_failed = False
        # (tag, save id) whose drain failure is only logged: recorded once already, or a drain resumed from the
        # node folders (a tag of an earlier job: were it raised, a tag whose files went with a node would
        # raise in every job after, before any of them could save a tag that supersedes it)
        self._drains_failed: set[tuple[str, str]] = set()
        self._lower_rank_writes_model_states: dict[str, bool] = {}  # by storage URL; see _model_states_writer
        self._previous_engine = engine.checkpoint_engine
        self._own_take_model_step = engine._take_model_step  # bound: the class's, or an override already there
        self._previous_take_model_step = engine.__dict__.get("_take_model_step")
        try:
            self._start(on_cpu=torch.device(getattr(engine, "device", "cpu")).type == "cpu")
            engine.checkpoint_engine = AsyncCheckpointEngine(self)
            engine.save_checkpoint = self._engine_save_checkpoint
            engine.save_16bit_model = self._engine_save_16bit_model
            engine._take_model_step = self._engine_take_model_step
            inflight.register(self)
        except BaseException:
            # nothing of a wrap() that failed outlives it: its threads, memory, storage clients and folder, and
            # the engine's patches (a later wrap() would find it wrapped by a checkpointer nobody holds)
            if self._writer is not None:
                self._writer.stop()  # idle: no save was queued
                self._writer.join(self.config.effective_wait_timeout_s)
            inflight.unregister(self)
            self._release()
            raise
        logger.debug("rank %d: async_ckpt wraps %s, writing to %s", self.rank, type(engine).__name__, config.url)

    def _start(self, *, on_cpu: bool) -> None:
        """Open the storages, start the writer (and drainer) threads, reserve the staging memory and, with a
        local tier, resume the drains a previous job left cut short; the engine is handed over only once
        all of it succeeded. With a local tier these steps meet in collectives, each checked: a failure on
        one rank is raised on every rank. Without one, wrap() runs no collective."""
        if self.config.local_tier is None:
            self._open_durable()
            self._prepare(on_cpu)
            return
        self._open_local_tier(self.config.local_tier)

        def prepare() -> list[tuple[str, str]] | None:
            self._prepare(on_cpu)
            return self._drains_to_resume() if self.rank == 0 else None

        self._start_drains(self._gather_checked("to reserve staging memory or find the drains to resume",
                                                prepare)[0])

    def _open_durable(self) -> None:
        self.storage = self._open(self.config.url)
        self._storages[_normalize(self.config.url)] = self.storage

    def _prepare(self, on_cpu: bool) -> None:
        """Start the writer thread, choose synchronous saves or not, and reserve the staging memory."""
        config, engine = self.config, self.engine
        if config.exact_bytes and self.storage.local_dir() is None:
            self._check_remote_scratch()
        self._store = job_store(self.world_size)  # the writer thread's own client of the job's c10d store
        self._writer = BackgroundWriter(self.rank, config.commit_timeout_s, self._record_failure,
                                        nice=config.writer_nice, exact_bytes=config.exact_bytes,
                                        cache_dir=config.cache_dir, on_done=config.on_save_done,
                                        on_local_commit=self._drain_later if self._drainer else None)
        self.synchronous = self._writes_synchronously(on_cpu)
        self._overlap_copy = config.overlap_copy and not _steps_in_backward(engine)
        if config.overlap_copy and not self._overlap_copy and self.rank == 0:
            logger.warning("overlap_copy is off for this engine: SuperOffload updates the optimizer state during "
                           "backward, so every save copies it before save() returns")
        stages = any(tier is not None and tier.aligned_lending for tier in (self.storage, self._local))
        if not on_cpu or not self.synchronous or stages:
            # saves that stage (device tensors always; host tensors unless a synchronous save writes them in
            # place, see _on_file), to either tier; pinned where the partitions are on CUDA
            estimate = estimate_snapshot(engine)
            cuda = estimate.device is not None and estimate.device.type == "cuda"
            self._pool.reserve(estimate.nbytes, buffers=estimate.buffers, pin_for=estimate.device if cuda else None)
        if on_cpu and not self.synchronous:
            self._warn_of_memory_filesystems()
        if self.rank == 0 and not engine.checkpoint_serialization_enabled():
            logger.warning("the DeepSpeed config sets checkpoint.checkpoint_serialization to false (torch.save's "
                           "legacy format); async_ckpt writes torch.save's zip format, which torch.load and "
                           "DeepSpeed's load_checkpoint, zero_to_fp32 and ds_to_universal read the same way, so "
                           "the files are not the legacy format's bytes")

    # ------------------------------------------------------------------ public API
    def save(self, tag: str | None = None, client_state: Mapping[str, Any] | None = None) -> SaveHandle:
        """Snapshot the engine's state and return; the write and the commit continue in the background.

        ``tag`` defaults to ``global_step{N}``. ``client_state`` is stored in the model-states
        file as with DeepSpeed (and returned by :meth:`load`). Raises a previous save's failure
        here when ``on_error="raise"``.
        """
        return self._save(self.storage, tag, client_state, save_latest=True)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is durable and committed (or failed).

        With ``on_error="raise"`` a failure is raised here; with ``"warn"`` it is logged. Waits at
        most ``timeout`` seconds (default ``wait_timeout_s``), then raises :class:`WaitTimeoutError`.
        """
        self._ensure_open()
        timeout = timeout_argument("wait(timeout=...)", timeout)
        if not inflight.waits_here("wait()"):
            return
        if timeout is None:
            self._await_handles(self.config.effective_wait_timeout_s)
        else:
            self._await_handles(timeout, limit="the timeout given to wait() or wait_all()")
        self._surface_errors()

    def save_consolidated(self, tag: str | None = None, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                          exclude_frozen_parameters: bool = False) -> SaveHandle:
        """Gather the whole model to rank 0 and write it as a Hugging Face folder, in the background.

        :meth:`save` writes each rank's partition, for resuming; this writes what inference and
        export need, loadable with ``AutoModelForCausalLM.from_pretrained(<url>/<tag>)`` without
        DeepSpeed: safetensors shards of at most ``max_shard_bytes`` with their index, plus the
        model config and tokenizer. Every rank calls it. The gather is DeepSpeed's own and runs
        here, on the training thread (under ZeRO-3 it is a collective); rank 0 snapshots the
        weights into the reused staging buffers and this returns, so training goes on while they
        are written and committed. ``tag`` defaults to ``global_step{N}_consolidated``; it never
        moves ``latest``, and :meth:`load`, the automatic tag choice and retention leave it alone.
        """
        self._ensure_open()
        started = time.perf_counter()
        tag = validate_tag(tag) if tag is not None else f"global_step{self.engine.global_steps}_consolidated"
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
        refuse_partial_export(self.engine, "save_consolidated", exclude_frozen_parameters=exclude_frozen_parameters)
        agreed = self._agree(self.storage, tag)
        with self._handed_over_or_failed(self.storage, tag, agreed):
            entered = time.perf_counter()
            state = gather_state_dict(self.engine, exclude_frozen_parameters=exclude_frozen_parameters)
            gathered = time.perf_counter()
            files = []
            if self.rank == 0:
                files.append(self._pool.snapshot(state, f"{tag}/model-*.safetensors", slot_key="consolidated",
                                                 defer=False))
                self._pool.release_stale()
            snapshot_s = time.perf_counter() - gathered
            extras_dir = self._save_extras(agreed.save_id)
            dtype = floating_dtype(state) if state else None
            config = os.path.join(extras_dir, "config.json") if extras_dir is not None else None
            if config is not None and dtype is not None and os.path.isfile(config):
                set_config_dtype(config, dtype)  # the weights' dtype, for from_pretrained
        return self._submit(self.storage, tag, agreed, files, CopyTicket([]), started, save_latest=False,
                            extras_dir=extras_dir, consolidated=True, max_shard_bytes=max_shard_bytes,
                            metrics={"buffer_wait_s": agreed.buffer_wait_s, "gather_s": gathered - entered,
                                     "snapshot_s": snapshot_s})

    def load(self, tag: str | None = None, *, fallback: bool = False, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True, load_module_strict: bool = True) -> tuple[str, dict]:
        """Restore model, optimizer, LR scheduler and client_state from a committed tag.

        ``tag`` defaults to the newest committed tag (normally the one ``latest`` names; see
        :func:`async_ckpt.resume.resolve` for what happens after a crash). The files every rank
        reads are verified against the manifest first; on a mismatch (or a file missing from storage)
        this raises :class:`VerificationError`, or with ``fallback=True`` every rank moves to the previous
        committed tag; one saved on another layout (world size, ZeRO stage) ends the fallback with a
        :class:`UsageError`. Returns ``(tag, client_state)``.

        An engine configured with ``"checkpoint": {"load_universal": true}`` loads universal tags
        instead (the one ``latest_universal`` names by default; made by ``async-ckpt to-universal``),
        on any number of ranks; every rank fetches and verifies all of its files.
        """
        self._ensure_open()
        if self._local is not None and not self._loads_universal():
            self._settle_saves_before_load(local_only=True)  # drains go on meanwhile
            return self._load_tiered(None if tag is None else validate_tag(tag), fallback=fallback,
                                     load_optimizer_states=load_optimizer_states,
                                     load_lr_scheduler_states=load_lr_scheduler_states,
                                     load_module_strict=load_module_strict)
        self._settle_saves_before_load(local_only=False)
        manifest = self._agreed_manifest(f"to find the tag to load at {self.storage.url}",
                                         lambda: resolve(self.storage, tag, universal=self._loads_universal()))
        self._check_compatible(manifest)
        dp_rank, mp_rank = self._dp_rank(load_optimizer_states), self._mp_rank()
        load_dir = None
        while True:
            def fetch() -> str | None:
                """This rank's files of ``manifest``, verified and fetched: ``None``, or what failed verification
                (every rank then falls back together); any other error is raised on every rank."""
                nonlocal load_dir
                try:
                    if self.config.verify_on_load and self.storage.local_dir() is not None:
                        check_for_rank(self.storage, manifest, dp_rank, mp_rank)
                    load_dir, self.last_fetch = fetch_for_rank(self.storage, manifest, dp_rank, self.config.cache_dir,
                                                               self.config.max_concurrency, mp_rank)
                except VerificationError as exc:
                    return str(exc)
                return None

            problems = self._gather_checked(f"to fetch tag {manifest.tag!r} from {self.storage.url}", fetch)
            if not any(problems):
                break
            first = next(p for p in problems if p)
            older = self._agreed_manifest(f"to find a tag older than {manifest.tag!r} at {self.storage.url}",
                                          lambda failed=manifest: older_committed(self.storage, failed)) \
                if fallback else None
            if older is None:
                raise VerificationError(first + ("; no older committed tag to fall back to" if fallback else
                                                 "; load another tag or pass fallback=True"))
            logger.warning("rank %d: %s; falling back to %s", self.rank, first, older.tag)
            manifest = older
            try:
                self._check_compatible(manifest)  # the same answer on every rank
            except UsageError as exc:
                raise UsageError(f"{exc} (load fell back to it from a tag that failed: {first})") from None
        return self._deepspeed_load(load_dir, manifest, self.storage.url, load_optimizer_states=load_optimizer_states,
                                    load_lr_scheduler_states=load_lr_scheduler_states,
                                    load_module_strict=load_module_strict)

    def _agreed_manifest(self, what: str, find: Callable[[], Manifest | None]) -> Manifest | None:
        """``find()`` on every rank, which must all find the same save: a rank whose read failed raises on
        every rank (not only its own, which would leave the others waiting in the next collective), and
        ranks that found different tags, or different saves of one tag (another job committing or
        overwriting there meanwhile), are refused rather than each loading its own. Only the tags and
        save ids are gathered, not the manifests."""
        found: list[Manifest | None] = []

        def save_found() -> tuple[str, str] | None:
            found.append(find())
            return (found[0].tag, found[0].save_id) if found[0] is not None else None

        saves = set(self._gather_checked(what, save_found))
        if len(saves) > 1:
            named = sorted(f"{save[0]} (save {save[1] or '?'})" if save else "none" for save in saves)
            raise StorageError(f"the ranks found different checkpoints at {self.storage.url} ({', '.join(named)}): "
                               "is another job saving there? Stop it, or pass tag= to load()")
        return found[0]

    def _deepspeed_load(self, load_dir: str, manifest: Manifest, source: str, **options: bool) -> tuple[str, dict]:
        with self._named_by_latest(load_dir, manifest.tag,
                                   self._weights_from_every_shard(options.get("load_optimizer_states", True))) as root, \
                inflight.not_waiting():  # DeepSpeed's readers, hooked, wait for none
            path, client_state = type(self.engine).load_checkpoint(self.engine, root, manifest.tag, **options)
        if path is None:
            raise CheckpointNotFoundError(f"DeepSpeed found no checkpoint files for tag {manifest.tag!r} in {load_dir}")
        logger.info("rank %d resumed from %s/%s (step %d)", self.rank, source, manifest.tag, manifest.step)
        if source == self.storage.url and self.storage.local_dir() is None:  # loaded from the resume cache
            prune_cache(load_dir)
        return manifest.tag, client_state or {}

    @contextlib.contextmanager
    def _named_by_latest(self, root: str, tag: str, needed: bool) -> Iterator[str]:
        """Where ``needed``, a root whose ``latest`` names ``tag``: DeepSpeed's ZeRO-3 load without optimizer
        states takes the weights (zero_to_fp32) of the tag the root's ``latest`` names, whatever tag it was
        asked to load. A folder in ``cache_dir`` holding such a ``latest`` and a link to ``root/tag``, made
        on every rank in a gathered step (a rank that cannot make it raises with the others), removed after
        the load."""
        if not needed:
            yield root
            return
        linked = os.path.join(self.config.cache_dir, "latest-links", uuid.uuid4().hex)

        def link() -> None:
            os.makedirs(linked)
            os.symlink(os.path.join(os.path.abspath(root), tag), os.path.join(linked, tag))
            with open(os.path.join(linked, LATEST), "w") as fh:
                fh.write(tag)

        try:
            self._gather_checked(f"to link tag {tag!r} for DeepSpeed's ZeRO-3 load without optimizer states", link)
            yield linked
        finally:
            shutil.rmtree(linked, ignore_errors=True)  # the link, not what it names

    def _load_tiered(self, tag: str | None, *, fallback: bool, **options: bool) -> tuple[str, dict]:
        """:meth:`load` with a local tier: the newest tag every rank can read from some tier, each rank
        reading from the nearest one that holds its files intact (its node's folder after a process
        restart, the durable URL after a node replacement or a wiped folder), logged per rank.

        The retention that drains run (each node's, and ``keep_last`` at the URL) is paused from before this
        rank lists the tags until the next save's agreement (or :meth:`close`), when every rank is past this
        load: no tag is deleted once any rank reads. A rank that listed its node folder before that node's
        leader paused may find a tag gone; it then reads the URL's copy, or falls back."""
        self._drainer.pause_retention()  # type: ignore[union-attr]  # a local tier has its drainer
        def list_committed() -> tuple[dict, dict | None]:
            """Each rank's node folder and rank 0 the URL (a node cut off from it may still load from its
            own); where no tag is named, what ``latest`` names there must be a tag this version reads, not
            an older tag in its place."""
            tiers = [self._local] + ([self.storage] if self.rank == 0 else [])
            for tier in tiers if tag is None else []:
                refuse_unsupported_latest(tier)
            return (committed_view(self._local), committed_view(self.storage) if self.rank == 0 else None,
                    self._refusal_of_named(tag) if self.rank == 0 and tag is not None else None)

        views = self._gather_checked("to list the committed tags", list_committed)
        if views[0][2] is not None:  # a tag the views leave out, named: refused as without a local tier
            raise UsageError(views[0][2])
        local_views, durable_view = [v[0] for v in views], views[0][1]
        dp_rank, mp_rank = self._dp_rank(options.get("load_optimizer_states", True)), self._mp_rank()
        unreadable: str | None = None  # the first tag's problem, once fallen back
        failed: str | None = None  # the last tag that could not be read
        load_dir: str | None = None
        manifest: Manifest | None = None
        source = ""
        while True:
            chosen, why = choose_tag(tag, local_views, durable_view, older_than=failed)
            if chosen is None and unreadable is not None:
                raise VerificationError(f"{unreadable}; no older committed tag to fall back to")
            if chosen is None:
                raise CheckpointNotFoundError(f"cannot resume from {self.config.local_tier} (local tier) or "
                                              f"{self.storage.url}: {why}")
            def nearest() -> tuple[str | None, str | None]:
                """``(problem, refusal)`` of this rank's nearest copy of ``chosen``, each for every rank to act
                on at once; any other error (a storage client's own type too) is raised on every rank."""
                nonlocal load_dir, manifest, source
                try:
                    in_local, in_durable = holds_chosen_save(chosen, local_views[self.rank], local_views,
                                                             durable_view)
                    load_dir, manifest, source = self._nearest_copy(chosen, in_local, in_durable, dp_rank, mp_rank)
                except UsageError as exc:  # a layout this job cannot load: raised on every rank, no fallback
                    return None, str(exc)
                except (VerificationError, CheckpointNotFoundError, StorageError, OSError,
                        UnsupportedManifestError) as exc:
                    return f"rank {self.rank}: {type(exc).__name__}: {exc}", None
                return None, None

            gathered = self._gather_checked(f"to read tag {chosen!r}", nearest)
            refusals = [r for _, r in gathered if r]
            if refusals:
                raise UsageError(refusals[0])
            problems = [p for p, _ in gathered if p]
            if not problems:
                break
            if not fallback:
                raise VerificationError(f"tag {chosen!r} cannot be read on every rank: {problems[0]}; pass "
                                        "fallback=True to take an older tag")
            logger.warning("rank %d: %s; falling back to an older tag", self.rank, problems[0])
            unreadable = unreadable or problems[0]
            failed = chosen
        return self._deepspeed_load(load_dir, manifest, source, **options)

    def _nearest_copy(self, tag: str, in_local: bool, in_durable: bool, dp_rank: int | None,
                      mp_rank: int) -> tuple[str, Manifest, str]:
        """``(folder to load from, manifest, where)`` of the first tier holding this rank's files intact; a
        layout this job cannot load is refused before any file is read or fetched."""
        why = "this node's local tier does not hold this save of it committed"
        if in_local:
            manifest = read_manifest(self._local, tag)
            try:
                if manifest is None:
                    raise CheckpointNotFoundError(f"tag {tag!r} is no longer committed in {self._local.url}")
                self._check_compatible(manifest)
                if self.config.verify_on_load:
                    check_for_rank(self._local, manifest, dp_rank, mp_rank)
                else:  # present at least: a node's folder holds its own ranks' shards only
                    missing = [p for p in rank_files(manifest, dp_rank, mp_rank)
                               if not self._local.exists(f"{tag}/{p}")]
                    if missing:
                        raise CheckpointNotFoundError(f"{self._local.url}/{tag} does not hold {missing[0]}")
                check_no_other_save(self._local.local_dir(), manifest, dp_rank)
                log_tier(self.rank, tag, "local", self._local.url)
                return self._local.local_dir(), manifest, self._local.url
            except (VerificationError, CheckpointNotFoundError) as exc:
                why = str(exc)
        if not in_durable:
            raise CheckpointNotFoundError(f"tag {tag!r}: {why}, and {self.storage.url} does not hold this save of it "
                                          "committed")
        manifest = read_manifest(self.storage, tag)
        if manifest is None:
            raise CheckpointNotFoundError(f"tag {tag!r} is no longer committed at {self.storage.url}")
        self._check_compatible(manifest)
        if self.config.verify_on_load and self.storage.local_dir() is not None:
            check_for_rank(self.storage, manifest, dp_rank, mp_rank)
        load_dir, self.last_fetch = fetch_for_rank(self.storage, manifest, dp_rank, self.config.cache_dir,
                                                   self.config.max_concurrency, mp_rank)
        log_tier(self.rank, tag, "durable", self.storage.url, why)
        return load_dir, manifest, self.storage.url

    def close(self) -> None:
        """Finish pending saves, stop the writer thread and give the engine its own checkpoint engine back.

        Waits at most ``wait_timeout_s`` in all for pending saves, the writer and any drains (then raises
        :class:`WaitTimeoutError`; the engine is given back all the same). A save still being written then
        may fail (closing its storage stops the transfers it started: S3 uploads in flight are cancelled) or
        may still commit later; either way ``latest`` only ever names a complete checkpoint.
        """
        if self._closed:
            return
        inflight.waits_here("close()")  # refused, before anything stops, in an on_save_done callback
        deadline = time.monotonic() + self.config.effective_wait_timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        settled_floor = min(self.config.effective_wait_timeout_s, _SETTLED_JOIN_S)
        settled = False
        try:
            self._writer.stop()  # first: it ends after the queued saves, even if a wait below gives up
            self._await_staging()
            self._await_handles(left())
            self._bounded(self._writer.join, self._last_job.tag if self._last_job else "-",
                          "the background writer thread to stop", max(left(), settled_floor),
                          url=self._last_job.storage.url if self._last_job else None)
            if self._drainer is not None:  # every drain has ended: every rank holds the same failures
                self._drainer.resume_retention()  # a load paused it: the redone drains' retention runs
                self._handles.extend(self._drainer.retry_failed())
                self._await_handles(left())
            settled = True
        finally:
            self._release(max(left(), settled_floor) if settled else left())
        self._surface_errors()

    def _release(self, drain_timeout_s: float | None = None) -> None:
        """Stop the threads, free the staging memory, close the storages and give the engine back: the end
        of :meth:`close`, and of a ``wrap()`` that failed part-way (whatever it had started). The engine
        goes back first and each step runs whatever an earlier one raised (a sticky CUDA error in the
        pool's synchronize): a checkpointer half released would leave the engine calling a closed one.
        ``drain_timeout_s``: how long the drainer may take to stop (what is left of :meth:`close`'s
        ``wait_timeout_s``; default all of it)."""
        self._give_engine_back()
        try:
            if self._drainer is not None:
                self._drainer.stop()
                waited = self.config.effective_wait_timeout_s if drain_timeout_s is None else drain_timeout_s
                if not self._drainer.join(waited):
                    logger.warning("rank %d: the drainer thread did not stop within close()'s wait_timeout_s (%.0f "
                                   "s); a drain to %s may still be running, and fails once its storage is closed",
                                   self.rank, self.config.effective_wait_timeout_s, self.config.url)
            self._closed = True
            inflight.unregister(self)
            self._pool.close()
        finally:
            try:
                for storage in [*self._storages.values(), *([self._local] if self._local is not None else [])]:
                    storage.close()
            finally:
                self._store = self._last_job = None  # the store client (and the last job's reference to it) holds a socket
                if self._writer is None or not self._writer.alive:
                    self._remove_shadow()  # else a save still queued reads its tokenizer from it: removed at exit

    def _give_engine_back(self) -> None:
        self.engine.checkpoint_engine = self._previous_engine
        for name, ours in (("save_checkpoint", self._engine_save_checkpoint),
                           ("save_16bit_model", self._engine_save_16bit_model),
                           ("_take_model_step", self._engine_take_model_step)):
            if self.engine.__dict__.get(name) == ours:
                delattr(self.engine, name)
        if self._previous_take_model_step is not None and "_take_model_step" not in self.engine.__dict__:
            self.engine._take_model_step = self._previous_take_model_step  # an override there before wrap()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """Close; where the block raised, a failure of the close is logged, not raised over the block's error."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as failure:  # noqa: BLE001 - the block's own error is what the caller must see
            logger.error("rank %d: closing the checkpointer after %s also failed: %s: %s", self.rank,
                         type(exc).__name__, type(failure).__name__, failure)

    @property
    def failures(self) -> list[SaveFailedError]:
        """Every background failure so far (also those already reported)."""
        return list(self._errors)

    @property
    def staging_reserved(self) -> bool:
        """Whether the staging memory ``wrap()`` reserves is ready: faulted in, and on a GPU pinned, on a
        helper thread. Until then that work shares the machine with training, and a save waits for it."""
        return self._pool.reserved

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffers of this rank."""
        return self._pool.allocated_bytes

    @property
    def staging_allocations(self) -> int:
        """How many staging buffers were ever allocated (flat after the first save)."""
        return self._pool.allocations

    @property
    def staging_outside_reserve(self) -> int:
        """Staging buffers that did not fit the memory ``wrap()`` reserved from its estimate of the
        snapshot (0 when the estimate held; each one is allocated, and on a GPU pinned, in a save's stall)."""
        return self._pool.buffers_outside_reserve

    # ------------------------------------------------------------------ save internals
    def _save(self, storage: Storage, tag: str | None, client_state: Mapping[str, Any] | None,
              save_latest: bool, exclude_frozen_parameters: bool = False) -> SaveHandle:
        self._ensure_open()
        started = time.perf_counter()
        tag = validate_tag(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        if client_state is not None and not isinstance(client_state, Mapping):
            raise UsageError(f"client_state must be a dict, got {type(client_state).__name__}")
        agreed = self._agree(storage, tag, tiered=self._local is not None and storage is self.storage)
        target = self._local if agreed.local else storage
        with self._handed_over_or_failed(target, tag, agreed):
            self._session = _Session(target)
            entered = time.perf_counter()
            try:
                with deferred_clones(), self._model_states_writer(storage, agreed.local):
                    type(self.engine).save_checkpoint(self.engine, self._shadow, tag, dict(client_state or {}),
                                                      save_latest=False,
                                                      exclude_frozen_parameters=exclude_frozen_parameters)
                files, snapshot_s = self._session.files, self._session.snapshot_s
                if self._session.failure is not None:  # the save fails; the other ranks' saves with it (above)
                    raise self._session.failure
            finally:
                self._session = None
            deepspeed_s = time.perf_counter() - entered
            deferred = [pair for f in files for pair in f.deferred]
            self._staging = self._pool.copy(deferred, background=True, checksum=not self.config.exact_bytes)
            self._pool.trim_reserve()
            self._pool.release_stale()
            extras_dir = self._save_extras(agreed.save_id)
        return self._submit(target, tag, agreed, files, self._staging, started, save_latest=save_latest,
                            extras_dir=extras_dir, metrics={"buffer_wait_s": agreed.buffer_wait_s,
                                                            "snapshot_s": snapshot_s,
                                                            "deepspeed_overhead_s": deepspeed_s - snapshot_s})

    @contextlib.contextmanager
    def _handed_over_or_failed(self, storage: Storage, tag: str, agreed: _Agreement) -> Iterator[None]:
        """A save's work between its agreement and its hand-over to the writer. Where it raises on this
        rank, the writer still takes part in the save's commit, to fail it: rank 0 aborts it at once, and
        the other ranks' writers do not wait for this rank's files until the commit times out (with the
        saves queued behind it)."""
        try:
            yield
        except BaseException as exc:
            handle = SaveHandle(tag=tag, url=storage.url)
            self._writer.submit(SaveJob(
                tag=tag, save_id=agreed.save_id, storage=storage, rank=self.rank, world_size=self.world_size,
                files=[], ticket=CopyTicket([]), handle=handle,
                handshake=Handshake(self._store, agreed.save_id, self.rank, self.world_size), save_latest=False,
                keep_last=None, keep_every=None, metadata={}, overwrites=agreed.overwrites,
                abandoned=f"{type(exc).__name__}: {exc}"))
            self._track(handle)  # waited for at exit: the writer's report is what lets rank 0 abort at once
            raise

    def _submit(self, storage: Storage, tag: str, agreed: _Agreement, files: list[StagedFile], ticket: CopyTicket,
                started: float, *, save_latest: bool, extras_dir: str | None, metrics: dict[str, float],
                consolidated: bool = False, max_shard_bytes: int | None = None) -> SaveHandle:
        """Hand a snapshotted save to the background writer; its handle's ``stall_s`` ends here. A save
        to the local tier (``agreed.local``) is committed in ``storage`` (that tier), then drained to the URL.
        With ``synchronous``, wait for the commit before returning."""
        tiered = agreed.local
        handle = SaveHandle(tag=tag, url=self.storage.url if tiered else storage.url)
        job = SaveJob(tag=tag, save_id=agreed.save_id, storage=storage, rank=self.rank, world_size=self.world_size,
                      files=files, ticket=ticket, handle=handle, save_latest=save_latest,
                      handshake=Handshake(self._store, agreed.save_id, self.rank, self.world_size),
                      keep_last=None if consolidated or tiered else self.config.keep_last,
                      keep_every=self.config.keep_every, metadata=self._metadata(), extras_dir=extras_dir,
                      consolidated=consolidated, max_shard_bytes=max_shard_bytes, tiered=tiered,
                      node_ranks=self._node_ranks if tiered else (), overwrites=agreed.overwrites, started=started,
                      unmarked=agreed.unmarked)
        if self._local is not None:
            metrics = {**metrics, "tier": "local" if tiered else "durable"}
        handle.metrics.update(stall_s=time.perf_counter() - started, staging_bytes=job.staged_bytes,
                              in_place_bytes=job.in_place_bytes, **metrics)
        self._last_job = job
        # handed to the writer before it is tracked: an exit signal raised between the two then leaves a save
        # that still ends, not a tracked handle no writer will settle (the exit would wait for it in vain)
        if not self.synchronous:
            self._writer.submit(job)
            self._track(handle)
            return handle
        waiting = time.perf_counter()
        try:
            self._writer.submit(job)
            self._track(handle)
            self._bounded(handle.wait, tag, "the save to commit (synchronous)", self.config.effective_wait_timeout_s,
                          url=handle.url)
        except BaseException:
            if job.abandon_reads():
                logger.error("rank %d: tag %s is written from the training state in place and training goes "
                             "on before it was read: the save will fail rather than commit", self.rank, tag)
            raise
        handle.metrics["commit_wait_s"] = time.perf_counter() - waiting
        self._surface_errors()
        return handle

    def _agree(self, storage: Storage, tag: str, *, replace_export: bool = False,
               tiered: bool = False) -> _Agreement:
        """One collective on the training thread: same tag everywhere, a fresh save id, tag not committed
        (or uncommitted first: with ``overwrite_tags``, or with ``replace_export`` where the committed tag
        is an earlier consolidated save, as DeepSpeed overwrites its 16-bit model file), and its folder
        not one with files async_ckpt did not start (unless ``overwrite_tags``; an export, with
        ``replace_export``, writes into any folder, as DeepSpeed's ``save_16bit_model`` does).

        With ``tiered``, also whether the save goes to the local tier (every rank's node folder has
        room; else straight to the URL), and the drains to resume, which rank 0 lists after one failed.

        An earlier save's failure is raised here, after the collective, on every rank at once (with
        ``on_error="raise"``): the rank whose write failed knows it before the others learn it from
        the commit, and a rank that raised before the collective would leave the others waiting in it.
        So does a failure of rank 0's checks of the storage, and a rank's timeout waiting for its earlier
        saves (of the tag, and the one whose staging buffers this save reuses), which it waits out first.
        """
        waited, stuck = self._await_earlier_saves(storage, tag)
        proposal, problem, holding = None, None, []  # holding: the tiers with the tag's manifest (rank 0)
        room = tier_room(self._local.local_dir(), estimate_save_bytes(self.engine, self.world_size,
                                                                      self._pool.allocated_bytes),
                         self.config.local_tier_max_bytes) if tiered else None
        if self.rank == 0:
            try:
                held = storage.list_dir(tag)  # one request tells a committed tag from a new one
                holding = [tier for tier, has in ((storage, MANIFEST in held),
                                                  (self._local, tiered and self._local.exists(manifest_path(tag))))
                           if has]
                committed = bool(holding)
                ours = bool(held) and not committed and started_here(storage, tag)  # a save of it that did not commit
                if ours and not replace_export and not tiered and stuck is None:  # (a wait that gave up: maybe live)
                    # a dead save of the tag (its start mark, no manifest: a job killed mid-save, an abort that
                    # kept its mark): its files go before any rank writes, or those of them this save does not
                    # overwrite (another world size's shards) would stay in the folder DeepSpeed's tools glob
                    logger.warning("tag %s at %s holds the files of a save of it that did not commit: removed before "
                                   "this save writes there", tag, storage.url)
                    commit.delete_tag(storage, tag)
                    held = []
                redrain = self._drains_to_resume() if tiered and self._drain_failed else []
                proposal = _Proposal(uuid.uuid4().hex, committed,
                                     committed and replace_export and _is_consolidated(storage, tag), redrain,
                                     foreign=bool(held) and not committed and not ours and holds_files(storage, tag))
            except Exception as exc:  # raised below, on every rank
                problem = exc
        views: list[_View] = self._gather(_View(tag, proposal, room, self._failure_to_report(),
                                                brief(problem) if problem else None, str(stuck) if stuck else None))
        if self._drainer is not None:  # every rank of the node is past any load before this save: it read its files
            self._drainer.resume_retention()
        found = views[0].proposal  # what rank 0 found, on every rank
        # an export replaces an earlier export only, never a ZeRO checkpoint, whatever overwrite_tags says
        overwrites = found is not None and found.committed and (
            found.replaceable if replace_export else self.config.overwrite_tags)
        if found is not None:  # before any raise below could drop them; rank 0's tag on every rank
            self._start_drains(found.redrain, skip=views[0].tag if overwrites else None)
        if overwrites and self._drainer is not None:  # this save replaces the earlier one's files: no retry of it
            self._drainer.supersede(views[0].tag)
        self._surface_errors([v.failure for v in views])
        if stuck is not None:
            raise stuck
        late = next(((rank, v.stuck) for rank, v in enumerate(views) if v.stuck), None)
        if late is not None:
            raise WaitTimeoutError(f"rank {late[0]} could not wait for its earlier saves, so no rank saves tag "
                                   f"{tag!r}: {late[1]}")
        if problem is not None:
            raise problem
        if views[0].problem is not None:
            raise StorageError(f"rank 0 could not check tag {tag!r} at {storage.url} before the save "
                               f"({views[0].problem}); nothing was written. Check the storage, then save again")
        tags = {v.tag for v in views}
        if len(tags) > 1:
            if self.engine.checkpoint_tag_validation_fail():
                self.engine._checkpoint_tag_validation(tag)  # DeepSpeed's own check raises its own error
            raise TagMismatchError(f"ranks disagree on the checkpoint tag: {sorted(tags)}; pass the same tag on "
                                   "every rank")
        save_id, committed, _, _, foreign = found  # type: ignore[misc]
        if foreign and not self.config.overwrite_tags and not replace_export:
            raise TagExistsError(f"folder {tag!r} at {storage.url} holds files but neither a manifest nor a start "
                                 "mark of async_ckpt: a checkpoint something else wrote (stock DeepSpeed?), or a "
                                 "save of an async_ckpt older than start marks that died. Saving into it would mix "
                                 "two checkpoints' files. Use a new tag, or move that folder away (overwrite_tags=True "
                                 "writes into it, as DeepSpeed would)")
        if committed and not overwrites and replace_export:
            raise TagExistsError(f"tag {tag!r} at {storage.url} is a committed ZeRO checkpoint: an export "
                                 "(save_16bit_model) never replaces one, whatever overwrite_tags says. Export into "
                                 "another folder")
        if committed and not overwrites:
            raise TagExistsError(f"tag {tag!r} is already committed at {storage.url}; saving it again would "
                                 "overwrite a good checkpoint. Use a new tag, delete the old one first, or pass "
                                 "overwrite_tags=True to wrap() for DeepSpeed's overwrite semantics (after a load() "
                                 "of an older tag, a rollback or a fallback, the default global_stepN tags reach "
                                 "the abandoned steps' tags: overwrite_tags=True replaces them as DeepSpeed does)")
        if committed:  # a collective: where rank 0 cannot uncommit the tag, every rank raises, none saves
            def uncommit() -> None:
                if self.rank != 0:
                    return
                logger.warning("overwriting committed tag %s at %s: it is uncommitted until this save commits", tag,
                               storage.url)
                for tier in holding:  # marked first: if the job dies before this save commits, gc knows it for ours
                    # not while a commit's retention pass, which may have listed the tag as committed, runs there
                    with tier.after_commit_lock:
                        if not replace_export:  # an export's folder may hold the user's files: never gc's
                            commit.mark_started(tier, tag, 0, save_id)
                        tier.delete(manifest_path(tag))  # uncommit: a half-overwritten tag is never 'committed'
            self._gather_checked(f"to uncommit tag {tag!r}, which this save overwrites", uncommit)
        # decided per node folder, from the bytes all its ranks will write: the same on every rank
        rooms = [(node, node_has_room(self._local.local_dir(), [views[r].room for r in node.ranks],
                                      self.config.local_tier_max_bytes)) for node in self._nodes] if tiered else []
        full = [f"ranks {','.join(map(str, node.ranks))}: {why}" for node, (fits, why) in rooms if not fits]
        if full and self.rank == 0:
            logger.warning("the local tier has no room for tag %s (%s); this save goes straight to %s", tag,
                           "; ".join(full), storage.url)
        local = tiered and not full
        # files not of this save's making in the folder (the user's beside an export, another tool's): not
        # found in the node folder, which a save to the local tier writes into, marked as ever
        unmarked = (foreign or (committed and replace_export)) and not local
        return _Agreement(save_id, local, committed, waited, unmarked=unmarked)

    def _check_remote_scratch(self) -> None:
        """``exact_bytes`` to an object store writes each file into ``cache_dir`` first: a folder there that
        cannot be written is refused now, not by every save in the background."""
        try:
            scratch = remote_scratch_dir(self.config.cache_dir)
            os.makedirs(scratch, exist_ok=True)
            tempfile.TemporaryFile(dir=scratch).close()
        except OSError as exc:
            raise ConfigError(f"exact_bytes=True writes each file under cache_dir ({self.config.cache_dir}) before it "
                              f"goes to {self.config.url}, and that folder cannot be written ({exc}): set cache_dir to "
                              "a local folder of your own") from None

    def _writes_synchronously(self, on_cpu: bool) -> bool:
        """``synchronous`` as configured; where it is ``None``, on for CPU training whose URL is in memory
        and has no local tier (see :class:`CheckpointConfig`). With a local tier a synchronous save would
        wait for the drain to the URL as well, so there it stays off (and wrap() warns)."""
        if self.config.synchronous is not None:
            return self.config.synchronous
        chosen = on_cpu and self._local is None and self.storage.memory_filesystem is not None
        if chosen:
            logger.info("rank %d: %s is on %s, in memory, and training runs on the CPU: each save is written while "
                        "training waits, which costs training less there than a background write "
                        "(benchmarks/RESULTS.md, 'A memory-backed target'); pass synchronous=False to write in the "
                        "background anyway", self.rank, self.storage.local_dir(), self.storage.memory_filesystem)
        return chosen

    def _warn_of_memory_filesystems(self) -> None:
        """On CPU training a background write to tmpfs takes its CPU from training, with no device to hand
        the bytes to, and costs training more than a synchronous save (benchmarks/RESULTS.md, "A
        memory-backed target"). Said at wrap() for a URL that ``synchronous=False`` writes in the
        background and for a local tier; a ``save_checkpoint`` to another folder is not checked."""
        for storage, fix in ((self.storage, "pass synchronous=True, or save to a disk"),
                             (self._local, "put local_tier on a disk")):
            if storage is not None and storage.memory_filesystem:
                logger.warning("rank %d: %s is on %s, in memory: with training on the CPU a background save there "
                               "costs training more time than a synchronous one (benchmarks/RESULTS.md, 'A "
                               "memory-backed target'); %s", self.rank, storage.local_dir(),
                               storage.memory_filesystem, fix)

    # ------------------------------------------------------------------ tiers
    def _open_local_tier(self, path: str) -> None:
        """Open the durable storage and this rank's node folder, learn which ranks share it, start the
        drainer thread."""
        def open_folders() -> None:
            self._open_durable()
            self._local = self._open(path)
            commit.add_marks_lock(self._local)

        self._gather_checked(f"to open {self.config.url} or the local tier {path}", open_folders)
        nodes = nodes_from(ranks_sharing(path, self.rank, self._gather))
        node = next(n for n in nodes if self.rank in n.ranks)
        self._nodes, self._node_ranks = nodes, node.ranks
        target = DrainTarget(local=self._local, durable=self.storage, keep_last=self.config.keep_last,
                             keep_every=self.config.keep_every, local_keep_last=self.config.local_keep_last,
                             tier_leader=node.leader == self.rank)
        self._drainer = Drainer(self.rank, self.world_size, job_store(self.world_size), target,
                                self.config.commit_timeout_s, self._record_drain_failure, nice=self.config.writer_nice,
                                on_done=self.config.on_save_done)
        if self.rank == 0:
            logger.info("local tier %s on %d node(s) (ranks sharing a folder: %s), drained to %s", path, len(nodes),
                        "; ".join(",".join(map(str, n.ranks)) for n in nodes), self.storage.url)

    def _model_states_written_by_a_lower_rank(self, storage: Storage) -> bool:
        """Whether a lower rank writes this rank's model-states file into the same folder of ``storage``
        (asked of every rank at its first save there: a collective).

        Under DeepSpeed's ``use_node_local_storage`` the first rank of every node writes
        ``mp_rank_NN_model_states.pt``. Where the nodes share the folder (NFS, a bucket) they all write
        one path, with copies that differ in a few bytes (``shared_params`` is found by data pointer),
        and the manifest lists the lowest rank's copy: only that rank may write it, or the file left
        behind may be another rank's and fail verification. (A local tier has its own rule, below.)"""
        engine = self.engine
        if self.world_size == 1 or not engine.use_node_local_storage():
            return False
        if storage.url not in self._lower_rank_writes_model_states:
            folder = storage.local_dir()
            where = ranks_sharing(folder, self.rank, self._gather)[self.rank] if folder is not None \
                else ("url", storage.url)
            mine = (where, engine._get_ckpt_name("", "tag")) if engine.save_non_zero_checkpoint else None
            gathered = self._gather(mine)  # on every rank, those that write no model states too: a collective
            self._lower_rank_writes_model_states[storage.url] = mine is not None and mine in gathered[:self.rank]
        return self._lower_rank_writes_model_states[storage.url]

    @contextlib.contextmanager
    def _model_states_writer(self, storage: Storage, local: bool) -> Iterator[None]:
        """Who writes DeepSpeed's model-states file in this save. For a save to the local tier, the first
        rank of each node writes it too (as DeepSpeed's ``use_node_local_storage`` does), so every node
        folder holds all its ranks read. Elsewhere, a rank whose file a lower rank writes into the same
        folder leaves it to that rank."""
        engine = self.engine
        writes = engine.save_non_zero_checkpoint
        if local and self._node_ranks[0] == self.rank:
            engine.save_non_zero_checkpoint = True
        elif not local and self._model_states_written_by_a_lower_rank(storage):
            engine.save_non_zero_checkpoint = False
        try:
            yield
        finally:
            engine.save_non_zero_checkpoint = writes

    def _drain_later(self, job: SaveJob, outcome: Outcome) -> None:
        """Writer thread: the save is committed on the local tier; queue its drain to the URL."""
        manifest = Manifest.from_json(outcome.manifest) if outcome.manifest else read_manifest(self._local, job.tag)
        error = None
        if manifest is None:  # this rank never learned the commit record: it must not drain (nor let commit) the tag
            error = f"rank {self.rank} does not know the files of tag {job.tag!r} (no manifest in {self._local.url})"
            manifest = Manifest(tag=job.tag, step=0, world_size=self.world_size, zero_stage=0, dtype="", files=[],
                                save_id=job.save_id)
        self._drainer.submit(DrainJob(manifest=manifest, drain_id=job.save_id, handle=job.handle,
                                      started=job.started, error=error, overwrites=job.overwrites))

    def _record_drain_failure(self, error: SaveFailedError, job: DrainJob) -> None:
        """A drain failed: retried at the next save. The first failure of a save's drain is reported (raised
        there with ``on_error="raise"``); a retry's, or a resumed drain's, is only logged, so that a tag that
        can never be drained (its files lost with a node) does not make every later save, or every later job,
        raise: a later tag that drains supersedes it."""
        self._drain_failed = True
        with self._errors_lock:
            first = (job.tag, job.manifest.save_id) not in self._drains_failed
            self._drains_failed.add((job.tag, job.manifest.save_id))
            if not first:
                self._errors.append(error)
        if first:
            self._record_failure(error)

    def _drains_to_resume(self) -> list[tuple[str, str]]:
        """Rank 0: ``(fresh drain id, manifest)`` of each tag its node folder holds committed but the URL
        does not (a drain that failed or was cut short), oldest first. A tag saved by another number of
        ranks is left out: this job's ranks do not hold all of its files, and a drain would commit at the
        URL a tag that lacks the others' shards."""
        # cleared before the listing, so that a drain failing meanwhile keeps the next save's listing due;
        # set again if the listing fails
        self._drain_failed = False
        # a save still in flight here is not undrained: its writer may have committed it on the node folder
        # and not yet handed it to the drainer, which would then drain it twice
        failed = self._drainer.failed_tags()  # recorded before their handles settle: not in flight
        in_flight = self._drainer.in_flight() | {handle.tag for handle in self._handles
                                                 if handle.url == self.storage.url and not handle.done()
                                                 and handle.tag not in failed}
        try:
            pending = undrained(self._local, self.storage, in_flight)
        except BaseException:
            self._drain_failed = True
            raise
        other_size = [m for m in pending if m.world_size != self.world_size]
        for manifest in other_size:
            logger.error("tag %s in %s was saved by %d rank(s); this job runs %d, so it cannot drain it to %s: it "
                         "stays committed in the node folders only. Resume on %d rank(s) to drain it, or load "
                         "another tag by name",
                         manifest.tag, self._local.url, manifest.world_size, self.world_size, self.storage.url,
                         manifest.world_size)
        pending = [m for m in pending if m.world_size == self.world_size]
        if pending:
            logger.warning("resuming the drain of %d tag(s) committed locally but not at %s: %s", len(pending),
                           self.storage.url, ", ".join(m.tag for m in pending))
        return [(uuid.uuid4().hex, m.to_json().decode()) for m in pending]

    def _start_drains(self, drains: list[tuple[str, str]], skip: str | None = None) -> None:
        """Drain again the tags :meth:`_drains_to_resume` found, except ``skip`` (a tag being overwritten)."""
        for drain_id, raw in drains:
            manifest = Manifest.from_json(raw)
            if manifest.tag == skip:
                logger.info("rank %d: not draining the earlier save of %s again: this save overwrites it",
                            self.rank, skip)
                continue
            with self._errors_lock:  # a tag of an earlier job, or an earlier attempt: its failure is logged
                self._drains_failed.add((manifest.tag, manifest.save_id))
            handle = SaveHandle(tag=manifest.tag, url=self.storage.url)
            handle._commit_local(SaveResult(tag=manifest.tag, url=self._local.url, bytes_written=manifest.total_bytes,
                                            stall_s=0.0, persist_s=0.0, commit_s=0.0))
            self._track(handle)
            self._drainer.submit(DrainJob(manifest=manifest, drain_id=drain_id, handle=handle))

    def _gather_checked(self, what: str, compute: Callable[[], Any]) -> list[Any]:
        """Every rank's ``compute()``, gathered. Where it raised on any rank, every rank raises after the
        collective (that rank its own error, the others a :class:`StorageError` naming it): a rank that
        raised before the collective would leave the others waiting in it until the job's timeout."""
        value, problem = None, None
        try:
            value = compute()
        except Exception as exc:  # raised below, after the collective
            problem = exc
        gathered = self._gather((value, brief(problem) if problem is not None else None,
                                 isinstance(problem, WaitTimeoutError)))
        if problem is not None:
            raise problem
        failed = [(rank, text, timed_out) for rank, (_, text, timed_out) in enumerate(gathered) if text]
        if failed:
            rank, text, timed_out = failed[0]
            # a peer's timeout is a timeout here too: code that waits longer and retries does so on every rank
            raise (WaitTimeoutError if timed_out else StorageError)(
                f"rank {rank} failed {what} ({text}); see that rank's error for the fix")
        return [v for v, _, _ in gathered]

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (one collective on the training thread, as DeepSpeed's own load does)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def _loads_universal(self) -> bool:
        return bool(self.engine.load_universal_checkpoint())

    def _refusal_of_named(self, tag: str) -> str | None:
        """Why ``load(tag=...)`` with a local tier refuses ``tag`` if the URL holds it committed as a save the
        tiers' views leave out (consolidated, or universal for an engine that does not load those): the
        refusal a load without a local tier gives, rather than "committed in no tier"."""
        try:
            manifest = read_manifest(self.storage, tag)
        except (CorruptManifestError, UnsupportedManifestError):  # the tiers' views skip it; a node's copy may load
            return None
        if manifest is None or not (manifest.consolidated or manifest.universal):
            return None
        try:
            self._check_compatible(manifest)
        except UsageError as exc:
            return str(exc)
        return None

    def _check_compatible(self, manifest: Any) -> None:
        if manifest.consolidated:
            raise UsageError(f"tag {manifest.tag!r} is a consolidated save (the whole model's weights, for inference "
                             "and export), not a ZeRO checkpoint: load() cannot resume from it. Load it with "
                             "transformers' from_pretrained (torch.load for a save_16bit_model file)")
        if manifest.universal != self._loads_universal():
            fix = ("set \"checkpoint\": {\"load_universal\": true} in the DeepSpeed config to load it" if manifest.universal
                   else "convert it with `async-ckpt to-universal`, or remove checkpoint.load_universal from the config")
            raise UsageError(f"tag {manifest.tag!r} is {'a' if manifest.universal else 'not a'} universal checkpoint "
                             f"but this engine {'does not load' if manifest.universal else 'loads'} universal "
                             f"checkpoints: {fix}")
        if manifest.universal:
            return
        stage = int(self.engine.zero_optimization_stage())
        if manifest.world_size != self.world_size or manifest.zero_stage != stage:
            raise UsageError(
                f"tag {manifest.tag!r} was saved by {manifest.world_size} rank(s) with ZeRO-{manifest.zero_stage}; "
                f"this job runs {self.world_size} rank(s) with ZeRO-{stage}. A ZeRO checkpoint loads only on the same "
                "layout: convert it with `async-ckpt to-universal` (DeepSpeed's ds_to_universal) and load it with "
                "checkpoint.load_universal")
        saved_mp, mp = model_parallel_size([f.path for f in manifest.files]), self._mp_size()
        if saved_mp != mp:  # same world size, another split into tensor/pipeline and data parallelism
            raise UsageError(
                f"tag {manifest.tag!r} was saved by {saved_mp} model-parallel (tensor x pipeline) rank(s) (its "
                f"mp_rank_NN files); this job has {mp}. A checkpoint loads only on the same layout: convert it with "
                "`async-ckpt to-universal` (DeepSpeed's ds_to_universal) and load it with checkpoint.load_universal")

    def _on_makedirs(self, path: str) -> None:
        if self._session is None:
            os.makedirs(path, exist_ok=True)  # a save outside async_ckpt (e.g. save_16bit_model)
        elif os.path.abspath(path).startswith(self._shadow):
            os.makedirs(path, exist_ok=True)  # DeepSpeed copies its recovery scripts here; we commit them

    def _on_file(self, state_dict: Any, path: str) -> None:
        if self._session is None:  # a save DeepSpeed makes outside save_checkpoint: keep it synchronous
            torch.save(state_dict, path)
            return
        session = self._session
        if session.failure is not None:  # an earlier file's snapshot failed: the save fails once DeepSpeed's ends
            return
        # save_16bit_model: the path spelled as its root was (file:// taken off, "~" expanded, made absolute)
        relpath = os.path.relpath(_normalize(path) if session.base else path,
                                  session.base or self._shadow).replace(os.sep, "/")
        name = relpath.rsplit("/", 1)[-1]
        slot_key = relpath.split("/", 1)[-1]  # the path in the tag: the same from save to save, one per file
        defer = self._overlap_copy and name.endswith("_optim_states.pt")
        compact = isinstance(state_dict, CloneRequest)
        started = time.perf_counter()
        write_in_place = self.synchronous and not compact and not session.storage.aligned_lending
        # buffers are placed where O_DIRECT can write them from, which torch's own scratch-file save does not
        placed = session.storage.aligned_lending and not self.config.exact_bytes
        try:
            staged = in_place(state_dict, relpath) if write_in_place else None
            session.files.append(staged or self._pool.snapshot(state_dict.item if compact else state_dict, relpath,
                                                               slot_key=slot_key, defer=defer, compact=compact,
                                                               offsets_of=record_offsets if placed else None))
        except Exception as exc:  # an object that cannot be copied, memory that cannot be had: see _Session
            session.failure = exc
        session.snapshot_s += time.perf_counter() - started

    def _engine_take_model_step(self, *args: Any, **kwargs: Any) -> Any:
        """Stand-in for the engine's optimizer step after wrap: wait for the overlapped copy first.
        ``engine.step()`` asks the checkpoint engine's ``get_commit_info()`` before it, which waits too;
        ``PipelineEngine.train_batch()`` steps without asking, and would change the optimizer state
        while the copy still reads it: the saved file a mix of two steps, its checksum matching."""
        self._before_optimizer_step()
        return self._own_take_model_step(*args, **kwargs)

    def _before_optimizer_step(self) -> None:
        if self._staging is not None and not self._staging.done:
            started = time.perf_counter()
            self._staging.wait()
            if self._last_job is not None:
                self._last_job.handle.metrics["step_wait_s"] = time.perf_counter() - started

    def _await_staging(self) -> None:
        if self._staging is not None:
            self._staging.wait()

    def _await_earlier_saves(self, storage: Storage, tag: str) -> tuple[float, WaitTimeoutError | None]:
        """This rank's earlier saves of ``tag`` settled (:meth:`_await_saves_of`) and the staging buffers free
        (:meth:`_await_buffers`): the seconds waited for the buffers, and the timeout that cut either wait
        short, which the caller raises on every rank after its collective."""
        try:
            waited = self._await_buffers()
            self._await_saves_of(storage, tag)
            return waited, None
        except WaitTimeoutError as exc:
            return 0.0, exc

    def _await_buffers(self) -> float:
        """The staging buffers are reused: wait until the previous save no longer reads them."""
        job = self._last_job
        if job is None or job.buffers_free.is_set():
            return 0.0
        started = time.perf_counter()
        self._bounded(job.buffers_free.wait, job.tag, "the previous save to finish writing (save() reuses its "
                      "staging buffers)", self.config.effective_wait_timeout_s, url=job.storage.url)
        waited = time.perf_counter() - started
        logger.warning("save() waited %.2f s for the previous save (%s) to finish writing; saves are more "
                       "frequent than storage can absorb", waited, job.tag)
        return waited

    def _track(self, handle: SaveHandle) -> None:
        """Keep ``handle`` until its save ends. Ended ones are let go here as well as in :meth:`wait`, so
        a run that saves without ever waiting does not hold every handle it made (a failure reaches the
        user through ``_record_failure``, not through this list)."""
        self._forget_ended_handles()
        self._handles.append(handle)

    def _forget_ended_handles(self) -> None:
        self._handles = [h for h in self._handles if not h.done()]

    def _await_saves_of(self, storage: Storage, tag: str) -> None:
        """Let this rank's earlier saves of ``tag`` settle (committed, drained to the URL, or failed)
        before a new save of it is agreed. Else the earlier save's commit, or its drain's commit at the
        URL, could land after rank 0 found the tag uncommitted, and the new save would write into a
        committed tag without uncommitting it (a crash midway would then leave that manifest over
        mixed files)."""
        deadline = time.monotonic() + self.config.effective_wait_timeout_s
        for handle in [h for h in self._handles if h.tag == tag and h.url == storage.url and not h.done()]:
            logger.info("rank %d: the save of %s waits for the earlier save of it to %s first", self.rank, tag,
                        "be durable" if self._local is not None else "commit")
            self._bounded(handle.wait, tag, "the earlier save of the same tag to commit",
                          max(0.0, deadline - time.monotonic()), url=handle.url)

    def _settle_saves_before_load(self, *, local_only: bool) -> None:
        """Before a load: every save so far committed (with ``local_only`` on its first tier: drains go on) or
        failed, and a failure raised on every rank or on none. A rank whose wait times out, or that learned of
        a failure before the others (a drain still running elsewhere), would otherwise raise alone, and the
        others wait in the load's collectives until the process group's timeout."""
        def settle() -> tuple[str | None, str] | None:
            self._await_handles(self.config.effective_wait_timeout_s, local_only=local_only)
            return self._failure_to_report()

        self._surface_errors(self._gather_checked("to wait for its saves before the load", settle))

    def _await_handles(self, timeout_s: float, *, local_only: bool = False, limit: str = "wait_timeout_s") -> None:
        """Every save so far committed (durably, or with ``local_only`` on its first tier) or failed,
        within ``timeout_s`` in all (set by ``limit``, which the timeout error names)."""
        deadline = time.monotonic() + timeout_s
        for handle in list(self._handles):
            self._bounded(handle.wait_local if local_only else handle.wait, handle.tag, "the save to commit",
                          max(0.0, deadline - time.monotonic()), limit=limit, url=handle.url)
        self._forget_ended_handles()

    def _bounded(self, done: Callable[[float], bool], tag: str, what: str, timeout_s: float, *,
                 limit: str = "wait_timeout_s", url: str | None = None) -> None:
        """Call ``done(slice)`` until it returns true; log every minute; :class:`WaitTimeoutError` after ``timeout_s``.

        A rank stuck here is usually waiting for a peer or for slow storage, so the log says which
        tag, for how long, and when the wait gives up. ``limit`` names the setting ``timeout_s`` came
        from (``wait_timeout_s``, or a call's own ``timeout``), which the error says to raise; ``url`` the
        root the save goes to (default: wrap()'s).
        """
        if not inflight.waits_here(f"a wait for {what} (tag {tag!r})"):
            return
        started = time.monotonic()
        deadline = started + timeout_s
        while not done(max(0.0, min(_PROGRESS_EVERY_S, deadline - time.monotonic()))):
            waited = time.monotonic() - started
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"rank {self.rank}: waited {waited:.0f} s for {what} (tag {tag!r} to "
                                       f"{url or self.storage.url}) and gave up. The write or its commit is stuck: "
                                       f"check the other ranks and the storage; raise {limit} if it is only slow")
            logger.warning("rank %d: still waiting for %s (tag %s) after %.0f s; giving up after %.0f s",
                           self.rank, what, tag, waited, timeout_s)

    def _engine_save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Mapping[str, Any] | None = None,
                                save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Stand-in for ``engine.save_checkpoint`` after wrap: the same call, non-blocking.

        Where DeepSpeed's semantics differ from a committed save, DeepSpeed's hold: an empty
        ``save_dir`` is its ``ValueError``, and per-rank tags (allowed by ``checkpoint.tag_validation``
        WARN or IGNORE) are saved by DeepSpeed's own engine, synchronously, and never committed.
        """
        if not save_dir:
            raise ConfigError(f"save_dir must be a non-empty string, got {save_dir!r}")
        storage = self._storage_for(os.fspath(save_dir))
        try:
            self._save(storage, None if tag is None else str(tag), client_state, save_latest,
                       exclude_frozen_parameters)
        except TagMismatchError as exc:
            logger.warning("rank %d: %s. checkpoint.tag_validation allows that, so DeepSpeed's own engine saves "
                           "this tag synchronously; async_ckpt does not commit per-rank tags", self.rank, exc)
            ours, self.engine.checkpoint_engine = self.engine.checkpoint_engine, self._previous_engine
            try:
                type(self.engine).save_checkpoint(self.engine, save_dir, tag, dict(client_state or {}),
                                                  save_latest=save_latest,
                                                  exclude_frozen_parameters=exclude_frozen_parameters)
            finally:
                self.engine.checkpoint_engine = ours
        return True

    def _engine_save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                                 exclude_frozen_parameters: bool = False) -> bool:
        """Stand-in for ``engine.save_16bit_model`` after wrap: DeepSpeed's gather and file, written later.

        DeepSpeed's own ``save_16bit_model`` runs with a session active, so the dict it hands its
        checkpoint engine on rank 0 is snapshotted instead of written; its torch.save to
        ``save_dir/save_filename`` then happens on the writer thread and commits like any save:
        tag = the folder's name, root = its parent, the manifest marked consolidated. DeepSpeed's
        semantics hold: ``False`` and nothing written under ZeRO-3 without
        ``stage3_gather_16bit_weights_on_model_save``; saving into the same folder again overwrites the
        earlier file. A folder that is a committed ZeRO checkpoint tag is refused (``TagExistsError``):
        its commit record would be replaced by the export's.
        """
        if not save_dir:
            raise ConfigError(f"save_dir must be a non-empty string, got {save_dir!r}")
        self._ensure_open()
        started = time.perf_counter()
        root, tag = _normalize(os.fspath(save_dir)).rsplit("/", 1)
        root = root or "/"  # a folder at the top of the filesystem: its parent is "/", not the working directory
        try:
            tag = validate_tag(tag)
        except InvalidTagError as exc:  # the user named a folder, not a tag
            raise InvalidTagError(f"save_16bit_model(save_dir={save_dir!r}): its last folder is committed as a tag, "
                                  f"so it must be a valid tag name: {exc}") from exc
        opened: list[Storage] = []

        def open_and_wait() -> float:
            opened.append(self._opened(root))
            return self._await_buffers()

        # before DeepSpeed's gather (collectives under ZeRO-3): a rank whose storage fails its probe, or whose
        # wait times out, raises on every rank
        waited = self._gather_checked(f"to open {root} (the export's root), or to wait for the previous save to "
                                      "free the staging buffers", open_and_wait)[self.rank]
        storage = opened[0]
        self._session = _Session(storage, base=root)
        entered = time.perf_counter()

        def snapshot() -> bool:
            saved = type(self.engine).save_16bit_model(self.engine, save_dir, save_filename,
                                                       exclude_frozen_parameters=exclude_frozen_parameters)
            if self._session.failure is not None:
                raise self._session.failure
            return saved

        try:  # DeepSpeed hands rank 0 alone the dict to save: where its snapshot fails, every rank raises
            saved = self._gather_checked("to snapshot the 16-bit model", snapshot)[self.rank]
            files, snapshot_s = self._session.files, self._session.snapshot_s
        finally:
            self._session = None
        if not saved:  # DeepSpeed declined (ZeRO-3 without gathering on save) on every rank alike
            return False
        gather_s = time.perf_counter() - entered - snapshot_s
        agreed = self._agree(storage, tag, replace_export=True)
        self._submit(storage, tag, agreed, files, CopyTicket([]), started, save_latest=False, extras_dir=None,
                     consolidated=True, metrics={"buffer_wait_s": waited, "gather_s": gather_s,
                                                 "snapshot_s": snapshot_s})
        return True

    def _storage_for(self, url: str) -> Storage:
        """The storage of ``url`` (save_dir of DeepSpeed's ``save_checkpoint``), opened on every rank: where its
        probe fails on any rank, every rank raises after one collective, rather than that rank alone before
        the save's own. wrap()'s URL needs no collective: wrap() opened it on every rank."""
        if _normalize(url) == _normalize(self.config.url):
            return self.storage
        opened: list[Storage] = []
        self._gather_checked(f"to open {url}", lambda: opened.append(self._opened(url)))
        return opened[0]

    def _opened(self, url: str) -> Storage:
        """The storage of a root other saves may share: opened and probed once (on this rank)."""
        key = _normalize(url)
        storage = self._storages.get(key)
        if storage is None:
            self._close_idle_storages()
            storage = self._storages[key] = self._open(url)
        return storage

    def _close_idle_storages(self) -> None:
        """Close and forget the storages of earlier save folders that no save in flight writes to.

        Hugging Face Trainer saves every checkpoint into a new ``checkpoint-N`` folder, so without this
        a long run would keep one storage per save open, each with its upload threads on S3."""
        self._forget_ended_handles()
        busy = {handle.url for handle in self._handles}
        for key, storage in list(self._storages.items()):
            if storage is not self.storage and storage.url not in busy:
                storage.close()
                del self._storages[key]

    def _open(self, url: str) -> Storage:
        options = self.config.storage_options if local_path(url) is None else {}
        storage = open_storage(url, options, fsync=self.config.fsync, direct_io=self.config.direct_io,
                               part_size=self.config.part_size, equal_parts=self.config.equal_parts,
                               max_concurrency=self.config.max_concurrency,
                               upload_threads=self.config.upload_threads,
                               retry=RetryPolicy(self.config.retry_attempts, self.config.retry_base_delay_s))
        storage.probe()
        return storage

    def _save_extras(self, save_id: str) -> str | None:
        """Rank 0's tokenizer and Hugging Face model config, for the commit to put in the tag folder.

        They are saved at ``save()`` time (small, and they describe this step), so that an export
        of the tag is a loadable model folder.
        """
        config = getattr(getattr(self.engine, "module", None), "config", None)
        has_config = callable(getattr(config, "save_pretrained", None))
        if self.rank != 0 or (self.tokenizer is None and not has_config):
            return None
        path = os.path.join(self._shadow, f"extras-{save_id}")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        if has_config:
            config.save_pretrained(path)
        return path

    def _metadata(self) -> dict[str, Any]:
        engine = self.engine
        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        return {
            "step": int(engine.global_steps),
            "zero_stage": int(engine.zero_optimization_stage()),
            "dtype": dtype,
            "versions": {"async_ckpt": _version, "deepspeed": deepspeed.__version__, "torch": torch.__version__},
        }

    def _dp_rank(self, load_optimizer_states: bool = True) -> int | None:
        """The data-parallel rank whose shards this rank reads on load; ``None`` (every rank's) under ZeRO's
        ``elastic_checkpoint``, with which DeepSpeed reads every rank's optimizer shard on every rank, and
        where :meth:`_weights_from_every_shard`."""
        if self.engine.zero_elastic_checkpoint() or self._weights_from_every_shard(load_optimizer_states):
            return None
        group = getattr(self.engine.optimizer, "dp_process_group", None)
        return dist.get_rank(group=group) if dist.is_initialized() else 0

    def _weights_from_every_shard(self, load_optimizer_states: bool) -> bool:
        """A ZeRO-3 load without optimizer states (not of a universal tag, without MoE layers): DeepSpeed
        rebuilds the weights from every data-parallel rank's shards, with zero_to_fp32."""
        engine = self.engine
        return (bool(engine.zero_optimization_partition_weights()) and not load_optimizer_states
                and not getattr(engine, "has_moe_layers", False) and not self._loads_universal())

    def _mp_rank(self) -> int:
        """This rank's model-parallel (tensor x pipeline) rank: the ``mp_rank_NN`` of its files."""
        return int(getattr(self.engine, "checkpoint_mp_rank", 0) or 0)

    def _mp_size(self) -> int:
        return int(getattr(self.engine, "mp_world_size", 1) or 1)

    # ------------------------------------------------------------------ errors and lifecycle
    def _record_failure(self, error: SaveFailedError) -> None:
        with self._errors_lock:
            self._errors.append(error)
            if error.tag in self._raised_for_peers:  # raised already, when another rank reported it
                self._raised_for_peers.discard(error.tag)
            else:
                self._unreported.append(error)

    def _failure_to_report(self) -> tuple[str | None, str] | None:
        """``(tag, message)`` of the failure :meth:`_surface_errors` would raise on this rank, for the others."""
        if self.config.on_error != "raise":
            return None
        with self._errors_lock:
            return (self._unreported[0].tag, str(self._unreported[0])) if self._unreported else None

    def _surface_errors(self, reported: list[tuple[str | None, str] | None] | None = None) -> None:
        """Raise (``on_error="raise"``) or log the failures this rank has not reported yet. ``reported``:
        what every rank would raise, gathered in a collective, so that all raise together; where no rank
        had one then, a failure recorded since waits for the next check (raising it now would raise on
        this rank alone)."""
        with self._errors_lock:
            peer = next((r for r in reported or [] if r is not None), None)
            if reported is not None and peer is None and self.config.on_error == "raise":
                return
            pending, self._unreported = self._unreported, []
            if not pending and peer is not None:
                self._raised_for_peers.add(peer[0])
        if self.config.on_error == "raise" and (pending or peer is not None):
            if len(pending) > 1:  # one raised, for all: the others are named on it, not lost
                pending[0].add_note(f"{len(pending) - 1} later save(s) failed too, of tag(s) "
                                    f"{[error.tag for error in pending[1:]]}; every failure is in failures")
            raise pending[0] if pending else SaveFailedError(peer[1], tag=peer[0])
        for error in pending:
            logger.warning("an earlier background save failed (training continues, on_error='warn'): %s", error)

    def _on_engine_destroy(self) -> None:
        if not self._closed:
            self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError("this checkpointer is closed; create a new one with async_ckpt.wrap(engine, url)")


def _is_consolidated(storage: Storage, tag: str) -> bool:
    try:
        manifest = read_manifest(storage, tag)
    except CorruptManifestError:
        return False
    return manifest is not None and manifest.consolidated


def wrap(engine: Any, url: str | os.PathLike[str], *, tokenizer: Any = None, keep_last: int | None = None,
         storage_options: Mapping[str, Any] | None = None, on_error: OnError = "warn",
         **options: Any) -> AsyncCheckpointer:
    """Make a DeepSpeed engine's checkpoint saves non-blocking, writing to ``url``.

    Args:
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        url: local/NFS path or fsspec URL (``s3://bucket/run1``) of the checkpoint root.
        tokenizer: anything with ``save_pretrained(dir)``; saved into each committed tag folder.
        keep_last: keep only the newest N committed tags.
        storage_options: passed to fsspec (endpoint, region, credentials...).
        on_error: ``"warn"`` (log and keep training) or ``"raise"`` (also raise at the next save/wait).
        **options: any other :class:`CheckpointConfig` field (``overlap_copy``, ``part_size``...).

    The destination is probed (a tiny write and delete) before this returns, so a wrong URL or
    credentials fail here rather than minutes later in the background.
    """
    try:
        config = CheckpointConfig(url=url, keep_last=keep_last, storage_options=storage_options or {},
                                  on_error=on_error, **options)
    except TypeError as exc:
        raise UsageError(f"wrap(): {exc}; see async_ckpt.CheckpointConfig for the options") from exc
    return AsyncCheckpointer(engine, config, tokenizer=tokenizer)
