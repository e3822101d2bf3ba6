"""A small GPT-style DeepSpeed training workload: the demo, the benchmark and the tests train it.

A second workload, a stack of large ``Linear`` layers (:func:`make_mlp_engine`), gives the save
benchmark long, CPU-heavy steps (``async-ckpt bench --workload mlp``).

Everything is built locally and deterministically (random-init model from a config, tokenizer
trained on an embedded text), so runs need no network and two runs of the same steps give
bitwise the same losses. It ships in the package because ``async-ckpt demo`` and ``async-ckpt bench``
train it at run time (with the ``example`` extra: transformers, tokenizers).
"""

from __future__ import annotations

from typing import Any

import torch

CORPUS = """\
Checkpoints exist for the day things break. A long training run writes its state every few
hundred steps, and the write must not stop the run. The optimizer holds twelve bytes for every
parameter: the master weights and two moments of Adam. ZeRO splits those bytes across the ranks,
so every rank writes its own shard, and a commit makes the shards one checkpoint. The latest file
names the newest checkpoint whose every shard is durable. Object storage keeps checkpoints when
machines come and go; a fresh job fetches only the shard it needs and resumes where the last left.
""" * 4

SIZES = {
    # name: (n_layer, n_embd, n_head, seq_len)
    "tiny": (2, 64, 4, 32),
    "small": (4, 256, 4, 64),
    "bench": (8, 1024, 16, 64),
    "large": (24, 1024, 16, 64),  # 302 M parameters: a 3.6 GB fp32 checkpoint, for GPU benchmarks
}


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


#: The GPT workload's micro-batch per rank unless one is given.
GPT_MICRO_BATCH = 2


def ds_config(stage: int, dtype: str = "fp32", *, micro_batch: int = GPT_MICRO_BATCH, lr: float = 1e-3,
              load_universal: bool = False) -> dict[str, Any]:
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "checkpoint": {"tag_validation": "FAIL", "load_universal": load_universal},
    }


def build_model(size: str = "tiny", vocab_size: int = 320, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, seq_len = SIZES[size]
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def make_engine(stage: int, dtype: str = "fp32", *, size: str = "tiny", seed: int = 0,
                load_universal: bool = False, micro_batch: int | None = None) -> Any:
    """``deepspeed.initialize`` on the workload model; every rank must call it. The default micro-batch
    (:data:`GPT_MICRO_BATCH`) keeps CPU steps short; on a GPU it leaves the steps bound by kernel launches
    and noisy, which a larger one quiets (benchmarks/RESULTS.md, "one H100")."""
    import deepspeed

    model = build_model(size, seed=seed)
    config = ds_config(stage, dtype, micro_batch=micro_batch or GPT_MICRO_BATCH, load_universal=load_universal)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def token_stream(tokenizer: Any = None) -> torch.Tensor:
    tokenizer = tokenizer or build_tokenizer()
    return torch.tensor(tokenizer(CORPUS)["input_ids"], dtype=torch.long)


def batch(step: int, rank: int, engine: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The micro-batch of ``rank`` at ``step``: the same on every run, different across ranks."""
    seq_len = engine.module.config.n_positions
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (engine.train_micro_batch_size_per_gpu(),), generator=gen)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()]).to(engine.device)


# The second workload: long, CPU-heavy steps and a large optimizer state, as in a user report
# (2 CPU ranks, ZeRO-3 fp32: ~0.87 GB per save, ~5.9 s per step). A GPT step on this machine takes a
# fraction of a second, so a background writer barely overlaps it; this one shows how much a save
# in flight slows a step that keeps every core busy for seconds.
MLP_SIZES = {
    # name: (n_linear, width, micro_batch)
    "tiny": (2, 256, 8),  # the --quick smoke run
    "small": (4, 1024, 16),
    "bench": (8, 3072, 64),  # the report's model: 75.5 M parameters, 0.91 GB of fp32 Adam state over the ranks
}


class MLP(torch.nn.Module):
    """``n_linear`` square ``Linear(width, width)`` layers with a ReLU between; the forward returns
    a scalar loss (the mean of the squared output), so no labels are needed."""

    def __init__(self, n_linear: int, width: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for i in range(n_linear):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(width, width))
        self.layers = torch.nn.Sequential(*layers)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 engines cast the weights, not the inputs: follow the first layer's dtype
        out = self.layers(x.to(self.layers[0].weight.dtype))
        return out.float().pow(2).mean()


def build_mlp(size: str = "bench", seed: int = 0) -> MLP:
    """The MLP of ``MLP_SIZES[size]``, initialised from ``seed`` (the same on every rank and run)."""
    n_linear, width, _ = MLP_SIZES[size]
    torch.manual_seed(seed)
    return MLP(n_linear, width)


def make_mlp_engine(stage: int, dtype: str = "fp32", *, size: str = "bench", seed: int = 0,
                    micro_batch: int | None = None) -> Any:
    """``deepspeed.initialize`` on :func:`build_mlp` with the GPT workload's :func:`ds_config` (only
    the micro-batch differs: the size's, unless given); every rank must call it."""
    import deepspeed

    model = build_mlp(size, seed=seed)
    config = ds_config(stage, dtype, micro_batch=micro_batch or MLP_SIZES[size][2])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def mlp_batch(step: int, rank: int, engine: Any) -> torch.Tensor:
    """The MLP's micro-batch of ``rank`` at ``step``: normal random inputs, the same on every run,
    different across ranks (seeded like :func:`batch`)."""
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), engine.module.width, generator=gen)
    return x.to(engine.device)


def _loss(engine: Any, step: int, rank: int, tokens: torch.Tensor | None) -> torch.Tensor:
    """The forward pass of either workload: the MLP needs no tokens, the GPT model needs them."""
    if isinstance(engine.module, MLP):
        return engine(mlp_batch(step, rank, engine))
    ids = batch(step, rank, engine, tokens)
    return engine(input_ids=ids, labels=ids).loss


def train(engine: Any, steps: int, tokens: torch.Tensor | None, rank: int) -> list[float]:
    """Run ``steps`` optimizer steps from the engine's current step; return the losses.

    Trains either workload (the GPT model of :func:`make_engine` on ``tokens``, or the MLP of
    :func:`make_mlp_engine`, which takes ``tokens=None``)."""
    losses = []
    for _ in range(steps):
        loss = _loss(engine, int(engine.global_steps), rank, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses
