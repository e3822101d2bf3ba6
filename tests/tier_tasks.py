"""Rank functions for tests/test_tiers.py: two simulated nodes, each rank seeing only its own local-tier
folder (``node{rank}``), the durable tier on the moto S3 server."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from typing import Iterator

import torch
import torch.distributed as dist

import async_ckpt
from async_ckpt import workload
from async_ckpt.catalog import read_manifest
from async_ckpt.layout import MANIFEST
from async_ckpt.gc import collect_garbage
from async_ckpt.storage import open_storage
from rank_tasks import STEPS_AFTER, _flip_byte, _outcome, async_ckpt_log

STAGE = 2  # ZeRO-2: rank 1 reads the model-states file that rank 0 writes, so node folders must each hold one


def _rank() -> int:
    return dist.get_rank()


def node_folder(work: str, rank: int) -> str:
    return os.path.join(work, f"node{rank}")


def _wrap(engine, url: str, options: dict, work: str, **extra):
    return async_ckpt.wrap(engine, url, storage_options=options, local_tier=node_folder(work, _rank()),
                           keep_last=3, local_keep_last=2, cache_dir=os.path.join(work, f"cache{_rank()}"), **extra)


def _moments(handle) -> dict:
    local = handle.local_result(timeout=120)
    durable = handle.result(timeout=120)
    return {"local_url": local.url, "durable_url": durable.url, "tier": handle.metrics["tier"],
            "local_committed_s": handle.metrics["local_committed_s"], "durable_s": handle.metrics["durable_s"]}


def save_in_tiers(url: str, options: dict, work: str) -> dict:
    """Stock save at step 3 (the reference), then tiered saves 'a' (same step), 'b', 'c' with training between."""
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32")
    workload.train(engine, 3, tokens, _rank())
    type(engine).save_checkpoint(engine, os.path.join(work, "stock"), tag="a")
    out: dict = {}
    with _wrap(engine, url, options, work, tokenizer=workload.build_tokenizer()) as ckpt:
        handle = ckpt.save(tag="a")
        out["local_done_first"] = handle.wait_local(120) and not handle.done()
        out["a"] = _moments(handle)
        out["losses_after_a"] = workload.train(engine, STEPS_AFTER, tokens, _rank())
        out["b"] = _moments(ckpt.save(tag="b"))
        workload.train(engine, 1, tokens, _rank())
        out["c"] = _moments(ckpt.save(tag="c"))
        out["losses_after_c"] = workload.train(engine, STEPS_AFTER, tokens, _rank())
    return out


def resume_in_tiers(url: str, options: dict, work: str, stock_dir: str | None = None) -> dict:
    """A new job resumes the newest tag, then (with ``stock_dir``) tag 'a' from the bucket next to a stock
    DeepSpeed load of the same step: every rank trains on and reports its losses and which tier it read."""
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=4321)
    out: dict = {}
    with async_ckpt_log() as log, _wrap(engine, url, options, work) as ckpt:
        out["tag"], _ = ckpt.load()
        out["losses"] = workload.train(engine, STEPS_AFTER, tokens, _rank())
        if stock_dir:
            out["named_tag"], _ = ckpt.load(tag="a")
            out["losses_named"] = workload.train(engine, STEPS_AFTER, tokens, _rank())
    out["tiers_used"] = [line for line in log if "resumes" in line and "tier" in line]
    if stock_dir:
        stock = workload.make_engine(STAGE, "fp32", seed=99)
        stock.load_checkpoint(stock_dir, tag="a")
        out["losses_stock"] = workload.train(stock, STEPS_AFTER, tokens, _rank())
    return out


def save_to_a_full_local_tier(url: str, options: dict, work: str) -> dict:
    """With no room in the local tier (a 1-byte quota) the save goes straight to the durable tier."""
    engine = workload.make_engine(STAGE, "fp32", seed=5)
    with async_ckpt_log() as log, _wrap(engine, url, options, work, local_tier_max_bytes=1) as ckpt:
        handle = ckpt.save(tag="direct")
        result = handle.result(timeout=120)
    return {"tier": handle.metrics["tier"], "url": result.url, "local_url": handle.local_result().url,
            "warnings": [line for line in log if "no room" in line]}


def killed_mid_drain(url: str, options: dict, work: str, proxy: str, results: str) -> dict:
    """Resume, save 'd' (committed on both nodes' folders), train on, then SIGKILL rank 1 while the proxy
    holds its upload of 'd' to the bucket: the drain is cut short."""
    from s3_server import held_requests, set_hold

    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=7)
    ckpt = _wrap(engine, url, options, work)
    ckpt.load()
    ckpt.wait()
    if _rank() == 1:
        set_hold(proxy, "d/zero_pp_rank_1")
    dist.barrier()
    handle = ckpt.save(tag="d")
    handle.wait_local(120)
    losses = workload.train(engine, STEPS_AFTER, tokens, _rank())
    with open(f"{results}.{_rank()}.json", "w") as fh:
        json.dump({"losses_after_d": losses, "local_committed": handle.local_done() and not handle.done()}, fh)
    if _rank() == 1:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not held_requests(proxy):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 waits in the drain's commit for rank 1 until the group is torn down
    return {}


def resume_after_killed_drain(url: str, options: dict, work: str) -> dict:
    """The next job: wrap() finds 'd' committed locally but not in the bucket and drains it again; load()
    resumes 'd' from the node folders; close() waits for the drain."""
    logging.getLogger("async_ckpt").setLevel(logging.INFO)
    engine = workload.make_engine(STAGE, "fp32", seed=8)
    with async_ckpt_log() as log, _wrap(engine, url, options, work) as ckpt:
        tag, _ = ckpt.load()
        losses = workload.train(engine, STEPS_AFTER, workload.token_stream(), _rank())
    return {"tag": tag, "losses": losses, "resumed_drain": [line for line in log if "resuming the drain" in line],
            "tiers_used": [line for line in log if "resumes" in line and "tier" in line]}


def drain_fails_then_heals(durable: str, work: str, heal_by: str) -> dict:
    """Rank 1's writes to the durable tier fail (ENOSPC injected), so the drain of 'first' fails after its
    local commit; then the storage heals and the drain is redone by ``close()`` or by the next ``save()``."""
    from faulty_fs import register

    register()
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    workload.train(engine, 1, tokens, _rank())
    options = {"fail_ranks": [1], "skip_instance_cache": True}  # a filesystem of its own: healed below
    ckpt = async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=options,
                           local_tier=node_folder(work, _rank()))
    handle = ckpt.save(tag="first")
    out = {"local_committed": handle.wait_local(120) and handle.local_result().tag == "first",
           "drain_error": str(handle.exception(timeout=120)),
           "durable_latest_after_failure": os.path.exists(os.path.join(durable, "latest"))}
    dist.barrier()  # every rank's drain has ended, and removed what it copied: gc then sees a folder at rest
    out["gc_after_failure"] = collect_garbage(open_storage(durable), grace_s=0, dry_run=True).incomplete_tags
    out["durable_files_after_failure"] = sorted(os.path.relpath(os.path.join(folder, name), durable)
                                                for folder, _, names in os.walk(durable) for name in names)
    dist.barrier()  # no rank drains again (close) before every rank has looked
    ckpt.storage.fs.fail_ranks = set()  # the durable tier heals
    if heal_by == "save":
        workload.train(engine, 1, tokens, _rank())
        ckpt.save(tag="second").result(timeout=120)
    ckpt.close()
    return out


def _wrap_where_rank_1_cannot_drain(durable: str, work: str, on_error: str):
    """A fresh engine wrapped with a local tier and a durable tier to which rank 1's writes always fail."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    options = {"fail_ranks": [1], "skip_instance_cache": True}
    return async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=options,
                           local_tier=node_folder(work, _rank()), on_error=on_error)


