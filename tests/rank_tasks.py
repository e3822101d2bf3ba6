"""Functions the tests run on every rank of a :class:`RankGroup` (they must be importable by name)."""

from __future__ import annotations

import contextlib
import glob
import errno
import logging
import os
import sys
import time
import threading
from typing import Iterator

import torch
import torch.distributed as dist

import async_ckpt
from async_ckpt import workload
from async_ckpt.deepspeed_adapter import estimate_snapshot
from async_ckpt.layout import MANIFEST

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

STEPS_BEFORE = 3
STEPS_AFTER = 3
CLIENT_STATE = {"epoch": 7, "note": "resume me", "schedule": [1, 2, 3]}


def _rank() -> int:
    return dist.get_rank()


def _tokens():
    return workload.token_stream()


@contextlib.contextmanager
def async_ckpt_log(at_least: int = logging.DEBUG) -> Iterator[list[str]]:
    """Every async_ckpt log line (``at_least`` that level) emitted on this rank meanwhile, formatted, in a list."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep(at_least)
    logger = logging.getLogger("async_ckpt")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _outcome(fn):
    """Run ``fn``; return ``None`` or ``(exception class name, message)``."""
    try:
        fn()
    except Exception as exc:  # the test asserts on the type and message
        return type(exc).__name__, str(exc)
    return None


def save_stock_and_async(stage: int, dtype: str, root: str) -> dict:
    """Train, save the same step with stock DeepSpeed and with async_ckpt (byte-exact files), keep training
    while it persists."""
    tokens = _tokens()
    engine = workload.make_engine(stage, dtype)
    workload.train(engine, STEPS_BEFORE, tokens, _rank())
    type(engine).save_checkpoint(engine, f"{root}/stock", client_state=dict(CLIENT_STATE))
    ckpt = async_ckpt.wrap(engine, f"{root}/async", tokenizer=workload.build_tokenizer(), exact_bytes=True)
    handle = ckpt.save(client_state=dict(CLIENT_STATE))
    losses = workload.train(engine, STEPS_AFTER, tokens, _rank())
    result = handle.result(timeout=120)
    ckpt.close()
    return {"tag": result.tag, "losses_after": losses}


def save_fast_persist_and_async(stage: int, dtype: str, root: str) -> dict:
    """The same step saved by DeepSpeed's FastPersist engine (its Python writer) and by async_ckpt's defaults."""
    engine = workload.make_engine(stage, dtype)
    workload.train(engine, STEPS_BEFORE, _tokens(), _rank())
    tag = f"global_step{engine.global_steps}"
    _fast_persist_save(engine, f"{root}/fast", tag)
    with async_ckpt.wrap(engine, f"{root}/async") as ckpt:
        ckpt.save(client_state=dict(CLIENT_STATE)).result(timeout=120)
    return {"tag": tag}


def resume_and_train(stage: int, dtype: str, root: str, use_async: bool) -> dict:
    """A fresh engine (different init) restores the checkpoint and trains on."""
    engine = workload.make_engine(stage, dtype, seed=1234)
    if use_async:
        with async_ckpt.wrap(engine, root) as ckpt:
            tag, client_state = ckpt.load()
    else:
        _, client_state = engine.load_checkpoint(root)
        tag = None
    losses = workload.train(engine, STEPS_AFTER, _tokens(), _rank())
    client_state = {k: client_state[k] for k in CLIENT_STATE if k in client_state}
    return {"tag": tag, "losses": losses, "client_state": client_state, "step": int(engine.global_steps)}


def _gated_checkpointer(root: str, gate: str, stage: int):
    """A once-trained engine wrapped on ``faulty://root`` whose data writes wait until ``gate`` exists."""
    from faulty_fs import register

    register()
    tokens = _tokens()
    engine = workload.make_engine(stage, "fp32")
    workload.train(engine, 1, tokens, _rank())
    return engine, tokens, async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate})


def save_while_storage_is_gated(root: str, gate: str) -> dict:
    """Steps run while every rank's write is held; the commit lands once the gate opens."""
    engine, tokens, ckpt = _gated_checkpointer(root, gate, stage=3)
    handle = ckpt.save()
    losses = workload.train(engine, 3, tokens, _rank())
    seen = {"steps_done": len(losses), "done_during_steps": handle.done(),
            "latest_during_steps": os.path.exists(f"{root}/latest")}
    dist.barrier()
    if _rank() == 0:
        open(gate, "w").close()
    result = handle.result(timeout=120)
    seen.update(latest_after=open(f"{root}/latest").read(), tag=result.tag)
    ckpt.close()
    return seen


def _waiting_for_peers(rank: int) -> bool:
    """Whether this process's writer thread is in the commit's wait for every rank's report."""
    writer = next((t for t in threading.enumerate() if t.name == f"async_ckpt-writer-rank{rank}"), None)
    frame = sys._current_frames().get(writer.ident) if writer is not None else None
    while frame is not None:
        if frame.f_code.co_name == "gather" and frame.f_code.co_filename.endswith("handshake.py"):
            return True
        frame = frame.f_back
    return False


