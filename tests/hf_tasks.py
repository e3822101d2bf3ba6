"""Rank tasks that train the workload model with ``transformers.Trainer`` and a DeepSpeed config."""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import time
from typing import Any, Iterator

import torch
from accelerate.state import AcceleratorState, PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from async_ckpt import UsageError, commit, hf_trainer, workload

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

MAX_STEPS = 6
SAVE_STEPS = 2
STOP_AT = 4  # the interrupted run ends here, as a preempted job would after its last save
COMMIT_DELAY_S = 1.0  # rank 0 holds every commit this long after all data is durable


def ds_config(stage: int) -> dict[str, Any]:
    """fp32 ZeRO with DeepSpeed's (torch) Adam; Trainer fills in the "auto" values and its own LR schedule."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                 "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000,
    }


def _dataset(tokenizer: Any) -> list[dict[str, torch.Tensor]]:
    tokens = workload.token_stream(tokenizer)
    seq_len = workload.SIZES["tiny"][3]
    return [{"input_ids": tokens[i * 8:i * 8 + seq_len], "labels": tokens[i * 8:i * 8 + seq_len]} for i in range(64)]


def _cpu_deepspeed_state() -> None:
    """Accelerate's process state for DeepSpeed over gloo on CPU.

    Accelerate picks a distributed backend only for accelerators (nccl, xccl...): on a CPU-only
    machine it would run DeepSpeed believing it is one process (every rank rank 0, unsharded data).
    With gloo named up front it counts the ranks of the process group the rank group started;
    ``accelerator_config={"use_configured_state": True}`` then makes Trainer keep this state.
    """
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments sets it, for this call only
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _trainer(output_dir: str, stage: int, *, seed: int, save: bool = True, best_model: bool = False) -> Trainer:
    """``best_model``: evaluate at every save and load the best checkpoint when training ends."""
    _cpu_deepspeed_state()
    tokenizer = workload.build_tokenizer()
    data = _dataset(tokenizer)
    evaluation = dict(eval_strategy="steps", eval_steps=SAVE_STEPS, load_best_model_at_end=True,
                      metric_for_best_model="loss", per_device_eval_batch_size=2) if best_model else {}
    args = TrainingArguments(
        output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="steps" if save else "no", save_steps=SAVE_STEPS,
        save_total_limit=2, deepspeed=ds_config(stage), report_to="none", seed=0,
        disable_tqdm=True, dataloader_num_workers=0, accelerator_config={"use_configured_state": True}, **evaluation)
    return Trainer(model=workload.build_model("tiny", seed=seed), args=args, train_dataset=data,
                   eval_dataset=data[:8] if best_model else None, processing_class=tokenizer,
                   data_collator=default_data_collator)


@contextlib.contextmanager
def _slow_commits() -> Iterator[None]:
    """Rank 0 holds every commit COMMIT_DELAY_S after all ranks' data is durable."""
    original = commit._write_extras  # the first step of rank 0's commit once every rank reported

    def slow_commit(job, entries):
        time.sleep(COMMIT_DELAY_S)
        return original(job, entries)

    commit._write_extras = slow_commit
    try:
        yield
    finally:
        commit._write_extras = original


@contextlib.contextmanager
def _commits_failing_after(good: int) -> Iterator[None]:
    """Rank 0's commit of every save after the first ``good`` fails, as on a disk that filled up."""
    original, commits = commit._write_extras, []

    def failing_commit(job, entries):
        commits.append(job.tag)
        if len(commits) > good:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(job, entries)

    commit._write_extras = failing_commit
    try:
        yield
    finally:
        commit._write_extras = original


def _committed(folder: str) -> bool:
    latest = os.path.join(folder, "latest")
    if not os.path.isfile(latest):
        return False
    with open(latest) as fh:
        return os.path.isfile(os.path.join(folder, fh.read().strip(), "async_ckpt_manifest.json"))