def drain_fails_for_good(durable: str, work: str) -> dict:
    """Rank 1's writes to the durable tier keep failing: 'first' is committed in both node folders and
    never at the URL (its drain, and close()'s retry, fail)."""
    ckpt = _wrap_where_rank_1_cannot_drain(durable, work, on_error="warn")
    handle = ckpt.save(tag="first")
    out = {"local_committed": handle.wait_local(120), "drained": handle.exception(timeout=120) is None}
    said: list[str] = []
    listener = logging.Handler(logging.ERROR)
    listener.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("async_ckpt").addHandler(listener)
    try:
        ckpt.close()  # its last pass drains 'first' again, and fails again
    finally:
        logging.getLogger("async_ckpt").removeHandler(listener)
    out["said_at_close"] = [line[line.index("drains it again") - 60:] for line in said if "drains it again" in line]
    return out


def saves_past_a_drain_that_keeps_failing(durable: str, work: str) -> dict:
    """on_error="raise"; rank 1's writes to the URL keep failing, so 'first' can never be drained. The next
    save raises that failure (and queues the drain again, which fails again); the saves after it go on."""
    ckpt = _wrap_where_rank_1_cannot_drain(durable, work, on_error="raise")
    handle = ckpt.save(tag="first")
    handle.exception(timeout=120)
    out = {"second": _outcome(lambda: ckpt.save(tag="second"))}
    out["wait_after_the_retry"] = _outcome(ckpt.wait)
    third = ckpt.save(tag="third")
    out["third_local"] = third.wait_local(120) and third.local_result().tag
    with contextlib.suppress(Exception):
        ckpt.close()
    return out


