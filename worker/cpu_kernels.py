"""The CPU's batch-invariant kernels (``csrc/cpu_kernels.cpp``), built at first use.

The operations, registered as ``torch.ops.jitney_cpu``:

- ``InvariantLinear``: ``y = x W^T + b`` with W packed once at load; every
  output is one fixed reduction over the whole of K, so its bits do not
  depend on how many rows share the call. bf16 where the CPU has AMX-BF16:
  Jitney's own tile kernel, which streams the weights with prefetches (a
  decode step's linears ran 1.4-1.8x faster than through oneDNN's brgemm,
  see docs/performance.md); elsewhere one oneDNN brgemm micro-kernel call
  per block. (oneDNN's own matmul picks blockings, and splits K between
  threads, by the number of rows: the same token gave different bf16 rows
  at 1 and at 33 rows.)
- ``paged_attention``: every query token walks its own sequence's cache
  blocks from position 0 with a float32 online softmax, reading K/V where
  they lie (no gather, no padding). Decodes and prefill chunks run the same
  arithmetic, so chunking, preemption and prefix-cache hits keep the bits.
- ``silu_mul``: torch's float32 SiLU rounds a vector's tail differently
  from its body, so a row's bits could depend on where it falls; this runs
  the same operations on every element.
- ``linear_int8`` (``csrc/cpu_int8.cpp``, ``--quantization int8``): int8
  weights with per-channel scales; the activations enter as two int8 limbs
  per row and every sum is an exact integer (AMX-INT8 where the CPU has it),
  so the result is batch-invariant and the same on any CPU.

The source is compiled once per machine with torch's C++ extension tooling
(a C++ compiler and ninja are needed; the ``ninja`` package is a
dependency) into ``$JITNEY_KERNEL_CACHE`` (default
``~/.cache/jitney/kernels``), in a folder keyed by the source, torch's
version and the CPU, and loaded from there afterwards (about 15 s the
first time). A failed build raises ``KernelBuildError`` with the compiler's
output; nothing falls back silently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch
from torch import nn

from jitney.worker.cpu_linear import replace_linears

logger = logging.getLogger("jitney.worker")

CSRC = Path(__file__).resolve().parent / "csrc"
# Every .cpp of csrc/ is one extension; cpu_kernels.cpp defines the
# ``jitney_cpu`` library, the others add to it (TORCH_LIBRARY_FRAGMENT).
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))      # included by the sources: part of the build's key
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

_lock = threading.Lock()
_loaded = False


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded."""


def _cpu_tag() -> str:
    """What the compiled code depends on besides its source: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def cache_dir() -> Path:
    """The build folder for these sources, torch version, flag set and CPU."""
    key = hashlib.sha256()
    parts = [src.name.encode() + src.read_bytes() for src in (*SOURCES, *HEADERS)]
    for part in (*parts, torch.__version__.encode(), " ".join(FLAGS).encode(), _cpu_tag().encode()):
        key.update(part)
    root = Path(os.environ.get("JITNEY_KERNEL_CACHE", Path.home() / ".cache" / "jitney" / "kernels"))
    return root / key.hexdigest()[:16]


def load() -> None:
    """Build (first time on this machine) and load the kernels; idempotent."""
    global _loaded
    if _loaded:   # every call of a kernel passes here: no lock once loaded
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(name="jitney_cpu", sources=[str(src) for src in SOURCES], extra_cflags=FLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(folder),
                               is_python_module=False, verbose=False)
        except (RuntimeError, OSError, ImportError) as err:
            raise KernelBuildError(f"building the CPU kernels in {folder} failed: {err}") from err
        _loaded = True
        logger.info("CPU kernels loaded from %s", folder)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, portable: bool = False) -> torch.Tensor:
    """Causal attention of ``query (T, nh, d)`` over the paged caches -> ``(T, nh, d)``.

    Sequence ``i`` owns query rows ``[query_start_loc[i], query_start_loc[i+1])``,
    the last at position ``seq_lens[i] - 1``; ``block_tables[i]`` covers its context.
    ``portable``: only the scalar loops (the AVX-512 form of 16-token blocks must
    give the same bits; the tests compare them).
    """
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, portable)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up (T, 2I)`` -> ``(T, I)``, the same operations for every element."""
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.silu_mul(gate_up)
    return out


class InvariantLinear(nn.Module):
    """``y = x W^T + b`` through ``jitney_cpu.linear``; x is (T, in_features).

    ``out_float``: return float32 (the logits) instead of x's dtype.
    ``portable``: oneDNN's brgemm micro-kernel even where bf16 would run on
    Jitney's AMX kernel (for tests and benchmarks; both are batch-invariant,
    their bits differ).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, out_float: bool = False,
                 portable: bool = False) -> None:
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.portable = portable
        self.packed = torch.ops.jitney_cpu.pack_linear_weight(weight.detach().contiguous(), portable)
        self.bias = bias
        self.out_float = out_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.jitney_cpu.linear(x, self.packed, self.bias, self.in_features, self.out_features,
                                                      self.out_float, self.portable)
        return y


def linear_uses_amx() -> bool:
    """Whether bf16 ``InvariantLinear``s run on Jitney's AMX-BF16 kernel here (else oneDNN's brgemm)."""
    load()
    return bool(torch.ops.jitney_cpu.linear_uses_amx())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight (N, K)``: ``(q (N, K) int8, scale (N,) float32)``
    with ``weight[n] ~ q[n] * scale[n]``, ``|q| <= 127``; an all-zero row gets scale 1 (and q 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


class Int8Linear(nn.Module):
    """``y = x (q * scale)^T + b`` through ``jitney_cpu.linear_int8`` (``csrc/cpu_int8.cpp``):
    weight-only int8 with per-output-channel scales computed here from
    ``weight``; x (T, in_features) is bfloat16 or float32, carried into the
    integer sums as a 16-bit fixed-point copy per row. The sums are exact
    integers, so a row's result never depends on its batch; AMX-INT8 runs
    them where the CPU has it (``portable`` forces the plain loops, which
    give the same bits).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, out_float: bool = False) -> None:
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        q, self.scale = quantize_int8(weight)
        self.packed = torch.ops.jitney_cpu.pack_int8_weight(q)
        self.bias = bias
        self.out_float = out_float
        self.portable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.jitney_cpu.linear_int8(x, self.packed, self.scale, self.bias, self.in_features,
                                                           self.out_features, self.out_float, self.portable)
        return y


def int8_uses_amx() -> bool:
    """Whether ``Int8Linear`` runs on AMX-INT8 here (else the portable loops, far slower)."""
    load()
    return bool(torch.ops.jitney_cpu.int8_uses_amx())


def use_int8_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an ``Int8Linear``; return how many."""
    return replace_linears(model, lambda linear: Int8Linear(linear.weight, linear.bias))


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether these kernels serve a model in ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def use_invariant_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an ``InvariantLinear``; return how many."""
    return replace_linears(model, lambda linear: InvariantLinear(linear.weight, linear.bias))
