"""GPU weight transports and colocation against a real GPU vLLM engine (skipped without CUDA).

A TP1 Megatron trainer on cuda:0 holds new weights; the engine starts on the old ones. After
a push over ``nccl`` (engine on cuda:1: NCCL refuses two ranks on one GPU) or ``cuda_ipc``
(engine colocated on cuda:0) the engine's log-probs equal those after a file update with the
same weights, and agree with the trainer's own forward. A NaN weight is rejected by name
with the old version still serving. Sleep mode frees the engine's GPU memory and the
two-step wake (weights, then KV cache) around a sync leaves it serving the new weights.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.engine.staging import MANIFEST
from megarl.errors import WeightSyncError
from megarl.fleet.fleet import Fleet
from tests.helpers import tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ = [1, 5, 9, 13, 17, 21, 25]


def _max_diff(a: list, b: list) -> float:
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    """Old weights (engine start), new weights (the trainer's), and the trainer model."""
    pytest.importorskip("vllm")
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
    from megarl.checkpoint.hf_io import load_hf_tensors, read_hf_folder
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.distributed import init_distributed, shutdown
    from megarl.model.builder import build_gpt

    base = tmp_path_factory.mktemp("gpu_sync")
    hf = tiny_hf_model(base / "hf", vocab=64)
    old = load_file(str(hf / "model.safetensors"))
    (hf / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in old.items()}))
    g = torch.Generator().manual_seed(3)
    new_dir = base / "hf_new"
    new_dir.mkdir()
    shutil.copy(hf / "config.json", new_dir / "config.json")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()},
              str(new_dir / "model.safetensors"))
    dims = init_distributed(1, 1, seed=0)
    hf_cfg, tensors = read_hf_folder(new_dir)
    mcfg = model_config_from_hf(hf_cfg, ModelConfig())
    model = build_gpt(mcfg, ParallelConfig(), dims, trainable=False)
    adapter = LlamaQwen2Adapter(mcfg)
    load_hf_tensors(model, adapter, tensors)
    yield {"base": base, "old": str(hf / "model.safetensors"), "new": str(new_dir / "model.safetensors"),
           "hf": hf, "model": model, "adapter": adapter}
    shutdown()


def _fleet(t: dict, name: str, visible: str, sleep_mode: bool) -> Fleet:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", visible)
        return Fleet.start_local(t["hf"], 1, 1, 0.25, t["base"] / name, seed=0, request_timeout_s=300,
                                 start_timeout_s=600, sleep_mode=sleep_mode)


@pytest.fixture(scope="module")
def colocated(trainer):
    f = _fleet(trainer, "colocated", "0", sleep_mode=True)
    yield f
    f.shutdown()


@pytest.fixture(scope="module")
def remote_gpu(trainer):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the engine on a second GPU")
    f = _fleet(trainer, "remote", "1", sleep_mode=False)
    yield f
    f.shutdown()


def _staged(fleet: Fleet, path: str) -> str:
    """A copy of ``path`` in the fleet's staging folder (engines read weight files only there)."""
    assert fleet.staging_dir is not None
    dst = fleet.staging_dir / "test" / f"{Path(path).parent.name}_{Path(path).name}"
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(path, dst)
    return str(dst)