def commit_waits_for_every_rank(root: str, gate: str) -> dict:
    """Rank 1's write is held: rank 0's files are durable, yet nothing is committed until rank 1's are."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate, "gate_ranks": [1]},
                           tokenizer=workload.build_tokenizer())
    first = ckpt.save(tag="first")
    seen: dict = {}
    if _rank() == 0:  # checked once rank 0's writer waits for its peers: a commit that did not would be done
        deadline = time.monotonic() + 60
        while not _waiting_for_peers(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["rank0_waiting"] = _waiting_for_peers(0)
        seen["rank0_durable"] = bool(glob.glob(f"{root}/first/zero_pp_rank_0_*_optim_states.pt"))
        seen["latest_before"] = os.path.exists(f"{root}/latest")
        seen["manifest_before"] = os.path.exists(f"{root}/first/async_ckpt_manifest.json")
        seen["tokenizer_before"] = os.path.exists(f"{root}/first/tokenizer.json")
        open(gate, "w").close()
    first.result(timeout=120)
    seen["latest_after"] = open(f"{root}/latest").read()
    seen["tokenizer_after"] = os.path.exists(f"{root}/first/tokenizer.json")
    ckpt.close()
    return seen


@contextlib.contextmanager
def _copies_held_back(seconds: float) -> Iterator[None]:
    """Every host copy of the staging layer starts ``seconds`` late (the copies ``save()`` queues for its
    helper thread too, which then run after the block)."""
    from async_ckpt import staging

    originals = {name: getattr(staging, name) for name in ("_copy_and_checksum", "_copy_all")}

    def late(copy):
        def copy_late(*args):
            time.sleep(seconds)
            return copy(*args)
        return copy_late

    for name, copy in originals.items():
        setattr(staging, name, late(copy))
    try:
        yield
    finally:
        for name, copy in originals.items():
            setattr(staging, name, copy)


def snapshot_ignores_later_mutation(root: str, mode: str) -> dict:
    """Mutate the live state right after save(); the checkpoint must hold the values at save time.
    ``mode``: "mutate-by-hand" (overlap_copy=False), "overlapped-copy-then-step" (the default), or
    "steps-in-backward" (the default, on a ZeRO-3 engine that says, as SuperOffload's does, that it updates
    the optimizer state during backward: here by hand, before any optimizer step)."""
    engine = workload.make_engine(3 if mode == "steps-in-backward" else 2, "fp32")
    workload.train(engine, 2, _tokens(), _rank())
    type(engine).save_checkpoint(engine, f"{root}/reference")
    if mode == "steps-in-backward":
        engine.super_offload = lambda: True
    ckpt = async_ckpt.wrap(engine, f"{root}/async", overlap_copy=mode != "mutate-by-hand")
    with _copies_held_back(1.0 if mode == "steps-in-backward" else 0.0):  # a copy overlapping would lose the race
        handle = ckpt.save()
    if mode == "overlapped-copy-then-step":  # the optimizer step is what may change state; it must wait for the copy
        workload.train(engine, 1, _tokens(), _rank())
    else:
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1.0)
            for group in getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or \
                    engine.optimizer.fp32_partitioned_groups_flat:
                group.add_(1.0)
            for state in engine.optimizer.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.is_floating_point():
                        value.add_(1.0)
    handle.result(timeout=120)
    ckpt.close()
    return {"tag": handle.tag}


def client_state_keyed_by_step(root: str, saves: int) -> dict:
    """Save with a tensor in ``client_state`` under a key naming the step, which changes every save: the
    staging memory stays that of one save, and each tag holds its own tensor."""
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    staged: list[int] = []
    tags: list[str] = []
    with async_ckpt.wrap(engine, root) as ckpt:
        for i in range(saves):
            workload.train(engine, 1, tokens, _rank())
            tags.append(ckpt.save(client_state={"probes": {f"step{i}": torch.full((1 << 18,), float(i))}}).tag)
            ckpt.wait()
            staged.append(ckpt.staging_bytes)
    loaded = {}
    for i in (0, saves - 1):
        _, client = engine.load_checkpoint(root, tag=tags[i])
        loaded[i] = {key: value.unique().tolist() for key, value in client["probes"].items()}
    return {"staged": staged, "loaded": loaded}


def _host_copy(obj):
    """Every tensor in ``obj`` cloned to a detached host tensor (deepcopy refuses ZeRO's non-leaf views)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_host_copy(v) for v in obj]
    return obj


def same_tensors(a, b) -> bool:
    """Whether two nested dicts/lists hold equal tensors in the same places (devices aside)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return True


def save_into_a_folder_one_rank_may_not_write(root: str) -> dict:
    """engine.save_checkpoint and save_16bit_model into a folder other than wrap()'s, which rank 1 may not write:
    its storage's probe fails there alone, and every rank raises rather than the others wait in a collective."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}/main",
                           storage_options={"deny_ranks": [1], "deny_match": "/elsewhere"})
    try:
        return {"save_checkpoint": _outcome(lambda: engine.save_checkpoint(f"faulty://{root}/elsewhere", tag="t")),
                "save_16bit_model": _outcome(lambda: engine.save_16bit_model(f"faulty://{root}/elsewhere/export")),
                "then": _outcome(lambda: ckpt.save(tag="after").result(timeout=120)),
                "into_a_file_url": _outcome(lambda: (engine.save_checkpoint(f"file://{root}/plain", tag="plain"),
                                                     ckpt.wait(timeout=120))),
                "committed_there": os.path.isfile(os.path.join(root, "plain", "plain", "async_ckpt_manifest.json"))}
    finally:
        ckpt.close()


def save_while_one_ranks_previous_write_is_stuck(root: str, gate: str) -> dict:
    """Rank 1's write of 'first' (into another folder) is held past wait_timeout_s; 'second', and then an export with
    save_16bit_model, cannot reuse its staging buffers there. Each time the timeout is raised on every rank,
    rank 0's naming rank 1, rather than rank 0 waiting alone in a collective. The gate then opens and 'first'
    commits."""
    from faulty_fs import register

    register()
    tokens = _tokens()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, tokens, _rank())
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate, "gate_ranks": [1]},
                           wait_timeout_s=3)
    engine.save_checkpoint(f"faulty://{root}-own", tag="first")  # into a folder of its own, as HF Trainer saves
    workload.train(engine, 1, tokens, _rank())
    out = {"second": _outcome(lambda: ckpt.save(tag="second")),
           "export": _outcome(lambda: engine.save_16bit_model(os.path.join(root, "export")))}
    dist.barrier()  # every rank has raised before the gate opens
    if _rank() == 0:
        open(gate, "w").close()
    ckpt.wait(timeout=120)
    out["first_committed"] = os.path.exists(f"{root}-own/first/{MANIFEST}")
    ckpt.close()
    return out


