"""Rank tasks: code in the same process reads a checkpoint folder right after a non-blocking save."""

from __future__ import annotations

import glob
import os
import sys
import tempfile

import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # taken before any wrap()

import async_ckpt
from async_ckpt import workload
from faulty_fs import register as register_faulty
from rank_tasks import _rank, _tokens

#: Every write() into a data file sleeps this long (torch.save writes each file in dozens of calls),
#: so each save is still in flight for seconds when the reader starts.
SLOW_WRITE_S = 0.05


def _slow_checkpointer(root: str):
    register_faulty()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    return engine, async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"latency_s": SLOW_WRITE_S})


def load_on_a_new_engine_right_after_save(root: str) -> dict:
    """A second, never-wrapped engine loads the folder right after save() returned."""
    engine, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="fresh")
    in_flight = not handle.done()
    other = workload.make_engine(2, "fp32", seed=99)
    path, _ = other.load_checkpoint(root)
    steps = other.global_steps
    ckpt.close()
    return {"in_flight_at_load": in_flight, "loaded": os.path.basename(os.path.dirname(path or "")),
            "steps": steps, "expected_steps": engine.global_steps}


def ds_to_universal_right_after_save(root: str, out: str) -> dict:
    """DeepSpeed's own converter, called (by its imported main) right after save() returned."""
    from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal, parse_arguments

    _, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="convert_me")
    in_flight = not handle.done()
    dist.barrier()
    converted = None
    if _rank() == 0:
        argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", f"{root}/convert_me", "--output_folder", out,
                                "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
        try:
            convert_to_universal(parse_arguments())
        finally:
            sys.argv = argv
        converted = sorted(os.listdir(os.path.join(out, "zero")))[:3]
    dist.barrier()
    ckpt.close()
    return {"in_flight_at_convert": in_flight, "converted": converted}


def wait_all_right_after_save(root: str) -> dict:
    """async_ckpt.wait_all() returns once the save in flight is committed."""
    _, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="a")
    in_flight = not handle.done()
    async_ckpt.wait_all()
    done = handle.done()
    ckpt.close()
    return {"in_flight": in_flight, "done_after_wait_all": done, "latest": open(f"{root}/latest").read()}


def synchronous_save_then_read_the_files(root: str) -> dict:
    """With synchronous=True, engine.save_checkpoint returns with its files committed (DeepSpeed's semantics):
    a torch.load of the model file right after it, as DeepSpeed's own tests do, finds it."""
    import torch

    register_faulty()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"latency_s": SLOW_WRITE_S}, synchronous=True):
        engine.save_checkpoint(root, tag="sync")
        module = torch.load(f"{root}/sync/mp_rank_00_model_states.pt", weights_only=False)["module"]
        latest = _read_latest(root)
    return {"module_keys": len(module), "latest": latest}


def synchronous_save_that_fails(root: str) -> dict:
    """With synchronous=True and on_error="raise", a failed write (rank 1's disk full) is raised by the save
    call itself on every rank; 'latest' stays on the previous tag."""
    from rank_tasks import _outcome

    register_faulty()
    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, f"faulty://{root}", synchronous=True, on_error="raise") as ckpt:
        ckpt.save(tag="good")
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"fail_ranks": [1]}, synchronous=True,
                         on_error="raise", commit_timeout_s=60) as ckpt:
        failed = _outcome(lambda: ckpt.save(tag="bad"))
    return {"failed": failed, "latest": _read_latest(root)}


def default_and_synchronous_saves_of_one_step(root: str, stage: int, dtype: str) -> dict:
    """The same step saved with the defaults (a staged snapshot, written in the background) and with
    synchronous=True: to buffered files (``direct_io=False``: the host state written in place while training
    waits) and with O_DIRECT (``direct``). Per synchronous save, the handle's metrics."""
    engine = workload.make_engine(stage, dtype)
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, f"{root}/staged", synchronous=False) as ckpt:
        ckpt.save(tag="t").result(timeout=120)
    out = {}
    for name, options in (("in_place", {"direct_io": False}), ("direct", {})):
        with async_ckpt.wrap(engine, f"{root}/{name}", synchronous=True, **options) as ckpt:
            handle = ckpt.save(tag="t")
            out[name] = {key: handle.metrics.get(key) for key in ("in_place_bytes", "bytes_written", "staging_bytes",
                                                                  "commit_wait_s")}
    return out


def synchronous_save_given_up_while_it_reads_the_state(root: str, gate: str) -> dict:
    """A synchronous save gives up waiting (wait_timeout_s) while its writes, held behind a gate, still read
    the training state in place; training goes on and changes that state, then the gate opens."""
    from rank_tasks import _outcome

    register_faulty()
    engine = workload.make_engine(2, "fp32")
    tokens = _tokens()
    workload.train(engine, 1, tokens, _rank())
    with async_ckpt.wrap(engine, f"faulty://{root}", synchronous=True) as ckpt:
        ckpt.save(tag="good")
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate}, synchronous=True,
                         on_error="raise", wait_timeout_s=2) as ckpt:
        gave_up = _outcome(lambda: ckpt.save(tag="torn"))
        workload.train(engine, 1, tokens, _rank())
        if _rank() == 0:
            open(gate, "w").close()
        failed = _outcome(lambda: ckpt.wait(timeout=120))
    return {"gave_up": gave_up, "failed": failed, "latest": _read_latest(root),
            "torn_committed": os.path.exists(f"{root}/torn/async_ckpt_manifest.json")}


