"""Rank tasks for the layout tests: pipeline parallelism, AutoTP, native MoE, AutoEP, frozen parameters,
node-local storage.

Each ``*_run`` task builds a small engine of one layout (seed 0), trains a few steps, saves the same
state with stock DeepSpeed (``{root}/stock``) and with async_ckpt (``{root}/async``), takes one more
step (the reference), then builds a fresh engine from another seed, restores it with
``ckpt.load()`` and takes the same step. The tests compare the two folders and the two steps.
Models are built here, DeepSpeed test style, not imported from DeepSpeed's test suite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import async_ckpt

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

STEPS_BEFORE = 2
TAG = "layout"

Build = Callable[[int], Any]  # seed -> engine
Step = Callable[[Any], float]  # engine -> loss of one optimizer step


def _rank() -> int:
    return dist.get_rank()


def _tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().cpu().clone()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _tensors(value, f"{prefix}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _tensors(value, f"{prefix}/{i}", out)


def state(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's training state: module parameters and buffers (gathered under ZeRO-3) and every
    tensor of the optimizer's state dict (fp32 master partitions, Adam moments)."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        _tensors(dict(engine.module.state_dict()), "module", out)
    _tensors(engine.optimizer.state_dict(), "optimizer", out)
    return out


def _save_async(engine: Any, url: str, options: dict | None, client_state: dict, exclude_frozen: bool) -> dict:
    with async_ckpt.wrap(engine, url, storage_options=options) as ckpt:
        if exclude_frozen:  # only the engine's own save_checkpoint takes the flag; after wrap it is async_ckpt's
            engine.save_checkpoint(url, tag=TAG, client_state=dict(client_state), exclude_frozen_parameters=True)
            ckpt.wait()
            return {"tag": TAG}
        result = ckpt.save(tag=TAG, client_state=dict(client_state)).result(timeout=300)
        return {"tag": result.tag, "stall_s": result.stall_s, "bytes_written": result.bytes_written}


def _resume(build: Build, step: Step, url: str, *, options: dict | None = None, cache_dir: str | None = None,
            strict: bool = True) -> dict:
    """A fresh engine (seed 4321) restored by ``ckpt.load()``, then one training step."""
    engine = build(4321)
    before = state(engine)
    extra = {"cache_dir": cache_dir} if cache_dir else {}
    with async_ckpt.wrap(engine, url, storage_options=options, **extra) as ckpt:
        tag, client_state = ckpt.load(load_module_strict=strict)
        fetched = sorted(ckpt.last_fetch.files) if ckpt.last_fetch else []
    loaded = state(engine)
    return {"tag": tag, "client_state": client_state, "fetched": fetched,
            "load_changed_state": any(not torch.equal(before[k], loaded[k]) for k in before if k in loaded),
            "loss": step(engine), "state": state(engine)}


def _stream_save(engine: Any, root: str, client_state: dict, exclude_frozen: bool) -> None:
    """DeepSpeed's save through a checkpoint engine that serializes as its FastPersist engine does,
    ``torch.save`` into a stream (here a plain file object). DeepSpeed's own FastPersist engine cannot be
    used for these layouts: in 0.19.8 its writer set-up raises for MoE (a NameError) and for AutoTP (the
    mpu has no pipeline functions)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class StreamCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            with open(path, "wb") as stream:
                torch.save(state_dict, stream)

    stock, engine.checkpoint_engine = engine.checkpoint_engine, StreamCheckpointEngine()
    try:
        type(engine).save_checkpoint(engine, root, tag=TAG, client_state=dict(client_state),
                                     exclude_frozen_parameters=exclude_frozen)
    finally:
        engine.checkpoint_engine = stock


@contextlib.contextmanager
def _model_states_from_rank_0(engine: Any, only_rank_0: bool) -> Iterator[None]:
    """With ``only_rank_0``, only rank 0 writes the model-states file: where DeepSpeed has several ranks
    write that one path into a shared folder (``use_node_local_storage``), their writes race and may
    leave a torn file, so the reference copies are taken from rank 0 alone."""
    writes = engine.save_non_zero_checkpoint
    if only_rank_0:
        engine.save_non_zero_checkpoint = writes and _rank() == 0
    try:
        yield
    finally:
        engine.save_non_zero_checkpoint = writes


