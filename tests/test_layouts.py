"""async_ckpt beyond plain ZeRO data parallelism: pipeline parallelism, AutoTP, native MoE, AutoEP,
ZeRO-Offload, frozen parameters; each on 2 real DeepSpeed ranks (gloo, CPU).

For every layout one rank run (``layout_tasks``) saves the same state with stock DeepSpeed and with
async_ckpt, then resumes a fresh engine through ``ckpt.load()``. The tests check that both folders
hold the same files with the same content (loaded, compared tensor by tensor with ``torch.equal``:
async_ckpt's default zip records are named ``archive/...``, so raw bytes differ), that the resumed
engine's next step is bitwise the original engine's, and for AutoTP and AutoEP that a universal
conversion (``async-ckpt to-universal``) loads on one rank exactly as DeepSpeed's conversion of its
own checkpoint does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import layout_tasks
import pytest
import torch
from conftest import Ranks, rank_group
from s3_server import options

from async_ckpt.cli import main as cli
from async_ckpt.layout import files_for_rank, model_parallel_size

TAG = layout_tasks.TAG
#: What async_ckpt adds to a tag folder: its manifest, and the model's Hugging Face config.json.
OUR_EXTRAS = {"async_ckpt_manifest.json", "config.json"}


# ---- fixtures: one rank run per layout ----------------------------------------------------------

class LayoutRanks:
    """The module's 2 ranks, restarted after a pipeline or AutoTP run. DeepSpeed keeps process-wide
    parallel state (``deepspeed.utils.groups``: the pipeline grid or AutoTP's device mesh as the global
    mpu), so an engine built after a pipeline or AutoTP engine in the same process inherits their
    groups. Data-parallel engines (MoE, AutoEP, offload, frozen) leave none: any run may follow them."""

    #: Layout families that leave process-wide parallel state behind.
    POLLUTING = ("pipeline", "autotp", "autotp_zero2", "autotp_zero3")

    def __init__(self, ranks: Ranks, folders: pytest.TempPathFactory) -> None:
        self.ranks, self.folders, self.family = ranks, folders, None

    def run(self, family: str, fn, *args) -> list[dict]:
        if self.family in self.POLLUTING and family != self.family:
            self.ranks.restart()
        self.family = family
        return self.ranks.run(fn, *args, timeout_s=600)

    def layout(self, folder: str, family: str, fn, *args) -> dict:
        """``fn(root, *args)`` on the ranks, ``root`` a new folder named ``folder``: ``{"root", "ranks"}``."""
        root = self.folders.mktemp(folder)
        return {"root": root, "ranks": self.run(family, fn, str(root), *args)}


@pytest.fixture(scope="module")
def layout_ranks(ranks, tmp_path_factory):
    return LayoutRanks(ranks, tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(layout_ranks, s3):
    """2 stages, ZeRO-1 fp32; also on S3."""
    url = f"s3://{s3.make_bucket('layouts-pipeline')}/run"
    return {**layout_ranks.layout("pipeline", "pipeline", layout_tasks.pipeline_run, 1, url, options(s3.endpoint)),
            "url": url}


@pytest.fixture(scope="module")
def pipeline_zero0(layout_ranks):
    """2 stages without ZeRO, fp32 (DeepSpeed's test_checkpoint_pipe_engine[0]): optimizer in the model states."""
    return layout_ranks.layout("pipeline-zero0", "pipeline", layout_tasks.pipeline_run, 0)


@pytest.fixture(scope="module")
def autotp(layout_ranks, s3):
    """AutoTP size 2 on 2 ranks, ZeRO-1 fp32; also on S3."""
    url = f"s3://{s3.make_bucket('layouts-autotp')}/run"
    run = layout_ranks.layout("autotp", "autotp", layout_tasks.autotp_run, 1, "fp32", url, options(s3.endpoint))
    return {**run, "url": url}


@pytest.fixture(scope="module")
def autotp_zero2(layout_ranks):
    """AutoTP size 2 on 2 ranks, ZeRO-2 fp32."""
    return layout_ranks.layout("autotp-zero2", "autotp_zero2", layout_tasks.autotp_run, 2, "fp32")


@pytest.fixture(scope="module")
def autotp_zero3(layout_ranks):
    """AutoTP size 2 on 2 ranks, ZeRO-3 bf16."""
    return layout_ranks.layout("autotp-zero3", "autotp_zero3", layout_tasks.autotp_run, 3, "bf16")


@pytest.fixture(scope="module")
def moe_zero0(layout_ranks, s3):
    """Native MoE without ZeRO, fp32: expert-parallel optimizer files (``expp_rank_*``); also on S3."""
    url = f"s3://{s3.make_bucket('layouts-moe')}/run"
    return {**layout_ranks.layout("moe-zero0", "dp", layout_tasks.moe_run, 0, "fp32", url, options(s3.endpoint)),
            "url": url}


@pytest.fixture(scope="module")
def moe_zero2(layout_ranks):
    """Native MoE with ZeRO-2, bf16."""
    return layout_ranks.layout("moe-zero2", "dp", layout_tasks.moe_run, 2, "bf16")


@pytest.fixture(scope="module")
def autoep(layout_ranks, s3):
    """AutoEP size 2, ZeRO-1 fp32; also on S3."""
    url = f"s3://{s3.make_bucket('layouts-autoep')}/run"
    return {**layout_ranks.layout("autoep-zero1", "dp", layout_tasks.autoep_run, 1, url, options(s3.endpoint)),
            "url": url}


@pytest.fixture(scope="module")
def autoep_zero3(layout_ranks):
    return layout_ranks.layout("autoep-zero3", "dp", layout_tasks.autoep_run, 3)


def _offload(layout_ranks, stage: int) -> dict:
    run = layout_ranks.layout(f"offload-zero{stage}", "dp", layout_tasks.offload_run, stage)
    assert all(o["offloaded"] for o in run["ranks"])
    return run


@pytest.fixture(scope="module")
def offload_zero2(layout_ranks):
    """ZeRO-2 with the optimizer offloaded to the CPU."""
    return _offload(layout_ranks, 2)


@pytest.fixture(scope="module")
def offload_zero3(layout_ranks):
    """ZeRO-3 with the optimizer and the parameters offloaded to the CPU."""
    return _offload(layout_ranks, 3)


@pytest.fixture(scope="module")
def frozen(layout_ranks):
    return layout_ranks.layout("frozen", "dp", layout_tasks.frozen_run)


@pytest.fixture(scope="module")
def node_local(layout_ranks):
    """DeepSpeed's ``use_node_local_storage`` on two simulated one-rank nodes sharing the folder."""
    return layout_ranks.layout("node-local", "dp", layout_tasks.node_local_run)


@pytest.fixture(scope="module")
def node_local_one_node(layout_ranks):
    """DeepSpeed's ``use_node_local_storage`` on one node of two ranks."""
    return layout_ranks.layout("node-local-one-node", "dp", layout_tasks.node_local_one_node_run)


@pytest.fixture(scope="module")
def four_ranks():
    yield from rank_group(4)


@pytest.fixture(scope="module")
def tp_pp(four_ranks, s3, tmp_path_factory):
    """2 pipeline stages x 2 tensor-parallel ranks on 4 ranks, ZeRO-1 fp32; also on S3."""
    root = tmp_path_factory.mktemp("tp-pp")
    url = f"s3://{s3.make_bucket('layouts-tp-pp')}/run"
    out = four_ranks.run(layout_tasks.tp_pp_run, str(root), url, options(s3.endpoint), timeout_s=600)
    return {"root": root, "url": url, "ranks": out}


@pytest.fixture(scope="module")
def one_rank():
    yield from rank_group(1)


def _stock_universal(root, *, check: bool = True) -> subprocess.CompletedProcess:
    """DeepSpeed's own ds_to_universal of the stock checkpoint, as ``{root}/stock/{TAG}_universal``."""
    return subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / "stock" / TAG), "--output_folder", str(root / "stock" / f"{TAG}_universal"),
                           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                          check=check, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def _our_universal(root) -> int:
    """`async-ckpt to-universal` of the async_ckpt checkpoint, as ``{root}/async/{TAG}_universal``."""
    return cli(["to-universal", str(root / "async"), "--tag", TAG, "--out", str(root / "async"), "--json",
                "--workers", "1"])


