"""The manifest: the commit record of one tag.

A tag is committed exactly when its manifest exists. It lists every file of the tag with size
and CRC-32, so a load can verify what it reads and a crashed save can be told apart from a good
one without trusting ``latest``.

Versions share roots (a job, and the CLI of an older install on a login node), so a manifest an
older version cannot read must not look corrupt to it: gc deletes corrupt tags. A field a later
version adds keeps the format when older readers may ignore it (they do); any other change is a
new ``async_ckpt/N``, which an older reader reports as :class:`UnsupportedManifestError`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterable

from async_ckpt.errors import CorruptManifestError, UnsupportedManifestError

FORMAT = "async_ckpt/1"
_FORMATS = "async_ckpt/"  # every version's formats begin so


@dataclass(frozen=True)
class FileEntry:
    """One file of a tag; ``path`` is relative to the tag folder."""

    path: str
    size: int
    crc32: str
    rank: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FileEntry":
        """One entry of a manifest as read; ``ValueError`` where it is not one. The path must stay inside
        the tag folder: a resume or a pull writes each file where its path says."""
        path = data["path"]
        parts = path.split("/") if isinstance(path, str) else []
        if not parts or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file path {path!r} is not a relative path inside the tag folder")
        if not isinstance(data["crc32"], str):
            raise ValueError(f"crc32 of {path!r} is {data['crc32']!r}, not a string")
        return cls(path=path, size=_count(f"size of {path!r}", data["size"]), crc32=data["crc32"],
                   rank=_count(f"rank of {path!r}", data["rank"]))


def _count(what: str, value: Any) -> int:
    """``value`` if it is an int of at least 0 (not a bool); ``ValueError`` naming ``what`` if not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is {value!r}, not a whole number of at least 0")
    return value


#: The type each field of a manifest must have as read (the file entries are checked by FileEntry).
_TYPES: dict[str, type | tuple[type, ...]] = {
    "tag": str, "dtype": str, "save_id": str, "versions": dict, "timings": dict,
    "universal": bool, "sets_latest": bool, "consolidated": bool,
}


@dataclass
class Manifest:
    tag: str
    step: int
    world_size: int
    zero_stage: int
    dtype: str
    files: list[FileEntry]
    versions: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    created_unix: float = 0.0
    save_id: str = ""
    #: DeepSpeed's universal format (``ds_to_universal`` output): loads on any number of ranks.
    universal: bool = False
    #: False for ``save_checkpoint(..., save_latest=False)``: the save did not move ``latest`` on
    #: purpose, so a newer such tag never makes ``latest`` look stale to ``load()``.
    sets_latest: bool = True
    #: The whole model gathered to rank 0 (``save_consolidated``, ``save_16bit_model`` after wrap):
    #: for ``from_pretrained``/``torch.load``, never resumed by ``load()``, never moves ``latest``.
    consolidated: bool = False
    #: In a local tier's node folder: the ranks whose files the folder holds (the manifest lists every
    #: rank's, for a resumed drain to commit the whole tag). Empty where every listed file is here.
    node_ranks: list[int] = field(default_factory=list)
    format: str = FORMAT

    @property
    def recency(self) -> tuple[float, int]:
        """How saves are ordered, newest last: by save time, then by step. Not by step first: after a
        rollback (training resumed from an older tag), the live run's saves have lower steps than the
        abandoned ones, yet they are the newer saves, the ones to resume and to keep."""
        return self.created_unix, self.step

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def one_copy_each(self, preferred: Iterable[int] = ()) -> "Manifest":
        """This manifest listing each path once: the copy a ``preferred`` rank wrote, else the lowest rank's.

        With a local tier, the first rank of every node writes the model-states file into its node's
        folder. DeepSpeed's copies differ between ranks in a few bytes (``shared_params`` is found by
        data pointer), so each node's manifest lists its own copy, and the durable tier rank 0's.
        """
        preferred = set(preferred)
        chosen: dict[str, FileEntry] = {}
        for entry in sorted(self.files, key=lambda e: (e.rank not in preferred, e.rank)):
            chosen.setdefault(entry.path, entry)
        return replace(self, files=sorted(chosen.values(), key=lambda e: e.path))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Manifest":
        """Parse a manifest; :class:`CorruptManifestError` if it is not one (bit rot, a hand edit),
        :class:`UnsupportedManifestError` if it is another version's format. Fields this version does not
        know are ignored (a later version's additions to this format)."""
        try:
            data = json.loads(raw)
            found = data.get("format") if isinstance(data, dict) else None
            if isinstance(found, str) and found.startswith(_FORMATS) and found != FORMAT:
                raise UnsupportedManifestError(f"manifest format {found!r} is another async_ckpt version's (this "
                                               f"one reads {FORMAT!r}): upgrade async_ckpt to load this tag")
            if found != FORMAT:
                raise ValueError(f"unknown manifest format {found!r} (expected {FORMAT!r})")
            known = {f.name for f in fields(cls)}
            data = {key: value for key, value in data.items() if key in known}
            for key, kind in _TYPES.items():
                if key in data and not isinstance(data[key], kind):
                    raise ValueError(f"{key} is {data[key]!r}, not a {kind.__name__}")
            for key in ("step", "world_size", "zero_stage"):
                _count(key, data[key])
            node_ranks = data.get("node_ranks", [])
            if not isinstance(node_ranks, list):
                raise ValueError(f"node_ranks is {node_ranks!r}, not a list")
            for rank in node_ranks:
                _count("a rank of node_ranks", rank)
            created = data.get("created_unix", 0.0)
            if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 1e11:
                raise ValueError(f"created_unix is {created!r}, not a time")
            if not isinstance(data["files"], list):
                raise ValueError(f"files is {data['files']!r}, not a list")
            data["files"] = [FileEntry.from_dict(f) for f in data["files"]]
            return cls(**data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            raise CorruptManifestError(f"not a valid async_ckpt manifest: {type(exc).__name__}: {exc}") from exc


def earlier_in_run(recency: tuple[float, int], than: tuple[float, int]) -> bool:
    """Whether the save of ``recency`` is in the history of the save of ``than`` (both ``Manifest.recency``):
    saved before it at no higher step. After a rollback the abandoned higher steps were saved before
    the live run's saves too, but are not their history: a fallback never goes to them."""
    return recency < than and recency[1] <= than[1]