def restart_past_a_tag_whose_node_copy_is_lost(durable: str, work: str) -> dict:
    """'first' is committed in both node folders and never at the URL (rank 1's writes to it fail); then node
    1's copy is lost (a node replaced). The next job (a new wrap, on_error="raise", the URL writable) drains
    'first' again from wrap(), which fails on rank 1 for good: logged, not raised, so that the job saves on."""
    import shutil

    ckpt = _wrap_where_rank_1_cannot_drain(durable, work, on_error="warn")
    ckpt.save(tag="first").exception(timeout=120)
    with contextlib.suppress(Exception):
        ckpt.close()
    if _rank() == 1:
        shutil.rmtree(os.path.join(node_folder(work, 1), "first"))
    dist.barrier()
    engine = workload.make_engine(STAGE, "fp32", seed=12)
    with async_ckpt_log() as log:
        ckpt = async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank()), on_error="raise")
        out = {"redrained": [line for line in log if "resuming the drain" in line]}
        out["wait"] = _outcome(ckpt.wait)
        out["second"] = _outcome(lambda: ckpt.save(tag="second").result(timeout=120))
        out["failures"] = [error.tag for error in ckpt.failures]
        ckpt.close()
    out["latest"] = open(os.path.join(durable, "latest")).read()
    return out


def nodes_found(durable: str, folders: list[str]) -> dict:
    """wrap() with rank r's local tier at ``folders[r]``, each rank on a host name of its own (as two hosts
    over one NFS folder): the ranks it takes for one node, and what the folder holds after wrap()."""
    import socket

    hostname = socket.gethostname
    socket.gethostname = lambda: f"host{_rank()}"
    try:
        engine = workload.make_engine(STAGE, "fp32", seed=13)
        with async_ckpt.wrap(engine, durable, local_tier=folders[_rank()]) as ckpt:
            dist.barrier()  # every rank's wrap() is done with the folder
            return {"node_ranks": list(ckpt._node_ranks), "left": sorted(os.listdir(folders[_rank()]))}
    finally:
        socket.gethostname = hostname


def listing_while_a_save_is_handed_to_its_drain(durable: str, work: str) -> dict:
    """Rank 1's drains keep failing, so each save lists what to drain again. 'second' is committed in the
    node folders while its writer's hand-over to the drainer is held; 'third' is saved meanwhile, after
    the redrain of 'first' failed: rank 0's listing then finds 'second' committed but not in the drainer."""
    ckpt = _wrap_where_rank_1_cannot_drain(durable, work, on_error="warn")
    held, submit = threading.Event(), ckpt._drainer.submit

    def held_hand_over(job) -> None:
        if job.tag == "second" and threading.current_thread().name.startswith("async_ckpt-writer"):
            held.wait(120)
        submit(job)

    ckpt._drainer.submit = held_hand_over
    with async_ckpt_log() as log:
        ckpt.save(tag="first").exception(timeout=120)
        second = ckpt.save(tag="second")  # lists 'first' to drain again: that redrain fails too
        second.wait_local(120)
        deadline = time.monotonic() + 120
        while not ckpt._drain_failed and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
        ckpt.save(tag="third")
        held.set()
        with contextlib.suppress(Exception):
            ckpt.close()
    return {"listed": [line for line in log if "resuming the drain" in line]}


