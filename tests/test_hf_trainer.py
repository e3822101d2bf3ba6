"""async_ckpt under Hugging Face Trainer with a DeepSpeed config, on 2 real ranks (gloo, CPU).

Per ZeRO stage, three Trainer runs of the same 6 steps: one with async saves every 2 steps,
stopped after the save at step 4 (as a preempted job ends); a fresh Trainer resuming from that
checkpoint, finishing, and loading its best checkpoint at the end; and a stock run without
async_ckpt and without saves as the reference. Both async runs hold each commit for 1 s, so that
every wait the callback must do is a real one.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

import hf_tasks
from async_ckpt import ConfigError, UsageError
from async_ckpt.cli import main as cli_main
from async_ckpt.hf_trainer import _saved_tag, enable, last_committed_checkpoint
from async_ckpt.layout import MANIFEST

STAGES = [2, 3]


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def runs(request, ranks, tmp_path_factory):
    stage = request.param
    root = tmp_path_factory.mktemp(f"hf-zero{stage}")
    out = str(root / "run")
    return {
        "stage": stage,
        "out": out,
        "interrupted": ranks.run(hf_tasks.train_interrupted, out, stage),
        "resumed": ranks.run(hf_tasks.train_resumed, out, stage),
        "stock": ranks.run(hf_tasks.train_uninterrupted_stock, str(root / "stock"), stage),
    }


def test_trainer_save_returns_before_the_commit(runs):
    first = runs["interrupted"][0]["seen"][hf_tasks.SAVE_STEPS]
    assert first["trainer_state_after_save"]  # Trainer's own files are written in the save itself
    assert not first["latest_after_save"]  # the DeepSpeed part still commits in the background


def test_each_checkpoint_is_saved_once_through_async_ckpt(runs):
    # under ZeRO-3 without 16-bit gathering, Trainer calls save_checkpoint twice per checkpoint
    expected = [(os.path.join(runs["out"], f"checkpoint-{step}"), f"global_step{step}", True)
                for step in range(hf_tasks.SAVE_STEPS, hf_tasks.STOP_AT + 1, hf_tasks.SAVE_STEPS)]
    assert [r["saves"] for r in runs["interrupted"]] == [expected, expected]


def test_earlier_checkpoints_are_committed_before_trainer_saves_and_rotates(runs):
    rank0 = runs["interrupted"][0]
    assert rank0["seen"][hf_tasks.STOP_AT]["earlier"] == {f"checkpoint-{hf_tasks.SAVE_STEPS}": True}
    kept = sorted(glob.glob(os.path.join(runs["out"], "checkpoint-*")))  # save_total_limit=2 after the resumed run
    assert [os.path.basename(p) for p in kept] == [f"checkpoint-{hf_tasks.STOP_AT}", f"checkpoint-{hf_tasks.MAX_STEPS}"]
    assert all(os.path.isfile(os.path.join(p, "latest")) for p in kept)


def test_train_end_closes_the_checkpointer_and_gives_the_engine_back(runs):
    for rank in runs["interrupted"]:
        assert rank["closed"] and rank["engine_restored"]


def test_trainer_files_land_next_to_the_deepspeed_checkpoint(runs):
    folder = os.path.join(runs["out"], f"checkpoint-{hf_tasks.MAX_STEPS}")
    names = set(os.listdir(folder))
    trainer_files = {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "training_args.bin", "config.json",
                     "tokenizer.json"} | ({"model.safetensors"} if runs["stage"] < 3 else set())
    assert trainer_files <= names
    with open(os.path.join(folder, "trainer_state.json")) as fh:
        assert json.load(fh)["global_step"] == hf_tasks.MAX_STEPS
    tag_dir = os.path.join(folder, f"global_step{hf_tasks.MAX_STEPS}")
    assert len(glob.glob(os.path.join(tag_dir, "*_optim_states.pt"))) == 2
    assert not glob.glob(os.path.join(folder, "**", "*.partial"), recursive=True)
    assert not os.path.exists(os.path.join(tag_dir, ".async_ckpt"))


def test_latest_names_the_committed_tag_and_every_file_verifies(runs, capsys):
    folder = os.path.join(runs["out"], f"checkpoint-{hf_tasks.MAX_STEPS}")
    tag = f"global_step{hf_tasks.MAX_STEPS}"
    with open(os.path.join(folder, "latest")) as fh:
        assert fh.read() == tag
    with open(os.path.join(folder, tag, "async_ckpt_manifest.json")) as fh:
        manifest = json.load(fh)
    assert (manifest["step"], manifest["world_size"], manifest["zero_stage"]) == (hf_tasks.MAX_STEPS, 2, runs["stage"])
    assert manifest["timings"]["stall_s"] > 0
    assert cli_main(["verify", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_async_saves_leave_training_unchanged(runs):
    stock = runs["stock"][0]["losses"]
    assert runs["interrupted"][0]["losses"] == {step: stock[step] for step in range(1, hf_tasks.STOP_AT + 1)}


def test_resume_continues_bitwise_like_the_uninterrupted_run(runs):
    stock = runs["stock"][0]["losses"]
    for rank in runs["resumed"]:
        assert rank["resumed_from"] == os.path.join(runs["out"], f"checkpoint-{hf_tasks.STOP_AT}")
        resumed = {step: loss for step, loss in rank["losses"].items() if step > hf_tasks.STOP_AT}
        assert resumed == {step: stock[step] for step in range(hf_tasks.STOP_AT + 1, hf_tasks.MAX_STEPS + 1)}


def test_best_checkpoint_is_loaded_at_train_end_once_committed(runs):
    # the resumed run's last save is its best: Trainer loads it right after saving it (commits are held 1 s)
    for rank in runs["resumed"]:
        assert rank["best"] == os.path.join(runs["out"], f"checkpoint-{hf_tasks.MAX_STEPS}")


def test_a_save_a_callback_asks_for_outside_the_save_steps_waits_for_the_earlier_ones_before_trainer_rotates(
        ranks, tmp_path):
    out = ranks.run(hf_tasks.train_saving_from_on_log, str(tmp_path / "run"), 2)[0]
    assert out["kept_committed"] == {2: {}, 4: {"checkpoint-2": True}, 6: {"checkpoint-4": True}}


def test_failed_saves_are_set_aside_so_trainers_rotation_keeps_the_committed_checkpoint(ranks, tmp_path):
    """save_total_limit=2, saves at steps 2, 4 and 6, the last two failing in the background: Trainer's
    rotation would count the failed folders and delete checkpoint-2, the one committed checkpoint."""
    out = ranks.run(hf_tasks.train_with_failing_saves, str(tmp_path / "run"), 2)[0]
    assert [f for f in out["folders"] if "checkpoint" in f] == ["_failed-checkpoint-4", "_failed-checkpoint-6",
                                                                 "checkpoint-2"]
    assert out["newest_committed"] == str(tmp_path / "run" / "checkpoint-2")


def test_a_failed_save_is_set_aside_even_when_its_tag_was_saved_into_another_folder_too(ranks, tmp_path):
    out = ranks.run(hf_tasks.train_with_failing_saves, str(tmp_path / "run"), 2,
                    also_into=str(tmp_path / "copies"))[0]
    assert [f for f in out["folders"] if "checkpoint" in f] == ["_failed-checkpoint-4", "_failed-checkpoint-6",
                                                                 "checkpoint-2"]


def test_a_failed_save_of_the_best_checkpoint_is_no_longer_the_best_one_trainer_loads_at_the_end(ranks, tmp_path):
    out = ranks.run(hf_tasks.train_with_failing_saves, str(tmp_path / "run"), 2, best_model=True)[0]
    assert out["best"] in (None, str(tmp_path / "run" / "checkpoint-2"))  # never a folder set aside
    assert "checkpoint-2" in out["folders"]


def test_training_stopped_on_a_step_that_saves_nothing_settles_the_last_save_before_trainer_loads_the_best(
        ranks, tmp_path):
    """Stopped after step 5 (no save there), Trainer loads its best checkpoint at once: the failed save of step
    4 must be set aside first, not loaded (DeepSpeed finds no 'latest' there and Trainer raises)."""
    out = ranks.run(hf_tasks.train_with_failing_saves, str(tmp_path / "run"), 2, best_model=True, stop_at=5)[0]
    assert [f for f in out["folders"] if "checkpoint" in f] == ["_failed-checkpoint-4", "checkpoint-2"]
    assert out["best"] in (None, str(tmp_path / "run" / "checkpoint-2"))


def test_a_new_run_refuses_to_start_below_committed_checkpoints(runs, ranks):
    errors = ranks.run(hf_tasks.start_over, runs["out"], runs["stage"])
    assert all(e is not None and f"resume from checkpoint-{hf_tasks.MAX_STEPS} (last_committed_checkpoint)" in e
               for e in errors)


def test_a_new_run_refuses_to_start_below_a_checkpoint_stock_deepspeed_saved(runs, ranks, tmp_path):
    stock = tmp_path / "out" / "checkpoint-99"
    (stock / "global_step99").mkdir(parents=True)
    (stock / "global_step99" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (stock / "latest").write_text("global_step99")
    errors = ranks.run(hf_tasks.start_over, str(tmp_path / "out"), runs["stage"])
    assert all(e is not None and "move checkpoint-99 away" in e and "stock DeepSpeed" in e for e in errors)
    assert all("resume from checkpoint" not in e for e in errors)  # not from one last_committed_checkpoint passes over


def test_a_resumed_run_sets_aside_a_later_folder_a_crash_cut_short_so_rotation_keeps_committed_ones(runs, ranks,
                                                                                                    tmp_path):
    """Resumed from step 4 beside checkpoint-8, a save a crash cut short (its start mark, no manifest, no
    latest): Trainer's rotation at the save of step 6 would keep 8 and 6 of the newest two, deleting 4."""
    out = tmp_path / "out"
    shutil.copytree(os.path.join(runs["out"], "checkpoint-4"), out / "checkpoint-4")
    cut = out / "checkpoint-8"
    shutil.copytree(out / "checkpoint-4", cut)
    (cut / "latest").unlink()
    (cut / "global_step4").rename(cut / "global_step8")
    (cut / "global_step8" / MANIFEST).unlink()
    (cut / "global_step8" / ".async_ckpt").mkdir()
    (cut / "global_step8" / ".async_ckpt" / "started-rank0").write_text("a save of async_ckpt's")
    folders = ranks.run(hf_tasks.resume_beside_a_save_cut_short, str(out), runs["stage"], str(out / "checkpoint-4"))
    assert folders[0] == ["_failed-checkpoint-8", "checkpoint-4", "checkpoint-6"]


