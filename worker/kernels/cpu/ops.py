"""The CPU's batch-invariant kernels (``csrc/``, one file per kind of op), built at first use.

The operations, registered as ``torch.ops.jitney_cpu``:

- ``InvariantLinear``: ``y = x W^T + b`` with W packed once at load; every
  output is one fixed reduction over the whole of K, so its bits do not
  depend on how many rows share the call. bf16 runs on the fastest of
  Jitney's own kernels the CPU has (``linear_kernel()``): AMX-BF16 tiles, which
  stream the weights with prefetches (a decode step's linears ran 1.4-1.8x
  faster than through oneDNN's brgemm, see docs/journal/2026-11-26-cpu-floor.md), else AVX-512
  BF16 (vdpbf16ps, one K pair at a time), else the portable loops. float32:
  one oneDNN brgemm micro-kernel call per block. (oneDNN's own matmul picks
  blockings, and splits K between threads, by the number of rows: the same
  token gave different bf16 rows at 1 and at 33 rows; its bf16 brgemm
  micro-kernel, on an AMD EPYC without AMX, ordered K one way for 1 row,
  another for 2-3 and a third for 4 or more.)
- ``paged_attention``: every query token walks its own sequence's cache
  blocks from position 0 (or its sliding window's first block) with a float32
  online softmax, reading K/V where they lie (no gather, no padding); scores
  optionally soft-capped, and a per-head sink logit optionally in the softmax. Decodes and prefill chunks run the same
  arithmetic, so chunking, preemption and prefix-cache hits keep the bits.
- ``silu_mul``: torch's float32 SiLU rounds a vector's tail differently
  from its body, so a row's bits could depend on where it falls; this runs
  the same operations on every element (float32 in AVX2 registers where the
  CPU has them, the scalar loops' bits; ``portable=True`` runs those loops).
- ``linear_silu_mul``: ``silu_mul(linear(x))`` of a gate_up layer, the same
  bits, in one pass on the AVX-512 BF16 kernel (the layer stack calls it).
- ``linear_int8`` (``csrc/linear_int8.cpp``, ``--quantization int8``): int8
  weights with per-channel scales; the activations enter as two int8 limbs
  per row and every sum is an exact integer (AMX-INT8 where the CPU has it),
  so the result is batch-invariant and the same on any CPU.
- ``linear_int4`` (same file, ``--quantization int4``): 4-bit weights with an
  integer scale per 32 inputs, exactly the int8 layer of the weights ``c * q``
  (AVX-512 VNNI from the nibbles for up to 4 rows, else int8 tiles unpacked in
  cache for the AMX kernel).
- ``lora_add`` (``csrc/lora.cpp``): LoRA adapters' per-row add into a linear's
  output slice, a step's rows grouped by adapter, every sum a fixed chain (float32
  fmas, or AVX-512 BF16 pairs for bf16 adapters), so a row's bits depend on its
  own x and adapter only.
- ``moe_experts`` (``csrc/moe.cpp``, wrapped by ``moe.InvariantMoeExperts``): a
  mixture-of-experts layer's routed experts, each expert's gate, up and down
  on the bf16 linear's kernels over the step's rows routed to it, a token's k
  outputs added in top-k order in float32 and rounded once.

The source is compiled once per machine with torch's C++ extension tooling
(a C++ compiler and ninja are needed; the ``ninja`` package is a
dependency) into ``$JITNEY_KERNEL_CACHE`` (default
``~/.cache/jitney/kernels``), in a folder keyed by the source, torch's
version and the CPU, and loaded from there afterwards (the build takes
41-47 s on a 2-core Zen 5; `make` runs it at install). A failed build raises ``KernelBuildError`` with the compiler's
output; nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jitney.worker.kernels.cpu.packed import replace_linears

logger = logging.getLogger("jitney.worker")

CSRC = Path(__file__).resolve().parent / "csrc"
# Every .cpp of csrc/ (one kind of op each) is one extension; library.cpp holds the
# ``jitney_cpu`` library's one TORCH_LIBRARY (every op's schema), layer_stack.cpp adds
# its class with a TORCH_LIBRARY_FRAGMENT. No sub-folders: pyproject ships csrc/*.cpp, *.h.
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


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold the build folder's lock while torch builds or loads into it.

    torch's own lock is a file it creates and deletes (``lock``, a FileBaton): a
    build killed in between (Ctrl-C during ``make``, a killed worker) leaves it
    behind, and every later start would wait for it forever, silently. This
    lock is an flock, which the kernel releases when its process dies; every
    Jitney build takes it first, so while it is held no other build can own a
    ``lock`` file there, and one that exists is stale.
    """
    with open(folder / "jitney.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
            with _build_lock(folder):
                cpp_extension.load(name="jitney_cpu", sources=[str(src) for src in SOURCES], extra_cflags=FLAGS,
                                   extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                   is_python_module=False, verbose=False)
        except (RuntimeError, OSError, ImportError) as err:
            raise KernelBuildError(f"building the CPU kernels in {folder} failed: {err}") from err
        _loaded = True
        logger.info("CPU kernels loaded from %s", folder)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, kernel: str = "auto", *, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``query (T, nh, d)`` over the paged caches -> ``(T, nh, d)``.

    Sequence ``i`` owns query rows ``[query_start_loc[i], query_start_loc[i+1])``,
    the last at position ``seq_lens[i] - 1``; ``block_tables[i]`` covers its context.
    ``kernel``: the form every row of the call runs in. ``auto`` (what the server
    runs): ``attention_kernel()``, for float32 too unless that takes bfloat16 only
    (``amx``, ``avx512bf16``: float32 then runs ``avx512``, else ``avx2``, else
    ``portable``). ``amx``: the tile unit's (bfloat16 16-token blocks, head_dim
    64 or 128); ``avx512bf16``: the same shapes by AVX-512 BF16 dot products
    (``vdpbf16ps``), 16 query rows a register where a sequence has many, a token's rows
    with the keys in the lanes; ``avx512``: 16-token blocks with head_dim a multiple of
    64 in AVX-512 float32 registers, the scalar loops' bits; ``avx2``: the same in AVX2's
    8-lane registers (with FMA), the same bits; ``portable``: the scalar loops only.
    Shapes a form does not cover run as under ``avx512``; a form this CPU lacks raises
    ``RuntimeError``. Each form's bits depend only on a row's own inputs; ``amx``'s and
    ``avx512bf16``'s are their own.
    ``window``: a query at position p sees keys ``[p - window + 1, p]``; the blocks
    wholly before the window of a sequence's first query are not read, nor their
    block-table entries. ``softcap``: scores ``s`` become ``softcap * tanh(s / softcap)``.
    ``sinks`` (nh,) float32: each query head's sink logit, in the softmax's
    denominator only (-inf: none). None: off.
    """
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kernel, window, softcap, sinks)
    return out


def attention_kernel() -> str:
    """The form ``kernel="auto"`` runs bfloat16 in, in this process: what
    ``set_attention_kernel`` named, else ``avx512bf16`` on a CPU with AVX-512 BF16 (whose
    ``vdpbf16ps`` computes what Intel's manual sets down, so such CPUs agree:
    ``dot_bf16_pairs``), else ``avx512``, else ``avx2`` on a CPU with AVX2 and FMA, else
    ``portable`` (these three: the same bits). ``amx`` is only ever named: its bits are
    its own."""
    load()
    return str(torch.ops.jitney_cpu.attention_kernel())


def dot_bf16_pairs(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc (n,)`` float32 plus each lane's two bfloat16 products ``a (n, 2) * b (n, 2)`` by
    the CPU's ``vdpbf16ps``, the one instruction of the ``avx512bf16`` form whose rounding
    is not plain IEEE arithmetic; ``RuntimeError`` without AVX-512 BF16."""
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.dot_bf16_pairs(acc, a, b)
    return out