def per_rank_tags(root: str, mode: str) -> dict:
    """engine.save_checkpoint with a different tag on each rank, under checkpoint.tag_validation=mode."""
    import deepspeed

    from rank_tasks import _outcome

    config = workload.ds_config(2, "fp32")
    config["checkpoint"] = {"tag_validation": mode}
    model = workload.build_model("tiny")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, root) as ckpt:
        error = _outcome(lambda: engine.save_checkpoint(root, tag=f"tag-{_rank()}"))
        api_error = _outcome(lambda: ckpt.save(tag=f"tag-{_rank()}"))
        empty_dir = _outcome(lambda: engine.save_checkpoint(""))
    own = f"{root}/tag-{_rank()}"
    return {"error": error, "api_error": api_error, "empty_dir": empty_dir,
            "own_tag_files": sorted(os.listdir(own)) if os.path.isdir(own) else None}


def resave_a_committed_tag(root: str) -> dict:
    """engine.save_checkpoint of a committed tag: refused by default, DeepSpeed's overwrite with overwrite_tags."""
    from rank_tasks import _outcome

    engine = workload.make_engine(2, "fp32")
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, root) as strict:
        strict.save(tag="t").result(timeout=60)
        refused = _outcome(lambda: engine.save_checkpoint(root, tag="t"))
    first_steps = engine.global_steps
    workload.train(engine, 1, _tokens(), _rank())
    with async_ckpt.wrap(engine, root, overwrite_tags=True):
        engine.save_checkpoint(root, tag="t")
        other = workload.make_engine(2, "fp32", seed=99)
        other.load_checkpoint(root, tag="t")
    return {"refused": refused, "first_steps": first_steps, "resaved_steps": engine.global_steps,
            "loaded_steps": other.global_steps, "latest": open(f"{root}/latest").read()}


def zero_to_fp32_imported_before_wrap_right_after_save(root: str) -> dict:
    """zero_to_fp32's function, taken with ``from ... import`` before the first wrap(), right after save()."""
    _, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="consolidate_me")
    in_flight = not handle.done()
    state = get_fp32_state_dict_from_zero_checkpoint(root, tag="consolidate_me")
    ckpt.close()
    return {"in_flight": in_flight, "tensors": len(state)}


def save_then_destroy_the_process_group(root: str) -> dict:
    """DeepSpeed's test harness ends its ranks so: ``deepspeed.comm.destroy_process_group()``, right after save()."""
    import deepspeed.comm

    from commit_tasks import _tag_state

    _, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="before_destroy")
    in_flight = not handle.done()
    deepspeed.comm.destroy_process_group()
    return {"in_flight": in_flight, "latest": _read_latest(root), **_tag_state(root, "before_destroy")}


def save_failing_then_destroy_the_process_group(root: str) -> dict:
    """A save whose write fails (on_error="raise"), then ``destroy_process_group()`` as a script's ``finally:``
    runs it: the failure is raised, and the group is destroyed even so."""
    from rank_tasks import _outcome

    register_faulty()
    engine = workload.make_engine(2, "fp32")
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"fail_ranks": [0, 1]}, on_error="raise")
    ckpt.save(tag="failing")
    raised = _outcome(dist.destroy_process_group)
    return {"raised": raised, "group_left": dist.is_initialized()}


def save_held_then_destroy_the_process_group(root: str, gate: str) -> dict:
    """A save held at the storage past wait_timeout_s, then ``destroy_process_group()``: the timeout is raised
    and the group kept, as the save still needs its store to commit; once let through, it commits."""
    from rank_tasks import _outcome

    register_faulty()
    engine = workload.make_engine(2, "fp32")
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate}, wait_timeout_s=2)
    handle = ckpt.save(tag="held")
    raised = _outcome(dist.destroy_process_group)
    group_kept = dist.is_initialized()
    if _rank() == 0:
        open(gate, "w").close()
    handle.result(timeout=120)
    ckpt.close()
    return {"raised": raised, "group_kept": group_kept, "latest": _read_latest(root)}


#: How long :func:`save_and_exit` lets its forked child take to end (one that waited for the parent's
#: save would take seconds, as long as the slow save).
FORKED_CHILD_WAIT_S = 20


def save_and_exit(root: str, rank: int, world_size: int, port: int, answers) -> None:
    """A multiprocessing child (as DeepSpeed's pool workers are) joins a group, saves and returns, which ends it.

    Before returning it forks a child that exits at once (as a DataLoader worker may), and says how
    long that child took to end: it must not wait for its parent's save.
    """
    import multiprocessing
    import time

    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    _, ckpt = _slow_checkpointer(root)
    handle = ckpt.save(tag="before_exit")
    in_flight = not handle.done()
    started = time.monotonic()
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join(timeout=FORKED_CHILD_WAIT_S)
    forked_child_s = time.monotonic() - started if child.exitcode is not None else None
    child.kill()
    answers.put({"rank": rank, "in_flight": in_flight, "in_flight_after_fork": not handle.done(),
                 "forked_child_s": forked_child_s,
                 "shadow_folders": glob.glob(os.path.join(tempfile.gettempdir(), "async_ckpt_shadow_*"))})


def _read_latest(root: str) -> str | None:
    path = os.path.join(root, "latest")
    return open(path).read() if os.path.exists(path) else None
