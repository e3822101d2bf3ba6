"""Rank tasks for the commit-protocol tests: post-commit faults, save_latest=False, stuck saves, corrupt manifests."""

from __future__ import annotations

import json
import os
import threading
import time

import torch.distributed as dist

import async_ckpt
from async_ckpt import workload
from async_ckpt.catalog import read_manifest
from async_ckpt.storage import open_storage
from async_ckpt.verify import verify_tag
from rank_tasks import _outcome, _rank, _tokens, async_ckpt_log


def _engine():
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    return engine


def _tag_state(root: str, tag: str) -> dict:
    """What a tag looks like on disk: committed?, its files, whether every file matches the manifest."""
    storage = open_storage(root)
    manifest = read_manifest(storage, tag)
    files = sorted(n for n in os.listdir(os.path.join(root, tag)) if n.endswith(".pt"))
    return {"committed": manifest is not None, "files": files,
            "verified": manifest is not None and all(c.ok for c in verify_tag(storage, manifest))}


def post_commit_failure(root: str, fault: str) -> dict:
    """Tag 'a' commits; then writing 'latest' (fault='latest') or retention (fault='retention') fails for 'b'."""
    from faulty_fs import register

    register()
    engine = _engine()
    url = root if fault == "latest" else f"faulty://{root}"
    options = {"fail_rm": "async_ckpt_manifest.json"} if fault == "retention" else None
    with async_ckpt.wrap(engine, url, storage_options=options, keep_last=1 if fault == "retention" else None) as ckpt:
        ckpt.save(tag="a").result(timeout=120)
        dist.barrier()
        if _rank() == 0 and fault == "latest":  # a folder where the file was: 'latest' can be neither written nor read
            os.remove(os.path.join(root, "latest"))
            os.makedirs(os.path.join(root, "latest", "blocker"))
        dist.barrier()
        workload.train(engine, 1, _tokens(), _rank())
        handle = ckpt.save(tag="b")
        error = _outcome(lambda: handle.result(timeout=120))
        warnings = list(handle.result().warnings) if error is None else []
        dist.barrier()
        with async_ckpt_log() as log:
            loaded = ckpt.load()[0]
    return {"error": error, "warnings": warnings, "b": _tag_state(root, "b"), "a_kept": os.path.isdir(f"{root}/a"),
            "loaded": loaded, "load_log": [line for line in log if "resuming from" in line]}


def save_latest_false_then_load(root: str) -> dict:
    """engine.save_checkpoint(save_latest=False) after a normal save: load() resumes what 'latest' names."""
    engine = _engine()
    with async_ckpt.wrap(engine, root) as ckpt:
        ckpt.save(tag="a")
        workload.train(engine, 1, _tokens(), _rank())
        engine.save_checkpoint(root, tag="b", save_latest=False)
        ckpt.wait()
        manifest = read_manifest(open_storage(root), "b")
        loaded = ckpt.load()[0]
    return {"latest": open(f"{root}/latest").read(), "b_committed": manifest is not None,
            "b_sets_latest": manifest.sets_latest, "loaded": loaded}