def set_attention_kernel(kernel: str) -> None:
    """Make ``kernel="auto"`` (the server's layers) run ``kernel`` in this process from now
    on; ``auto`` restores the default (``attention_kernel``). ``amx`` (~2.8x ``avx512``
    on a Xeon) and ``avx512bf16`` (~2x on a Zen 5) are faster on a long prompt's
    attention (bench/cpu_attention.py) and give their own bits: replicas that must agree
    bit for bit run the same one on every machine. An unknown name, or a form this CPU lacks,
    raises ``RuntimeError``."""
    load()
    torch.ops.jitney_cpu.set_attention_kernel(kernel)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up (T, 2I)`` -> ``(T, I)``, the same operations for every element."""
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.silu_mul(gate_up)
    return out


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up (T, 2I)`` -> ``(T, I)``, the same operations for every element."""
    load()
    out: torch.Tensor = torch.ops.jitney_cpu.gelu_mul(gate_up)
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             slots: torch.Tensor, offset: int, portable: bool = False) -> None:
    """In place: ``y[t, offset : offset + out] += scale[s] * B[s] @ (A[s] @ x[t])`` for each
    row t of slot ``s = slots[t]`` (0: none, the row untouched), computed in float32 and
    rounded once into y's dtype. ``x (T, in)``, ``a (S, R, in)``, ``b (S, out, R)`` in y's
    dtype (bfloat16 or float32), ``scale (S,)`` float32, ``slots (T,)`` int32; a bad
    argument raises ``RuntimeError`` before y changes. ``portable``: the plain loops (float32
    fmas: the AVX-512 path's bits, not the AVX-512 BF16 one's)."""
    load()
    torch.ops.jitney_cpu.lora_add(y, x, a, b, scale, slots, offset, portable)


