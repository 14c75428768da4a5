"""torchrun worker (PP=2, so two stage owners each POST their own buckets): a Megatron model
holding the weights of ``--hf`` pushes them to the test's running engines over http, then
the same weights over shm, then an update with a NaN weight over http (must be rejected on
every rank, naming the tensor). Rank 0 writes what the engines answered to ``--out``."""

import argparse
import json
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, ParallelConfig  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.errors import WeightSyncError  # noqa: E402
from megarl.fleet.fleet import Fleet  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.weight_sync.sync import WeightSync, check_integrity  # noqa: E402

SEQ = [1, 5, 9, 13, 17, 21, 25]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--addresses", required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dims = init_distributed(1, 2, seed=0)
    hf_cfg, tensors = read_hf_folder(args.hf)
    mcfg = model_config_from_hf(hf_cfg, ModelConfig())
    model = build_gpt(mcfg, ParallelConfig(pipeline_parallel=2), dims, trainable=False)
    adapter = LlamaQwen2Adapter(mcfg)
    load_hf_tensors(model, adapter, tensors)
    # credential (MEGARL_ENGINE_TOKEN) and staging folder (MEGARL_STAGING_DIR) from the environment
    fleet = Fleet.attach(args.addresses.split(","), 120, 60) if dims.is_rank0 else None
    out: dict = {}

    def engines() -> dict:
        return {"logprobs": fleet.logprobs([SEQ], 1.0), "versions": fleet.versions()} if fleet else {}

    v = args.version
    http = WeightSync(model, adapter, fleet, bucket_mb=0.05, transport="http")
    stats = http.push(v)
    out["http"] = engines() | {"stats": stats, "transport": http.transport.name}
    out["http"]["integrity"] = check_integrity(model, fleet, SEQ, tol=1e-3)  # trainer vs engines (collective)
    shm = WeightSync(model, adapter, fleet, bucket_mb=0.05, transport="shm")  # MEGARL_STAGING_DIR
    shm.push(v + 1)
    out["shm"] = engines() | {"transport": shm.transport.name}
    # a NaN in the last stage's final norm: stage 1's owner sends it, every engine must refuse it
    with torch.no_grad():
        for name, p in model.core.named_parameters():
            if name == "decoder.final_layernorm.weight":
                p[3] = float("nan")
    try:
        http.push(v + 2)
        out["nan"] = {"error": ""}
    except WeightSyncError as err:
        out["nan"] = {"error": str(err)}
    errors = [None] * dims.world_size
    torch.distributed.all_gather_object(errors, out["nan"]["error"])
    out["nan"] |= engines() | {"errors_per_rank": errors}
    if dims.is_rank0:
        Path(args.out).write_text(json.dumps(out))
    shm.cleanup()
    shutdown()


if __name__ == "__main__":
    main()