def test_last_committed_checkpoint_skips_folders_a_crash_left_incomplete(tmp_path):
    def folder(step, *, latest=True, manifest=True, trainer_state=True):
        path = tmp_path / f"checkpoint-{step}"
        (path / f"global_step{step}").mkdir(parents=True)
        if latest:
            (path / "latest").write_text(f"global_step{step}")
        if manifest:
            (path / f"global_step{step}" / "async_ckpt_manifest.json").write_text("{}")
        if trainer_state:
            (path / "trainer_state.json").write_text("{}")

    folder(2)
    folder(4)
    folder(6, latest=False, manifest=False)  # killed while writing
    folder(8, manifest=False)  # `latest` names a tag that never committed
    folder(10, trainer_state=False)  # killed between the commit and Trainer's state file
    (tmp_path / "checkpoint-12").write_text("not a folder")
    assert last_committed_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    assert last_committed_checkpoint(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def cpu_trainer(tmp_path_factory):
    """A Trainer without DeepSpeed, in this process."""
    from transformers import Trainer, TrainingArguments

    from async_ckpt import workload

    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("cpu")), use_cpu=True, report_to="none")
    return Trainer(model=workload.build_model("tiny"), args=args)


def test_enable_refuses_a_trainer_without_deepspeed(cpu_trainer):
    with pytest.raises(UsageError, match="deepspeed"):
        enable(cpu_trainer)