def _push_and_compare(t: dict, fleet: Fleet, transport: str, version: int) -> dict:
    """Push the trainer's weights through ``transport`` and measure what the engine serves:
    against the old weights, the same weights loaded from a file, the trainer's own forward,
    and after a push with a NaN on the trainer (which must be refused by name)."""
    from megarl.weight_sync.sync import WeightSync, check_integrity

    fleet.update_weights(version, [_staged(fleet, t["old"])])
    before = fleet.logprobs([SEQ], 1.0)
    sync = WeightSync(t["model"], t["adapter"], fleet, bucket_mb=0.05, transport=transport)
    stats = sync.push(version + 1)
    pushed = fleet.logprobs([SEQ], 1.0)
    got = {
        "transport": sync.transport.name,
        "bytes": stats["bytes"],
        "expected_bytes": 4 * sum(p.numel() for p in load_file(t["new"]).values()),
        "versions_after_push": fleet.versions(),
        "moved": _max_diff(pushed, before),
        "integrity": check_integrity(t["model"], fleet, SEQ, tol=1e-3),
    }
    fleet.update_weights(version + 2, [_staged(fleet, t["new"])])  # the same weights from the file
    got["vs_file"] = _max_diff(fleet.logprobs([SEQ], 1.0), pushed)
    # a NaN on the trainer: rejected by name, the engine keeps serving version + 2
    norm = dict(t["model"].core.named_parameters())["decoder.final_layernorm.weight"]
    saved = norm.detach().clone()
    with torch.no_grad():
        norm[3] = float("nan")
    got["nan_error"] = ""
    try:
        sync.push(version + 3)
    except WeightSyncError as e:
        got["nan_error"] = str(e)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    got["versions_after_nan"] = fleet.versions()
    got["vs_file_after_nan"] = _max_diff(fleet.logprobs([SEQ], 1.0), pushed)
    return got


def _assert_pushed(got: dict, transport: str, version: int) -> None:
    assert got["transport"] == transport
    assert got["bytes"] == got["expected_bytes"]
    assert got["versions_after_push"] == [version + 1]
    assert got["moved"] > 0.05  # the new weights serve
    assert got["integrity"] <= 1e-3  # ... and equal the trainer's forward
    assert got["vs_file"] <= 1e-5  # ... and the same weights loaded from a file
    assert re.search(r"tensor 'model\.norm\.weight' contains NaN/Inf", got["nan_error"]), got["nan_error"]
    assert got["versions_after_nan"] == [version + 2] and got["vs_file_after_nan"] <= 1e-5


def test_nccl_transport(trainer, remote_gpu) -> None:
    got = _push_and_compare(trainer, remote_gpu, "nccl", 10)
    assert got["transport"] == "nccl" and got["bytes"] == got["expected_bytes"]
    assert got["versions_after_push"] == [11] and got["moved"] > 0.05 and got["integrity"] <= 1e-3
    assert got["vs_file"] <= 1e-5 and "contains NaN/Inf" in got["nan_error"]
    _assert_pushed(got, "nccl", 10)


def test_cuda_ipc_transport(trainer, colocated) -> None:
    got = _push_and_compare(trainer, colocated, "cuda_ipc", 20)
    assert got["transport"] == "cuda_ipc" and got["bytes"] == got["expected_bytes"]
    assert got["versions_after_push"] == [21] and got["moved"] > 0.05 and got["integrity"] <= 1e-3
    assert got["vs_file"] <= 1e-5 and "contains NaN/Inf" in got["nan_error"]
    _assert_pushed(got, "cuda_ipc", 20)


def test_sleep_frees_memory_and_two_step_wake_around_sync(trainer, colocated) -> None:
    from megarl.weight_sync.sync import WeightSync

    colocated.update_weights(30, [_staged(colocated, trainer["old"])])
    free_awake, _ = torch.cuda.mem_get_info(0)
    colocated.sleep(level=1)
    assert colocated.engines[0].info()["asleep"] == ["kv_cache", "weights"]
    free_asleep, _ = torch.cuda.mem_get_info(0)
    assert free_asleep - free_awake >= 0.2 * (1 << 30)  # at least the 0.25 GiB KV cache came back
    colocated.wake_up(["weights"])
    assert colocated.engines[0].info()["asleep"] == ["kv_cache"]
    WeightSync(trainer["model"], trainer["adapter"], colocated, bucket_mb=0.05, transport="cuda_ipc").push(31)
    colocated.wake_up(["kv_cache"])
    assert colocated.engines[0].info()["asleep"] == []
    pushed = colocated.logprobs([SEQ], 1.0)
    colocated.update_weights(32, [_staged(colocated, trainer["new"])])
    assert _max_diff(colocated.logprobs([SEQ], 1.0), pushed) <= 1e-5
