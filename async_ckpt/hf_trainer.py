"""async_ckpt under Hugging Face ``transformers.Trainer`` with a DeepSpeed config.

``async_ckpt.hf_trainer.enable(trainer)`` makes Trainer's own checkpoint saves non-blocking. Trainer
keeps deciding when to save, what goes in ``output_dir/checkpoint-N`` and which folders to rotate
away; only the DeepSpeed part of each save (model, optimizer and ZeRO shards, written by
``engine.save_checkpoint``) is snapshotted and written in the background, then committed into that
``checkpoint-N`` folder (``global_stepN/async_ckpt_manifest.json``, then ``latest``), as
``async_ckpt.wrap`` does for any ``save_dir``. Trainer's small files (``trainer_state.json``, RNG
states, config, tokenizer, ``scheduler.pt`` when the LR scheduler is not DeepSpeed's) are still
written by Trainer, during the save.

**Finding the engine.** Trainer creates the ``DeepSpeedEngine`` inside ``train()`` (Accelerate's
``prepare``), after ``enable`` ran and after a resume checkpoint was loaded, right before it fires
``on_train_begin``; it saves with ``trainer.model_wrapped.save_checkpoint(...)``. So the callback
wraps exactly ``trainer.model_wrapped`` at ``on_train_begin``: the object whose ``save_checkpoint``
Trainer calls (``trainer.deepspeed`` is the same object, kept by transformers only for backward
compatibility). Callback arguments cannot provide it (their ``model`` is the unwrapped module,
their ``optimizer`` Accelerate's wrapper), hence the reference to the trainer. Each ``train()``
call's engine is wrapped at its ``on_train_begin`` and given back at its ``on_train_end``.

**Rotation and best-model loading.** Trainer deletes old ``checkpoint-N`` folders
(``save_total_limit``, ordered by mtime, keeping the newest and the best) right after each save,
and after the last save may load the best checkpoint or delete all but it. async_ckpt already
makes a save wait until the previous one is written; the callback also waits, before Trainer
starts a new save, until every earlier save is *committed*, and at the last save until that one
is. So Trainer never deletes or loads a checkpoint still being written or committed, and the
folder it just saved is also the newest by mtime. A ``checkpoint-N`` whose save failed in the
background (``on_error="warn"``) is then renamed ``_failed-checkpoint-N`` by the process that writes
Trainer's files, once every rank is done with it: Trainer's rotation would otherwise count it among the
``save_total_limit`` newest and delete committed checkpoints in its place (after a few failures, every
one), ``resume_from_checkpoint=True`` would pick it, and a hub upload would send it (Trainer's uploads
leave out ``_*``). The cost is the previous save's commit time
(markers and a manifest), paid only when saves come faster than storage absorbs them.
``save_total_limit=1`` is refused: Trainer would delete the last committed checkpoint as soon as
the next save is snapshotted, and a crash before that one commits would leave nothing to resume.
With 2 and ``metric_for_best_model`` set, enable() warns: Trainer keeps the best checkpoint beside the
newest then, and a crash before the newest commits resumes from the best, maybe older, one.

**ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``.** Trainer's ``save_model`` then
calls ``save_checkpoint`` into the checkpoint folder, and ``_save_optimizer_and_scheduler`` calls it
again for the same folder and step. Stock DeepSpeed writes everything twice; async_ckpt would
write it twice too, or refuse the second save if the first had committed in between. The
callback saves it once and answers the repeated call (same folder, tag and step) as done.

**Resume.** ``trainer.train(resume_from_checkpoint=path)`` loads with DeepSpeed's stock
``load_checkpoint``, which reads ``checkpoint-N/latest``: the commit writes it last, so a folder
loads exactly when its save committed. ``resume_from_checkpoint=True`` takes the highest-numbered
folder, which after a crash can be one whose save never committed; :func:`last_committed_checkpoint`
names the newest committed one instead. A run that starts below checkpoints of later steps in
``output_dir`` (committed, or saved by stock DeepSpeed) is refused at ``on_train_begin``: async_ckpt
never overwrites a committed checkpoint nor writes into a stock one, and would otherwise fail only
when it reached that step. Its other ``checkpoint-N`` folders of later steps (saves a crash or
``on_error="raise"`` cut short) are set aside as ``_failed-checkpoint-N`` then, out of Trainer's rotation.

Importing this module imports transformers (in the ``example`` and ``test`` extras), which the
rest of async_ckpt does not need.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Any, Callable, Mapping

import deepspeed
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy

from async_ckpt.catalog import started_here
from async_ckpt.checkpointer import AsyncCheckpointer, wrap
from async_ckpt.config import CheckpointConfig
from async_ckpt.errors import UsageError
from async_ckpt.layout import LATEST, MANIFEST
from async_ckpt.storage import open_storage

logger = logging.getLogger("async_ckpt")

_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class AsyncCheckpointCallback(TrainerCallback):
    """Routes a Trainer's DeepSpeed checkpoint saves through async_ckpt. Create it with :func:`enable`.

    ``checkpointer`` is the :class:`~async_ckpt.AsyncCheckpointer` of the running ``train()`` call
    (``None`` outside of it): ``checkpointer.failures`` lists failed background saves.
    """

    def __init__(self, trainer: Trainer, **options: Any) -> None:
        if not isinstance(trainer, Trainer):
            raise UsageError(f"enable() takes a transformers.Trainer, got {type(trainer).__name__}")
        for name in ("keep_last", "keep_every"):
            if options.get(name) is not None:
                raise UsageError(f"{name} does not apply under Trainer: every checkpoint-N folder holds one tag. "
                                 "Use TrainingArguments(save_total_limit=...) to keep the newest checkpoints")
        args = trainer.args
        if args.push_to_hub and args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            raise UsageError(f"hub_strategy={HubStrategy(args.hub_strategy).value!r} uploads each checkpoint folder "
                             "right after the save returns, before async_ckpt has written it: use "
                             "hub_strategy='every_save' or 'end'")
        if args.save_total_limit == 1:
            raise UsageError("save_total_limit=1 lets Trainer delete the last committed checkpoint as soon as the next "
                             "save is snapshotted, while that one is still being written: a crash then leaves nothing "
                             "to resume from. Use save_total_limit=2 or more (or None)")
        if (args.save_total_limit == 2 and args.metric_for_best_model is not None
                and args.save_strategy != SaveStrategy.BEST and args.process_index == 0):
            logger.warning("save_total_limit=2 with metric_for_best_model set: Trainer's rotation keeps the newest "
                           "checkpoint, still being written, and the best one; where the best is older, it deletes "
                           "the last committed checkpoint, and a crash before the newest commits resumes from the "
                           "best. Use save_total_limit=3 to keep the last committed one too")
        if not trainer.is_deepspeed_enabled:
            raise UsageError("this Trainer does not train with DeepSpeed: pass TrainingArguments(deepspeed=ds_config) "
                             "(a dict or a JSON path), and do not set use_cpu=True, which turns DeepSpeed off")
        if "url" in options:
            raise UsageError("url does not apply under Trainer: checkpoints go to TrainingArguments.output_dir")
        if options.get("local_tier") is not None:
            raise UsageError("local_tier does not apply under Trainer: Trainer saves each checkpoint into a "
                             "checkpoint-N folder of its own, which the local tier does not cover. Set output_dir "
                             "on the fast disk instead, or save with wrap() outside Trainer")
        try:  # checked now, not at train()'s start after the model and DeepSpeed are set up
            CheckpointConfig(url=args.output_dir, **{k: v for k, v in options.items() if k != "tokenizer"})
        except TypeError as exc:
            raise UsageError(f"enable(): {exc}; see async_ckpt.CheckpointConfig for the options") from exc
        self._trainer = trainer
        self._options = options
        self.checkpointer: AsyncCheckpointer | None = None
        self._async_save: Callable[..., bool] | None = None  # the engine's save_checkpoint as wrap() left it
        self._last_saved: tuple[str, str, int] | None = None
        self._settled = True  # every save this callback made has been waited for since (on every rank alike)
        self._saved: set[tuple[str, str]] = set()  # (folder, tag) of each save this callback made
        self._failures_seen = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        engine = self._trainer.model_wrapped
        if not isinstance(engine, deepspeed.DeepSpeedEngine):
            raise UsageError(f"trainer.model_wrapped is a {type(engine).__name__}, not a DeepSpeedEngine; "
                             "async_ckpt needs Trainer to train with a DeepSpeed config (TrainingArguments(deepspeed=...))")
        # first: a previous train() that raised left its checkpointer open, maybe still writing into a folder below
        self.close()
        later = [folder for step, folder in _checkpoint_folders(args.output_dir)
                 if step > state.global_step and _saved_tag(folder)]
        if later:  # fail now rather than at that step, hours into the run
            resumable = [os.path.basename(f) for f in later if _resumable(f)]
            cut_short = [os.path.basename(f) for f in later if not _resumable(f)]
            raise UsageError(
                f"{args.output_dir} already holds checkpoints of later steps than this run starts from, and "
                "async_ckpt never overwrites a committed checkpoint nor writes into one stock DeepSpeed saved: "
                + (f"resume from {resumable[-1]} (last_committed_checkpoint), or move {', '.join(resumable)} away"
                   if resumable else "")
                + ("; " if resumable and cut_short else "")
                + (f"move {', '.join(cut_short)} away: no latest naming a tag async_ckpt committed, or no "
                   "trainer_state.json (a crash cut the save short, or another tool saved it), so "
                   "last_committed_checkpoint does not resume from there" if cut_short else ""))
        self.checkpointer = wrap(engine, args.output_dir, **self._options)
        # what else lies beyond this run's step: a save cut short (a crash, on_error="raise"), which Trainer's
        # rotation would count among the newest and keep, deleting committed checkpoints instead. Set aside once
        # every rank has looked at the folders above (one collective), by the process that writes Trainer's files
        self.checkpointer._gather_checked("to look at the checkpoint folders", lambda: None)
        if args.should_save:
            for step, folder in _checkpoint_folders(args.output_dir):
                if step > state.global_step:
                    _set_aside(folder, "holds no committed checkpoint (a crash or an error cut its save short)")
        self._async_save = engine.save_checkpoint
        engine.save_checkpoint = self._save_checkpoint
        self._last_saved, self._settled = None, True
        self._saved, self._failures_seen = set(), 0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._before_trainer_saves(args, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_training_stop and not control.should_save and not self._settled:
            # stopped on a step that saved nothing (an early stop): Trainer may load the best checkpoint right
            # after this epoch's end, which must not be a save still in flight, or one that failed
            if self.checkpointer is not None:
                self._wait_for_saves(self.checkpointer)
        self._before_trainer_saves(args, control)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_training_stop and self.checkpointer is not None:
            # Trainer's end of training may load the best checkpoint or delete all others right away.
            self._wait_for_saves(self.checkpointer)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        try:  # a save still in flight that fails (the last one, where training ended on a step that saved
            # nothing, as with save_strategy="best") is set aside too, out of the next run's rotation
            if self.checkpointer is not None and not self._settled:
                self._wait_for_saves(self.checkpointer)
        finally:
            self.close()

    def close(self) -> None:
        """Wait until every save is committed, stop the writer and give the engine its own ``save_checkpoint``.

        ``on_train_end`` calls it. Call it yourself when ``train()`` raised and the process goes on:
        saves still in flight then finish.
        """
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is None:
            return
        if checkpointer.engine.__dict__.get("save_checkpoint") == self._save_checkpoint:
            del checkpointer.engine.save_checkpoint
        checkpointer.close()

    def _before_trainer_saves(self, args: TrainingArguments, control: TrainerControl) -> None:
        """Commit every earlier save before Trainer saves again (and then rotates checkpoint folders)."""
        saves_next = control.should_save or (control.should_evaluate and args.save_strategy == SaveStrategy.BEST)
        if saves_next and self.checkpointer is not None:
            self._wait_for_saves(self.checkpointer)

    def _wait_for_saves(self, checkpointer: AsyncCheckpointer) -> None:
        """Every earlier save settled on every rank, then the folders of those that failed set aside. One
        collective (every rank's callbacks run at the same steps) holds each rank until the others are done
        too: a rank whose save failed may still be removing its files from the folder until then. Where
        ``wait()`` raises on any rank (``on_error="raise"``, or a timeout) every rank raises after it, so
        training stops with that error on every rank, not on one while the others wait, and the folder stays."""
        checkpointer._gather_checked("to wait for its earlier saves", checkpointer.wait)
        self._set_failed_aside(checkpointer)
        self._settled = True

    def _set_failed_aside(self, checkpointer: AsyncCheckpointer) -> None:
        """Rename the ``checkpoint-N`` folder of each save that failed since the last call to
        ``_failed-checkpoint-N`` (on the process that writes Trainer's files), out of reach of Trainer's
        rotation, of ``resume_from_checkpoint=True`` and of hub uploads."""
        failures = checkpointer.failures[self._failures_seen:]
        self._failures_seen += len(failures)
        state = self._trainer.state
        for failure in failures:
            folder = None if failure.url is None else os.path.abspath(failure.url)  # the root the save went to
            # by folder and tag: a save of another tag into the folder (save_16bit_model) is not Trainer's checkpoint
            if (folder, failure.tag) not in self._saved or not _CHECKPOINT_RE.match(os.path.basename(folder)):
                continue
            if state.best_model_checkpoint is not None and os.path.abspath(state.best_model_checkpoint) == folder:
                # on every process: load_best_model_at_end would load a folder that holds no checkpoint. Its step
                # and metric go too: Trainer would point at the folder again from its step, and no later
                # checkpoint would be best unless it beat the failed one's metric
                state.best_model_checkpoint, state.best_metric = None, None
                if hasattr(state, "best_global_step"):
                    state.best_global_step = None
                logger.warning("the save into %s, Trainer's best checkpoint so far, failed: Trainer picks its best "
                               "checkpoint anew from the next evaluation on", folder)
            if self._trainer.args.should_save and os.path.isdir(folder):
                _set_aside(folder, "holds the save that failed")

    def _save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Mapping[str, Any] | None = None,
                         save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """``engine.save_checkpoint`` while training: async_ckpt's non-blocking save, once per checkpoint.

        The signature is DeepSpeed's: Trainer inspects it for ``exclude_frozen_parameters``.
        """
        assert self.checkpointer is not None and self._async_save is not None  # installed together at train begin
        step = int(self.checkpointer.engine.global_steps)
        key = (os.path.abspath(os.fspath(save_dir)), f"global_step{step}" if tag is None else str(tag), step)
        if key == self._last_saved:
            logger.debug("%s/%s is already being saved at this step; not saving it twice", key[0], key[1])
            return True
        if not self._settled:  # a save the callbacks did not see coming (a user's callback asked for it
            # after on_step_end): Trainer rotates the folders right after it, so the earlier saves commit first
            self._wait_for_saves(self.checkpointer)
        self._saved.add(key[:2])
        self._async_save(save_dir, tag, client_state, save_latest=save_latest,
                         exclude_frozen_parameters=exclude_frozen_parameters)
        self._last_saved, self._settled = key, False
        return True


def enable(trainer: Trainer, **options: Any) -> AsyncCheckpointCallback:
    """Make ``trainer``'s DeepSpeed checkpoint saves non-blocking; returns the callback it added.

    Call it after creating the Trainer and before ``train()``. ``options`` are those of
    :func:`async_ckpt.wrap` (``on_error``, ``overlap_copy``, ``writer_nice``, ``on_save_done``...),
    except ``keep_last``/``keep_every``: Trainer's ``save_total_limit`` rotates checkpoints.
    """
    callback = AsyncCheckpointCallback(trainer, **options)
    trainer.add_callback(callback)
    return callback


def last_committed_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that is complete, or ``None``.

    Complete means Trainer wrote its ``trainer_state.json`` and the DeepSpeed save committed
    (``latest`` names a tag whose manifest exists). Pass it to
    ``trainer.train(resume_from_checkpoint=...)`` instead of ``True``, which takes the
    highest-numbered folder even when a crash cut its save short; ``None`` starts from scratch.
    """
    if not isinstance(output_dir, (str, os.PathLike)):
        raise UsageError(f"output_dir must be a folder path, got {output_dir!r}")
    for _, folder in reversed(_checkpoint_folders(output_dir)):
        if _resumable(folder):
            return folder
    return None


def _set_aside(folder: str, why: str) -> None:
    """Rename ``checkpoint-N`` to ``_failed-checkpoint-N`` (``-1``, ``-2``... where taken), out of reach of
    Trainer's rotation, of ``resume_from_checkpoint=True`` and of hub uploads; an error is logged."""
    aside = os.path.join(os.path.dirname(folder), f"_failed-{os.path.basename(folder)}")
    n = 1
    while os.path.exists(aside):
        aside, n = os.path.join(os.path.dirname(folder), f"_failed-{os.path.basename(folder)}-{n}"), n + 1
    try:
        os.rename(folder, aside)
    except FileNotFoundError:  # set aside by another node's process over a shared filesystem (save_on_each_node)
        logger.debug("%s is gone: set aside by another process", folder)
        return
    except OSError as exc:
        logger.error("%s %s and could not be set aside (%s): Trainer's rotation counts it as a checkpoint; move it "
                     "away by hand", folder, why, exc)
        return
    logger.warning("%s %s; it is now %s, so that Trainer's rotation (save_total_limit) keeps committed checkpoints "
                   "instead of it", folder, why, aside)


def _resumable(folder: str) -> bool:
    """Whether Trainer can resume from ``folder``: its state written, and ``latest`` naming a committed tag."""
    return bool(_committed_tag(folder)) and os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME))


