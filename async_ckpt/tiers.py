"""Tiered checkpoints: a fast node-local tier first, the durable URL second, restart from the nearest.

With ``wrap(engine, url, local_tier=PATH)`` a save is written and committed on ``PATH`` (NVMe or
``/dev/shm`` of each node), which takes seconds, and then drained to ``url`` (S3, NFS, any fsspec URL)
by each rank's drainer thread (:mod:`async_ckpt.drain`) with a commit of its own. Each tier has its
own manifest, ``latest`` and retention.

No shared filesystem is needed. ``PATH`` may be a different folder on every node (or, on one
machine, per simulated node): the ranks that see the same folder form a *node*, found once at
``wrap()`` by the files each rank leaves there and finds there (:func:`ranks_sharing`). The
commit agreement goes through the job's c10d store as always (:mod:`async_ckpt.handshake`); rank 0
publishes the manifest with its outcome and the first rank of every other node writes it into that
node's folder. So that a node's folder holds every file its ranks read on a restart, the first rank of
each node also writes DeepSpeed's model-states file there, as DeepSpeed's own
``use_node_local_storage`` does; the manifest lists that path once and the drain uploads rank 0's copy.

Restart (:func:`choose_tag`): the newest tag that every rank can read from some tier: committed at
the durable URL, or committed in every node's folder from one save (:func:`readable_saves`). Each
rank then reads that save from the nearest tier that holds it with its files intact (verified),
never another save of the tag, and logs which tier it used.

Retention: ``local_keep_last`` tags stay in a node's folder; an older one is deleted once its drain
committed it at the URL (the same save), or once the URL's own ``keep_last`` no longer keeps it there
(:func:`prune_local`), never while a save is being written into its folder. ``keep_last`` applies to
the URL as without tiers. A load pauses the retention that drains run (a node's, and ``keep_last``
at the URL) until the next save (:meth:`~async_ckpt.drain.Drainer.pause_retention`), so that a drain
ending meanwhile deletes no tag a rank may still read; later drains make the deletions it skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection, ContextManager

from async_ckpt.catalog import TagInfo, has_start_mark, holds_files, list_tags, read_latest, read_manifest
from async_ckpt.commit import always_allowed, delete_tag, no_new_marks
from async_ckpt.manifest import Manifest, earlier_in_run
from async_ckpt.storage.base import PROBE_PREFIX, Storage

logger = logging.getLogger("async_ckpt")

#: A local save needs this much more free space than the previous save's bytes (or the estimate).
SPACE_MARGIN = 1.1


@dataclass(frozen=True)
class Node:
    """The ranks that share one local-tier folder."""

    index: int
    ranks: tuple[int, ...]

    @property
    def leader(self) -> int:
        """The rank that writes the manifest, ``latest`` and the model states into the node's folder."""
        return self.ranks[0]


def ranks_sharing(path: str, rank: int, gather: Callable[[Any], list[Any]]) -> list[tuple[int, ...]]:
    """Every rank's view of the ranks that see its folder ``path`` as the same folder (two collectives,
    ``gather`` gathering one value per rank). Each rank leaves a file of its own there; the ranks whose
    files a rank finds share its folder. Neither the host name nor the folder's device and inode say so:
    an NFS folder is one folder on many hosts (with a device number of each client's), and one host's
    containers may have host names of their own over one shared host path."""
    os.makedirs(path, exist_ok=True)
    name = f"{PROBE_PREFIX}rank{rank}-{uuid.uuid4().hex}"  # a killed rank's is gc's, as wrap()'s probe is
    mark: str | None = os.path.join(path, name)
    try:
        with open(mark, "xb"):
            pass
    except OSError as exc:  # the folder's probe has passed: rare; this rank then sees only itself
        logger.warning("rank %d: cannot leave a mark in %s to find the ranks sharing it (%s)", rank, path, exc)
        mark = None
    try:
        names = gather(name if mark else None)
        seen = tuple(r for r, other in enumerate(names)
                     if r == rank or (other is not None and os.path.exists(os.path.join(path, other))))
        return gather(seen)  # after every rank has looked: then the marks may go
    finally:
        if mark is not None:
            with contextlib.suppress(OSError):
                os.unlink(mark)


