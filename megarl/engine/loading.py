"""How one whole weight update is written into a vLLM worker's model, and checked to cover it.

:func:`apply_update` (the worker extension calls it for every transport):
  1. routed-expert tensors are split off and checked complete (``megarl.engine.experts``): if
     any is missing nothing is written;
  2. every other tensor goes through vLLM's ``model.load_weights``:
       in place     a CPU engine whose layers compute ``F.linear`` on their parameters
                    (``--cpu-gemm plain``): the copy is the whole update
       layer-wise   everywhere else (vLLM's ``reload_weights`` steps, called here so the loaded
                    names come back): a packed CPU layer has dropped its weight for a oneDNN
                    kernel, so each layer is restored, loaded and processed again
  3. the experts are written in the kernel's layout (never by either path above: both
     corrupt them on vLLM 0.32, see ``megarl.engine.experts``);
  4. the coverage record (``megarl.engine.coverage``): parameters not written, sent tensors
     not used. The engine joins its workers' records and refuses the update if either is
     non-empty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from megarl.engine.coverage import SourceTracker, coverage_report
from megarl.engine.experts import expert_layers, plan_experts, write_experts

log = logging.getLogger("megarl.engine")


def loads_in_place(model: torch.nn.Module) -> bool:
    """True if every layer computes from its parameters, so ``model.load_weights`` is a whole
    update: no CPU layer holds a packed kernel of an older weight (a packed LM head keeps its
    weight *and* a kernel built from it: a copy would leave the logits stale)."""
    linear = torch.nn.functional.linear
    return all(getattr(m, "cpu_linear", linear) is linear for m in model.modules())


def apply_update(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """Write the update ``weights`` (HF names) into ``worker``'s model; return its coverage
    record (``coverage_report``). Writes nothing if expert tensors are missing (the record
    names them)."""
    runner = worker.model_runner
    model = runner.get_model()
    in_place = getattr(worker, "_megarl_in_place", None)
    if in_place is None:  # the layers' kernels are chosen once, when the model is built
        in_place = worker._megarl_in_place = loads_in_place(model) and not torch.cuda.is_available()
        log.info("weight updates: %s", "load_weights in place" if in_place else "vLLM's layer-wise reload")
    named = list(weights)
    plan, rest, missing = plan_experts(expert_layers(model), named)
    if missing:  # refused before anything is written (a record, not an exception: see coverage)
        return coverage_report([], set(), [], set(), missing)
    tracker = SourceTracker(rest)
    with torch.no_grad():
        with tracker:
            written = _load(runner, model, rest, in_place)
        experts, used = write_experts(plan)
    params = list(model.named_parameters())
    written |= {n for n, p in params if any(p is w for w in experts)}
    return coverage_report([n for n, _ in params], written, [n for n, _ in named], tracker.used | used)


def _load(runner: Any, model: Any, named: list[tuple[str, torch.Tensor]], in_place: bool) -> set[str]:
    """vLLM's ``load_weights`` in place, or its layer-wise reload (``runner.reload_weights``
    with ``is_checkpoint_format=True``, minus the LoRA / encoder / multimodal cache resets
    megarl's engines have no use for); the vLLM names of the parameters loaded."""
    if in_place:
        return set(model.load_weights(weights=iter(named)) or ())
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    loaded = model.load_weights(iter(named))
    finalize_layerwise_reload(model, runner.vllm_config.model_config)
    _refresh_tied_lm_head(model)
    return set(loaded or ())


def _refresh_tied_lm_head(model: Any) -> None:
    """Re-derive a tied LM head's kernel state from the (just reloaded) embedding.

    With tied embeddings vLLM's ``lm_head`` is its own module sharing the embedding's
    Parameter. The layer-wise reload only loads ``model.embed_tokens.weight``, so it processes
    the embedding and never the head: on CPU the head keeps the GEMM it packed at start-up
    from the dummy weights (``dispatch_cpu_unquantized_gemm``), and the logits stay those of
    the dummy model (0.5 off transformers' log-probs, tests/weight_sync/test_engine_model.py).
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    if head is None or embed is None or weight is None or weight is not getattr(embed, "weight", None):
        return
    quant_method = getattr(head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(head)