def load_that_fails_on_rank_1_with_a_client_error(durable: str, work: str) -> dict:
    """A tiered load whose read of the chosen tag raises, on rank 1 only, an error of the storage client's
    own type (not an OSError), as botocore's ClientError is."""
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank())) as ckpt:
        ckpt.save(tag="a").result(timeout=120)
        if _rank() == 1:
            def client_error(*args, **kwargs):
                raise RuntimeError("injected: the storage client's own error")
            ckpt._nearest_copy = client_error
        return {"load": _outcome(ckpt.load)}


def load_of_a_consolidated_tag_in_tiers(durable: str, work: str) -> dict:
    """A consolidated save (straight to the URL), then load(tag=...) of it with a local tier."""
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank())) as ckpt:
        tag = ckpt.save_consolidated().tag
        ckpt.wait()
        return {"load": _outcome(lambda: ckpt.load(tag=tag))}


def load_of_a_tag_whose_url_manifest_is_corrupt(durable: str, work: str) -> dict:
    """A save drained to the URL, whose manifest there is then garbled: load(tag=...) with a local tier,
    whose node folders still hold the tag committed."""
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank())) as ckpt:
        ckpt.save(tag="t").result(timeout=120)
        dist.barrier()
        if _rank() == 0:
            with open(os.path.join(durable, "t", MANIFEST), "w") as fh:
                fh.write("{not json")
        dist.barrier()
        return {"load": _outcome(lambda: ckpt.load(tag="t"))}


def close_while_a_drain_is_held(durable: str, gate: str, work: str, wait_timeout_s: float) -> dict:
    """A save committed on the local tier whose drain to the URL is held: close() gives up, and how long it took."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    ckpt = async_ckpt.wrap(engine, f"faulty://{durable}", storage_options={"gate": gate},
                           local_tier=node_folder(work, _rank()), wait_timeout_s=wait_timeout_s)
    ckpt.save(tag="held").wait_local(120)
    started = time.monotonic()
    outcome = _outcome(ckpt.close)
    close_s = time.monotonic() - started
    dist.barrier()
    if _rank() == 0:
        open(gate, "w").close()
    deadline = time.monotonic() + 60  # the held drain ends once the gate opens: no thread outlives the task
    while any(t.name.startswith("async_ckpt-drainer") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"close": outcome, "close_s": close_s}


def load_while_a_drain_fails_on_one_rank(durable: str, work: str) -> dict:
    """Rank 1's drain of 'first' fails at once; rank 0's upload is held at a gate, still running, when both
    call load() with on_error="raise"."""
    from faulty_fs import register

    register()
    gate = os.path.join(work, "gate")
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    options = {"fail_ranks": [1], "gate": gate, "gate_ranks": [0], "skip_instance_cache": True}
    ckpt = async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=options,
                           local_tier=node_folder(work, _rank()), on_error="raise")
    handle = ckpt.save(tag="first")
    handle.wait_local(120)
    if _rank() == 1:
        handle.exception(timeout=120)  # its drain failed
    dist.barrier()
    out = {"load": _outcome(ckpt.load), "drain_still_running": not handle.done()}
    if _rank() == 0:
        open(gate, "w").close()
    dist.barrier()
    with contextlib.suppress(Exception):
        ckpt.close()
    return out


def resume_on_fewer_ranks(durable: str, work: str) -> dict:
    """One rank, on node 0's folder, after a job of two left 'first' committed there but not at the URL."""
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    with async_ckpt_log() as lines:
        async_ckpt.wrap(engine, durable, local_tier=node_folder(work, 0)).close()
    return {"committed_at_url": read_manifest(open_storage(durable), "first") is not None,
            "latest_at_url": os.path.exists(os.path.join(durable, "latest")),
            "errors": [line for line in lines if "cannot drain" in line]}