def _without_numbers(text: str) -> str:
    """``text`` with its numbers and bracketed shapes blanked out."""
    return re.sub(r"\[[^\]]*\]|\d+", "#", text)


def _universal_file_differences(root) -> list[str]:
    """Where the two conversions differ: a file only one has, or one whose loaded content differs."""
    stock_dir, our_dir = root / "stock" / f"{TAG}_universal", root / "async" / f"{TAG}_universal"
    stock = {n for n in _files(stock_dir) if n.endswith(".pt")}
    ours = {n for n in _files(our_dir) if n.endswith(".pt")}
    assert any(n.startswith("zero/") for n in stock), "DeepSpeed's conversion wrote no zero/ folder"
    return sorted(stock ^ ours) + [n for n in sorted(stock & ours) if _differences(_load(stock_dir / n),
                                                                                  _load(our_dir / n))]


def _universal(layout: dict, one_rank, task, *args, s3=None) -> dict:
    """The layout's checkpoint converted by `async-ckpt to-universal` (on disk, and on S3 when ``s3`` is
    given) and by DeepSpeed from the stock copy, each loaded on one rank by ``task(*args, sources)``:
    ``{"local" | "s3" | "stock": that load}``."""
    root = layout["root"]
    assert _our_universal(root) == 0
    sources = {"local": (str(root / "async"), None, True)}
    if s3 is not None:
        url = layout["url"]
        assert cli(["to-universal", url, "--endpoint", s3.endpoint, "--out", url, "--json", "--workers", "1"]) == 0
        sources["s3"] = (url, options(s3.endpoint), True)
    _stock_universal(root)
    sources["stock"] = (str(root / "stock"), None, False)
    out = one_rank.run(task, *args, list(sources.values()), timeout_s=600)
    return {name: out[0][src[0]] for name, src in sources.items()}


