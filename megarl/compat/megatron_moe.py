"""megatron-core 0.16.x MoE without Transformer Engine, on CPU and GPU alike.

1. ``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` only when TE is
   installed, yet its router GEMM (``RouterGatingLinearFunction``) tests
   ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
   ``NameError``. -> :func:`install` defines the name as ``None``, so the router falls back to
   ``torch.mm`` in the router dtype, megatron's own non-TE path.

Idempotent; a no-op where TE provides the name. Tested in ``tests/compat/test_cpu_compat.py``.
"""

from __future__ import annotations


def install() -> bool:
    """Apply the patch above; True if megatron lacked the name (and now has it)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