def wrap_fails_on_one_rank(durable: str, work: str, where: str) -> dict:
    """wrap() fails on one rank only: rank 1's local tier lies under a plain file (``where="local_tier"``,
    before any thread starts), or rank 0's listing of the durable tier fails (``"drain_listing"``: the
    search for drains to resume, after the writer thread started and the staging memory was reserved)."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    own_engine = engine.checkpoint_engine
    blocker = os.path.join(work, "plain-file")
    if _rank() == 1:
        open(blocker, "w").close()
    tier = os.path.join(blocker, "node1") if where == "local_tier" and _rank() == 1 else node_folder(work, _rank())
    options = {"fail_ls_ranks": [0] if where == "drain_listing" else [], "skip_instance_cache": True}
    before = set(threading.enumerate())
    error = _outcome(lambda: async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=options,
                                             local_tier=tier, retry_attempts=1))
    dist.barrier()  # both ranks got here: neither waits in a collective the other left
    return {"error": error, "engine_given_back": engine.checkpoint_engine is own_engine
            and "save_checkpoint" not in engine.__dict__ and "save_16bit_model" not in engine.__dict__,
            "threads_left": [t.name for t in threading.enumerate() if t not in before and t.is_alive()]}


def fallback_in_tiers(durable: str, work: str) -> dict:
    """Tags 'older', 'newer' and 'newest' saved in tiers and drained. A file of 'newer' is corrupted in both
    tiers: a load of it is refused without fallback, and with fallback takes 'older' (not 'newest'); the
    default load still takes 'newest'. Then 'newest' is corrupted too: the default load falls back past
    both to 'older'; with 'newer' repaired, to 'newer'. Last, a later async_ckpt version's 'v2' (a manifest
    format of its own) is what 'latest' names, at the URL and then in each node folder: the default load
    is refused, a load naming 'older' is not."""
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=11)
    optim = f"zero_pp_rank_{_rank()}_mp_rank_00_optim_states.pt"

    def corrupt(tag: str) -> None:  # each rank its own file, in its node folder and in the durable one
        dist.barrier()
        for root in (node_folder(work, _rank()), durable):
            _flip_byte(os.path.join(root, tag, optim))
        dist.barrier()

    with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank())) as ckpt:
        for tag in ("older", "newer", "newest"):
            ckpt.save(tag=tag)
            workload.train(engine, 1, tokens, _rank())
        ckpt.wait()
        corrupt("newer")
        out = {"refused": _outcome(lambda: ckpt.load(tag="newer")),
               "named": ckpt.load(tag="newer", fallback=True)[0], "newest_whole": ckpt.load(fallback=True)[0]}
        corrupt("newest")
        out["both_broken"] = ckpt.load(fallback=True)[0]
        corrupt("newer")  # flipped back: whole again
        out["newer_repaired"] = ckpt.load(fallback=True)[0]
        if _rank() == 0:  # a later async_ckpt version saved 'v2' at the URL in a format of its own
            _save_of_a_later_version(durable)
        dist.barrier()
        out["latest_unsupported"] = _outcome(lambda: ckpt.load(fallback=True))
        out["named_past_unsupported"] = ckpt.load(tag="older")[0]
        dist.barrier()
        if _rank() == 0:
            with open(os.path.join(durable, "latest"), "w") as fh:
                fh.write("newest")
        _save_of_a_later_version(node_folder(work, _rank()))  # each node's own
        dist.barrier()
        out["node_latest_unsupported"] = _outcome(lambda: ckpt.load(fallback=True))
    return out


def _save_of_a_later_version(root: str) -> None:
    """'v2' in ``root``, its manifest in a format of a later async_ckpt version, and 'latest' naming it."""
    with open(os.path.join(root, "newest", MANIFEST)) as fh:
        manifest = {**json.load(fh), "tag": "v2", "format": "async_ckpt/2"}
    os.makedirs(os.path.join(root, "v2"))
    with open(os.path.join(root, "v2", MANIFEST), "w") as fh:
        json.dump(manifest, fh)
    with open(os.path.join(root, "latest"), "w") as fh:
        fh.write("v2")


def load_then_save_in_tiers(durable: str, work: str) -> dict:
    """A job saves 'a' and 'b' in tiers (keep_last=2 at the URL, local_keep_last=2); the next job loads, then
    saves 'c' and 'd'. The load pauses the drains' retention and the next save resumes it: what the node
    folders and the URL hold after."""
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=13)
    for tags in (("a", "b"), ("c", "d")):
        with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank()), keep_last=2,
                             local_keep_last=2) as ckpt:
            if tags[0] == "c":
                ckpt.load()
            for tag in tags:
                workload.train(engine, 1, tokens, _rank())
                ckpt.save(tag=tag).result(timeout=120)
    local, url = open_storage(node_folder(work, _rank())), open_storage(durable)
    return {"node_tags": [tag for tag in "abcd" if read_manifest(local, tag) is not None],
            "url_tags": [tag for tag in "abcd" if read_manifest(url, tag) is not None]}


def resume_without_verification_past_a_shard_gone_from_node1(durable: str, work: str) -> dict:
    """verify_on_load=False: tag 'only' saved in tiers and drained, then rank 1's optimizer shard deleted from its
    node folder: the load reads it from the durable folder rather than hand DeepSpeed a folder without it."""
    engine = workload.make_engine(STAGE, "fp32", seed=12)
    with async_ckpt_log() as log, async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank()),
                                                  verify_on_load=False) as ckpt:
        ckpt.save(tag="only").result(timeout=120)
        dist.barrier()
        if _rank() == 1:
            os.unlink(os.path.join(node_folder(work, 1), "only", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        dist.barrier()
        out = {"load": _outcome(ckpt.load)}
    out["tiers_used"] = [line for line in log if "resumes" in line and "tier" in line]
    return out


def node_commit_fails_on_node1(durable: str, work: str) -> dict:
    """Node 1's folder holds a directory where DeepSpeed's ``zero_to_fp32.py`` goes, so its leader (rank 1)
    cannot commit tag 't' there, while rank 0's commit of 't' holds."""
    if _rank() == 1:
        os.makedirs(os.path.join(node_folder(work, 1), "zero_to_fp32.py"))
    engine = workload.make_engine(STAGE, "fp32", seed=12)
    workload.train(engine, 1, workload.token_stream(), _rank())
    with async_ckpt.wrap(engine, durable, local_tier=node_folder(work, _rank())) as ckpt:
        handle = ckpt.save(tag="t")
        handle.result(timeout=120)
    dist.barrier()
    node = node_folder(work, _rank())
    marks = os.path.join(node, "t", ".async_ckpt")
    return {"local_warnings": list(handle.local_result().warnings), "marks": sorted(os.listdir(marks)) if os.path.isdir(marks) else [],
            "node_manifest": os.path.exists(os.path.join(node, "t", "async_ckpt_manifest.json")),
            "node_gc": collect_garbage(open_storage(node), grace_s=0, dry_run=True).incomplete_tags}