@pytest.mark.parametrize("option", ["keep_last", "keep_every"])
def test_enable_points_retention_options_to_save_total_limit(cpu_trainer, option):
    with pytest.raises(UsageError, match="save_total_limit"):
        enable(cpu_trainer, **{option: 2})


def test_enable_refuses_a_save_total_limit_of_one(cpu_trainer, monkeypatch):
    monkeypatch.setattr(cpu_trainer.args, "save_total_limit", 1)
    with pytest.raises(UsageError, match="save_total_limit=2 or more"):
        enable(cpu_trainer)


@pytest.mark.parametrize("strategy,warned", [("steps", True), ("best", False)])
def test_enable_warns_of_a_save_total_limit_of_two_where_trainer_keeps_an_older_best_checkpoint_too(
        cpu_trainer, monkeypatch, caplog, strategy, warned):
    """Trainer's rotation then keeps the save in flight and the best folder, which may be older: the last
    committed one goes. With save_strategy="best" every save is the best, and the one before it stays."""
    monkeypatch.setattr(cpu_trainer.args, "save_total_limit", 2)
    monkeypatch.setattr(cpu_trainer.args, "metric_for_best_model", "loss")
    monkeypatch.setattr(cpu_trainer.args, "save_strategy", strategy)
    with pytest.raises(UsageError, match="does not train with DeepSpeed"):  # this Trainer's, checked after
        enable(cpu_trainer)
    assert ("save_total_limit=3" in caplog.text) is warned


