"""Which kernel a model's linear layers and logits head run on, chosen before the model is built.

The choice is made from the device, dtype and flags alone, so a bad combination
(``--quantization int8`` on CUDA, ``--batch-invariant`` on CUDA without triton)
is refused before any weight is read; the model applies it once its weights are
loaded (a kernel packs or quantizes the loaded weights):

- ``quantization`` int8 (the CPU): ``cpu_kernels.Int8Linear``, int8 weights
  quantized at load, batch-invariant whatever ``batch_invariant``; int4:
  ``cpu_kernels.Int4Linear`` for the layers, the head int8;
- ``batch_invariant`` on CUDA: the Triton matmul (``kernels/triton/matmul.py``);
- ``batch_invariant`` on the CPU: ``cpu_kernels.InvariantLinear``, the head with
  float32 output;
- else bf16 on the CPU: weights packed for oneDNN, whose rounding depends on the
  number of rows; else torch's ``nn.Linear``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from jitney.worker.attention.backends import BackendUnavailableError
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.kernels.cpu.packed import PackedLinear, pack_linears, packing_supported

logger = logging.getLogger("jitney.worker")

KINDS = ("torch", "onednn", "cpu_invariant", "triton_invariant", "int8", "int4")


@dataclass(frozen=True)
class LinearKernel:
    """One of ``KINDS``; ``apply`` swaps a loaded model's linears for it."""

    kind: str = "torch"

    def apply(self, layers: nn.Module, head_weight: torch.Tensor,
              head_bias: torch.Tensor | None = None) -> nn.Module | None:
        """Replace the ``nn.Linear`` layers inside ``layers`` (a loaded model's
        decoder) by this kernel's; return the head over ``head_weight`` and
        ``head_bias`` (None: torch's own head stays)."""
        if self.kind in ("int8", "int4"):
            return self._quantized(layers, head_weight, head_bias)
        if self.kind == "triton_invariant":
            from jitney.worker.kernels.triton import matmul as triton_matmul

            count = triton_matmul.use_invariant_linears(layers)
            logger.info("batch-invariant: %d linear layers and the head run the Triton matmul", count)
            return triton_matmul.TritonInvariantLinear(head_weight, head_bias)
        if self.kind == "cpu_invariant":
            count = cpu_kernels.use_invariant_linears(layers)
            logger.info("batch-invariant: %d linear layers and the head run the CPU kernel", count)
            return cpu_kernels.InvariantLinear(head_weight, head_bias, out_float=True)
        if self.kind == "onednn":
            count = pack_linears(layers)
            logger.info("packed %d linear layers and the head for oneDNN (bf16 on the CPU)", count)
            return PackedLinear(head_weight, head_bias)
        return None

    def _quantized(self, layers: nn.Module, head_weight: torch.Tensor, head_bias: torch.Tensor | None) -> nn.Module:
        names = {"amx": "AMX-INT8", "vnni": "AVX-512 VNNI", "portable": "the portable loops"}
        head_where = names[cpu_kernels.int8_path()]
        if self.kind == "int8":
            count = cpu_kernels.use_int8_linears(layers)
            where = head_where
        else:
            count = cpu_kernels.use_int4_linears(layers)
            path = cpu_kernels.int4_path()
            where = "AVX-512 VNNI (up to 4 rows) and AMX-INT8 (more)" if path == "amx" else names[path]
        if "portable" not in where + head_where:
            logger.info("%s weights: %d linear layers run on %s, the int8 head on %s", self.kind, count, where,
                        head_where)
        else:
            # Measured on a 2-core AVX2-only EPYC (README "int4 weights"): one sequence's decode step
            # int8 0.48x float32's, int4 0.51x; 64 sequences' 2.2x and 2.4x. Without AVX2, far slower.
            logger.warning("%s weights: %d linear layers run on %s, the int8 head on %s: this CPU lacks AMX-INT8 "
                           "and AVX-512 VNNI; on the portable loops int8 and int4 pay only at a few sequences "
                           "(same results)", self.kind, count, where, head_where)
        # The head stays int8 under int4 too: with an int4 head, perplexity rose to 22.4 against
        # 19.0 (bench/quant_accuracy.py; README "int4 weights").
        return cpu_kernels.Int8Linear(head_weight, head_bias, out_float=True)


def choose_linear_kernel(dtype: torch.dtype, device: torch.device, batch_invariant: bool,
                         quantization: str = "none") -> LinearKernel:
    """The kernel for these settings; raises ``ValueError`` / ``BackendUnavailableError``
    for a combination that cannot run."""
    if quantization in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"--quantization {quantization} runs on the CPU only")
        return LinearKernel(quantization)
    if batch_invariant and device.type == "cuda":
        try:
            import jitney.worker.kernels.triton.matmul  # noqa: F401
        except ImportError as err:
            raise BackendUnavailableError("--batch-invariant on CUDA needs the triton package "
                                          "(pip install triton)") from err
        return LinearKernel("triton_invariant")
    if batch_invariant and cpu_kernels.supported(dtype, device):
        return LinearKernel("cpu_invariant")
    if packing_supported(dtype, device):
        return LinearKernel("onednn")
    return LinearKernel()
