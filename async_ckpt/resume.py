"""Resume: pick a committed tag and put the files this rank needs where DeepSpeed can read them.

DeepSpeed's ``load_checkpoint`` discovers files with local ``glob``/``os.path.exists``, so it can
only read a local folder. Local and NFS roots are read in place; any other storage is fetched
into a cache folder first: only the files this rank reads, verified against the manifest, and
skipped when a verified copy is already cached.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import shutil
import time

from async_ckpt.catalog import inspect_latest, list_tags, newest_mtime, read_manifest, refuse_unsupported_latest
from async_ckpt.config import default_cache_dir
from async_ckpt.errors import (CheckpointNotFoundError, ConfigError, InvalidTagError, NotCommittedError,
                               VerificationError)
from async_ckpt.layout import LATEST, LATEST_UNIVERSAL, files_for_rank, validate_tag
from async_ckpt.manifest import Manifest, earlier_in_run
from async_ckpt.pull import PullReport, download, files_of_another_save
from async_ckpt.verify import check_stored_file
from async_ckpt.storage.base import Storage
from async_ckpt.storage.local import LocalStorage

logger = logging.getLogger("async_ckpt")


def resolve(storage: Storage, tag: str | None, *, universal: bool = False) -> Manifest:
    """The manifest of ``tag``, refusing uncommitted and corrupt tags.

    With ``tag=None``, the rule (each choice is logged when it is not simply ``latest``):

    - the tag ``latest`` names, if it is committed and no newer committed tag was saved to move
      ``latest`` (a newer one means the job stopped between that tag's manifest and its ``latest``
      write: ``latest`` is stale, and the newer tag is taken). Tags saved with
      ``save_latest=False`` never make ``latest`` stale: they are resumed only when named;
    - if ``latest`` is missing, unreadable or names a tag that is gone, uncommitted or corrupt: the
      newest committed tag that moved ``latest`` (else the newest committed tag);
    - tags whose manifest cannot be read are skipped with a warning naming them, unless ``latest`` names
      one in another async_ckpt version's format: :class:`UnsupportedManifestError`, not an older tag;
    - consolidated tags (whole-model weights, not a ZeRO checkpoint) are never chosen.

    With ``universal``, the same among universal tags, by ``latest_universal``.
    """
    if tag is not None:
        if tag in (LATEST, LATEST_UNIVERSAL):
            raise InvalidTagError(f"{tag!r} is the file that names a tag, not a tag: leave the tag out (no --tag, "
                                  f"tag=None) to use the tag it names")
        tag = validate_tag(tag)
        manifest = read_manifest(storage, tag)
        if manifest is not None:
            return manifest
        if storage.list_dir(tag):
            raise NotCommittedError(
                f"tag {tag!r} at {storage.url} was never committed (no manifest): its save did not finish "
                "on every rank, so its data may be incomplete. Load another tag")
        known = [t.tag for t in list_tags(storage) if t.committed]
        raise CheckpointNotFoundError(f"tag {tag!r} not found at {storage.url}; committed tags: {known or 'none'}")
    latest_name = LATEST_UNIVERSAL if universal else LATEST
    latest, unreadable = inspect_latest(storage, latest_name)
    infos = list_tags(storage)
    refuse_unsupported_latest(storage, latest_name)
    for info in infos:
        if info.error:
            logger.warning("skipping %s tag %s: %s%s", info.state, info.tag, info.error,
                           "" if info.unsupported else " (`async-ckpt gc` removes it after the grace period)")
    committed = [t.manifest for t in infos if t.is_checkpoint(universal=universal)]
    moved_latest = [m for m in committed if m.sets_latest]
    newest = moved_latest[-1] if moved_latest else committed[-1] if committed else None
    named = next((m for m in committed if m.tag == latest), None)
    if named is not None and (newest is None or newest.tag == named.tag or newest.recency <= named.recency):
        return named
    if newest is None:
        kind = "universal checkpoint" if universal else "checkpoint"
        why = (f"{latest_name!r} cannot be read ({unreadable})" if unreadable else
               f"there is no {latest_name!r} file" if latest is None else
               f"{latest_name!r} names {latest!r}, which is not committed")
        other = [t.tag for t in infos if t.committed and t.manifest.universal != universal]
        hint = (" or convert a checkpoint with `async-ckpt to-universal`" if universal else "")
        if other:  # the URL is right: it holds the other kind only, which is named by tag
            hint = (f"; it holds {'ZeRO' if universal else 'universal'} checkpoint(s) only: "
                    f"{', '.join(other[-3:])}. Name one by tag (--tag)")
        raise CheckpointNotFoundError(f"no committed {kind} at {storage.url}: {why}"
                                      + (hint if other else f". Check the URL{hint}"))
    if unreadable:
        why = f"{latest_name!r} cannot be read ({unreadable})"
    elif latest is None:
        why = f"{latest_name!r} is missing"
    elif named is None:
        why = f"{latest_name!r} names {latest!r}, which is missing, corrupt or was never committed"
    else:
        why = (f"{latest_name!r} names {latest!r} (step {named.step}) but a newer tag is committed (the job stopped "
               "before writing 'latest')")
    logger.warning("resuming from %s (step %d), the newest committed tag at %s: %s", newest.tag, newest.step,
                   storage.url, why)
    return newest


def older_committed(storage: Storage, manifest: Manifest) -> Manifest | None:
    """The newest committed tag saved before ``manifest`` at no higher step (for falling back after a
    failed check): after a rollback, the live run's earlier saves, never the abandoned later steps."""
    older = [t.manifest for t in list_tags(storage) if t.is_checkpoint(universal=manifest.universal)
             and t.tag != manifest.tag and earlier_in_run(t.manifest.recency, manifest.recency)]
    return older[-1] if older else None


