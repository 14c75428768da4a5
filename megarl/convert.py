"""HF ⇄ megarl checkpoint conversion for Llama-, Qwen2-, Qwen3-, Qwen3-MoE- and Mixtral-family decoders.

    python tools/convert.py hf-to-megarl --hf HF_DIR --out CKPT_ROOT [--tp N] [--pp M] [--ep E]
    python tools/convert.py megarl-to-hf --ckpt CKPT --out HF_DIR [--tp N] [--pp M] [--ep E]

``hf-to-megarl`` writes a megarl checkpoint (the format of
:func:`megarl.checkpoint.dist_ckpt.save_checkpoint`: model "actor", no optimizer state) as
``CKPT_ROOT/<name>/`` and points ``CKPT_ROOT/latest`` at it; the HF config, generation config
and tokenizer files travel inside it. ``megarl-to-hf`` writes ``model.safetensors`` +
``config.json`` + ``generation_config.json`` (+ tokenizer files) that transformers and vLLM
load, in the source model's dtype unless ``--dtype`` says otherwise. An HF model megarl would
not reproduce exactly (RoPE type, activation, bias layout, unexpected tensors: see
:mod:`megarl.config.hf`, :mod:`megarl.checkpoint.hf_config`) is refused in one line naming the key and value,
before any process starts. ``--tp/--pp/--ep`` give the layout the model is built in (``--ep``:
expert parallelism of a MoE model over as many DP ranks); the checkpoint itself reshards, so
any layout reads any checkpoint. Run with TP×PP×EP > 1 outside torchrun, the tool re-launches
itself under torchrun with TP×PP×EP processes.

Every name and layout rule (QKV grouping, SwiGLU [gate; up] per TP shard, vocabulary padding,
tied embeddings, Qwen2 QKV bias, Qwen3 q/k norms, Qwen3-MoE and Mixtral routers and experts) lives
in :mod:`megarl.checkpoint.hf_adapter`, the one Megatron ⇄ HF mapping that weight sync uses too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from megarl.data.hf_tokenizer import GENERATION_CONFIG, HF_TOKENIZER_FILES
from megarl.data.tokenizer import export_tokenizer_files

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("megarl.convert")

HF_CONFIG_IN_CKPT = "hf_config.json"
"""The source HF ``config.json`` as stored inside a converted checkpoint."""
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
SOURCE_DTYPE = "hf_dtype"
"""Key of the converted checkpoint's state.json holding the source tensors' dtype name."""


class LazyHFTensors(Mapping[str, Any]):
    """Read-only ``{name: tensor}`` over an HF folder's safetensors files, loaded on access.

    Each rank reads only the tensors its shards need (the adapter slices them), instead of
    holding the whole model in memory.
    """

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                self._where[name] = handle

    def __getitem__(self, name: str) -> Any:
        return self._where[name].get_tensor(name)

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape, read from the file headers (no tensor is loaded)."""
        return {name: list(h.get_slice(name).get_shape()) for name, h in self._where.items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megarl convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-megarl", help="HF folder -> megarl checkpoint")
    imp.add_argument("--hf", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    imp.add_argument("--out", required=True, type=Path, help="checkpoint root to write into")
    imp.add_argument("--name", default="hf_import", help="checkpoint name under --out (default: hf_import)")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter dtype of the checkpoint")
    exp = sub.add_parser("megarl-to-hf", help="megarl checkpoint -> HF folder")
    exp.add_argument("--ckpt", required=True, type=Path, help="a checkpoint dir, or a root (its latest)")
    exp.add_argument("--out", required=True, type=Path, help="HF folder to write (replaced if it exists)")
    exp.add_argument("--model", default="actor", help="model name inside the checkpoint (default: actor)")
    exp.add_argument("--tokenizer", type=Path, help="tokenizer file or folder to copy (default: the checkpoint's)")
    exp.add_argument(
        "--dtype",
        choices=["auto", *EXPORT_DTYPES],
        default="auto",
        help="tensor dtype of the HF folder (default auto: the dtype of the HF model the checkpoint was "
        "converted from, else the checkpoint's own)",
    )
    for flag in ("bos", "eos", "pad"):
        exp.add_argument(f"--{flag}-id", type=int, help=f"{flag} token id (default: from the checkpoint)")
    for p in (imp, exp):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the layout used")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the layout used")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size of the layout used (MoE models)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point (``megarl convert ...`` calls this). Returns the exit code."""
    args = _parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if min(args.tp, args.pp, args.ep) < 1:
        raise SystemExit(f"--tp={args.tp}, --pp={args.pp} and --ep={args.ep} must be >= 1")
    if Path(args.out).is_file():
        raise SystemExit(f"--out {args.out} is a file: give a folder")
    if args.command == "hf-to-megarl":
        check_hf_source(args.hf)
        _check_hf_model(args.hf, args.tp, args.pp, args.ep)
        run: Any = hf_to_megarl
    else:
        from megarl.checkpoint.dist_ckpt import checkpoint_model_config
        from megarl.checkpoint.hf_io import replaceable_hf_folder

        try:  # before any work: the export replaces an HF folder, never anything else
            replaceable_hf_folder(Path(args.out))
        except FileExistsError as e:
            raise SystemExit(f"--out: {e}") from None
        saved = checkpoint_model_config(args.ckpt, args.model)  # a missing/partial checkpoint fails here
        if saved.num_experts % args.ep or (args.ep > 1 and not saved.is_moe):
            raise SystemExit(f"--ep={args.ep} does not split the {saved.num_experts} experts of {args.ckpt}")
        if args.tokenizer is not None and not args.tokenizer.exists():
            raise SystemExit(f"--tokenizer {args.tokenizer} does not exist")
        run = megarl_to_hf
    nproc = args.tp * args.pp * args.ep
    if "RANK" not in os.environ and nproc > 1:
        return _relaunch(argv, nproc)
    _setup_logging()
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megarl.distributed import init_distributed, shutdown

    owned = not dist.is_initialized()
    if owned and "RANK" not in os.environ:
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dims = init_distributed(args.tp, args.pp, seed=0, ep=args.ep)
    try:
        run(args, dims)
    finally:
        if owned:
            shutdown()
    return 0


# --------------------------------------------------------------------------- HF -> megarl


def hf_to_megarl(args: argparse.Namespace, dims: Any) -> Path:
    """Build the model at ``dims``' layout from the HF folder and save it as a checkpoint."""
    from megarl.checkpoint.dist_ckpt import save_checkpoint
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
    from megarl.checkpoint.hf_io import load_hf_tensors
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.model.builder import build_gpt

    hf_dir: Path = args.hf
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    mcfg = model_config_from_hf(hf_cfg, ModelConfig(dtype=args.dtype))
    pcfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep)
    model = build_gpt(mcfg, pcfg, dims, trainable=False)
    source = LazyHFTensors(hf_dir)
    load_hf_tensors(model, LlamaQwen2Adapter(mcfg), source)
    files = {HF_CONFIG_IN_CKPT: hf_dir / "config.json"}
    for name in (GENERATION_CONFIG, *HF_TOKENIZER_FILES):
        if (hf_dir / name).is_file():
            files[name] = hf_dir / name
    dtype = str(source["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    extra = {"step": 0, "converted_from": str(hf_dir.resolve()), "arch": mcfg.arch, SOURCE_DTYPE: dtype}
    path = save_checkpoint(args.out, {"actor": model}, extra, keep_last=sys.maxsize, name=args.name, files=files)
    if dims.is_rank0:
        logger.info("wrote %s (%s, TP=%d PP=%d EP=%d)", path, mcfg.arch, args.tp, args.pp, args.ep)
    return path


def check_hf_source(hf_dir: Path) -> None:
    """Before anything else: an HF folder of a supported architecture, with safetensors weights.
    Raises :class:`megarl.errors.ConvertError` naming the folder or its config.json."""
    from megarl.errors import ConvertError

    cfg_file = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf {hf_dir} does not exist (expected an HF model folder)")
    if not cfg_file.is_file():
        raise ConvertError(f"{cfg_file} not found: {hf_dir} is not an HF model folder")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConvertError(f"{cfg_file} is not a JSON object ({e})") from None
    if model_type not in ARCHITECTURES:
        raise ConvertError(
            f"{cfg_file}: model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if not list(hf_dir.glob("*.safetensors")):
        others = sorted(p.name for p in hf_dir.glob("*.bin"))
        hint = f" (found {', '.join(others)}: re-save with safe_serialization=True)" if others else ""
        raise ConvertError(f"no *.safetensors weights in {hf_dir}{hint}")


def _check_hf_model(hf_dir: Path, tp: int, pp: int, ep: int = 1) -> None:
    """Fail with one line, before any process starts, when megarl would not reproduce the HF
    model exactly (config key and value named) or the layout cannot split it."""
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter
    from megarl.checkpoint.hf_config import check_hf_tensors
    from megarl.config import ModelConfig
    from megarl.config.hf import model_config_from_hf
    from megarl.errors import ConvertError, UnsupportedHFModel

    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise ConvertError(f"{cfg_file} not found: not an HF model folder")
    cfg = json.loads(cfg_file.read_text())
    try:
        mcfg = model_config_from_hf(cfg, ModelConfig())
        found = LazyHFTensors(hf_dir).shapes()
        check_hf_tensors(LlamaQwen2Adapter(mcfg).hf_shapes(), found, tied=mcfg.tie_embeddings, where=str(hf_dir))
    except (UnsupportedHFModel, FileNotFoundError) as e:
        raise ConvertError(f"{cfg_file}: {e}") from None
    mixtral = mcfg.arch == "mixtral"  # (its HF keys for the expert count and width)
    for flag, div, field, value in (
        ("--tp", tp, "num_attention_heads", mcfg.num_attention_heads),
        ("--tp", tp, "num_key_value_heads", mcfg.num_query_groups),
        ("--pp", pp, "num_hidden_layers", mcfg.num_layers),
        ("--ep", ep, "num_local_experts" if mixtral else "num_experts", mcfg.num_experts),
        ("--tp", tp, "intermediate_size" if mixtral else "moe_intermediate_size", mcfg.moe_ffn_hidden_size),
    ):
        if value % div:
            raise ConvertError(f"{flag}={div} does not divide {field}={value} of {cfg_file}")
    if ep > 1 and not mcfg.is_moe:
        raise ConvertError(f"--ep={ep} needs a mixture-of-experts model; {cfg_file} describes a dense one")


# --------------------------------------------------------------------------- megarl -> HF


def megarl_to_hf(args: argparse.Namespace, dims: Any) -> Path | None:
    """Load the checkpoint's model at ``dims``' layout and write it as an HF folder (rank 0)."""
    import torch
    import torch.distributed as dist

    from megarl.checkpoint.dist_ckpt import checkpoint_model_config, load_checkpoint, resolve_checkpoint
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter
    from megarl.checkpoint.hf_io import hf_state_dict, save_hf_folder
    from megarl.config import ParallelConfig
    from megarl.model.builder import build_gpt

    ckpt = resolve_checkpoint(args.ckpt)
    mcfg = checkpoint_model_config(ckpt, args.model)
    pcfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep)
    model = build_gpt(mcfg, pcfg, dims, trainable=False)
    load_checkpoint(ckpt, {args.model: model}, load_optimizer=False)
    adapter = LlamaQwen2Adapter(mcfg)
    tensors = hf_state_dict(model, adapter)
    out: Path | None = None
    if dims.is_rank0:
        ids = _token_ids(args, ckpt)
        dtype = _export_dtype(args.dtype, ckpt, mcfg.dtype)
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
        hf_config = adapter.hf_config(ids["eos"], ids["bos"], ids["pad"], dtype=dtype)
        hf_config.architectures = [ARCHITECTURES[mcfg.arch]]  # vLLM picks its model class by this
        out = save_hf_folder(args.out, tensors, hf_config)
        if (ckpt / GENERATION_CONFIG).is_file():  # the source model's sampling defaults, verbatim
            shutil.copyfile(ckpt / GENERATION_CONFIG, out / GENERATION_CONFIG)
        export_tokenizer_files(_tokenizer_files(args.tokenizer, ckpt), out)
        logger.info("wrote %s (%d tensors, %s) from %s", out, len(tensors), dtype, ckpt)
    dist.barrier()
    return out


def _export_dtype(flag: str, ckpt: Path, model_dtype: str) -> str:
    """``--dtype``, or auto: the source HF model's dtype (recorded at import), else the checkpoint's."""
    if flag != "auto":
        return flag
    from megarl.checkpoint.hf_config import hf_dtype_name

    state = ckpt / "state.json"
    recorded = json.loads(state.read_text()).get(SOURCE_DTYPE) if state.is_file() else None
    if recorded is None and (ckpt / HF_CONFIG_IN_CKPT).is_file():
        recorded = hf_dtype_name(json.loads((ckpt / HF_CONFIG_IN_CKPT).read_text()))
    if recorded in EXPORT_DTYPES:
        return str(recorded)
    return "bfloat16" if model_dtype == "bf16" else "float32"


def _token_ids(args: argparse.Namespace, ckpt: Path) -> dict[str, int | None]:
    """bos/eos/pad ids: flags, else the checkpoint's HF configs, else its SentencePiece model."""
    ids: dict[str, int | None] = {k: getattr(args, f"{k}_id") for k in ("bos", "eos", "pad")}
    for name in (GENERATION_CONFIG, HF_CONFIG_IN_CKPT):
        if (ckpt / name).is_file():
            cfg = json.loads((ckpt / name).read_text())
            for k in ids:
                if ids[k] is None and isinstance(cfg.get(f"{k}_token_id"), (int, list)):  # eos may be a list
                    ids[k] = cfg[f"{k}_token_id"]
    spm = args.tokenizer if args.tokenizer and args.tokenizer.is_file() else ckpt / "tokenizer.model"
    if any(v is None for v in ids.values()) and spm.is_file():
        import sentencepiece as spm_lib

        sp = spm_lib.SentencePieceProcessor(model_file=str(spm))
        found = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
        ids = {k: v if v is not None else (found[k] if found[k] >= 0 else None) for k, v in ids.items()}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        logger.warning("no %s token id in %s; pass --%s-id", "/".join(missing), ckpt, "-id/--".join(missing))
    return ids


def _tokenizer_files(tokenizer: Path | None, ckpt: Path) -> list[Path]:
    if tokenizer is not None:
        if tokenizer.is_file():
            return [tokenizer]
        if not tokenizer.is_dir():
            raise FileNotFoundError(f"--tokenizer {tokenizer} does not exist")
        return [tokenizer / n for n in HF_TOKENIZER_FILES if (tokenizer / n).is_file()]
    return [ckpt / n for n in HF_TOKENIZER_FILES if (ckpt / n).is_file()]


# --------------------------------------------------------------------------- launching


def _relaunch(argv: list[str], nproc: int) -> int:
    """Run this tool under torchrun with ``nproc`` ranks; returns torchrun's exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "megarl.launcher",  # torchrun, quiet when a rank reported a one-line error
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "megarl.cli",  # each rank runs `megarl convert ...`: errors become one line, as for the user
        "convert",
        *argv,
    ]
    from megarl.launcher import launch

    return launch(cmd, env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[convert r{rank}] %(message)s",
    )
    for noisy in ("megatron", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