class Probe(TrainerCallback):
    """Runs after async_ckpt's callback; records what a save looks like from Trainer's side."""

    def __init__(self, stop_at: int) -> None:
        self.stop_at = stop_at
        self.seen: dict[int, dict[str, Any]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            earlier = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*")))
            self.seen[state.global_step] = {"earlier": {os.path.basename(p): _committed(p) for p in earlier}}
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.seen[state.global_step].update(
            latest_after_save=os.path.exists(os.path.join(folder, "latest")),
            trainer_state_after_save=os.path.isfile(os.path.join(folder, "trainer_state.json")))


def _losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def train_interrupted(output_dir: str, stage: int) -> dict:
    """Async saves every SAVE_STEPS with slow commits; training stops after the save at STOP_AT."""
    saved: list[tuple[str, str, bool]] = []
    trainer = _trainer(output_dir, stage, seed=0)
    callback = hf_trainer.enable(trainer, on_save_done=lambda h: saved.append((h.url, h.tag, h.exception() is None)))
    probe = Probe(stop_at=STOP_AT)
    trainer.add_callback(probe)
    with _slow_commits():
        trainer.train()
    return {"losses": _losses(trainer), "seen": probe.seen, "saves": saved,
            "closed": callback.checkpointer is None,
            "engine_restored": "save_checkpoint" not in trainer.model_wrapped.__dict__}


class _SavedAgainInto(TrainerCallback):
    """After each of Trainer's saves, the engine saved again into another folder, under the same tag (as
    Trainer's own ``save_model`` does under ZeRO-3 without a 16-bit gather)."""

    def __init__(self, trainer: Trainer, folder: str) -> None:
        self._trainer, self._folder = trainer, folder

    def on_save(self, args, state, control, **kwargs):
        self._trainer.model_wrapped.save_checkpoint(self._folder)


def train_with_failing_saves(output_dir: str, stage: int, *, also_into: str | None = None,
                             best_model: bool = False, stop_at: int | None = None) -> dict:
    """Saves at steps 2, 4 and 6 with save_total_limit=2 and on_error="warn"; only the first commits.
    With ``also_into``, each save is followed by one of the same tag into that folder; with ``best_model``,
    each is evaluated and the best loaded at the end; with ``stop_at``, training stops after that step (as
    an early-stopping callback stops it), added after async_ckpt's callback."""
    trainer = _trainer(output_dir, stage, seed=0, best_model=best_model)
    if also_into is not None:
        trainer.add_callback(_SavedAgainInto(trainer, also_into))
    hf_trainer.enable(trainer, on_error="warn")
    if stop_at is not None:
        trainer.add_callback(Probe(stop_at=stop_at))
    with _commits_failing_after(1):
        trainer.train()
    return {"folders": sorted(os.listdir(output_dir)), "newest_committed": hf_trainer.last_committed_checkpoint(output_dir),
            "best": trainer.state.best_model_checkpoint}


class _SavesFromOnLog(TrainerCallback):
    """A user's callback that asks for a save from ``on_log`` every SAVE_STEPS (Trainer saves right after its
    log, where async_ckpt's ``on_step_end`` saw no save coming); after each save, whether the folders Trainer
    kept of earlier saves are committed."""

    def __init__(self) -> None:
        self.kept_committed: dict[int, dict[str, bool]] = {}

    def on_log(self, args, state, control, **kwargs):
        if state.global_step % SAVE_STEPS == 0:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        current = f"checkpoint-{state.global_step}"
        self.kept_committed[state.global_step] = {
            os.path.basename(p): _committed(p) for p in sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*")))
            if os.path.basename(p) != current}


def train_saving_from_on_log(output_dir: str, stage: int) -> dict:
    """save_strategy="no", save_total_limit=2 and slow commits; a callback asks for the saves from on_log."""
    trainer = _trainer(output_dir, stage, seed=0, save=False)
    hf_trainer.enable(trainer)
    probe = _SavesFromOnLog()
    trainer.add_callback(probe)
    with _slow_commits():
        trainer.train()
    return {"kept_committed": probe.kept_committed}


def train_resumed(output_dir: str, stage: int) -> dict:
    """A fresh Trainer (other init) resumes from the newest committed checkpoint and finishes the run.

    It evaluates at its one save (the last) and loads that best checkpoint as soon as training ends.
    """
    trainer = _trainer(output_dir, stage, seed=1234, best_model=True)
    hf_trainer.enable(trainer)
    resume_from = hf_trainer.last_committed_checkpoint(output_dir)
    with _slow_commits():
        trainer.train(resume_from_checkpoint=resume_from)
    return {"losses": _losses(trainer), "resumed_from": resume_from, "best": trainer.state.best_model_checkpoint}


def resume_beside_a_save_cut_short(output_dir: str, stage: int, resume_from: str) -> list[str]:
    """A fresh Trainer resumes from ``resume_from`` and saves once more; the checkpoint folders after the run."""
    trainer = _trainer(output_dir, stage, seed=1234)
    hf_trainer.enable(trainer)
    trainer.train(resume_from_checkpoint=resume_from)
    return sorted(name for name in os.listdir(output_dir) if "checkpoint-" in name)


def start_over(output_dir: str, stage: int) -> str | None:
    """A new run from step 0 into an output_dir holding later committed checkpoints: the error it stops with."""
    trainer = _trainer(output_dir, stage, seed=0)
    hf_trainer.enable(trainer)
    try:
        trainer.train()
    except UsageError as exc:
        return str(exc)
    return None


def train_uninterrupted_stock(output_dir: str, stage: int) -> dict:
    """The reference: the same run, start to end, without async_ckpt and without saves."""
    trainer = _trainer(output_dir, stage, seed=0, save=False)
    trainer.train()
    return {"losses": _losses(trainer)}