def save_while_previous_persists(root: str, gate: str) -> dict:
    """A second save() while the first one's write is held waits for it, and each tag keeps its own step."""
    import threading

    engine, tokens, ckpt = _gated_checkpointer(root, gate, stage=2)
    states = [_host_copy(engine.optimizer.state_dict())]
    first = ckpt.save(tag="first")
    workload.train(engine, 1, tokens, _rank())
    states.append(_host_copy(engine.optimizer.state_dict()))
    opener = threading.Timer(1.0, lambda: open(gate, "w").close()) if _rank() == 0 else None
    if opener is not None:
        opener.start()
    second = ckpt.save(tag="second")
    name = f"zero_pp_rank_{_rank()}_mp_rank_00_optim_states.pt"
    seen = {"first_written_when_second_returned": os.path.exists(f"{root}/first/{name}"),
            "buffer_wait_s": second.metrics["buffer_wait_s"]}
    first.result(timeout=120)
    second.result(timeout=120)
    ckpt.close()
    if opener is not None:
        opener.join()
    saved = [torch.load(f"{root}/{tag}/{name}", weights_only=False)["optimizer_state_dict"] for tag in ("first", "second")]
    seen["tags_hold_their_own_step"] = [same_tensors(s, state) for s, state in zip(saved, states)]
    seen["steps_differ"] = not same_tensors(states[0], states[1])
    return seen


def bad_inputs(root: str, not_a_dir: str, memory_root: str | None = None) -> dict:
    """Every misuse gives a typed error; returns ``{case: (error type, message)}`` and what was written,
    and the warnings of wrap() on ``root`` and on ``memory_root`` (a tmpfs folder) and whether it chose
    synchronous saves, with ``synchronous`` unset, True and False, and unset with a local tier on ``root``'s disk."""
    engine = workload.make_engine(1, "fp32")
    out: dict = {}
    tier = os.path.join(os.path.dirname(root), "tier")
    for case, url, options in [("disk", root, {}), ("memory", memory_root, {}),
                               ("memory_synchronous", memory_root, {"synchronous": True}),
                               ("memory_background", memory_root, {"synchronous": False}),
                               ("memory_tiered", memory_root, {"local_tier": tier})]:
        if url is not None:
            with async_ckpt_log(logging.WARNING) as lines:
                ckpt = async_ckpt.wrap(engine, url, **options)
                ckpt.close()
            out[f"wrap_warnings_{case}"] = [line for line in lines if "in memory" in line]
            out[f"synchronous_{case}"] = ckpt.synchronous
    out["unwritable_destination"] = _outcome(lambda: async_ckpt.wrap(engine, f"{not_a_dir}/ckpt"))
    out["exact_bytes_unwritable_cache_dir"] = _outcome(lambda: async_ckpt.wrap(
        engine, f"memory://exact-rank{_rank()}", exact_bytes=True, cache_dir=not_a_dir))
    out["bad_keep_last"] = _outcome(lambda: async_ckpt.wrap(engine, root, keep_last=0))
    out["bad_on_error"] = _outcome(lambda: async_ckpt.wrap(engine, root, on_error="explode"))
    out["unknown_option"] = _outcome(lambda: async_ckpt.wrap(engine, root, overlap=True))
    engine.zero_nvme_offload_optimizer = lambda: True  # as an engine with offload_optimizer.device 'nvme' answers
    out["nvme_offload"] = _outcome(lambda: async_ckpt.wrap(engine, root))
    del engine.zero_nvme_offload_optimizer
    engine.checkpoint_serialization_enabled = lambda: False  # as with checkpoint.checkpoint_serialization: false
    with async_ckpt_log(logging.WARNING) as lines:
        async_ckpt.wrap(engine, root).close()
    out["wrap_warnings_legacy_serialization"] = [line for line in lines if "checkpoint_serialization" in line]
    del engine.checkpoint_serialization_enabled
    ckpt = async_ckpt.wrap(engine, root)
    out["wrap_of_a_wrapped_engine"] = _outcome(lambda: async_ckpt.wrap(engine, f"{root}-second"))
    out["second_root_made"] = os.path.exists(f"{root}-second")
    dist.barrier()  # every rank's wrap probe file is gone before the listing
    before = sorted(os.listdir(root))
    for name, tag in {"empty_tag": "", "slash_tag": "a/b", "dotdot_tag": "..", "parent_tag": "../escape",
                      "backslash_tag": "a\\b", "space_tag": " x", "latest_tag": "latest",
                      "script_tag": "zero_to_fp32.py", "newline_tag": "global_step5\n"}.items():
        out[name] = _outcome(lambda t=tag: ckpt.save(tag=t))
    out["written_after_bad_tags"] = sorted(os.listdir(root)) != before
    dist.barrier()  # no rank starts the good save below before every rank has listed
    out["load_when_empty"] = _outcome(lambda: ckpt.load())
    ckpt.save(tag="good").result(timeout=60)
    out["resave_committed_tag"] = _outcome(lambda: ckpt.save(tag="good"))
    out["wait_nan_timeout"] = _outcome(lambda: ckpt.wait(timeout=float("nan")))
    out["wait_text_timeout"] = _outcome(lambda: ckpt.wait(timeout="5"))
    out["load_missing_tag"] = _outcome(lambda: ckpt.load(tag="nope"))
    if _rank() == 0:
        os.makedirs(f"{root}/partial", exist_ok=True)
        open(f"{root}/partial/zero_pp_rank_0_mp_rank_00_optim_states.pt", "wb").close()
    dist.barrier()
    out["load_uncommitted_tag"] = _outcome(lambda: ckpt.load(tag="partial"))
    out["save_into_a_foreign_folder"] = _outcome(lambda: ckpt.save(tag="partial"))
    out["foreign_folder_after"] = sorted(os.listdir(f"{root}/partial"))
    if _rank() == 0:  # what an aborted save leaves on a local root: empty bookkeeping folders
        os.makedirs(f"{root}/aborted/.async_ckpt/scratch-rank0", exist_ok=True)
    dist.barrier()
    out["save_over_an_aborted_save"] = _outcome(lambda: ckpt.save(tag="aborted").result(timeout=60))
    if _rank() == 0:  # what a save of 6 ranks killed mid-save leaves: its marks and shards, no manifest
        os.makedirs(f"{root}/dead/.async_ckpt", exist_ok=True)
        with open(f"{root}/dead/.async_ckpt/started-rank5", "w") as fh:
            fh.write("an earlier save's id")
        open(f"{root}/dead/zero_pp_rank_5_mp_rank_00_optim_states.pt", "wb").close()
    dist.barrier()
    out["save_over_a_dead_save"] = _outcome(lambda: ckpt.save(tag="dead").result(timeout=60))
    out["dead_folder_after"] = sorted(os.listdir(f"{root}/dead"))
    # ZeRO-1: rank 0 alone writes the model states, with client_state; only its snapshot of them fails
    out["unsnapshottable_client_state"] = _outcome(
        lambda: ckpt.save(tag="lock", client_state={"lock": threading.Lock()}).result(timeout=120))
    out["latest_after_unsnapshottable"] = open(f"{root}/latest").read()
    out["save_after_unsnapshottable"] = _outcome(lambda: ckpt.save(tag="after").result(timeout=60))
    ckpt.close()
    out["save_after_close"] = _outcome(lambda: ckpt.save())
    out["wait_after_close"] = _outcome(lambda: ckpt.wait())
    return out


