"""Names of everything async_ckpt puts next to DeepSpeed's own files.

DeepSpeed's tools find checkpoint files by glob (``*_model_states.pt``, ``*_optim_states.pt``) and
by regex (``zero_pp_rank_(\\d+)_mp_rank_(\\d+)``), so nothing written here may match those
patterns: temporary files end in ``.partial``, bookkeeping lives under ``.async_ckpt/``.
"""

from __future__ import annotations

import os
import re

from async_ckpt.errors import InvalidTagError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
MANIFEST = "async_ckpt_manifest.json"
MARKER_DIR = ".async_ckpt"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")
_MAX_TAG_LEN = 200
_RESERVED = frozenset((LATEST, LATEST_UNIVERSAL, *RECOVERY_SCRIPTS))  # files of the root
_RANK_FILE_RE = re.compile(r"zero_pp_rank_(\d+)_")
_MP_RANK_RE = re.compile(r"mp_rank_(\d+)_")


def is_deepspeed_shard(path: str) -> bool:
    """Whether a file's name is one DeepSpeed's loaders and tools glob a tag folder for (``*_model_states.pt``,
    ``*_optim_states.pt``, and a pipeline's ``layer_NN-*model_states.pt``)."""
    return path.endswith(("model_states.pt", "optim_states.pt"))


def validate_tag(tag: object) -> str:
    """Return ``tag`` as a string, or raise if it is not a safe single folder name.

    A tag becomes one path component locally and one key prefix on object stores, so separators,
    ``..``, leading dots and whitespace are refused rather than silently escaped, and so are the
    names of the root's own files (``latest``, ``zero_to_fp32.py``...), which a tag folder would shadow.
    """
    text = str(tag) if tag is not None else ""
    if not text:
        raise InvalidTagError("checkpoint tag is empty; pass a name such as 'global_step100' or tag=None")
    if len(text) > _MAX_TAG_LEN:
        raise InvalidTagError(f"checkpoint tag is {len(text)} characters; use at most {_MAX_TAG_LEN}")
    if text in _RESERVED:
        raise InvalidTagError(f"checkpoint tag {text!r} is the name of a file DeepSpeed or async_ckpt keeps in the "
                              "checkpoint root (a tag folder of that name would block it); choose another name")
    if "/" in text or "\\" in text or ".." in text or not _TAG_RE.fullmatch(text):
        raise InvalidTagError(
            f"checkpoint tag {text!r} is not a plain folder name; use letters, digits and "
            "'._+=-' only, starting with a letter or digit (no '/', '\\' or '..')"
        )
    return text


def installed_recovery_scripts() -> dict[str, str]:
    """Of DeepSpeed's recovery scripts, those the installed release ships: name -> local path.

    Every supported release ships both; a release that drops one gets no copy of it, not an error.
    """
    import deepspeed

    folder = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
    return {name: os.path.join(folder, name) for name in RECOVERY_SCRIPTS
            if os.path.isfile(os.path.join(folder, name))}


def manifest_path(tag: str) -> str:
    return f"{tag}/{MANIFEST}"


_START_MARK = "started-rank"
#: The root's folder of deletion marks (see :func:`deletion_mark`).
DELETION_MARKS = f"{MARKER_DIR}/deleting"
#: A node folder's lock between a rank writing its start mark and local retention deleting a tag
#: (see :func:`async_ckpt.commit.mark_started`).
MARKS_LOCK = f"{MARKER_DIR}/marks.lock"


def start_mark(tag: str, rank: int) -> str:
    """The file a rank writes into a tag before any other: the sign, for ``async-ckpt gc``, that a folder
    without a manifest is a save of ours that died, not a checkpoint someone else (stock DeepSpeed) wrote."""
    return f"{tag}/{MARKER_DIR}/{_START_MARK}{rank}"


def is_start_mark(name: str) -> bool:
    """Whether a file name in a tag's ``.async_ckpt/`` folder is a start mark (not byte-exact scratch)."""
    return name.startswith(_START_MARK)


def deletion_mark(tag: str) -> str:
    """The file written into the root's ``.async_ckpt/`` folder before a tag's deletion begins and removed
    once it ends: a deletion cut short (a crash; an object store deletes in batches, the start marks
    first) still leaves gc a sign that the rest of the folder is ours."""
    return f"{DELETION_MARKS}/{tag}"


def files_for_rank(paths: list[str], dp_rank: int | None, mp_rank: int | None = None) -> list[str]:
    """Of a tag's DeepSpeed files, those rank ``dp_rank`` reads in ``load_checkpoint`` (``None``: a rank
    that reads every data-parallel rank's shards, as under ZeRO's ``elastic_checkpoint``).

    Files named ``zero_pp_rank_N_`` belong to data-parallel rank N (its optimizer shard, and its
    ZeRO-3 model states); with ``mp_rank``, an optimizer shard (``..._mp_rank_MM_optim_states.pt``)
    belongs to model-parallel (tensor/pipeline) rank MM only. Every other ``.pt`` file is read by
    all ranks: the model states of every model-parallel rank (DeepSpeed counts them to tell its own
    layout), pipeline layer files (``layer_NN-model_states.pt``), MoE expert files and the
    expert-parallel optimizer files (``expp_rank_E_...``) of a non-ZeRO MoE run.
    """
    wanted = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if not name.endswith(".pt"):
            continue
        owner = _RANK_FILE_RE.search(name)
        if owner is not None and dp_rank is not None and int(owner.group(1)) != dp_rank:
            continue
        model_parallel = _MP_RANK_RE.search(name)
        if (owner is not None and mp_rank is not None and name.endswith("_optim_states.pt")
                and model_parallel is not None and int(model_parallel.group(1)) != mp_rank):
            continue
        wanted.append(path)
    return wanted


def model_parallel_size(paths: list[str]) -> int:
    """How many model-parallel (tensor x pipeline) ranks saved a tag: its distinct ``mp_rank_MM`` files."""
    names = [p.rsplit("/", 1)[-1] for p in paths if p.endswith(".pt")]
    return len({m.group(1) for m in map(_MP_RANK_RE.search, names) if m is not None}) or 1