@pytest.fixture(scope="module")
def autotp_universal(autotp, one_rank, s3):
    """The TP-2 ZeRO-1 checkpoint, on disk and on S3, loaded on one rank with TP 1."""
    return _universal(autotp, one_rank, layout_tasks.autotp_universal, 1, "fp32", s3=s3)


@pytest.fixture(scope="module")
def autotp_zero2_universal(autotp_zero2, one_rank):
    """The TP-2 ZeRO-2 checkpoint loaded on one rank with TP 1 under ZeRO-2."""
    return _universal(autotp_zero2, one_rank, layout_tasks.autotp_universal, 2, "fp32")


@pytest.fixture(scope="module")
def autotp_zero3_universal(autotp_zero3, one_rank):
    """The TP-2 ZeRO-3 bf16 checkpoint loaded on one rank with TP 1 under ZeRO-3."""
    return _universal(autotp_zero3, one_rank, layout_tasks.autotp_universal, 3, "bf16")


@pytest.fixture(scope="module")
def autoep_universal(autoep, one_rank, s3):
    """The EP-2 ZeRO-1 checkpoint, on disk and on S3, loaded on one rank with AutoEP size 1."""
    return _universal(autoep, one_rank, layout_tasks.autoep_universal, 1, s3=s3)


@pytest.fixture(scope="module")
def autoep_zero3_universal(autoep_zero3, one_rank):
    """The EP-2 ZeRO-3 checkpoint loaded on one rank with AutoEP size 1 under ZeRO-3 (DeepSpeed converts
    AutoEP under ZeRO-3 too, while its zero_to_fp32 refuses it)."""
    return _universal(autoep_zero3, one_rank, layout_tasks.autoep_universal, 3)


@pytest.fixture(scope="module")
def pipeline_universal(pipeline, one_rank, s3):
    """The 2-stage ZeRO-1 checkpoint, on disk and on S3, loaded on one rank as a single stage; and where the
    two conversions' files differ."""
    loads = _universal(pipeline, one_rank, layout_tasks.pipeline_universal, s3=s3)
    return {"differences": _universal_file_differences(pipeline["root"]), **loads}


#: In this order, the module restarts its ranks only after each AutoTP run (see LayoutRanks).
LAYOUTS = ["moe_zero0", "moe_zero2", "autoep", "autoep_zero3", "offload_zero2", "offload_zero3", "frozen", "node_local",
           "node_local_one_node", "autotp", "autotp_zero2", "autotp_zero3", "pipeline", "pipeline_zero0", "tp_pp"]


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.getfixturevalue(request.param)