def _files_under(root: str, folder: str) -> list[str]:
    """Every file below ``root/folder``, as sorted paths relative to ``root``."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(os.path.join(root, folder))
                  for n in names)


def failing_write_keeps_previous(root: str, on_error: str, fail_errno: str = "ENOSPC", after_bytes: int = 0) -> dict:
    """Rank 1's data write fails (after some bytes): the tag fails on every rank; 'latest' keeps the previous tag."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    workload.train(engine, 1, tokens, _rank())
    good = async_ckpt.wrap(engine, f"faulty://{root}")
    good.save(tag="good").result(timeout=60)
    good.close()
    faults = {"fail_ranks": [1], "fail_errno": fail_errno, "fail_after_bytes": after_bytes}
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options=faults, on_error=on_error, keep_last=1)
    handle = ckpt.save(tag="bad")
    error = handle.exception(timeout=120)
    dist.barrier()
    seen = {"handle_error": (type(error).__name__, str(error)) if error else None,
            "latest": open(f"{root}/latest").read(),
            "good_manifest": os.path.exists(f"{root}/good/async_ckpt_manifest.json"),
            "bad_manifest": os.path.exists(f"{root}/bad/async_ckpt_manifest.json"),
            "bad_data_files": sorted(os.path.basename(p) for p in glob.glob(f"{root}/bad/*.pt*")),
            "bad_files": _files_under(root, "bad"),
            "extras_left": glob.glob(os.path.join(ckpt._shadow, "extras-*"))}
    workload.train(engine, 1, tokens, _rank())
    seen["next_save"] = _outcome(lambda: ckpt.save(tag="after"))
    ckpt.close() if on_error == "warn" else _outcome(ckpt.close)
    return seen


def deepspeed_failing_after_the_model_states(root: str, fail_model_states: bool = False) -> dict:
    """ZeRO-3 (every rank writes a model-states file): the optimizer's state_dict raises after DeepSpeed
    handed over the model states (``handed_over``: the files the save had then), so save() raises; then
    the same checkpointer saves again. With ``fail_model_states``, rank 1's write of its model-states file
    fails instead (on the ``faulty://`` filesystem): save() returns and its handle fails; the next save
    is made with a checkpointer whose storage does not fail."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(3, "fp32", size="small")
    tokens = _tokens()
    workload.train(engine, 1, tokens, _rank())
    with async_ckpt.wrap(engine, f"faulty://{root}") as ckpt:
        ckpt.save(tag="good").result(timeout=120)
    seen: dict = {}

    def after_the_failed_save(ckpt) -> None:
        """What the failed save left in its tag folder and ``latest``; then the next save and ``latest``."""
        dist.barrier()
        seen["bad_files"] = _files_under(root, "bad")
        seen["latest_after_bad"] = open(f"{root}/latest").read()
        workload.train(engine, 1, tokens, _rank())
        seen["next_save"] = _outcome(lambda: ckpt.save(tag="after").result(timeout=120))
        seen["latest"] = open(f"{root}/latest").read()

    if fail_model_states:
        with async_ckpt.wrap(engine, f"faulty://{root}",
                             storage_options={"fail_ranks": [1], "fail_match": "model_states"}) as ckpt:
            error = ckpt.save(tag="bad").exception(timeout=120)
            seen["raised"] = (type(error).__name__, str(error)) if error else None
        with async_ckpt.wrap(engine, f"faulty://{root}") as ckpt:
            after_the_failed_save(ckpt)
    else:
        with async_ckpt.wrap(engine, f"faulty://{root}") as ckpt:
            def broken_state_dict():
                seen["handed_over"] = [os.path.basename(f.relpath) for f in ckpt._session.files]
                raise RuntimeError("optimizer state_dict failed (injected)")

            engine.optimizer.state_dict = broken_state_dict
            try:
                seen["raised"] = _outcome(lambda: ckpt.save(tag="bad"))
            finally:
                del engine.optimizer.state_dict
            after_the_failed_save(ckpt)
    return seen


@contextlib.contextmanager
def _overwriting_committed_t(root: str, faults: dict) -> Iterator[async_ckpt.AsyncCheckpointer]:
    """Tag 't' committed in ``faulty://root``, then a checkpointer with ``overwrite_tags`` and ``faults``."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, f"faulty://{root}") as ckpt:
        ckpt.save(tag="t").result(timeout=60)
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options=faults, overwrite_tags=True) as ckpt:
        yield ckpt


def failing_overwrite_of_a_committed_tag(root: str) -> dict:
    """With overwrite_tags, rank 1's write of a second save of the committed tag 't' fails."""
    with _overwriting_committed_t(root, {"fail_ranks": [1]}) as ckpt:
        error = ckpt.save(tag="t").exception(timeout=120)
    dist.barrier()
    return {"handle_error": str(error), "t_committed": os.path.exists(f"{root}/t/async_ckpt_manifest.json"),
            "t_marks": sorted(os.listdir(f"{root}/t/.async_ckpt"))}


def overwrite_that_cannot_uncommit_the_tag(root: str) -> dict:
    """With overwrite_tags, rank 0 may not delete the committed tag's manifest (permission denied)."""
    with _overwriting_committed_t(root, {"fail_rm": MANIFEST}) as ckpt:
        raised = _outcome(lambda: ckpt.save(tag="t"))
        after = ckpt.save(tag="u").result(timeout=120).tag  # the ranks are still in step
    return {"raised": raised, "after": after, "t_committed": os.path.exists(f"{root}/t/{MANIFEST}")}


class _TokenizerFailingOnce:
    """A tokenizer whose first save_pretrained raises (the disk of rank 0's shadow folder full, say)."""

    def __init__(self) -> None:
        self.calls = 0

    def save_pretrained(self, path: str) -> None:
        self.calls += 1
        if self.calls == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
            fh.write("{}")