def _checkpoint_folders(output_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder, by step."""
    root = os.fspath(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
                  if (m := _CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(root, name)))


def _latest_tag(folder: str) -> str | None:
    """The tag ``folder/latest`` names, or ``None``."""
    try:
        with open(os.path.join(folder, LATEST)) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _committed_tag(folder: str) -> str | None:
    """The tag ``folder/latest`` names if that tag is committed (its manifest exists)."""
    tag = _latest_tag(folder)
    return tag if tag and os.path.isfile(os.path.join(folder, tag, MANIFEST)) else None


def _saved_tag(folder: str) -> str | None:
    """A tag folder of ``folder`` that a save of that tag would refuse: committed by async_ckpt (its
    manifest, whether or not ``latest`` was written after it), or holding files async_ckpt did not start
    (stock DeepSpeed's, say by a run before this one, which may have died before its ``latest``)."""
    storage = open_storage(folder)
    for name in sorted(os.listdir(folder)):
        tag_dir = os.path.join(folder, name)
        if name.startswith(".") or not os.path.isdir(tag_dir):
            continue
        if os.path.isfile(os.path.join(tag_dir, MANIFEST)):
            return name
        # a DeepSpeed tag folder's files, not another subfolder Trainer saves (a tokenizer's chat templates)
        deepspeed_files = glob.glob(os.path.join(glob.escape(tag_dir), "*_states.pt"))
        if deepspeed_files and not started_here(storage, name):
            return name
    return None