def _layout_run(build: Build, step: Step, root: str, layout: str, *, s3: tuple[str, dict] | None = None,
                exclude_frozen: bool = False, at_save: Callable[[Any], dict] | None = None,
                stock_model_states_from_rank_0: bool = False) -> tuple[dict, Any]:
    """Train, save stock, async and as FastPersist serializes (and async to ``s3``), take the reference
    step, resume (from disk and ``s3``).

    ``at_save(engine)`` adds facts about the saved state (called on every rank before the next step)."""
    started = time.perf_counter()
    client_state = {"layout": layout}
    engine = build(0)
    for _ in range(STEPS_BEFORE):
        step(engine)
    with _model_states_from_rank_0(engine, stock_model_states_from_rank_0):
        type(engine).save_checkpoint(engine, f"{root}/stock", tag=TAG, client_state=dict(client_state),
                                     exclude_frozen_parameters=exclude_frozen)
    out = _save_async(engine, f"{root}/async", None, client_state, exclude_frozen)
    with _model_states_from_rank_0(engine, stock_model_states_from_rank_0):
        _stream_save(engine, f"{root}/fast", client_state, exclude_frozen)
    if s3 is not None:
        _save_async(engine, s3[0], s3[1], client_state, exclude_frozen)
    out["saved"] = state(engine)
    out.update(at_save(engine) if at_save else {})
    loss = step(engine)
    out["reference"] = {"loss": loss, "state": state(engine)}
    out["resumed"] = _resume(build, step, f"{root}/async", strict=not exclude_frozen)
    if s3 is not None:
        out["resumed_s3"] = _resume(build, step, s3[0], options=s3[1], cache_dir=f"{root}/cache/rank{_rank()}",
                                    strict=not exclude_frozen)
    out["seconds"] = time.perf_counter() - started
    return out, engine


def _outcome(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the test compares type and message)
        return type(exc).__name__, str(exc)
    return None


def _universal_resume(build: Build, step: Step, sources: list[tuple[str, dict | None, bool]]) -> dict:
    """For each universal source (url, storage_options, through async_ckpt?): a fresh engine loads it, one step."""
    out = {}
    for url, options, via_async in sources:
        started = time.perf_counter()
        engine = build(4321)
        tag = None
        if via_async:
            with async_ckpt.wrap(engine, url, storage_options=options) as ckpt:
                tag, _ = ckpt.load()
        else:
            engine.load_checkpoint(url, tag=f"{TAG}_universal")
        loaded = state(engine)
        out[url] = {"tag": tag, "loaded": loaded, "loss": step(engine), "state": state(engine),
                    "world_size": dist.get_world_size(), "seconds": time.perf_counter() - started}
    return out


# ---- pipeline parallelism ----------------------------------------------------------------------

PIPE_HIDDEN, PIPE_CLASSES = 16, 4


def _ds_config(stage: int) -> dict:
    """What every layout's engine shares: micro-batch 2, torch's Adam (no CPU Adam op build), quiet."""
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 1_000_000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}