def save_that_rank_0_fails_after_the_agreement(root: str) -> dict:
    """Rank 0's save() raises after the save was agreed (its tokenizer's save fails); rank 1's returned,
    and its writer waits in the commit for rank 0's files."""
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    done = []
    with async_ckpt.wrap(engine, root, tokenizer=_TokenizerFailingOnce(), commit_timeout_s=300,
                         on_save_done=lambda handle: done.append(handle.tag)) as ckpt:
        handle, raised = None, None
        try:
            handle = ckpt.save(tag="bad")
        except OSError as exc:
            raised = str(exc)
        failed = str(handle.exception(timeout=120)) if handle is not None else None
        after = ckpt.save(tag="after").result(timeout=120).tag
    return {"raised": raised, "failed": failed, "after": after, "bad_files": _files_under(root, "bad"), "done": done}


def failure_known_to_one_rank_first(root: str) -> dict:
    """With ``on_error="raise"``: rank 1's write of tag 'bad' fails at once, while rank 0's is held (a
    gate opened 2 s into the next save), so only rank 1 knows of the failure when both call save() again."""
    import threading

    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    gate = f"{root}.gate"
    faults = {"fail_ranks": [1], "gate": gate, "gate_ranks": [0]}
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options=faults, on_error="raise")
    handle = ckpt.save(tag="bad")
    known = handle.wait(60) if _rank() == 1 else handle.done()
    dist.barrier()
    if _rank() == 0:
        threading.Timer(2.0, lambda: open(gate, "w").close()).start()
    seen = {"knew_before_next_save": known, "next_save": _outcome(lambda: ckpt.save(tag="next"))}
    seen["wait_after"] = _outcome(ckpt.wait)
    seen["close"] = _outcome(ckpt.close)
    return seen


def _flip_byte(path: str, offset: int = 200) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def recovery_after_crashes(root: str) -> dict:
    """Two committed tags, then what a crash can leave: a stale, dangling or missing 'latest', a corrupt shard."""
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    out: dict = {}
    with async_ckpt.wrap(engine, root) as ckpt:
        workload.train(engine, 1, tokens, _rank())
        ckpt.save(tag="older")
        workload.train(engine, 1, tokens, _rank())
        ckpt.save(tag="newer")
        ckpt.wait()

        def with_latest(text: str | None, case: str) -> None:
            if _rank() == 0:
                if text is None:
                    os.remove(f"{root}/latest")
                else:
                    with open(f"{root}/latest", "w") as fh:
                        fh.write(text)
            dist.barrier()
            with async_ckpt_log() as lines:
                out[case] = ckpt.load()[0]
            out[f"{case}_log"] = [line for line in lines if "resuming from" in line]

        with_latest("older", "stale_latest")
        with_latest("deleted-tag", "dangling_latest")
        with_latest(None, "missing_latest")
        if _rank() == 0:
            _flip_byte(f"{root}/newer/zero_pp_rank_1_mp_rank_00_optim_states.pt")
        dist.barrier()
        out["corrupt_shard"] = _outcome(lambda: ckpt.load(tag="newer"))
        out["corrupt_shard_fallback"] = ckpt.load(tag="newer", fallback=True)[0]
        if _rank() == 0:
            with open(f"{root}/older/zero_pp_rank_0_mp_rank_00_optim_states.pt", "r+b") as fh:
                fh.truncate(1000)
        dist.barrier()
        out["truncated_shard"] = _outcome(lambda: ckpt.load(tag="older"))
        out["truncated_shard_fallback"] = _outcome(lambda: ckpt.load(tag="older", fallback=True))
        workload.train(engine, 1, tokens, _rank())
        ckpt.save(tag="third").result(timeout=60)
        if _rank() == 0:
            os.remove(f"{root}/third/zero_pp_rank_1_mp_rank_00_optim_states.pt")
        dist.barrier()
        out["missing_shard"] = _outcome(lambda: ckpt.load(tag="third"))
    return out


def load_manifest_from_other_layout(root: str, field: str, value: int, *, as_fallback: bool = False) -> dict:
    """A committed tag 't' whose manifest says another world size or ZeRO stage (as if saved by another job);
    with ``as_fallback``, loaded as the tag a load(fallback=True) falls back to from a newer corrupt tag 'u'."""
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, root) as ckpt:
        ckpt.save(tag="t").result(timeout=60)
        dist.barrier()  # every rank has seen the commit before the manifest changes under it
        if _rank() == 0:
            import json

            path = f"{root}/t/async_ckpt_manifest.json"
            with open(path) as fh:
                data = json.load(fh)
            data[field] = value
            with open(f"{path}.edit", "w") as fh:
                json.dump(data, fh)
            os.replace(f"{path}.edit", path)
        dist.barrier()
        if as_fallback:
            workload.train(engine, 1, _tokens(), _rank())
            ckpt.save(tag="u").result(timeout=60)
            if _rank() == 0:
                _flip_byte(f"{root}/u/zero_pp_rank_1_mp_rank_00_optim_states.pt")
            dist.barrier()
        return {"load": _outcome(lambda: ckpt.load(fallback=as_fallback))}


def load_fails_on_one_rank(root: str) -> dict:
    """After a committed save, rank 1's listings of the root fail (an I/O error) and every rank calls
    load(): returns each rank's outcome, once both ranks are past it."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"skip_instance_cache": True},
                         retry_attempts=1) as ckpt:
        ckpt.save(tag="a").result(timeout=120)
        ckpt.storage.fs.fail_ls_ranks = {1}
        outcome = _outcome(ckpt.load)
        dist.barrier()  # both ranks got here: neither waits in a collective the other left
        ckpt.storage.fs.fail_ls_ranks = set()
    return {"load": outcome}


def load_sees_a_stale_root_on_one_rank(root: str) -> dict:
    """Tags 'a' then 'b' committed; rank 1 then sees neither 'b' nor the 'latest' naming it (a stale NFS
    cache) and every rank calls load(): returns each rank's outcome, once both ranks are past it."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"skip_instance_cache": True}) as ckpt:
        ckpt.save(tag="a")
        ckpt.save(tag="b").result(timeout=120)
        ckpt.storage.fs.stale_ranks, ckpt.storage.fs.stale_latest, ckpt.storage.fs.stale_hidden = {1}, "a", "b"
        outcome = _outcome(ckpt.load)
        dist.barrier()  # both ranks got here: neither waits in a collective the other left
        ckpt.storage.fs.stale_ranks = set()
    return {"load": outcome}