# ---- helpers ----------------------------------------------------------------------------------

def _differences(a, b, path: str = "") -> list[str]:
    """Where two loaded checkpoint objects differ: tensors by dtype, shape and torch.equal, containers
    recursively, objects by their attributes, everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [path]
    if type(a) is not type(b):
        return [f"{path} (type {type(a).__name__} != {type(b).__name__})"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path} (keys {sorted(map(str, a))} != {sorted(map(str, b))})"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} (length {len(a)} != {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if a == b:
        return []
    if hasattr(a, "__dict__"):
        return _differences(vars(a), vars(b), f"{path}.")
    return [f"{path} ({a!r} != {b!r})"]


def _first_record_difference(a, b) -> str:
    """Which zip record of two torch.save files differs first, and the bytes around the difference."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        if za.namelist() != zb.namelist():
            return f"{a.name}: records {za.namelist()} != {zb.namelist()}"
        for name in za.namelist():
            x, y = za.read(name), zb.read(name)
            if x != y:
                at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                return f"{a.name}/{name} at byte {at} of {len(x)} vs {len(y)}: {x[at - 60:at + 60]!r} != {y[at - 60:at + 60]!r}"
    return f"{a.name}: same records, other zip bytes"


def _files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names}


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _state_differences(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys: {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


# ---- every layout: the same files as stock DeepSpeed, bitwise resume ----------------------------

def test_tag_folder_has_stock_deepspeeds_file_names_plus_the_manifest(layout):
    stock, ours = _files(layout["root"] / "stock" / TAG), _files(layout["root"] / "async" / TAG)
    assert {n for n in stock if n.endswith(".pt")}, "stock DeepSpeed saved no files"
    assert ours - stock <= OUR_EXTRAS and "async_ckpt_manifest.json" in ours
    assert stock - ours == set()


def test_every_file_holds_stock_deepspeeds_tensors_bitwise(layout):
    stock_dir, our_dir = layout["root"] / "stock" / TAG, layout["root"] / "async" / TAG
    differences = {}
    for name in sorted(_files(stock_dir)):
        diff = _differences(_load(stock_dir / name), _load(our_dir / name))
        if diff:
            differences[name] = diff[:5]
    assert differences == {}


def test_every_file_is_byte_for_byte_what_fast_persist_serializes(layout):
    """async_ckpt's default bytes are those of DeepSpeed's FastPersist engine: torch.save into a stream."""
    fast_dir, our_dir = layout["root"] / "fast" / TAG, layout["root"] / "async" / TAG
    names = sorted(n for n in _files(fast_dir) if n.endswith(".pt"))
    assert names and [_first_record_difference(fast_dir / n, our_dir / n) for n in names
                      if (fast_dir / n).read_bytes() != (our_dir / n).read_bytes()] == []


def test_resume_on_a_fresh_engine_takes_the_same_next_step_bitwise(layout):
    for rank, out in enumerate(layout["ranks"]):
        resumed, reference = out["resumed"], out["reference"]
        kinds = {k.split("/")[0] for k, v in reference["state"].items() if v.numel()}
        assert kinds == {"module", "optimizer"}, f"rank {rank}: nothing to compare"
        assert resumed["load_changed_state"], f"rank {rank}: the fresh engine started from the saved state"
        assert resumed["tag"] == TAG and resumed["client_state"]["layout"]
        assert resumed["loss"] == reference["loss"], f"rank {rank}"
        assert _state_differences(resumed["state"], reference["state"]) == [], f"rank {rank}"


# ---- pipeline parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("name,optimizer_files", [
    ("pipeline", {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"}),
    ("pipeline_zero0", set()),
])
def test_pipeline_writes_each_stages_layer_files_and_model_states(request, name, optimizer_files):
    run = request.getfixturevalue(name)
    assert [(o["stage_id"], o["mp_rank"], o["mp_world_size"]) for o in run["ranks"]] == [(0, 0, 2), (1, 1, 2)]
    names = {n for n in _files(run["root"] / "async" / TAG) if n.endswith(".pt")}
    assert names == {f"layer_{i:02d}-model_states.pt" for i in range(10)} | optimizer_files | {
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"}


def test_a_pipelines_consolidated_save_is_refused_before_anything_is_written(pipeline):
    """Each stage holds its own layers, and its module_state_dict writes layer files into the tag last loaded."""
    for out in pipeline["ranks"]:
        kind, message = out["consolidated"]
        assert kind == "UsageError" and "pipeline" in message and out["export_written"] is False


def test_pipeline_resume_from_s3_fetches_the_layer_files_and_takes_the_same_step(pipeline):
    for rank, out in enumerate(pipeline["ranks"]):
        resumed = out["resumed_s3"]
        assert {f"layer_{i:02d}-model_states.pt" for i in range(10)} <= set(resumed["fetched"])
        assert resumed["loss"] == out["reference"]["loss"]
        assert _state_differences(resumed["state"], out["reference"]["state"]) == [], f"rank {rank}"


def test_pipeline_train_batch_after_a_save_waits_for_the_optimizer_files_overlapped_copy(ranks, tmp_path):
    """train_batch() steps the optimizer without asking the checkpoint engine first, as engine.step() does."""
    for out in ranks.run(layout_tasks.pipeline_step_during_a_slow_copy, str(tmp_path)):
        assert out == {"stepped": True, "saved_at_save": True}


# ---- TP x PP on 4 ranks ------------------------------------------------------------------------

def test_tp_pp_numbers_model_parallel_files_pipeline_major_as_deepspeed_does(tp_pp):
    assert sorted((o["stage_id"], o["mp_rank"]) for o in tp_pp["ranks"]) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    names = _files(tp_pp["root"] / "async" / TAG)
    assert {f"mp_rank_{r:02d}_model_states.pt" for r in range(4)} <= names
    assert {n for n in names if n.endswith("_optim_states.pt")} == {
        f"zero_pp_rank_0_mp_rank_{r:02d}_optim_states.pt" for r in range(4)}


def test_tp_pp_resume_from_s3_takes_the_same_step(tp_pp):
    for rank, out in enumerate(tp_pp["ranks"]):
        resumed = out["resumed_s3"]
        assert resumed["tag"] == TAG and resumed["loss"] == out["reference"]["loss"]
        assert _state_differences(resumed["state"], out["reference"]["state"]) == [], f"rank {rank}"


def test_tp_pp_universal_conversion_equals_deepspeeds_own_conversion_bitwise(tp_pp):
    assert _our_universal(tp_pp["root"]) == 0
    _stock_universal(tp_pp["root"])
    assert _universal_file_differences(tp_pp["root"]) == []


@pytest.mark.parametrize("name", ["moe_zero0", "moe_zero2"])
def test_to_universal_of_native_moe_fails_with_deepspeeds_own_error(request, name, capsys):
    """DeepSpeed 0.19 cannot convert native MoE checkpoints (ZeRO-0: its optimizer files are not ZeRO's, a
    KeyError; ZeRO-2: a reshape error on an expert parameter): to-universal fails with DeepSpeed's error."""
    root = request.getfixturevalue(name)["root"]
    stock = _stock_universal(root, check=False)
    code = _our_universal(root)
    assert stock.returncode != 0
    refusal = _without_numbers(stock.stderr.strip().splitlines()[-1])  # up to the shapes of the parameter met first
    assert code != 0 and refusal in _without_numbers(capsys.readouterr().err)


def test_to_universal_of_native_moe_on_s3_fails_with_deepspeeds_own_error(moe_zero0, s3, capsys):
    stock = _stock_universal(moe_zero0["root"], check=False)
    code = cli(["to-universal", moe_zero0["url"], "--endpoint", s3.endpoint, "--out", moe_zero0["url"], "--json",
                "--workers", "1"])
    refusal = _without_numbers(stock.stderr.strip().splitlines()[-1])
    assert code != 0 and refusal in _without_numbers(capsys.readouterr().err)


def test_pipeline_universal_conversion_equals_deepspeeds_own_conversion_bitwise(pipeline_universal):
    assert pipeline_universal["differences"] == []


@pytest.mark.parametrize("source", ["local", "s3"])
def test_pipeline_universal_on_one_stage_equals_deepspeeds_own_conversion_bitwise(pipeline_universal, source):
    ours, stock = pipeline_universal[source], pipeline_universal["stock"]
    assert ours["tag"] == f"{TAG}_universal" and ours["world_size"] == 1
    assert _state_differences(ours["loaded"], stock["loaded"]) == []
    assert ours["loss"] == stock["loss"]
    assert _state_differences(ours["state"], stock["state"]) == []


def test_pipeline_universal_on_one_stage_holds_both_stages_weights(pipeline, pipeline_universal):
    loaded = pipeline_universal["local"]["loaded"]
    saved = {k: v for out in pipeline["ranks"] for k, v in out["saved"].items() if k.startswith("module/")}
    assert len(saved) > 2 and saved.keys() <= loaded.keys()
    assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == []


# ---- AutoTP -----------------------------------------------------------------------------------

AUTOTP_LAYOUTS = ["autotp", "autotp_zero2", "autotp_zero3"]


@pytest.mark.parametrize("name,files", [
    ("autotp", {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"}),
    ("autotp_zero2", {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                      "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"}),
    ("autotp_zero3", {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_01_model_states.pt",
                      "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"}),
])
def test_autotp_saves_one_model_and_optimizer_file_per_tensor_parallel_rank(request, name, files):
    run = request.getfixturevalue(name)
    assert [(o["tp_rank"], o["mp_rank"], o["dp_world_size"]) for o in run["ranks"]] == [(0, 0, 1), (1, 1, 1)]
    assert {n for n in _files(run["root"] / "async" / TAG) if n.endswith(".pt")} == files


def test_autotp_resume_from_s3_fetches_only_its_own_optimizer_shard(autotp):
    for rank, out in enumerate(autotp["ranks"]):
        resumed = out["resumed_s3"]
        assert resumed["fetched"] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                      f"zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt"]
        assert resumed["loss"] == out["reference"]["loss"]
        assert _state_differences(resumed["state"], out["reference"]["state"]) == [], f"rank {rank}"


@pytest.mark.parametrize("name", AUTOTP_LAYOUTS)
def test_autotp_checkpoint_on_the_same_world_size_with_another_tp_size_is_refused_naming_the_fix(request, name):
    for out in request.getfixturevalue(name)["ranks"]:
        kind, message = out["load_on_tp1"]
        assert kind == "UsageError"
        assert "2 model-parallel" in message and "this job has 1" in message and "to-universal" in message


@pytest.mark.parametrize("name", ["autotp", "autotp_zero2"])
def test_autotp_consolidated_save_holds_the_whole_model_as_deepspeeds_tensor_parallel_gather_gives_it(request, name):
    """Not each rank's slices under the whole model's names, which from_pretrained refuses."""
    rank0 = request.getfixturevalue(name)["ranks"][0]
    assert rank0["consolidated"] is None and rank0["exported_differs"] == []


def test_autotp_consolidated_save_under_zero3_is_refused_before_anything_is_written(autotp_zero3):
    for out in autotp_zero3["ranks"]:
        kind, message = out["consolidated"]
        assert kind == "UsageError" and "AutoTP" in message and "to-universal" in message
    assert not (autotp_zero3["root"] / "export" / "whole").exists()


@pytest.mark.parametrize("name,source", [("autotp", "local"), ("autotp", "s3"), ("autotp_zero2", "local"),
                                         ("autotp_zero3", "local")])
def test_autotp_universal_on_one_rank_equals_deepspeeds_own_conversion_bitwise(request, name, source):
    universal = request.getfixturevalue(f"{name}_universal")
    ours, stock = universal[source], universal["stock"]
    assert ours["tag"] == f"{TAG}_universal" and ours["world_size"] == 1
    assert _state_differences(ours["loaded"], stock["loaded"]) == []
    assert ours["loss"] == stock["loss"]
    assert _state_differences(ours["state"], stock["state"]) == []


@pytest.mark.parametrize("name", AUTOTP_LAYOUTS)
def test_autotp_universal_weights_equal_the_gathered_tensor_parallel_weights(request, name):
    full = request.getfixturevalue(name)["ranks"][0]["full_weights"]
    loaded = request.getfixturevalue(f"{name}_universal")["local"]["loaded"]
    assert full and {f"module/{k}" for k in full} <= loaded.keys()
    assert [k for k in full if not torch.equal(loaded[f"module/{k}"], full[k])] == []


# ---- native MoE and AutoEP --------------------------------------------------------------------

@pytest.fixture(params=["moe_zero0", "moe_zero2", "autoep"])
def expert_layout(request):
    return request.getfixturevalue(request.param)


def test_expert_files_hold_only_their_own_storage(expert_layout):
    """DeepSpeed's checkpoint_correctness_verification: no expert file carries a whole flat buffer."""
    our_dir = expert_layout["root"] / "async" / TAG
    expert_files = sorted(n for n in _files(our_dir) if "_expert_" in n and "_model_states" in n)
    assert len(expert_files) == 8  # 2 MoE layers x 4 experts
    for name in expert_files:
        tensors = [t for t in _load(our_dir / name).values() if isinstance(t, torch.Tensor)]
        needed = sum(t.numel() * t.element_size() for t in tensors)
        stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        assert needed == sum(stored.values()), name


@pytest.mark.parametrize("name,optimizer_files", [
    ("moe_zero0", {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"}),
    ("moe_zero2", {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}),
])
def test_moe_writes_one_optimizer_file_per_expert_parallel_rank(request, name, optimizer_files):
    names = _files(request.getfixturevalue(name)["root"] / "async" / TAG)
    assert {n for n in names if n.endswith("_optim_states.pt")} == optimizer_files


def test_moe_without_zero_resume_from_s3_fetches_both_expert_parallel_optimizer_files(moe_zero0):
    for rank, out in enumerate(moe_zero0["ranks"]):
        resumed = out["resumed_s3"]
        assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= set(
            resumed["fetched"])
        assert resumed["loss"] == out["reference"]["loss"]
        assert _state_differences(resumed["state"], out["reference"]["state"]) == [], f"rank {rank}"


def test_autoep_resume_from_s3_takes_the_same_step(autoep):
    for rank, out in enumerate(autoep["ranks"]):
        resumed = out["resumed_s3"]
        assert resumed["tag"] == TAG and resumed["loss"] == out["reference"]["loss"]
        assert _state_differences(resumed["state"], out["reference"]["state"]) == [], f"rank {rank}"


@pytest.mark.parametrize("source", ["local", "s3"])
def test_autoep_universal_on_one_rank_equals_deepspeeds_own_conversion_bitwise(autoep_universal, source):
    ours, stock = autoep_universal[source], autoep_universal["stock"]
    assert ours["tag"] == f"{TAG}_universal" and ours["world_size"] == 1
    assert _state_differences(ours["loaded"], stock["loaded"]) == []
    assert ours["loss"] == stock["loss"]
    assert _state_differences(ours["state"], stock["state"]) == []


def test_autoep_zero3_universal_on_one_rank_equals_deepspeeds_own_conversion_bitwise(autoep_zero3_universal):
    ours, stock = autoep_zero3_universal["local"], autoep_zero3_universal["stock"]
    assert ours["tag"] == f"{TAG}_universal" and ours["world_size"] == 1
    assert ours["loaded"] and _state_differences(ours["loaded"], stock["loaded"]) == []
    assert ours["loss"] == stock["loss"]
    assert _state_differences(ours["state"], stock["state"]) == []


@pytest.mark.parametrize("stage", [1, 3])
def test_autoep_universal_holds_every_ranks_experts(request, stage):
    run, universal = (request.getfixturevalue(name) for name in (
        ("autoep", "autoep_universal") if stage == 1 else ("autoep_zero3", "autoep_zero3_universal")))
    saved = [o["saved"] for o in run["ranks"]]
    loaded = universal["local"]["loaded"]
    experts = [k for k in saved[0] if k.startswith("module/") and ".experts.w" in k]
    assert experts and all(loaded[k].shape[0] == 2 * saved[0][k].shape[0] for k in experts)
    assert [k for k in experts if not torch.equal(loaded[k], torch.cat([saved[0][k], saved[1][k]]))] == []
    dense = [k for k in saved[0] if k.startswith("module/") and k not in experts]
    assert [k for k in dense if not torch.equal(loaded[k], saved[0][k])] == []


def test_autoep_zero3_consolidated_saves_after_wrap_are_deepspeeds_own_refusal(autoep_zero3):
    for out in autoep_zero3["ranks"]:
        kind, message = out["stock_16bit"]
        assert kind == "NotImplementedError" and "AutoEP" in message
        assert out["wrapped_16bit"] == out["stock_16bit"]
        assert out["consolidated"] == (kind, message.replace("save_16bit_model", "save_consolidated"))
        assert out["saves_after"] == "after-refusals"


def test_autoep_zero3_export_is_zero_to_fp32s_own_refusal(autoep_zero3, capsys, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(NotImplementedError) as stock:
        get_fp32_state_dict_from_zero_checkpoint(str(autoep_zero3["root"] / "stock"), tag=TAG)
    code = cli(["export", str(autoep_zero3["root"] / "async"), "--tag", TAG, "--out", str(tmp_path / "hf")])
    assert code == 2 and str(stock.value) in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_moe_zero2_export_is_zero_to_fp32s_own_refusal_as_a_conversion_error(moe_zero2, capsys, tmp_path):
    """BF16_Optimizer's files, which zero_to_fp32 takes for no ZeRO checkpoint (ValueError)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(ValueError):
        get_fp32_state_dict_from_zero_checkpoint(str(moe_zero2["root"] / "stock"), tag=TAG)
    code = cli(["export", str(moe_zero2["root"] / "async"), "--tag", TAG, "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot consolidate tag" in err and "to-universal" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


# ---- frozen parameters ------------------------------------------------------------------------

def test_excluded_frozen_parameters_are_absent_from_both_checkpoints(frozen):
    frozen_names = frozen["ranks"][0]["frozen_names"]
    assert frozen_names
    for folder in ("stock", "async"):
        module = _load(frozen["root"] / folder / TAG / "mp_rank_00_model_states.pt")["module"]
        assert not set(frozen_names) & module.keys(), folder


# ---- node-local storage ----------------------------------------------------------------------

def test_node_local_storage_on_one_node_saves_with_only_its_first_rank_writing_the_model_states(
        node_local_one_node):
    """The first save asks every rank, in one collective, whether a lower rank writes its model states:
    a rank that writes none must take part too."""
    assert [out["writes_model_states"] for out in node_local_one_node["ranks"]] == [True, False]


def test_node_local_storage_on_a_shared_folder_has_only_the_lowest_rank_write_the_model_states(node_local):
    assert [out["writes_model_states"] for out in node_local["ranks"]] == [True, True]  # as DeepSpeed decides
    rank1_optimizer = node_local["root"] / "async" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert node_local["ranks"][1]["bytes_written"] == rank1_optimizer.stat().st_size


# ---- file ownership (no ranks) ----------------------------------------------------------------

def test_files_for_rank_covers_layer_expert_and_model_parallel_files():
    zero2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_to_fp32.py"]
    assert files_for_rank(zero2, 1, 0) == files_for_rank(zero2, 1) == [zero2[0], zero2[2]]
    zero3 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert files_for_rank(zero3, 0, 0) == [zero3[0], zero3[2]]
    pipeline = ["layer_00-model_states.pt", "layer_05-model_states.pt", "mp_rank_00_model_states.pt",
                "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_0_mp_rank_01_optim_states.pt", "async_ckpt_manifest.json"]
    assert files_for_rank(pipeline, 0, 1) == pipeline[:4] + ["zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    assert files_for_rank(pipeline, 0) == pipeline[:6]  # no model-parallel rank given: every shard of dp rank 0
    moe = ["expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt",
           "layer_0_expert_3_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt",
           "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert files_for_rank(moe, 1, 0) == moe[:4] + ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    zero3_tp = ["zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_01_model_states.pt",
                "zero_pp_rank_1_mp_rank_01_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    assert files_for_rank(zero3_tp, 1, 1) == zero3_tp[:3]  # DeepSpeed globs every mp rank's model states
    assert [model_parallel_size(p) for p in (pipeline, moe, zero3_tp, ["mp_rank_00_model_states.pt"])] == [2, 1, 2, 1]

