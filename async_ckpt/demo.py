"""The demo: train a small GPT with DeepSpeed ZeRO-3 on 2 CPU ranks, save asynchronously, resume.

Phase 1 trains and saves every few steps, printing per save how long training was blocked
against how long the write took (in the background, unless wrap() chose synchronous saves). Phase 2
starts a *new* process group, resumes from the latest committed checkpoint and shows the loss carrying on.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

from async_ckpt.arguments import make_writable_folder
from async_ckpt.errors import UsageError
from async_ckpt.launch import RankGroup

logger = logging.getLogger("async_ckpt")


def _quiet() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


def train_and_save(root: str, steps: int, save_every: int, size: str) -> dict:
    """Rank task: train ``steps`` steps, saving every ``save_every``; report per-save timings."""
    _quiet()
    import torch.distributed as dist

    import async_ckpt
    from async_ckpt import workload

    rank = dist.get_rank()
    tokenizer = workload.build_tokenizer()
    tokens = workload.token_stream(tokenizer)
    engine = workload.make_engine(3, "fp32", size=size)
    handles, losses = [], []
    with async_ckpt.wrap(engine, root, tokenizer=tokenizer, keep_last=2) as ckpt:
        for _ in range(steps // save_every):
            step_started = time.perf_counter()
            losses += workload.train(engine, save_every, tokens, rank)
            train_s = time.perf_counter() - step_started
            handles.append(ckpt.save())
            if rank == 0:
                print(f"  step {engine.global_steps:3d}  loss {losses[-1]:.4f}  ({train_s / save_every:.2f} s/step)  "
                      f"save({handles[-1].tag}) returned after {_training_waited_s(handles[-1]) * 1000:.1f} ms",
                      flush=True)
        ckpt.wait()
    saves = [{"tag": h.tag, "waited_s": _training_waited_s(h),
              **{k: h.metrics.get(k) for k in ("persist_s", "durable_s", "bytes_written")}} for h in handles]
    return {"losses": losses, "saves": saves, "staging_allocations": ckpt.staging_allocations,
            "synchronous": ckpt.synchronous}


def _training_waited_s(handle) -> float:
    """How long ``save()`` held training: the snapshot, and a synchronous save's whole write too."""
    return handle.metrics["stall_s"] + handle.metrics.get("commit_wait_s", 0.0)


def resume_and_train(root: str, steps: int, size: str) -> dict:
    """Rank task: a fresh engine resumes from ``latest`` and trains ``steps`` more steps."""
    _quiet()
    import torch.distributed as dist

    import async_ckpt
    from async_ckpt import workload

    engine = workload.make_engine(3, "fp32", size=size, seed=99)
    with async_ckpt.wrap(engine, root) as ckpt:
        tag, _ = ckpt.load()
    start = int(engine.global_steps)
    losses = workload.train(engine, steps, workload.token_stream(), dist.get_rank())
    return {"tag": tag, "start_step": start, "losses": losses}


def run_demo(root: str | None = None, steps: int = 20, save_every: int = 5, size: str = "small") -> dict:
    """Run both phases and print what happened; returns the figures."""
    if steps % save_every:
        raise UsageError(f"--steps {steps} is not a multiple of --save-every {save_every}: phase 1 ends with a save, "
                         "which phase 2 resumes from; pass a multiple")
    root = os.path.expanduser(root) if root else None  # as wrap() takes it
    if root is not None and os.path.isdir(root) and os.listdir(root):
        raise UsageError(f"--dir {root} is not empty (an earlier demo's checkpoints?): the demo's tags would clash "
                         "with them; pass a new or empty folder, or leave --dir out")
    if root is not None:
        make_writable_folder(root, "--dir", "pass a new or empty folder you can write to, or leave --dir out")
    root = root or tempfile.mkdtemp(prefix="async_ckpt_demo_")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(f"async_ckpt demo: GPT-style model ({size}), DeepSpeed ZeRO-3 fp32, 2 CPU ranks (gloo)")
    print(f"checkpoints -> {root}\n\nphase 1: train {steps} steps, non-blocking save every {save_every}")
    with RankGroup(2) as ranks:
        first = ranks.run(train_and_save, root, steps, save_every, size)[0]
    if first["synchronous"]:
        print(f"\n  {root} is in memory (tmpfs or ramfs): wrap() chose synchronous saves, written while training "
              "waits, which costs training less there than a background write; pass --dir on a disk to see saves "
              "in the background")
    write = "synchronous write" if first["synchronous"] else "background write"
    print(f"\n  {'tag':<14} {'training stalled':>16} {write:>18} {'durable after':>15}   {'bytes written':>12}")
    for save in first["saves"]:
        if save["durable_s"] is None:  # logged with its cause by the writer
            print(f"  {save['tag']:<14} {save['waited_s'] * 1000:13.1f} ms   failed: see the error logged above")
            continue
        print(f"  {save['tag']:<14} {save['waited_s'] * 1000:13.1f} ms {save['persist_s'] * 1000:15.1f} ms "
              f"{save['durable_s'] * 1000:12.1f} ms   {save['bytes_written'] or 0:>12,d} (rank 0)")
    print(f"  staging buffers allocated once and reused: {first['staging_allocations']} allocations "
          f"over {len(first['saves'])} saves")
    print(f"\nphase 2: new process group, resume from 'latest', train {save_every} more steps")
    with RankGroup(2) as ranks:
        second = ranks.run(resume_and_train, root, save_every, size)[0]
    print(f"  resumed {second['tag']} at step {second['start_step']}; loss before save {first['losses'][-1]:.4f}, "
          f"after resume: " + ", ".join(f"{x:.4f}" for x in second["losses"]))
    print(f"\nthe checkpoint is a plain DeepSpeed checkpoint: python {root}/zero_to_fp32.py {root} out/")
    return {"root": root, "train": first, "resume": second}