def retention(root: str, keep_last: int, keep_every: int | None) -> dict:
    """Five saves, one step apart (steps 1..5); which committed tags survive."""
    engine = workload.make_engine(1, "fp32")
    tokens = _tokens()
    with async_ckpt.wrap(engine, root, keep_last=keep_last, keep_every=keep_every) as ckpt:
        for _ in range(5):
            workload.train(engine, 1, tokens, _rank())
            ckpt.save().result(timeout=60)
    return {"tags": sorted(t for t in os.listdir(root) if os.path.isfile(f"{root}/{t}/async_ckpt_manifest.json")),
            "latest": open(f"{root}/latest").read()}


def retention_spares_the_latest_tag(root: str) -> dict:
    """keep_last=1, but later saves leave 'latest' on the first tag (save_latest=False)."""
    engine = workload.make_engine(1, "fp32")
    tokens = _tokens()
    with async_ckpt.wrap(engine, root, keep_last=1) as ckpt:
        workload.train(engine, 1, tokens, _rank())
        ckpt.save(tag="a").result(timeout=60)
        for tag in ("b", "c"):
            workload.train(engine, 1, tokens, _rank())
            engine.save_checkpoint(root, tag=tag, save_latest=False)
            ckpt.wait()
    return {"tags": sorted(t for t in os.listdir(root) if os.path.isfile(f"{root}/{t}/async_ckpt_manifest.json")),
            "latest": open(f"{root}/latest").read()}


def save_committed_tags(url: str, options: dict, tags: list[str]) -> dict:
    engine = workload.make_engine(3, "fp32")
    with async_ckpt.wrap(engine, url, storage_options=options, tokenizer=workload.build_tokenizer()) as ckpt:
        for tag in tags:
            workload.train(engine, 1, _tokens(), _rank())
            ckpt.save(tag=tag)
    return {}


def soak(url: str, saves: int, storage_options: dict | None = None, size: str = "tiny", **options) -> dict:
    """Many consecutive saves in one run: every tag verifiable, memory flat, nothing leaked."""
    import gc as pygc
    import tempfile
    import threading

    import weakref

    import fsspec.asyn
    import psutil

    from async_ckpt.catalog import list_tags
    from async_ckpt.storage import open_storage
    from async_ckpt.verify import verify_tag

    def threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("async_ckpt"))

    _return_freed_blocks_at_once()
    engine = workload.make_engine(2, "fp32", size=size)
    tokens = _tokens()
    workload.train(engine, 1, tokens, _rank())
    proc = psutil.Process()
    fsspec.asyn.get_loop()  # fsspec's process-wide IO loop and its wake-up sockets: made once per process, never closed
    fds_before = proc.num_fds()
    shadow_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "async_ckpt_shadow_*")))
    rss: list[int] = []
    handles: list[weakref.ref] = []
    with async_ckpt.wrap(engine, url, storage_options=storage_options, **options) as ckpt:
        for i in range(saves):
            workload.train(engine, 1, tokens, _rank())
            handles.append(weakref.ref(ckpt.save()))
            if i == saves - 1:  # the writer runs one save at a time: all but the last two have ended
                pygc.collect()
                ended_handles_kept = sum(ref() is not None for ref in handles[:-2])
            if i == 0:
                allocations_after_first = ckpt.staging_allocations
                ckpt.wait()
                threads_after_first = threads()
            if i in (saves // 5, saves - 1):
                ckpt.wait()
                pygc.collect()
                _release_free_heap()
                rss.append(proc.memory_info().rss)
        threads_after_last = threads()
        allocations = ckpt.staging_allocations
    storage = open_storage(url, storage_options)
    tags = list_tags(storage)
    bad = [(t.tag, c.path) for t in tags if t.committed for c in verify_tag(storage, t.manifest) if not c.ok]
    local = storage.local_dir()
    leftovers = storage.list_incomplete_uploads() + (glob.glob(f"{local}/**/*.partial", recursive=True) if local else [])
    storage.close()
    return {
        "tags": len(tags), "committed": sum(t.committed for t in tags), "bad_files": bad,
        "rss_growth": (rss[1] - rss[0]) / rss[0],
        "threads_after_first_save": threads_after_first, "threads_after_last_save": threads_after_last,
        "threads_after_close": threads(),
        "fds_leaked": proc.num_fds() - fds_before,
        "leftovers": leftovers,
        "shadow_dirs_left": sorted(set(glob.glob(os.path.join(tempfile.gettempdir(), "async_ckpt_shadow_*"))) - shadow_before),
        "allocations_after_first": allocations_after_first, "allocations_after_last": allocations,
        "ended_handles_kept": ended_handles_kept,
    }


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _libc_function(name: str):
    """``name`` from the C library this process runs on (as ``async_ckpt.host_memory`` finds ``madvise``), or
    ``None`` where it has no such function."""
    import ctypes

    return getattr(ctypes.CDLL(None), name, None)


def _return_freed_blocks_at_once() -> None:
    """Have glibc's malloc give freed blocks of 128 KiB or more back to the system at once, so that RSS
    reads what is live.

    Its thresholds adapt by default: once a freed part buffer (5 MiB) has raised them, later part
    buffers come from the malloc arena of the thread that allocates them (an upload lane's). Such an
    arena keeps the free pages at its top mapped: ``malloc_trim`` returns free pages inside every
    arena, but trims only the main arena's top. RSS then swung by 5-13 MiB per arena between two reads
    while nothing was held: -13 to +13 MiB per rank over 40 saves to S3, against at most 1.1 MiB with
    fixed thresholds (measured on 2 ranks, ``size="small"``)."""
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD):
            mallopt(option, 128 * 1024)