def _pipe_engine(seed: int, stage: int = 1, *, num_stages: int | None = 2, topology: Any = None,
                 load_universal: bool = False) -> Any:
    """DeepSpeed's LinearStackPipe, smaller: Linear, 4 x (Linear, ReLU), Linear, over 2 stages (or
    ``num_stages``, or the stages of ``topology``)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(seed)
    layers: list[Any] = [LayerSpec(torch.nn.Linear, PIPE_HIDDEN, PIPE_HIDDEN)]
    for _ in range(4):
        layers += [LayerSpec(torch.nn.Linear, PIPE_HIDDEN, PIPE_HIDDEN, bias=False), torch.nn.ReLU()]
    layers.append(LayerSpec(torch.nn.Linear, PIPE_HIDDEN, PIPE_CLASSES))
    model = PipelineModule(layers=layers, num_stages=None if topology else num_stages, topology=topology,
                           loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform")
    config = {**_ds_config(stage), "train_batch_size": 4, "pipeline": {"activation_checkpoint_interval": 0},
              "checkpoint": {"load_universal": load_universal}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine


def _pipe_batches(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    while True:
        x = torch.randn(2, PIPE_HIDDEN, generator=gen)
        yield x, (x.sum(dim=1) > 0).long() + 2 * (x[:, 0] > 0).long()


def _pipe_step(engine: Any) -> float:
    return float(engine.train_batch(data_iter=_pipe_batches(int(engine.global_steps))).item())


def pipeline_run(root: str, stage: int, s3_url: str | None = None, options: dict | None = None) -> dict:
    """2 stages on 2 ranks, fp32, ``train_batch`` with 2 micro-batches; also saved to ``s3_url``."""
    out, engine = _layout_run(lambda seed: _pipe_engine(seed, stage), _pipe_step, root, "pipeline",
                              s3=(s3_url, options) if s3_url else None)
    out.update(stage_id=engine.stage_id, mp_world_size=engine.mp_world_size, mp_rank=engine.checkpoint_mp_rank)
    with async_ckpt.wrap(engine, f"{root}/export") as ckpt:
        out["consolidated"] = _outcome(lambda: ckpt.save_consolidated(tag="whole"))
    out["export_written"] = os.path.exists(f"{root}/export/whole")
    return out


def pipeline_step_during_a_slow_copy(root: str) -> dict:
    """One stage, data parallel on 2 ranks: save with the optimizer file's copy overlapped (the default)
    and slowed to 1 s per piece, then ``train_batch`` at once. Whether the saved optimizer state is the
    state at save(), and whether the step changed it."""
    from async_ckpt import staging

    engine = _pipe_engine(0, num_stages=1)
    _pipe_step(engine)
    copy_and_checksum, copy_all = staging._copy_and_checksum, staging._copy_all

    def slow(copy: Callable[..., Any]) -> Callable[..., Any]:
        def slowed(*args: Any) -> Any:
            time.sleep(1.0)  # a large partition on a busy host
            return copy(*args)
        return slowed

    staging._copy_and_checksum, staging._copy_all = slow(copy_and_checksum), slow(copy_all)
    try:
        with async_ckpt.wrap(engine, root) as ckpt:
            at_save = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
            handle = ckpt.save(tag="t")
            _pipe_step(engine)
            after = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
            handle.result(timeout=120)
    finally:
        staging._copy_and_checksum, staging._copy_all = copy_and_checksum, copy_all
    name = f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_optim_states.pt"
    saved = torch.load(os.path.join(root, "t", name), weights_only=False)["optimizer_state_dict"][
        "single_partition_of_fp32_groups"]
    return {"stepped": not all(torch.equal(a, b) for a, b in zip(at_save, after)),
            "saved_at_save": all(torch.equal(s, b) for s, b in zip(saved, at_save))}


def pipeline_universal(sources: list[tuple[str, dict | None, bool]]) -> dict:
    """One stage on one rank: load each universal conversion of the 2-stage checkpoint, one step."""
    return _universal_resume(lambda seed: _pipe_engine(seed, num_stages=1, load_universal=True), _pipe_step, sources)


def _tp_pp_engine(seed: int) -> Any:
    """The pipeline above over 2 stages x 2 tensor-parallel ranks (DeepSpeed's TPxPP checkpoint test's
    topology: plain Linear layers are replicated, not sharded, across the TP ranks; the grid, the file
    names and the PP-major mp_rank numbering are DeepSpeed's)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return _pipe_engine(seed, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))


def tp_pp_run(root: str, s3_url: str, options: dict) -> dict:
    """2 pipeline stages x 2 tensor-parallel ranks on 4 ranks, ZeRO-1 fp32; also saved to and resumed from S3."""
    out, engine = _layout_run(_tp_pp_engine, _pipe_step, root, "tp_pp", s3=(s3_url, options))
    out.update(stage_id=engine.stage_id, mp_rank=engine.checkpoint_mp_rank)
    return out


# ---- AutoTP -------------------------------------------------------------------------------------

TP_VOCAB, TP_SEQ = 64, 16


def _tp_engine(seed: int, *, tp_size: int = 2, stage: int = 1, dtype: str = "fp32",
               load_universal: bool = False) -> Any:
    """A tiny Llama (transformers), AutoTP-sharded when ``tp_size`` > 1."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=TP_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=TP_SEQ, tie_word_embeddings=False))
    config = {**_ds_config(stage), "bf16": {"enabled": dtype == "bf16"},
              "checkpoint": {"load_universal": load_universal}}
    if tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": tp_size}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _tp_step(engine: Any) -> float:
    """One step on this step's batch, the same on every rank (TP ranks share one data-parallel replica)."""
    gen = torch.Generator().manual_seed(2000 + int(engine.global_steps))
    ids = torch.randint(0, TP_VOCAB, (2, TP_SEQ), generator=gen)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def autotp_run(root: str, stage: int, dtype: str, s3_url: str | None = None, options: dict | None = None) -> dict:
    """AutoTP size 2 on 2 ranks (data parallel 1) under ZeRO ``stage`` in ``dtype``; also saved to S3 when
    ``s3_url`` is given. Then an engine with the same world size but TP 1 (data parallel 2) tries
    ``ckpt.load()`` of it."""
    from deepspeed.utils import groups

    # Built first: an engine built after an AutoTP engine in the same process inherits its device mesh.
    other = _tp_engine(4321, tp_size=1, stage=stage, dtype=dtype)
    out, engine = _layout_run(lambda seed: _tp_engine(seed, stage=stage, dtype=dtype), _tp_step, root, "autotp",
                              s3=(s3_url, options) if s3_url else None, at_save=_gathered)
    out.update(tp_rank=groups.get_tensor_model_parallel_rank(), mp_rank=engine.checkpoint_mp_rank,
               dp_world_size=dist.get_world_size(group=engine.optimizer.dp_process_group))
    with async_ckpt.wrap(other, f"{root}/async") as ckpt:
        out["load_on_tp1"] = _outcome(ckpt.load)
    with async_ckpt.wrap(engine, f"{root}/export") as ckpt:
        out["consolidated"] = _outcome(lambda: ckpt.save_consolidated(tag="whole").result(timeout=300))
    full = _gathered(engine)["full_weights"]  # a collective: on every rank
    if _rank() == 0 and out["consolidated"] is None:
        from safetensors.torch import load_file

        exported: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(f"{root}/export/whole")):
            if name.endswith(".safetensors"):
                exported.update(load_file(f"{root}/export/whole/{name}"))
        out["exported_differs"] = sorted(set(exported) ^ set(full)) + [
            k for k in full if k in exported and not torch.equal(exported[k], full[k].to(exported[k].dtype))]
    return out