def check_for_rank(storage: Storage, manifest: Manifest, dp_rank: int | None, mp_rank: int | None = None) -> None:
    """Verify size and CRC-32 of the files ``dp_rank`` will read; raise naming the first bad one."""
    for path in rank_files(manifest, dp_rank, mp_rank):
        check = check_stored_file(storage, manifest.tag, manifest.entry(path))
        if not check.ok:
            raise VerificationError(f"{storage.url}/{manifest.tag}/{path}: {check.problem} (expected size "
                                    f"{check.expected_size}, crc32 {check.expected_crc32}; found size "
                                    f"{check.actual_size}, crc32 {check.actual_crc32}). The file is corrupt or "
                                    "truncated")


def check_no_other_save(root: str, manifest: Manifest, dp_rank: int | None) -> None:
    """The tag folder read in place must hold no DeepSpeed file its manifest does not list (of an earlier
    save of the tag, in another layout) that this load globs for, and would read with this save's: the
    model-states files (``mp_rank_*_model_states.pt``, under ZeRO-3 this rank's of every model-parallel
    rank, and a pipeline's layer files, on every load), and where a load reads every rank's
    shards (``dp_rank`` None: ``elastic_checkpoint``, a ZeRO-3 load without optimizer states) every shard.
    A load of this rank's own optimizer shard reads it by name."""
    if manifest.universal:
        return
    others = files_of_another_save(os.path.join(root, manifest.tag), [f.path for f in manifest.files])
    if dp_rank is not None:  # the globs of DeepSpeed's _get_all_ckpt_names (its _get_ckpt_name, any mp rank) and
        # of a pipeline module's ckpt_layer_path_list
        globbed = (f"zero_pp_rank_{dp_rank}_mp_rank_*_model_states.pt" if manifest.zero_stage == 3
                   else "mp_rank_*_model_states.pt", "layer_*-*model_states.pt")
        others = [p for p in others if "/" not in p and any(fnmatch.fnmatch(p, g) for g in globbed)]
    if others:
        raise VerificationError(f"{root}/{manifest.tag} holds DeepSpeed shards its manifest does not list "
                                f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): another save's, which "
                                "DeepSpeed's loaders would read with this one's. Move them away, or load another tag")


def rank_files(manifest: Manifest, dp_rank: int | None, mp_rank: int | None = None) -> list[str]:
    """The files of a tag that a rank (``dp_rank``, and ``mp_rank`` under tensor/pipeline parallelism)
    reads when loading it: its share (see :func:`files_for_rank`), or all of a universal tag."""
    paths = [f.path for f in manifest.files]
    if manifest.universal:
        return [p for p in paths if p.endswith(".pt")]
    return files_for_rank(paths, dp_rank, mp_rank)


_SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")  # as async_ckpt makes them (uuid4 hex); anything else is hashed


def cache_root(cache_dir: str, url: str, manifest: Manifest) -> str:
    """A cache folder per storage URL and save, loaded as a checkpoint root.

    Per URL, so that two runs never share (or clobber) cached files. Per save, so that a tag saved again
    (``overwrite_tags``, or a new run reusing the URL's tag names) never finds the files of its earlier
    save beside its own: DeepSpeed's loaders glob the tag folder (``mp_rank_*_model_states.pt``,
    ``layer_*``) and would merge whatever they find there, files this save does not have included.
    """
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    save = manifest.save_id if _SAVE_ID.fullmatch(manifest.save_id or "") else hashlib.sha256(
        f"{manifest.tag}\0{manifest.created_unix}\0{manifest.save_id}".encode()).hexdigest()[:32]
    return os.path.join(cache_dir, digest, save)


