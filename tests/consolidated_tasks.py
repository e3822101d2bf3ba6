"""Rank tasks for the consolidated-save tests: save_consolidated and save_16bit_model after wrap."""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from rank_tasks import _outcome, _rank, _tokens

import async_ckpt
from async_ckpt import workload
from async_ckpt.catalog import read_manifest
from async_ckpt.pull import pull

PROBE_IDS = torch.arange(2, 26).unsqueeze(0)  # one fixed prompt for comparing logits
#: Small enough that the tiny model's weights take several shards.
SHARD_BYTES = 100_000


def _engine(stage: int, dtype: str):
    """The workload's engine, gathering 16-bit weights on save_16bit_model under ZeRO-3 (as users configure it)."""
    config = workload.ds_config(stage, dtype)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    model = workload.build_model("tiny")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _logits(engine) -> torch.Tensor:
    """The engine's own logits on PROBE_IDS, every rank taking part (a ZeRO-3 forward is collective)."""
    engine.module.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE_IDS).logits
    engine.module.train()
    return logits


def _gate(path: str, opened: bool) -> None:
    """Let rank 0's gated writes through (``opened``) or hold them; every rank waits until it is done."""
    if _rank() == 0:
        if opened:
            open(path, "w").close()
        elif os.path.exists(path):
            os.remove(path)
    dist.barrier()


def consolidated_saves(stage: int, dtype: str, root: str, s3_url: str, s3_options: dict, work: str) -> dict:
    """One engine: a regular save, then save_16bit_model and save_consolidated held at the storage (to see that
    they return before the write), training on meanwhile; then a consolidated save to S3, pulled on rank 0."""
    from faulty_fs import register

    register()
    engine = _engine(stage, dtype)
    tokens = _tokens()
    workload.train(engine, 2, tokens, _rank())
    out: dict = {"logits": _logits(engine)}
    stock_dir = os.path.join(work, "stock16")
    type(engine).save_16bit_model(engine, stock_dir)  # DeepSpeed's own, synchronous, before wrap
    gate = os.path.join(work, "gate")
    _gate(gate, opened=True)
    ckpt = async_ckpt.wrap(engine, f"faulty://{root}", storage_options={"gate": gate, "gate_match": "model"},
                           tokenizer=workload.build_tokenizer())
    ckpt.save(tag="regular").result(timeout=120)

    if _rank() == 0:  # the user's own file in the export folder, as a tokenizer saved there first
        os.makedirs(f"{root}/export16")
        with open(f"{root}/export16/tokenizer_config.json", "w") as fh:
            fh.write("{}")
    dist.barrier()
    _gate(gate, opened=False)
    out["save_16bit_model"] = engine.save_16bit_model(f"faulty://{root}/export16")
    out["bin_written_at_return"] = os.path.exists(f"{root}/export16/pytorch_model.bin")
    _gate(gate, opened=True)
    ckpt.wait()
    out["resaved_16bit"] = engine.save_16bit_model(f"faulty://{root}/export16")  # DeepSpeed overwrites: so do we
    ckpt.wait()
    out["export_folder"] = sorted(os.listdir(f"{root}/export16"))
    engine.save_16bit_model(os.path.join(root, "dotted", "sub", ".."))  # DeepSpeed writes into root/dotted
    ckpt.wait()
    out["dotted_folder"] = sorted(os.listdir(f"{root}/dotted")) if os.path.isdir(f"{root}/dotted") else None
    out["bin_beside_the_tags"] = os.path.exists(f"{root}/pytorch_model.bin")
    engine.save_16bit_model(f"file://{root}/file_url")
    ckpt.wait()
    out["file_url_folder"] = sorted(os.listdir(f"{root}/file_url")) if os.path.isdir(f"{root}/file_url") else None

    _gate(gate, opened=False)
    handle = ckpt.save_consolidated(max_shard_bytes=SHARD_BYTES)
    out["done_at_return"] = handle.done()
    workload.train(engine, 1, tokens, _rank())  # training goes on while the write is held
    _gate(gate, opened=True)
    out["tag"] = handle.result(timeout=120).tag
    out["metrics"] = dict(handle.metrics)

    out["16bit_into_a_zero_tag"] = _outcome(lambda: engine.save_16bit_model(f"faulty://{root}/regular"))
    out["16bit_into_a_folder_no_tag_can_name"] = _outcome(lambda: engine.save_16bit_model(f"faulty://{root}/my model"))
    out["tag_reused"] = _outcome(lambda: ckpt.save_consolidated(tag=out["tag"]))
    out["load_consolidated"] = _outcome(lambda: ckpt.load(tag=out["tag"]))
    if stage == 3:
        engine._config.zero_config.gather_16bit_weights_on_model_save = False
        out["16bit_without_gather"] = engine.save_16bit_model(f"faulty://{root}/not_gathered")
        out["16bit_without_gather_wrote"] = os.path.exists(f"{root}/not_gathered")
        engine._config.zero_config.gather_16bit_weights_on_model_save = True
    out["latest"] = ckpt.storage.read_bytes("latest").decode()
    out["loaded"], _ = ckpt.load()
    out["failures"] = [str(e) for e in ckpt.failures]
    ckpt.close()
    out["save_16bit_model_restored"] = "save_16bit_model" not in engine.__dict__
    with async_ckpt.wrap(engine, root, overwrite_tags=True) as ckpt:  # overwrites tags, not with an export
        out["16bit_into_a_zero_tag_overwrite_tags"] = _outcome(lambda: engine.save_16bit_model(f"{root}/regular"))

    out["s3_logits"] = _logits(engine)
    with async_ckpt.wrap(engine, s3_url, storage_options=s3_options, tokenizer=workload.build_tokenizer()) as ckpt:
        out["s3_tag"] = ckpt.save_consolidated(tag="on_s3").result(timeout=300).tag
        if _rank() == 0:
            pull(ckpt.storage, read_manifest(ckpt.storage, "on_s3"), os.path.join(work, "pulled"), show_progress=False)
    return out