def test_enable_refuses_hub_uploads_of_unwritten_checkpoint_folders(cpu_trainer, monkeypatch):
    monkeypatch.setattr(cpu_trainer.args, "push_to_hub", True)
    monkeypatch.setattr(cpu_trainer.args, "hub_strategy", "checkpoint")
    with pytest.raises(UsageError, match="hub_strategy='every_save'"):
        enable(cpu_trainer)


@pytest.mark.parametrize("options,error,names", [(dict(on_eror="raise"), UsageError, "on_eror"),
                                                 (dict(part_size=1), ConfigError, "part_size"),
                                                 (dict(url="s3://bucket/run"), UsageError, "output_dir"),
                                                 (dict(local_tier="/dev/shm/ckpt"), UsageError, "checkpoint-N"),
                                                 (dict(storage_options={"anon": True}), ConfigError, "local path")])
def test_enable_refuses_a_bad_option_before_train_begins(cpu_trainer, monkeypatch, options, error, names):
    monkeypatch.setattr(cpu_trainer, "is_deepspeed_enabled", True)  # as with a DeepSpeed config
    with pytest.raises(error, match=names):
        enable(cpu_trainer, **options)


def test_enable_refuses_what_is_not_a_trainer():
    with pytest.raises(UsageError, match="takes a transformers.Trainer, got object"):
        enable(object())


def test_last_committed_checkpoint_refuses_what_is_not_a_folder_path():
    with pytest.raises(UsageError, match="output_dir must be a folder path"):
        last_committed_checkpoint(None)


def test_a_tag_folder_that_an_aborted_save_left_without_files_is_no_saved_checkpoint(tmp_path):
    (tmp_path / "global_step9" / ".async_ckpt").mkdir(parents=True)  # what an abort leaves on a local root
    (tmp_path / "latest").write_text("global_step9")
    assert _saved_tag(str(tmp_path)) is None
    (tmp_path / "global_step9" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert _saved_tag(str(tmp_path)) == "global_step9"


def test_a_subfolder_trainer_saves_beside_the_tag_is_no_saved_checkpoint(tmp_path):
    """A tokenizer's chat templates (additional_chat_templates/*.jinja) in a checkpoint a crash cut short."""
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    assert _saved_tag(str(tmp_path)) is None


def test_a_committed_tag_without_latest_or_a_stock_one_that_died_before_it_is_a_saved_checkpoint(tmp_path):
    """Both would make the save of that step refuse its tag, hours into the run: refused at train begin."""
    committed, stock, dead = tmp_path / "committed", tmp_path / "stock", tmp_path / "dead"
    (committed / "global_step9").mkdir(parents=True)
    (committed / "global_step9" / "async_ckpt_manifest.json").write_text("{}")  # latest never written
    (stock / "global_step9").mkdir(parents=True)
    (stock / "global_step9" / "mp_rank_00_model_states.pt").write_bytes(b"x")  # no latest, no start mark
    (dead / "global_step9" / ".async_ckpt").mkdir(parents=True)
    (dead / "global_step9" / ".async_ckpt" / "started-rank0").write_text("save-id")
    (dead / "global_step9" / "mp_rank_00_model_states.pt").write_bytes(b"x")  # our own save cut short
    assert _saved_tag(str(committed)) == "global_step9" and _saved_tag(str(stock)) == "global_step9"
    assert _saved_tag(str(dead)) is None