def nodes_from(views: list[tuple[int, ...]]) -> list[Node]:
    """Group ranks by the folder they see (``views[r]``: the ranks rank r finds in its folder, from
    :func:`ranks_sharing`); nodes ordered by first rank."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, view in enumerate(views):
        groups.setdefault(tuple(view), []).append(rank)
    return [Node(i, tuple(ranks)) for i, ranks in enumerate(sorted(groups.values()))]


def tier_bytes(root: str) -> int:
    """Bytes of every file under ``root`` (what the local tier holds now)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


@dataclass(frozen=True)
class TierRoom:
    """What one rank brings to the save's collective about its node folder: the bytes it will write there,
    and what it found there (free bytes; with a quota, the bytes the folder holds; or why it could not
    look). The ranks of a node share the folder, so whether a save fits is decided per node, on every
    rank alike, from all of them (:func:`node_has_room`)."""

    needed: int
    free: int = 0
    held: int | None = None
    error: str | None = None


def tier_room(root: str, needed: int, max_bytes: int | None) -> TierRoom:
    """This rank's :class:`TierRoom` for ``needed`` bytes in the node folder ``root``. Never raises: it
    runs on each rank before the save's collective, where a raise on one node would leave the others
    waiting in it; a folder that cannot be checked (gone, an I/O error) has no room."""
    try:
        free = shutil.disk_usage(root).free
    except OSError as exc:
        return TierRoom(needed, error=f"cannot check the room in {root} ({type(exc).__name__}: {exc})")
    return TierRoom(needed, free, tier_bytes(root) if max_bytes is not None else None)


def node_has_room(root: str, rooms: list[TierRoom], max_bytes: int | None) -> tuple[bool, str]:
    """Whether the bytes every rank of one node will write (``rooms``, one per rank of the node; with a
    margin) fit in its folder ``root``: free disk space and the ``local_tier_max_bytes`` quota, which
    bound the folder, not a rank. Returns ``(fits, why not)``."""
    problems = [room.error for room in rooms if room.error]
    if problems:
        return False, problems[0]
    wanted = int(sum(room.needed for room in rooms) * SPACE_MARGIN)
    free = min(room.free for room in rooms)
    ranks = f"{len(rooms)} rank(s)" if len(rooms) > 1 else "one rank"
    if free < wanted:
        return False, f"{free / 1e9:.2f} GB free on {root}, about {wanted / 1e9:.2f} GB needed by its {ranks}"
    held = max((room.held for room in rooms if room.held is not None), default=None)
    if max_bytes is not None and held is not None and held + wanted > max_bytes:
        return False, (f"{root} holds {held / 1e9:.2f} GB; another {wanted / 1e9:.2f} GB for its {ranks} would "
                       f"exceed local_tier_max_bytes={max_bytes}")
    return True, ""


def committed_view(storage: Storage) -> dict[str, tuple[int, float, bool, str]]:
    """``tag -> (step, created, sets_latest, save_id)`` of the resumable tags committed in ``storage``
    (not universal, not consolidated); a tag whose manifest cannot be read is skipped with a warning
    naming it, as a load without a local tier skips it."""
    tags = list_tags(storage)
    for info in tags:
        if info.error is not None:
            logger.warning("skipping %s tag %s at %s: %s", info.state, info.tag, storage.url, info.error)
    return {info.tag: (info.manifest.step, info.manifest.created_unix, info.manifest.sets_latest,
                       info.manifest.save_id)
            for info in tags if info.is_checkpoint()}


def _recency(view: tuple[int, float, bool, str]) -> tuple[float, int]:
    """A committed view's order among saves, as :attr:`~async_ckpt.manifest.Manifest.recency`."""
    return view[1], view[0]


def readable_saves(local_views: list[dict[str, Any]], durable_view: dict[str, Any]) -> dict[str, Any]:
    """``tag -> view`` of the save of each tag that every rank can read: the one committed at the URL,
    or the one every node holds committed (one save on every node), the newer where there are both.

    A node folder can hold another save of a tag than the URL: an older one, where an
    ``overwrite_tags`` save went straight to the URL (its local tier was full) and rank 0 cannot see
    other nodes' folders to uncommit them; or a newer one, where the drain of an earlier save of the
    tag committed at the URL after the overwrite began. Reading one rank's files from one save and
    another's from the other would mix two checkpoints, so a restart reads one save only.
    """
    shared = set.intersection(*(set(v) for v in local_views)) if local_views else set()
    on_nodes = {t: local_views[0][t] for t in shared if len({v[t][3] for v in local_views}) == 1}
    readable = dict(durable_view)
    for t, view in on_nodes.items():
        if t not in readable or _recency(view) > _recency(readable[t]):
            readable[t] = view
    return readable


