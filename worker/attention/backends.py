"""Which attention backend a worker runs: Triton on CUDA, torch on the CPU.

Triton is imported only when chosen, so CPU workers never need it, and a
test can set ``TRITON_INTERPRET=1`` before the kernels are decorated.
"""

from __future__ import annotations

import logging
import os

import torch

from jitney.worker.attention.backend import AttentionBackend, InvariantCpuAttention, TorchPagedAttention

logger = logging.getLogger("jitney.worker")


class BackendUnavailableError(RuntimeError):
    """The asked-for attention backend cannot run here."""


def interpreting() -> bool:
    """Whether Triton kernels will be interpreted (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto``/``torch``/``triton`` -> ``torch`` or ``triton`` for ``device``.

    Raises ``BackendUnavailableError`` for Triton on a CPU without the
    interpreter, or when Triton is not installed.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_installed() else "torch"
        if device.type == "cuda" and name == "torch":
            logger.warning("triton is not installed: CUDA runs the torch attention path")
        return name
    if name == "triton":
        if device.type == "cpu" and not interpreting():
            raise BackendUnavailableError(
                "--attention-backend triton on the CPU runs only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 (slow; for tests), or use --attention-backend torch"
            )
        if not _triton_installed():
            raise BackendUnavailableError("--attention-backend triton needs the triton package (pip install triton)")
    return name


def make_attention_backend(name: str, device: torch.device, *, batch_invariant: bool = False) -> AttentionBackend:
    """The backend instance for the config's ``attention_backend`` on ``device``.

    The torch backend on the CPU is ``InvariantCpuAttention`` (the CPU kernel)
    when ``batch_invariant``, else ``TorchPagedAttention`` (gather + SDPA);
    Triton's gives decodes the prefill's tile height when ``batch_invariant``.
    """
    if resolve_backend_name(name, device) == "torch":
        if batch_invariant and device.type == "cpu":
            return InvariantCpuAttention()
        return TorchPagedAttention()
    from jitney.worker.attention.triton import TritonPagedAttention

    return TritonPagedAttention(batch_invariant=batch_invariant)


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def prefill_block_q(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per tile of the Triton attention's tile-mapped launch (imports Triton)."""
    from jitney.worker.attention.triton import prefill_block_q as block_q

    return block_q(num_heads, num_kv_heads)