def _gathered(engine: Any) -> dict:
    """The saved weights un-sharded by AutoTP's own gather (a collective; rank 0 gets them), inside ZeRO-3's
    gather of its data-parallel partitions."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        full = engine._replace_module_consolidated_state_dict()
    return {"full_weights": {k: v.detach().cpu().clone() for k, v in (full or {}).items()}}


def autotp_universal(stage: int, dtype: str, sources: list[tuple[str, dict | None, bool]]) -> dict:
    """TP 1 (one rank): load each universal conversion of the TP-2 checkpoint, one step."""
    return _universal_resume(lambda seed: _tp_engine(seed, tp_size=1, stage=stage, dtype=dtype, load_universal=True),
                             _tp_step, sources)


# ---- native DeepSpeed MoE ----------------------------------------------------------------------

MOE_HIDDEN, MOE_EXPERTS, MOE_CLASSES = 16, 4, 4


class MoEModel(torch.nn.Module):
    """DeepSpeed's SimpleMoEModel shape: dense, MoE, dense, MoE, dense (one expert module shared by both
    MoE layers' construction), deterministic gating (no random token selection) for bitwise resume."""

    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.linear1 = torch.nn.Linear(MOE_HIDDEN, MOE_HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(MOE_HIDDEN, MOE_HIDDEN), torch.nn.Linear(MOE_HIDDEN, MOE_HIDDEN))
        kwargs = {"hidden_size": MOE_HIDDEN, "expert": expert, "ep_size": ep_size, "num_experts": MOE_EXPERTS, "k": 1,
                  "use_rts": False, "capacity_factor": 4.0, "min_capacity": 8}
        self.moe_1 = MoE(**kwargs)
        self.linear2 = torch.nn.Linear(MOE_HIDDEN, MOE_HIDDEN)
        self.moe_2 = MoE(**kwargs)
        self.linear3 = torch.nn.Linear(MOE_HIDDEN, MOE_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.linear1(x)
        out, aux_1, _ = self.moe_1(h)
        out, aux_2, _ = self.moe_2(self.linear2(out))
        logits = self.linear3(out + h).reshape(-1, MOE_CLASSES).float()
        return torch.nn.functional.cross_entropy(logits, y.reshape(-1)) + 0.01 * (aux_1 + aux_2)


def _moe_engine(seed: int, *, stage: int, dtype: str) -> Any:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    model = MoEModel(ep_size=2)
    param_groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                         "name": "parameters"})
    config = {**_ds_config(stage), "bf16": {"enabled": dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups, config=config)
    return engine


def _moe_step(engine: Any) -> float:
    gen = torch.Generator().manual_seed(3000 + 17 * int(engine.global_steps) + _rank())  # per data-parallel rank
    x = torch.randn(2, 8, MOE_HIDDEN, generator=gen)
    y = torch.randint(0, MOE_CLASSES, (2, 8), generator=gen)
    loss = engine(x.to(torch.bfloat16 if engine.bfloat16_enabled() else torch.float32), y)
    engine.backward(loss)
    engine.step()
    return float(loss.float().item())


def moe_run(root: str, stage: int, dtype: str, s3_url: str | None = None, options: dict | None = None) -> dict:
    """Native MoE, 4 experts, ep_size 2 on 2 ranks (2 experts each); also saved to and resumed from ``s3_url``."""
    out, _ = _layout_run(lambda seed: _moe_engine(seed, stage=stage, dtype=dtype), _moe_step, root, "moe",
                         s3=(s3_url, options) if s3_url else None)
    return out


# ---- AutoEP -------------------------------------------------------------------------------------

EP_VOCAB, EP_SEQ = 64, 16


def _ep_engine(seed: int, *, ep_size: int = 2, stage: int = 1, load_universal: bool = False) -> Any:
    """A tiny DeepSeek-V2 (transformers) with AutoEP's ``deepseek_v2`` preset: 4 routed experts, 1 shared.

    AutoEP at size 1 still replaces the MoE layers (the parameter names a universal checkpoint loads by).
    """
    import deepspeed
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=EP_VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=0, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, max_position_embeddings=EP_SEQ, tie_word_embeddings=False))
    config = {**_ds_config(stage), "checkpoint": {"load_universal": load_universal},
              "expert_parallel": {"enabled": True, "autoep_size": ep_size, "preset_model": "deepseek_v2"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _ep_step(engine: Any) -> float:
    """One step; each data-parallel rank its own batch."""
    gen = torch.Generator().manual_seed(4000 + 31 * int(engine.global_steps) + _rank())
    ids = torch.randint(0, EP_VOCAB, (2, EP_SEQ), generator=gen)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.float().item())


def autoep_run(root: str, stage: int, s3_url: str | None = None, options: dict | None = None) -> dict:
    """AutoEP size 2 on 2 ranks (also saved to ``s3_url`` and resumed from it, if given). Under ZeRO-3,
    also DeepSpeed's refusal of a consolidated export: by the engine alone, by the engine after wrap and
    by ``save_consolidated``; a save works after them."""
    out, engine = _layout_run(lambda seed: _ep_engine(seed, stage=stage), _ep_step, root, "autoep",
                              s3=(s3_url, options) if s3_url else None)
    if stage == 3:
        out["stock_16bit"] = _outcome(lambda: engine.save_16bit_model(f"{root}/stock_16bit"))
        with async_ckpt.wrap(engine, f"{root}/async") as ckpt:
            out["wrapped_16bit"] = _outcome(lambda: engine.save_16bit_model(f"{root}/async_16bit"))
            out["consolidated"] = _outcome(lambda: ckpt.save_consolidated(tag="consolidated"))
            out["saves_after"] = ckpt.save(tag="after-refusals").result(timeout=300).tag
    return out


def autoep_universal(stage: int, sources: list[tuple[str, dict | None, bool]]) -> dict:
    """AutoEP size 1 (one rank): load each universal conversion of the EP-2 checkpoint, one step."""
    return _universal_resume(lambda seed: _ep_engine(seed, ep_size=1, stage=stage, load_universal=True), _ep_step,
                             sources)


# ---- ZeRO-Offload and frozen parameters ----------------------------------------------------------

def _offload_engine(seed: int, *, stage: int) -> Any:
    """The workload GPT with the optimizer (and under ZeRO-3 the parameters) offloaded to the CPU.

    ``torch_adam`` keeps DeepSpeed's CPU Adam op (a C++ build of minutes) out of it: ZeRO-Offload then
    steps torch's Adam on the offloaded fp32 partition; the checkpoint code is the same.
    """
    import deepspeed

    from async_ckpt import workload

    model = workload.build_model("tiny", seed=seed)
    config = workload.ds_config(stage, "fp32")
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def offload_run(root: str, stage: int) -> dict:
    out, engine = _layout_run(lambda seed: _offload_engine(seed, stage=stage), _gpt_step, root, "offload")
    out["offloaded"] = engine.zero_offload_optimizer() is not None
    return out


def _frozen_engine(seed: int) -> Any:
    """The workload GPT with its position embeddings and first block frozen. The frozen weights are
    seed 0's in every engine (as pretrained weights would be); the trainable ones follow ``seed``."""
    import deepspeed

    from async_ckpt import workload

    model = workload.build_model("tiny", seed=0)
    torch.manual_seed(seed)
    frozen = ("transformer.wpe.", "transformer.h.0.")
    for name, param in model.named_parameters():
        if name.startswith(frozen):
            param.requires_grad_(False)
        elif seed != 0:
            with torch.no_grad():
                param.normal_(0, 0.02)
    config = workload.ds_config(2, "fp32")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    return engine


def _node_local_engine(seed: int) -> Any:
    """The workload GPT under ZeRO-1 fp32 with DeepSpeed's ``checkpoint.use_node_local_storage``."""
    import deepspeed

    from async_ckpt import workload

    config = workload.ds_config(1, "fp32")
    config["checkpoint"]["use_node_local_storage"] = True
    model = workload.build_model("tiny", seed=seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def node_local_one_node_run(root: str) -> dict:
    """``use_node_local_storage`` on one node of two ranks: DeepSpeed has its first rank (``LOCAL_RANK`` 0)
    alone write the model-states file."""
    out, engine = _layout_run(_node_local_engine, _gpt_step, root, "node_local_one_node")
    out["writes_model_states"] = engine.save_non_zero_checkpoint
    return out


def node_local_run(root: str) -> dict:
    """``use_node_local_storage`` on two simulated nodes of one rank each (``LOCAL_RANK`` 0 on both
    ranks, and a host name of each one's own, as two hosts over NFS), sharing one folder: DeepSpeed has
    each node's first rank write the model-states file, so both ranks would write
    ``mp_rank_00_model_states.pt`` (the reference saves take rank 0's alone)."""
    import socket

    local_rank, hostname = os.environ["LOCAL_RANK"], socket.gethostname
    os.environ["LOCAL_RANK"] = "0"
    socket.gethostname = lambda: f"node{_rank()}"
    try:
        out, engine = _layout_run(_node_local_engine, _gpt_step, root, "node_local",
                                  stock_model_states_from_rank_0=True)
    finally:
        os.environ["LOCAL_RANK"], socket.gethostname = local_rank, hostname
    out["writes_model_states"] = engine.save_non_zero_checkpoint
    return out


def _gpt_step(engine: Any) -> float:
    from async_ckpt import workload

    if "tokens" not in _TOKENS:
        _TOKENS["tokens"] = workload.token_stream()
    return workload.train(engine, 1, _TOKENS["tokens"], _rank())[0]


_TOKENS: dict[str, torch.Tensor] = {}


def frozen_run(root: str) -> dict:
    """ZeRO-2 fp32 with frozen parameters, saved with ``exclude_frozen_parameters=True`` (stock, and
    ``engine.save_checkpoint`` after wrap); resumed with ``load_module_strict=False``."""
    out, engine = _layout_run(_frozen_engine, _gpt_step, root, "frozen", exclude_frozen=True)
    out["frozen_names"] = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    return out