class _UncopyableExtraState(torch.nn.Module):
    """A model whose state dict holds an object no snapshot can copy (``get_extra_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def get_extra_state(self) -> object:
        import threading

        return threading.Lock()

    def set_extra_state(self, state: object) -> None:
        pass


def save_16bit_model_whose_snapshot_fails_on_rank_0(root: str) -> dict:
    """DeepSpeed hands the consolidated state dict to the checkpoint engine on rank 0 alone, where its
    snapshot fails; every rank must then raise rather than the others wait in the save's collective."""
    model = _UncopyableExtraState()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=workload.ds_config(2, "fp32"))
    ckpt = async_ckpt.wrap(engine, root)
    try:
        return {"outcome": _outcome(lambda: engine.save_16bit_model(os.path.join(root, "export")))}
    finally:
        ckpt.close()


def failed_export_into_a_folder_of_the_users_files(root: str, again: bool) -> dict:
    """Rank 0's write of save_16bit_model's file is cut short, in a folder that held the user's config.json
    (the usual Hugging Face export folder), where with ``again`` an earlier export committed; then gc runs with
    no grace period."""
    from faulty_fs import register

    from async_ckpt.gc import collect_garbage
    from async_ckpt.storage import open_storage

    register()
    engine = _engine(2, "fp32")
    if _rank() == 0:
        os.makedirs(f"{root}/final")
        with open(f"{root}/final/config.json", "w") as fh:
            fh.write("{}")
    dist.barrier()
    if again:
        with async_ckpt.wrap(engine, root) as ckpt:
            engine.save_16bit_model(f"{root}/final")
    faults = {"fail_ranks": [0], "fail_match": "pytorch_model", "fail_after_bytes": 1000}
    with async_ckpt.wrap(engine, f"faulty://{root}", storage_options=faults) as ckpt:
        engine.save_16bit_model(f"faulty://{root}/final")
        ckpt.wait()
        failed = [error.tag for error in ckpt.failures]
    dist.barrier()
    if _rank() == 0:
        collect_garbage(open_storage(root), grace_s=0)
    dist.barrier()
    return {"failed": failed, "left": sorted(os.listdir(f"{root}/final")) if os.path.isdir(f"{root}/final") else None}