def _release_free_heap() -> None:
    """Hand the main C heap's free pages back to the system (glibc's ``malloc_trim``) before reading RSS."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def killed_mid_save(root: str, gate: str, phase: str, results: str) -> dict:
    """Commit 'good', train on, then SIGKILL a rank while it writes tag 'doomed' ('upload': rank 1 in the
    middle of its shard; 'commit': rank 0 in the middle of writing the manifest)."""
    import json
    import signal

    from faulty_fs import register

    register()
    victim, match, partial = {
        "upload": (1, "doomed/zero_pp_rank_1", f"{root}/doomed/zero_pp_rank_1*.partial"),
        "commit": (0, "doomed/async_ckpt_manifest", f"{root}/doomed/async_ckpt_manifest.json*.partial"),
    }[phase]
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    workload.train(engine, 2, tokens, _rank())
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}",
                           storage_options={"gate": gate, "gate_ranks": [victim], "gate_match": match})
    ckpt.save(tag="good").result(timeout=60)
    losses = workload.train(engine, STEPS_AFTER, tokens, _rank())
    with open(f"{results}.{_rank()}.json", "w") as fh:
        json.dump({"losses_after_good": losses}, fh)
    ckpt.save(tag="doomed")
    if _rank() == victim:
        deadline = time.monotonic() + 60
        while not glob.glob(partial) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survivor": _rank()}


def killed_mid_s3_save(url: str, options: dict, proxy: str, results: str, phase: str) -> dict:
    """Commit 'good' to S3, train on, then SIGKILL a rank while it writes tag 'doomed' ('upload': rank 1
    with its multipart upload in flight; 'commit': rank 0 with its PUT of the manifest in flight). The
    proxy holds those requests, so they stay open until the kill."""
    import json
    import signal

    from s3_server import held_requests, set_hold

    victim, match = {"upload": (1, "doomed/zero_pp_rank_1"), "commit": (0, "doomed/async_ckpt_manifest")}[phase]
    engine = workload.make_engine(2, "fp32", size="small")
    tokens = _tokens()
    workload.train(engine, 2, tokens, _rank())
    ckpt = async_ckpt.wrap(engine, url, storage_options=options, part_size=5 * 1024 * 1024)
    ckpt.save(tag="good").result(timeout=120)
    losses = workload.train(engine, STEPS_AFTER, tokens, _rank())
    with open(f"{results}.{_rank()}.json", "w") as fh:
        json.dump({"losses_after_good": losses}, fh)
    if _rank() == victim:
        set_hold(proxy, match)
    dist.barrier()
    ckpt.save(tag="doomed")
    if _rank() == victim:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not held_requests(proxy):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survivor": _rank()}


def resume_latest(root: str, options: dict | None = None, size: str = "tiny", cache_dir: str | None = None) -> dict:
    engine = workload.make_engine(2, "fp32", seed=77, size=size)
    extra = {"cache_dir": f"{cache_dir}/rank{_rank()}"} if cache_dir else {}
    with async_ckpt.wrap(engine, root, storage_options=options, **extra) as ckpt:
        tag, _ = ckpt.load()
    return {"tag": tag, "losses": workload.train(engine, STEPS_AFTER, _tokens(), _rank())}


def load_outcome(stage: int, url: str, options: dict | None, tag: str | None) -> tuple[str, str] | None:
    """``ckpt.load(tag)`` on a plain (non-universal) engine: the error it raises, if any."""
    engine = workload.make_engine(stage, "fp32", seed=99)
    with async_ckpt.wrap(engine, url, storage_options=options) as ckpt:
        return _outcome(lambda: ckpt.load(tag))


def save_done_callback(root: str) -> dict:
    """A tracker callback sees every finished save; one that raises does not break saving."""
    seen = []

    def record(handle) -> None:
        seen.append({"tag": handle.tag, "done": handle.done(), "ok": handle.exception() is None,
                     "metrics": dict(handle.metrics)})

    def explode(handle) -> None:
        raise RuntimeError("tracker is down")

    engine = workload.make_engine(1, "fp32")
    with async_ckpt.wrap(engine, f"{root}/a", on_save_done=record) as ckpt:
        ckpt.save(tag="one").result(timeout=60)
    with async_ckpt.wrap(engine, f"{root}/b", on_save_done=explode) as ckpt:
        committed = ckpt.save(tag="two").result(timeout=60).tag
    return {"seen": seen, "committed_despite_raising_callback": committed}


def waits_inside_a_zero3_load_without_optimizer_states(root: str) -> dict:
    """How often DeepSpeed's hooked readers waited for saves inside ckpt.load(): DeepSpeed reads a ZeRO-3
    checkpoint without optimizer states through zero_to_fp32, whose hook would wait for drains going on."""
    from async_ckpt import inflight

    engine = workload.make_engine(3, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    waits = []
    with async_ckpt.wrap(engine, root) as ckpt:
        ckpt.save(tag="a").result(timeout=120)
        original, inflight.wait_all = inflight.wait_all, lambda *a, **k: waits.append(a)
        try:
            loaded, _ = ckpt.load(tag="a", load_optimizer_states=False)
        finally:
            inflight.wait_all = original
    return {"loaded": loaded, "waits": len(waits)}


def waits_in_a_save_done_callback(root: str) -> dict:
    """What a callback that waits for saves, or reads the checkpoint, gets on the writer thread."""
    from deepspeed.utils import zero_to_fp32

    seen: dict = {}

    def callback(handle) -> None:
        for name, wait in (("wait_all", async_ckpt.wait_all), ("wait", lambda: ckpt.wait()),
                           ("close", lambda: ckpt.close())):
            try:
                wait()
                seen[name] = None
            except Exception as exc:
                seen[name] = (type(exc).__name__, str(exc))
        seen["read"] = len(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag=handle.tag))

    engine = workload.make_engine(2, "fp32")
    with async_ckpt.wrap(engine, root, on_save_done=callback) as ckpt:
        ckpt.save(tag="a").result(timeout=120)
        seen["saves_after"] = ckpt.save(tag="b").result(timeout=120).tag  # the refused close() stopped nothing
    return seen


def save_to_slow_storage(root: str) -> dict:
    """Every data write is slow: training steps run on while the save persists, and it still commits."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"latency_s": 0.3}) as ckpt:
        handle = ckpt.save(tag="slow")
        losses = workload.train(engine, 2, tokens, _rank())
        done_after_steps = handle.done()
        tag = handle.result(timeout=120).tag
    return {"steps": len(losses), "done_after_steps": done_after_steps, "tag": tag,
            "latest": open(f"{root}/latest").read()}