def holds_chosen_save(tag: str, local_view: dict[str, Any], local_views: list[dict[str, Any]],
                      durable_view: dict[str, Any]) -> tuple[bool, bool]:
    """Whether this node's folder (``local_view``) and the URL hold the save of ``tag`` that
    :func:`readable_saves` gives: the tiers a rank may read it from."""
    chosen = readable_saves(local_views, durable_view).get(tag)
    if chosen is None:
        return False, False
    return (tag in local_view and local_view[tag][3] == chosen[3],
            tag in durable_view and durable_view[tag][3] == chosen[3])


def choose_tag(tag: str | None, local_views: list[dict[str, Any]], durable_view: dict[str, Any], *,
               older_than: str | None = None) -> tuple[str | None, str]:
    """The tag every rank can read from some tier (:func:`readable_saves`): ``tag`` if given, else the
    newest such tag.

    ``local_views[r]`` is what rank r's node folder holds committed (``tag -> (step, created,
    sets_latest, save_id)``). Tags saved with ``save_latest=False`` are taken only when named, as
    without tiers. ``older_than`` (a tag that could not be read, for ``load(fallback=True)``): instead,
    the newest such tag committed before it at no higher step, whether or not it moved ``latest``, as
    :func:`~async_ckpt.resume.older_committed` chooses without tiers. Returns ``(tag, None-or-why
    not)``; the tag is ``None`` when there is none.
    """
    readable = readable_saves(local_views, durable_view)
    if older_than is not None:
        limit = _recency(readable[older_than])
        older = sorted((*_recency(v), t) for t, v in readable.items() if earlier_in_run(_recency(v), limit))
        return (older[-1][2], "") if older else (None, f"no tag older than {older_than!r} can be read by every rank")
    if tag is not None:
        if tag in readable:
            return tag, ""
        holders = [r for r, v in enumerate(local_views) if tag in v]
        if holders and len(holders) == len(local_views):
            return None, (f"tag {tag!r} is not committed at the durable URL, and the nodes' local tiers hold "
                          "different saves of it (an overwrite that did not reach every node)")
        return None, (f"tag {tag!r} is not committed at the durable URL, and only rank(s) {holders} hold it "
                      "committed in their node's local tier" if holders else
                      f"tag {tag!r} is committed in no tier")
    candidates = sorted(((*_recency(v), t) for t, v in readable.items() if v[2]), reverse=True)
    if not candidates:
        return None, "no tag is committed at the durable URL or in every node's local tier"
    return candidates[0][2], ""