def failing_overwrite_in_tiers(durable: str, work: str) -> dict:
    """Tag 't' committed in both tiers; an overwrite of it with no room on the local tier goes straight to
    the durable tier, where rank 1's write fails. (gc keeps 't' in both for now: ``latest`` names it.)"""
    from faulty_fs import register

    register()
    engine = workload.make_engine(STAGE, "fp32", seed=13)
    workload.train(engine, 1, workload.token_stream(), _rank())
    node = node_folder(work, _rank())
    with async_ckpt.wrap(engine, durable, local_tier=node) as ckpt:
        ckpt.save(tag="t").result(timeout=120)
    faults = {"fail_ranks": [1], "skip_instance_cache": True}
    with async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=faults, local_tier=node,
                         local_tier_max_bytes=1, overwrite_tags=True) as ckpt:
        error = ckpt.save(tag="t").exception(timeout=120)
    dist.barrier()
    return {"error": str(error),
            "node_manifest": os.path.exists(os.path.join(node, "t", "async_ckpt_manifest.json")),
            "node_marks": sorted(os.listdir(os.path.join(node, "t", ".async_ckpt"))),
            "durable_marks": sorted(os.listdir(os.path.join(durable, "t", ".async_ckpt")))}


def overwrite_past_a_full_local_tier_then_resume(durable: str, work: str) -> dict:
    """Tag 't' saved in tiers; after two more steps an overwrite of it, with no room on the local tier,
    goes straight to the durable tier, so node 1 still holds the first save of 't' committed (rank 0
    uncommits only its own node's copy). A new job then loads 't'."""
    logging.getLogger("async_ckpt").setLevel(logging.INFO)
    tokens = workload.token_stream()
    engine = workload.make_engine(STAGE, "fp32", seed=14)
    workload.train(engine, 1, tokens, _rank())
    node = node_folder(work, _rank())
    with async_ckpt.wrap(engine, durable, local_tier=node) as ckpt:
        ckpt.save(tag="t").result(timeout=120)
    workload.train(engine, 2, tokens, _rank())
    saved = [part.detach().clone() for part in engine.optimizer.single_partition_of_fp32_groups]
    with async_ckpt.wrap(engine, durable, local_tier=node, local_tier_max_bytes=1, overwrite_tags=True) as ckpt:
        ckpt.save(tag="t").result(timeout=120)
    workload.train(engine, 2, tokens, _rank())
    with async_ckpt_log() as log, async_ckpt.wrap(engine, durable, local_tier=node) as ckpt:
        ckpt.load(tag="t")
    loaded = engine.optimizer.single_partition_of_fp32_groups
    return {"as_saved": all(torch.equal(a, b) for a, b in zip(saved, loaded)),
            "node_holds_t": os.path.exists(os.path.join(node, "t", "async_ckpt_manifest.json")),
            "tiers_used": [line for line in log if "resumes t from" in line]}