def stuck_previous_save(root: str, gate: str) -> dict:
    """The first save's write is held: save(), wait() and close() each give up after wait_timeout_s, and its
    handle's result() after the timeout given to it. Saved with a tokenizer, which close() must leave to it."""
    from faulty_fs import register

    register()
    engine = _engine()
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate}, wait_timeout_s=2,
                           tokenizer=workload.build_tokenizer())
    first = ckpt.save(tag="first")
    seen = {"save": _outcome(lambda: ckpt.save(tag="second")),
            "wait": _outcome(lambda: ckpt.wait(timeout=1)),
            "result": _outcome(lambda: first.result(timeout=0.5)),
            "close": _outcome(ckpt.close)}
    seen["engine_given_back"] = not {"save_checkpoint", "save_16bit_model", "_take_model_step"} & set(engine.__dict__)
    dist.barrier()
    if _rank() == 0:
        open(gate, "w").close()
    seen["first_committed"] = first.result(timeout=120).tag
    deadline = time.monotonic() + 60
    while any(t.name.startswith("async_ckpt-writer") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["writer_threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("async_ckpt-writer")]
    seen["first_files"] = sorted(f.path for f in read_manifest(open_storage(root), "first").files)
    return seen


def close_failures(root: str, gate: str) -> dict:
    """A with-block raises while a save is held past wait_timeout_s; then a close whose release of the
    staging memory raises. What each close raised, and whether the engine was given back."""
    from faulty_fs import register

    register()
    engine = _engine()
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}/held", storage_options={"gate": gate}, wait_timeout_s=1)
    held = ckpt.save(tag="held")
    seen = {}
    try:
        with ckpt:
            raise ValueError("the block's own error")
    except Exception as exc:  # noqa: BLE001 - what the block's caller sees
        seen["block"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    if _rank() == 0:
        open(gate, "w").close()
    seen["held"] = held.result(timeout=120).tag
    ckpt = async_ckpt.wrap(engine, f"{root}/other")

    def broken() -> None:
        raise RuntimeError("injected: the staging memory cannot be freed")

    ckpt._pool.close = broken
    seen["close"] = _outcome(ckpt.close)
    seen["engine_given_back"] = (not {"save_checkpoint", "save_16bit_model", "_take_model_step"} & set(engine.__dict__)
                                 and type(engine.checkpoint_engine).__name__ != "AsyncCheckpointEngine")
    seen["shadow_left"] = os.path.exists(ckpt._shadow)
    return seen


def writer_bookkeeping_fails(root: str) -> dict:
    """The commit step of tag 'a' raises what the writer does not expect there (a BaseException, as a bug
    would); then tag 'b' is saved as usual."""
    from async_ckpt import writer

    engine = _engine()
    real_commit = writer.commit.commit

    def broken(*args, **kwargs):
        raise SystemExit("injected fault in the commit's bookkeeping")

    with async_ckpt.wrap(engine, root, wait_timeout_s=60) as ckpt:
        writer.commit.commit = broken
        try:
            a = _outcome(lambda: ckpt.save(tag="a").result(timeout=60))
        finally:
            writer.commit.commit = real_commit
        alive = ckpt._writer.alive
        workload.train(engine, 1, _tokens(), _rank())
        b = ckpt.save(tag="b").result(timeout=60).tag
    return {"a": a, "writer_alive": alive, "b": b, "latest": open(f"{root}/latest").read()}


def corrupt_older_manifest(root: str) -> dict:
    """Tags 'a' then 'b'; 'a''s manifest is then not JSON: load() resumes 'b' and names 'a' as corrupt."""
    engine = _engine()
    with async_ckpt.wrap(engine, root) as ckpt:
        ckpt.save(tag="a")
        workload.train(engine, 1, _tokens(), _rank())
        ckpt.save(tag="b")
        ckpt.wait()
        dist.barrier()
        if _rank() == 0:
            with open(f"{root}/a/async_ckpt_manifest.json", "w") as fh:
                fh.write("{'not': json")
        dist.barrier()
        with async_ckpt_log() as log:
            loaded = ckpt.load()[0]
        explicit = _outcome(lambda: ckpt.load("a"))
    return {"loaded": loaded, "log": [line for line in log if "corrupt" in line], "explicit": explicit,
            "manifest_b": json.loads(open(f"{root}/b/async_ckpt_manifest.json").read())["tag"]}


def resave_while_the_first_save_commits(root: str, gate: str) -> dict:
    """Rank 0's manifest write of the first save of 't' is held behind a gate opened 2 s later, so its
    data files are written (the staging buffers free) but 't' is not committed yet when the second
    save of 't' is agreed."""
    from faulty_fs import register

    register()
    engine = _engine()
    faults = {"gate": gate, "gate_match": "async_ckpt_manifest", "gate_ranks": [0]}
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options=faults) as ckpt:
        first = ckpt.save(tag="t")
        if _rank() == 0:
            threading.Timer(2.0, lambda: open(gate, "w").close()).start()
        second = _outcome(lambda: ckpt.save(tag="t"))
        first_error = first.exception(timeout=60)
    return {"second": second, "first_error": first_error and str(first_error),
            "t_manifest": read_manifest(open_storage(root), "t") is not None}