def lora_kernel() -> str:
    """Where bf16 ``lora_add`` runs here: ``avx512_bf16`` (vdpbf16ps), ``avx512`` (float32
    fmas, the portable loops' bits) or ``portable``; float32 adapters take float32 fmas."""
    load()
    return str(torch.ops.jitney_cpu.lora_kernel())


class InvariantLinear(nn.Module):
    """``y = x W^T + b`` through ``jitney_cpu.linear``; x is (T, in_features).

    ``out_float``: return float32 (the logits) instead of x's dtype.
    ``portable``: bf16 through the plain loops, whatever the CPU has (for
    tests and benchmarks; every kernel is batch-invariant, their bits differ).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, out_float: bool = False,
                 portable: bool = False) -> None:
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.portable = portable
        self.packed = torch.ops.jitney_cpu.pack_linear_weight(weight.detach().contiguous())
        self.bias = bias
        self.out_float = out_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.jitney_cpu.linear(x, self.packed, self.bias, self.in_features, self.out_features,
                                                      self.out_float, self.portable)
        return y


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture-of-experts block (``layers/moe.py``'s ``SparseMoe``) for ``layer_stack``:
    its router (a linear of this module's), its experts (``moe.InvariantMoeExperts``),
    ``top_k`` of them per token, their softmax weights renormalised to sum 1 when ``normalize``;
    ``topk_then_softmax`` (gpt-oss): the top k of the router's logits, then their softmax."""

    router: nn.Module
    experts: nn.Module
    top_k: int
    normalize: bool
    topk_then_softmax: bool = False


@dataclass(frozen=True)
class StackLora:
    """A LoRA target of a stack layer's linear ``linear`` (``layers/lora.py``): after it,
    ``lora_add`` of ``a``, ``b``, ``scale`` (the adapter slots' tensors themselves, which
    a load rewrites in place) into its output columns from ``offset``."""

    linear: int
    offset: int
    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer for ``layer_stack``: its program (``layers/program.py``'s (op,
    index) steps), the [(weight, eps), ...] of the norms and the linears (or experts
    blocks) its indices name, its K and V caches, which of ``forward``'s rotary tables
    it rotates by, its attention's window, soft cap and sinks (None: off), and its LoRA targets."""

    program: Sequence[tuple[int, int]]
    norms: list[tuple[torch.Tensor, float]]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    linears: Sequence[nn.Module | RoutedExperts]
    rope: int = 0
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    lora: Sequence[StackLora] = ()