@contextlib.contextmanager
def _after_a_failed_drain_of_first(durable: str, work: str, seed: int, **wrap_options) -> Iterator:
    """A tiered checkpointer whose drain of tag 'first' failed (rank 1's writes to the durable tier),
    then the durable tier healed: the checkpointer, open."""
    from faulty_fs import register

    register()
    engine = workload.make_engine(STAGE, "fp32", seed=seed)
    workload.train(engine, 1, workload.token_stream(), _rank())
    options = {"fail_ranks": [1], "skip_instance_cache": True}
    with async_ckpt.wrap(engine, f"faulty://{durable}", storage_options=options,
                         local_tier=node_folder(work, _rank()), **wrap_options) as ckpt:
        ckpt.save(tag="first").exception(timeout=120)
        dist.barrier()
        ckpt.storage.fs.fail_ranks = set()  # the durable tier heals
        yield ckpt


def refused_resave_after_a_failed_drain(durable: str, work: str, on_error: str) -> dict:
    """After a failed drain of 'first', a save of 'first' again is refused: as committed locally, or
    (``on_error="raise"``) with the drain's failure. The drain of 'first' is still redone."""
    with _after_a_failed_drain_of_first(durable, work, 15, on_error=on_error) as ckpt:
        refused = _outcome(lambda: ckpt.save(tag="first"))
        ckpt.wait(timeout=120)
        drained = read_manifest(open_storage(durable), "first") is not None
    return {"refused": refused, "drained_before_close": drained}


def overwrite_after_a_failed_drain(durable: str, work: str) -> dict:
    """As above, but with ``overwrite_tags`` the second save of 'first' overwrites it: the earlier
    save's drain is not redone into the folder this save writes, and the URL gets the second save."""
    logging.getLogger("async_ckpt").setLevel(logging.INFO)
    with async_ckpt_log() as log, _after_a_failed_drain_of_first(durable, work, 16, overwrite_tags=True) as ckpt:
        ckpt.save(tag="first").result(timeout=120)
        ckpt.wait(timeout=120)
    local_id = read_manifest(open_storage(node_folder(work, _rank())), "first").save_id
    return {"skipped": [line for line in log if "not draining the earlier save of first" in line],
            "drained": [line for line in log if line.startswith("drained first to")],
            "failures": len(ckpt.failures),
            "url_has_the_second_save": read_manifest(open_storage(durable), "first").save_id == local_id}