def prune_local(local: Storage, durable: Storage, keep: int, *, url_keep_last: int | None = None,
                url_keep_every: int | None = None, in_flight: Collection[str] = (),
                allowed: Callable[[], ContextManager[bool]] = always_allowed) -> list[str]:
    """Delete a node folder's oldest tags beyond ``keep`` that the durable tier holds committed from the
    same save, and any tag it holds from a later save: a copy an overwrite left on this node, which
    restarts never read (:func:`readable_saves`) and which would fill the folder. Never the tag
    ``latest`` names, never a tag being drained (``in_flight``).

    Never the only copy of a save either, unless the URL's own retention (``url_keep_last``,
    ``url_keep_every``: the job's ``keep_last``, ``keep_every``) would not keep it there: a tag beyond
    ``keep`` that the URL lacks while holding ``url_keep_last`` newer ones. Else, with ``keep_last`` no
    larger than ``local_keep_last``, each tag the URL's retention deleted first stayed on the node for good.
    Such a tag is left alone while the URL holds any file of it (uncommitted there by an overwrite that has
    begun: rank 0 marks it first). No tag is deleted whose node folder holds a start mark of another save
    than its committed one: an overwrite's first write, while the folders of nodes other than rank 0's stay
    committed until their own commit. A mark waits while the check and the deletion run (:func:`no_new_marks`).

    Each deletion runs inside ``allowed()``, and only where it yields true; where it yields false the
    pass ends there (a load reads the folder: the next pass deletes what this one left)."""
    committed = [info for info in list_tags(local) if info.is_checkpoint()]
    latest = read_latest(local)
    deleted = []
    url_recencies: list[tuple[float, int]] | None = None  # listed once, where a tag is missing at the URL
    for index, info in enumerate(committed):
        if info.tag == latest or info.tag in in_flight:
            continue
        try:
            durable_manifest = read_manifest(durable, info.tag)
        except Exception as exc:  # a corrupt or unreadable durable copy is no copy
            logger.debug("local retention keeps %s: its durable manifest cannot be read (%s)", info.tag, exc)
            continue
        beyond_keep = index < len(committed) - keep
        if durable_manifest is None:
            if not beyond_keep or not url_keep_last or (url_keep_every and info.manifest.step % url_keep_every == 0):
                continue
            if url_recencies is None:
                url_recencies = [_recency(view) for view in committed_view(durable).values()]
            if sum(recency > info.manifest.recency for recency in url_recencies) < url_keep_last:
                continue
            if holds_files(durable, info.tag):  # uncommitted at the URL, not deleted: an overwrite under way
                continue
            why = f"{durable.url} keeps {url_keep_last} newer tags and not this one (keep_last={url_keep_last})"
        elif durable_manifest.save_id == info.manifest.save_id:
            if not beyond_keep:
                continue
            why = f"durable at {durable.url}; local_keep_last={keep}"
        elif durable_manifest.recency > info.manifest.recency:
            why = f"{durable.url} holds a later save of it"
        else:
            continue
        with allowed() as may_delete:
            if not may_delete:
                logger.info("local retention: leaving %s in %s while a load may read it (%s); a later drain "
                            "deletes it", info.tag, local.url, why)
                break
            with no_new_marks(local):
                if _overwritten_since(local, info):
                    logger.info("local retention: leaving %s in %s: a save is being written into it", info.tag,
                                local.url)
                    continue
                logger.info("local retention: deleting %s from %s (%s)", info.tag, local.url, why)
                delete_tag(local, info.tag)
        deleted.append(info.tag)
    return deleted


def _overwritten_since(local: Storage, info: TagInfo) -> bool:
    """Whether a save other than the one ``info`` listed has begun in the folder (its start mark: an
    overwrite's first write) or committed there since (its manifest; ``latest`` may now name it): the
    pass listed the folder before it took the marks lock. Last before a deletion: the least time to go."""
    if has_start_mark(local, info.tag, other_than=info.manifest.save_id):
        return True
    try:
        now = read_manifest(local, info.tag)
    except Exception:  # unreadable now: something wrote it since the listing
        return True
    return now is None or now.save_id != info.manifest.save_id or read_latest(local) == info.tag


def undrained(local: Storage, durable: Storage, in_flight: set[str]) -> list[Manifest]:
    """Tags committed in this node's folder but not at the URL, newer than the URL's newest committed tag
    and not being drained now: what a drain that was cut short (a crash, a failure) left behind.
    Oldest first, so that draining them in order moves the durable ``latest`` forward only."""
    durable_tags = committed_view(durable)
    newest = max((_recency(view) for view in durable_tags.values()), default=None)
    pending = []
    for info in list_tags(local):
        manifest = info.manifest
        if manifest is None or manifest.universal or manifest.consolidated or info.tag in in_flight:
            continue
        if info.tag in durable_tags and durable_tags[info.tag][3] == manifest.save_id:
            continue
        if newest is not None and manifest.recency <= newest:
            continue
        pending.append(manifest)
    return sorted(pending, key=lambda m: m.recency)


def estimate_save_bytes(engine: Any, world_size: int, previous: int) -> int:
    """This rank's bytes in one save: the previous save's, else an estimate from the model (mixed-precision
    Adam holds about 16 bytes per parameter: weights, fp32 master copy and two moments) over the ranks."""
    if previous:
        return previous
    # ZeRO-3 frees a partitioned parameter to an empty tensor: its size is in ds_numel
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    return 16 * params // max(world_size, 1)


def log_tier(rank: int, tag: str, tier: str, where: str, why: str = "") -> None:
    logger.info("rank %d resumes %s from the %s tier %s%s", rank, tag, tier, where, f" ({why})" if why else "")