def layer_stack(num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                layers: Sequence[StackLayer]) -> torch.ScriptObject | None:
    """``csrc/layer_stack.cpp``'s ``LayerStack``: every layer of a step in one call,
    each running its program with the kernels ``InvariantCpuLayerOps`` calls, in the
    program's order (so the same bits). Only without tensor parallelism: its REDUCE
    steps are the identity. Its ``forward`` takes the step's embeddings, a list of
    cos and one of sin (a layer's ``rope`` picks one of each) and the attention
    metadata, and each token's LoRA slot (None: no adapter in the step; with it, each
    layer's ``lora`` targets are added after their linears). None where a linear is not
    one of this module's (``InvariantLinear``,
    ``Int8Linear``, ``Int4Linear``) or returns float32, or an experts block's
    experts return float32."""
    load()
    if not layers:
        raise ValueError("a layer stack needs a layer")

    def steps(program: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        return [int(op) for op, _ in program], [index for _, index in program]

    stack = torch.classes.jitney_cpu.LayerStack(num_heads, num_kv_heads, head_dim, scale, *steps(layers[0].program))
    programs = {tuple(layers[0].program): 0}
    for layer in layers:
        program = tuple(layer.program)
        if program not in programs:
            programs[program] = stack.add_program(*steps(program))
        stack.add_layer(layer.k_cache, layer.v_cache)
        stack.set_layer(programs[program], layer.rope, layer.window, layer.softcap, layer.sinks)
        for weight, eps in layer.norms:
            stack.add_norm(weight, eps)
        for lin in layer.linears:
            if not _add_linear(stack, lin):
                return None
        for target in layer.lora:
            stack.add_lora(target.linear, target.offset, target.a, target.b, target.scale)
    stack.check()
    return stack


def _add_linear(stack: Any, lin: nn.Module | RoutedExperts) -> bool:
    """Give ``stack``'s last layer its next linear (or experts block); False: the stack cannot run it."""
    if isinstance(lin, RoutedExperts):
        ex: Any = lin.experts
        if ex.out_float or not _add_linear(stack, lin.router):
            return False
        stack.add_experts(ex.gate, ex.up, ex.down, ex.gate_bias, ex.up_bias, ex.down_bias, ex.hidden_size,
                          ex.intermediate_size, ex.activation, ex.alpha, ex.limit, ex.portable, lin.top_k,
                          lin.normalize, lin.topk_then_softmax)
        return True
    if not isinstance(lin, (InvariantLinear, Int8Linear, Int4Linear)) or lin.out_float:
        return False
    # (layer_stack.cpp's Kind, weights, int4's group scales, int8/int4's per-channel scales)
    if isinstance(lin, Int4Linear):
        kind, weights, cv, channels = 2, lin.q4, lin.cv, lin.scale
    elif isinstance(lin, Int8Linear):
        kind, weights, cv, channels = 1, lin.packed, None, lin.scale
    else:
        kind, weights, cv, channels = 0, lin.packed, None, None
    stack.add_linear(kind, weights, cv, channels, lin.bias, lin.in_features, lin.out_features, lin.portable)
    return True


def linear_kernel() -> str:
    """The kernel bf16 ``InvariantLinear``s run on here: ``amx`` (AMX-BF16), ``avx512_bf16``
    (AVX-512 BF16, no AMX) or ``portable`` (the plain loops: a CPU with neither)."""
    load()
    return str(torch.ops.jitney_cpu.linear_kernel())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight (N, K)``: ``(q (N, K) int8, scale (N,) float32)``
    with ``weight[n] ~ q[n] * scale[n]``, ``|q| <= 127``; an all-zero row gets scale 1 (and q 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


class Int8Linear(nn.Module):
    """``y = x (q * scale)^T + b`` through ``jitney_cpu.linear_int8`` (``csrc/linear_int8.cpp``, ``csrc/linear_int4.cpp``):
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


INT4_GROUP = 32  # K values sharing one integer scale c


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-level int4 of ``weight (N, K)``: ``(q (N, K) int8 in [-8, 7], c (N, G) uint8 in [1, 16],
    scale (N,) float32)``, G = ceil(K / 32), with ``weight[n, k] ~ scale[n] * c[n, k // 32] * q[n, k]``.

    ``c * q`` fits int8, so the int8 kernel's exact integer sums carry over
    (``csrc/linear_int8.cpp``, ``csrc/linear_int4.cpp``). Per column, ``scale = max|w| / (f * 16)`` for f
    in 7, 7.5 and 8 (the largest group's step at ``c = 16``); per group of
    32, the ``c`` whose rounded, clamped ``q`` has the smallest squared error
    among the four integers around ``16 max|w_group| / max|w_column|`` (all
    16 candidates gave 0.7% less error, at four times the load time); per
    column, the f whose groups' error sums smallest.
    (Against the bundled model's weights: 8.5-9.0% relative RMS error per
    layer kind, against 9.5-9.9% for c from the group's max alone and
    9.9-10.4% for plain round-to-nearest with a float scale per group.) An all-zero row gets scale 1 (q 0, c 1).
    """
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // INT4_GROUP)
    wg = torch.nn.functional.pad(w, (0, groups * INT4_GROUP - k)).view(n, groups, INT4_GROUP)
    amax_g = wg.abs().amax(dim=2)
    amax = amax_g.amax(dim=1)
    nonzero = torch.where(amax > 0, amax, torch.ones_like(amax))
    # The error is smallest near c = 16 max|w_group| / max|w_column| (whatever f): the 4 integers around it.
    ideal = (16.0 * amax_g / nonzero[:, None]).floor_()
    candidates = [(ideal + d).clamp_(1, 16) for d in (-1, 0, 1, 2)]
    best_c, best_scale, best_err = torch.ones(n, groups), torch.ones(n), torch.full((n,), float("inf"))
    for f in (7.0, 7.5, 8.0):
        scale = torch.where(amax > 0, amax / (f * 16.0), torch.ones_like(amax))
        c_f = torch.ones(n, groups)
        err_f = torch.full((n, groups), float("inf"))
        for c in candidates:
            step = scale[:, None, None] * c[:, :, None]
            err = torch.round(wg / step).clamp_(-8, 7).mul_(step).sub_(wg).square_().sum(dim=2)
            better = err < err_f
            c_f = torch.where(better, c, c_f)
            err_f = torch.where(better, err, err_f)
        column = err_f.sum(dim=1)
        take = column < best_err
        best_c = torch.where(take[:, None], c_f, best_c)
        best_scale = torch.where(take, scale, best_scale)
        best_err = torch.where(take, column, best_err)
    q = torch.round(wg / (best_scale[:, None, None] * best_c[:, :, None])).clamp_(-8, 7)
    return (q.reshape(n, groups * INT4_GROUP)[:, :k].to(torch.int8).contiguous(),
            best_c.to(torch.uint8).contiguous(), best_scale.contiguous())


class Int4Linear(nn.Module):
    """``y = x (scale * c * q)^T + b`` through ``jitney_cpu.linear_int4``: the
    weights of ``quantize_int4``, stored in half a byte each (plus one byte
    per 32 for c). Each work unit is unpacked into the int8 kernel's tile
    layout in cache and computed by it, so the results are, bit for bit,
    ``Int8Linear``'s on the int8 weights ``c * q``: exact integer sums,
    batch-invariant (``portable`` forces the plain loops, the same bits).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, out_float: bool = False) -> None:
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        q, c, self.scale = quantize_int4(weight)
        self.q4, self.cv = torch.ops.jitney_cpu.pack_int4_weight(q, c)
        self.bias = bias
        self.out_float = out_float
        self.portable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.jitney_cpu.linear_int4(x, self.q4, self.cv, self.scale, self.bias,
                                                           self.in_features, self.out_features, self.out_float,
                                                           self.portable)
        return y


def use_int4_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an ``Int4Linear``; return how many."""
    return replace_linears(model, lambda linear: Int4Linear(linear.weight, linear.bias))


def int8_path() -> str:
    """Where ``Int8Linear`` runs here: ``amx`` (AMX-INT8), ``vnni`` (AVX-512 VNNI) or
    ``portable`` (the plain loops, far slower). All three give the same bits."""
    load()
    return str(torch.ops.jitney_cpu.int8_path())


def int4_path() -> str:
    """Where ``Int4Linear`` runs here: ``amx`` (AMX-INT8, and AVX-512 VNNI for calls of
    up to 4 rows), ``vnni`` (AVX-512 VNNI, 4 rows a pass) or ``portable`` (the plain
    loops only, far slower)."""
    load()
    return str(torch.ops.jitney_cpu.int4_path())


def use_int8_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an ``Int8Linear``; return how many."""
    return replace_linears(model, lambda linear: Int8Linear(linear.weight, linear.bias))


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether these kernels serve a model in ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def use_invariant_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an ``InvariantLinear``; return how many."""
    return replace_linears(model, lambda linear: InvariantLinear(linear.weight, linear.bias))