def owned_cache_dir(cache_dir: str) -> str:
    """``cache_dir``, made (readable by this user only) where missing. The default folder
    (:func:`~async_ckpt.config.default_cache_dir`) is refused (:class:`ConfigError`) where another user owns
    it or others may write into it; a folder the user chose is taken as it is (a team's shared cache, say).

    Why: the default lies in the shared temporary folder under a name anyone can predict. Another user who
    made it first could read the cached shards, or put a file there whose size and CRC-32 match the
    manifest's (CRC-32 is no signature), which ``torch.load`` would then unpickle in this job."""
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    if cache_dir == default_cache_dir() and hasattr(os, "getuid"):
        status = os.stat(cache_dir)
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            raise ConfigError(f"the default resume cache {cache_dir} belongs to another user or others may write "
                              "into it: a file put there would be loaded as the checkpoint's. Set cache_dir to a "
                              "folder of your own (or remove that one)")
    return cache_dir


def fetch_for_rank(storage: Storage, manifest: Manifest, dp_rank: int | None, cache_dir: str,
                   max_concurrency: int, mp_rank: int | None = None) -> tuple[str, PullReport]:
    """Fetch what ``dp_rank`` needs of ``manifest`` into the cache; return the folder to load from."""
    local = storage.local_dir()
    if local is not None:
        check_no_other_save(local, manifest, dp_rank)
        return local, PullReport(tag=manifest.tag, dest=local)
    root = cache_root(owned_cache_dir(cache_dir), storage.url, manifest)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, _IN_USE), "w"):  # in use from now: loads of other saves leave it (prune_cache)
        pass
    wanted = [manifest.entry(p) for p in rank_files(manifest, dp_rank, mp_rank)]
    report = download(storage, manifest, wanted, os.path.join(root, manifest.tag),
                      max_concurrency=max_concurrency, resumable=False)
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write(manifest.tag)
    logger.info("data-parallel rank %s fetched %d file(s), %.3f GB of tag %s (%d already cached) in %.2f s",
                "(every shard)" if dp_rank is None else dp_rank, report.files_fetched, report.bytes_fetched / 1e9,
                manifest.tag, report.files_skipped, report.seconds)
    return root, report


#: How long a save cached for a URL stays after its last use began (a fetch, or a check of what is cached)
#: or anything in it changed, whatever loads of other saves of that URL do: longer than any fetch and
#: DeepSpeed load of it that another job or rank may be running.
CACHE_GRACE_S = 3600.0
_IN_USE = ".in-use"  # in a cached save's folder: touched as each load of it begins


def prune_cache(loaded: str, grace_s: float = CACHE_GRACE_S) -> list[str]:
    """After a load from ``loaded`` (a folder :func:`cache_root` made), remove the saves cached for its URL
    other than it that no load used and nothing changed in for ``grace_s``, and the partial files in it
    that killed fetches left as long ago; return the folders removed.
    A failure to remove is logged, never raised: the load it follows succeeded.

    Why: each resume from object storage fetches the save it loads into a folder of its own, so without
    this the cache grows by this rank's share of a checkpoint at every restart until the disk is full.
    A URL never loaded from again keeps its last save cached."""
    parent, cutoff, removed = os.path.dirname(loaded), time.time() - grace_s, []
    _remove_killed_fetches(loaded, cutoff)
    try:
        folder = LocalStorage(parent)
        for name in sorted(os.listdir(parent)):
            path = os.path.join(parent, name)
            if name == os.path.basename(loaded) or not os.path.isdir(path) or newest_mtime(folder, name) >= cutoff:
                continue
            shutil.rmtree(path, ignore_errors=True)  # the other ranks sharing the cache remove it too
            if os.path.exists(path):
                logger.warning("could not remove %s, an earlier save of this URL, from the resume cache; it stays "
                               "until a later load removes it", path)
            else:
                removed.append(path)
    except OSError as exc:  # the listing or a file's time: the cache's folder gone or unreadable
        logger.warning("could not look for earlier saves of this URL in the resume cache %s (%s)", parent, exc)
    if removed:
        logger.info("removed %d earlier save(s) of this URL from the resume cache %s", len(removed), parent)
    return removed


def _remove_killed_fetches(loaded: str, cutoff: float) -> None:
    """The partial files (and their part journals) that fetches killed mid-file left in the loaded save's
    folder, unchanged since ``cutoff``: each fetch into the cache writes under a name of its own, which no
    later fetch resumes, so a job killed while fetching a shard leaves up to a shard's size behind."""
    for folder, _, names in os.walk(loaded):
        for name in names:
            path = os.path.join(folder, name)
            try:
                if name.endswith((".partial", ".partial.parts")) and os.stat(path).st_mtime < cutoff:
                    os.unlink(path)
                    logger.info("removed %s, left in the resume cache by a fetch that was killed", path)
            except OSError as exc:  # removed meanwhile by another rank sharing the cache, or not ours to remove
                logger.debug("could not remove %s from the resume cache: %s", path, exc)
