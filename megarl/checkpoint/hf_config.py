"""The checkpoint's side of an HF model folder: are its tensors exactly the ones the model
consumes (:func:`check_hf_tensors`), and which dtype does its config.json record
(:func:`hf_dtype_name`). Used where HF weights are read or written (``megarl convert``, the
trainer's ``init_from`` load and its exports). What megarl can represent of the folder's
config.json is :mod:`megarl.config.hf` (the config's checks need it at load time).

:func:`check_hf_tensors` compares the checkpoint's tensor names and shapes with the ones the
model consumes (``LlamaQwen2Adapter.hf_shapes``): a missing, unexpected or misshapen tensor is
refused with :class:`~megarl.errors.UnsupportedHFModel`, so no source tensor is silently left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megarl.config import ModelConfig
from megarl.errors import UnsupportedHFModel


def _ignorable(name: str, tied: bool) -> bool:
    # derived buffers some exporters store; with tied embeddings transformers ignores lm_head too
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def check_hf_tensors(
    expected: Mapping[str, Sequence[int]],  # name -> shape the model consumes (adapter.hf_shapes())
    found: Mapping[str, Sequence[int]],  # name -> shape in the checkpoint's safetensors files
    *,
    tied: bool,
    where: str,
) -> None:
    """Refuse a checkpoint whose tensors are not exactly the ones the model consumes."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(n for n in found if n not in expected and not _ignorable(n, tied))
    wrong = [n for n in sorted(expected) if n in found and list(found[n]) != list(expected[n])]
    more = {k: len(v) - 1 for k, v in (("missing", missing), ("extra", extra), ("wrong", wrong))}
    if extra:
        n = extra[0]
        raise UnsupportedHFModel(
            f"{where}: tensor '{n}' {list(found[n])} is not part of the model its config.json describes "
            f"(and {more['extra']} more unexpected tensor(s)); megarl would drop it"
        )
    if missing:
        n = missing[0]
        raise UnsupportedHFModel(
            f"{where}: tensor '{n}' {list(expected[n])} is missing (and {more['missing']} more); "
            "its config.json describes a model that has it"
        )
    if wrong:
        n = wrong[0]
        raise UnsupportedHFModel(
            f"{where}: tensor '{n}' has shape {list(found[n])}, its config.json implies {list(expected[n])} "
            f"(and {more['wrong']} more)"
        )


def hf_dtype_name(hf_cfg: Mapping[str, Any]) -> str | None:
    """The ``torch_dtype`` (transformers 4) or ``dtype`` (transformers 5) an HF config records."""
    value = hf_cfg.get("torch_dtype") or hf_cfg.get("dtype")
    return str(value) if value else None


def export_dtype(m: ModelConfig) -> str:
    """The dtype an exported HF folder keeps, as ``megarl convert megarl-to-hf --dtype auto``:
    the one ``model.init_from``'s config.json records, else the trainer's ``model.dtype``
    (the gathered tensors are fp32 whatever the trainer computes in)."""
    if m.init_from:
        recorded = hf_dtype_name(json.loads((Path(m.init_from) / "config.json").read_text()))
        if recorded in ("float32", "bfloat16", "float16"):
            return recorded
    return "bfloat16" if m.dtype == "bf16" else "float32"