def environment(names: list[str]) -> list[str | None]:
    """The values of ``names`` in this rank's environment (None where unset)."""
    return [os.environ.get(name) for name in names]


def hang_on_rank(rank: int, seconds: float) -> dict:
    """``rank`` hangs (a sleep standing in for a stuck collective); the others answer at once."""
    if _rank() == rank:
        _stuck_in_a_long_wait(seconds)
    return {}


def _stuck_in_a_long_wait(seconds: float) -> None:
    time.sleep(seconds)


def return_a_lock() -> object:
    """A result no queue can carry back to the caller."""
    import threading

    return threading.Lock()


def return_the_rank() -> int:
    return _rank()


def _fast_persist_save(engine, root: str, tag: str) -> None:
    """A save by DeepSpeed's FastPersist engine (its Python writer): torch.save into a stream, as async_ckpt's
    default writes."""
    from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import groups

    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1"}.items():  # what the deepspeed launcher sets
        os.environ.setdefault(key, value)
    config = dict(engine.config)
    config["checkpoint"] = {"writer": {"type": "python", "decoupled": False, "io_buffer_size": 16 * 1024 * 1024,
                                       "io_buffer_double": True, "show_statistics": False, "data_parallel": "socket"}}
    stock_engine = engine.checkpoint_engine
    engine.checkpoint_engine = create_checkpoint_engine(DeepSpeedConfig(config), groups, engine.zero_optimization_stage(),
                                                        engine.has_moe_layers, False)
    try:
        type(engine).save_checkpoint(engine, root, tag=tag, client_state=dict(CLIENT_STATE))
    finally:
        engine.checkpoint_engine = stock_engine


class _LayoutPasses:
    """The layout passes (``record_offsets``) each save makes, by the name given to the save under way:
    counted by a wrapper patched into the checkpointer module, since the pass runs inside ``save()`` and
    no metric reports it. Passes outside a named save count under ``"outside a save"``."""

    def __init__(self) -> None:
        self.by_save: dict[str, int] = {}
        self._under_way = "outside a save"

    def save(self, ckpt, name: str, tag: str):
        """``ckpt.save(tag)``, its layout passes counted under ``name`` (the pass runs inside the call)."""
        self._under_way = name
        self.by_save[name] = 0
        try:
            return ckpt.save(tag=tag, client_state=dict(CLIENT_STATE))
        finally:
            self._under_way = "outside a save"

    @contextlib.contextmanager
    def patched(self):
        from async_ckpt import checkpointer

        real = checkpointer.record_offsets

        def counted(*args, **kwargs):
            self.by_save[self._under_way] = self.by_save.get(self._under_way, 0) + 1
            return real(*args, **kwargs)

        checkpointer.record_offsets = counted
        try:
            yield self
        finally:
            checkpointer.record_offsets = real


def lent_saves_against_fast_persist(combos: list[tuple[int, str]], root: str, s3_url: str | None = None,
                                    s3_options: dict | None = None) -> list[dict]:
    """Per ZeRO stage and dtype, on the 'small' model (optimizer records of megabytes, so they are lent):
    two async_ckpt saves with defaults (the first one's buffers placed by their layout, the second one's by
    where the first wrote them), one with ``exact_bytes``, optionally the same step to S3, FastPersist's
    save of the same step, then a fresh engine loads the async save and both engines train one more step.
    ``layouts``: the layout passes each of those saves made, by name."""
    out = []
    for stage, dtype in combos:
        base = f"{root}/zero{stage}-{dtype}"
        tokens = _tokens()
        engine = workload.make_engine(stage, dtype, size="small")
        workload.train(engine, 1, tokens, _rank())
        with _LayoutPasses().patched() as layouts:
            with async_ckpt.wrap(engine, f"{base}/async") as ckpt:
                first_handle = layouts.save(ckpt, "first", "first")
                first = first_handle.result(timeout=300)
                outside_reserve, staged = ckpt.staging_outside_reserve, ckpt.staging_bytes
                workload.train(engine, 1, tokens, _rank())
                handle = layouts.save(ckpt, "second", "second")
                handle.result(timeout=300)
            with async_ckpt.wrap(engine, f"{base}/exact", exact_bytes=True) as ckpt:
                layouts.save(ckpt, "exact_bytes", "second").result(timeout=300)
            if s3_url is not None:
                with async_ckpt.wrap(engine, f"{s3_url}/zero{stage}-{dtype}", storage_options=s3_options) as ckpt:
                    layouts.save(ckpt, "s3", "second").result(timeout=300)
        _fast_persist_save(engine, f"{base}/fast", "second")
        losses = workload.train(engine, 1, tokens, _rank())
        fresh = workload.make_engine(stage, dtype, size="small", seed=1234)
        fresh.load_checkpoint(f"{base}/async", tag="second")
        out.append({"combo": f"zero{stage}-{dtype}", "first_bytes": first.bytes_written,
                    "outside_reserve": outside_reserve, "estimated": estimate_snapshot(engine).nbytes,
                    "staged": staged,
                    "zero_copy_bytes": [first_handle.metrics["zero_copy_bytes"], handle.metrics["zero_copy_bytes"]],
                    "layouts": layouts.by_save, "losses": losses,
                    "loaded_losses": workload.train(fresh, 1, tokens, _rank())})
    return out


def floor_write_while_training(folder: str, *, file_size_limit_on_rank: int | None = None) -> dict:
    """The bench's write floor written while this rank trains (each step: one collective and a short
    sleep): whether the floor's write was running at each step, and its seconds. With
    ``file_size_limit_on_rank``, that rank's files may grow to 1 MiB only (RLIMIT_FSIZE), so its write
    fails part way with the OS's own EFBIG, as a full disk fails one."""
    import resource
    import signal
    import threading

    from async_ckpt.bench import floors

    seen: list[bool] = []

    def step() -> None:
        seen.append(any(t.name == "floor-write" for t in threading.enumerate()))
        dist.all_reduce(torch.ones(1))
        time.sleep(0.02)

    limited = file_size_limit_on_rank == _rank()
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.getsignal(signal.SIGXFSZ)
    if limited:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
    try:
        seconds = floors._timed_write_s(32 << 20, folder, direct=False, training=(step, torch.device("cpu")))
    finally:
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)
    return {"seconds": seconds, "steps": seen}
