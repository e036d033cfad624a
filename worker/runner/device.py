"""Device and dtype choices derived from the worker config."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.config import WorkerConfig

logger = logging.getLogger("jitney.worker")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX).

    Without these, torch emulates bf16 matmuls and float32 is both faster
    and more accurate.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def cuda_index(device: torch.device) -> int:
    """The CUDA index of ``device`` (the current device for a bare "cuda"). A step's event
    records pass it to ``torch.cuda.current_stream``: without an index, torch's device
    lookup took ~40 µs a call (under cProfile, on an H200's host)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def resolve_dtype(config: WorkerConfig) -> torch.dtype:
    """The torch dtype the model and cache use (``auto`` resolved)."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if config.device == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_device(config: WorkerConfig) -> torch.device:
    """The torch device, checked to exist."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(config.device)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name the Ready message carries)."""
    return str(dtype).removeprefix("torch.")


# Step budget and seats when the flags leave them unset: (max_num_batched_tokens, max_num_seqs).
# CPU: a 512-token step keeps a decode step's latency low on 2 cores.
# CUDA: a 2048-token step runs offline-64 1.7x faster than 512 on an H100 (1.08 s vs 1.84 s,
# docs/benchmarks.md) and a 1B-shape 2048-token prefill step still takes ~7 ms; 256 seats
# (vLLM's default too) keep the card busy at small models' decode sizes.
STEP_DEFAULTS: dict[str, tuple[int, int]] = {"cpu": (512, 64), "cuda": (2048, 256)}


def step_defaults(config: WorkerConfig, device: torch.device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): the flags', or the device's defaults."""
    tokens, seqs = STEP_DEFAULTS[device.type]
    if config.max_num_seqs is not None:
        seqs = config.max_num_seqs
    if config.max_num_batched_tokens is not None:
        tokens = config.max_num_batched_tokens
    elif tokens < seqs:
        tokens = seqs  # every seat must be able to decode in one step
    return tokens, seqs


# Steps of at most this many tokens run the skinny Triton linears on CUDA (``worker/kernels/triton/skinny.py``).
SKINNY_ROWS = 16


def skinny_rows(config: WorkerConfig, device: torch.device, graph_safe: bool, batch_invariant: bool,
                tuned: int | None = None) -> int:
    """How many token rows a step may have to run the skinny kernels (0: never).

    The default on CUDA is the card's tuned value (``tuned_configs``), else ``SKINNY_ROWS``.
    They need the Triton backend's fused ops and are not batch-invariant
    (their summation order is not the other steps' matmuls'). An explicit
    ``--skinny-rows`` where they cannot run raises ``ValueError``.
    """
    usable = graph_safe and not batch_invariant
    if config.skinny_rows is None:
        default = SKINNY_ROWS if tuned is None else tuned
        return default if usable and device.type == "cuda" else 0
    if config.skinny_rows and not usable:
        raise ValueError("--skinny-rows needs the Triton attention backend without --batch-invariant")
    return config.skinny_rows


def resolve_batch_invariant(config: WorkerConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this worker runs its batch-invariant kernels (``--batch-invariant``).

    Unset: on for the CPU in bfloat16 and float32 (its kernels are
    batch-invariant by construction, ``kernels/cpu/ops.py``); off on CUDA, where
    the Triton matmul's cost is not yet measured on a GPU, and for float16 on
    the CPU (no invariant kernels: a warning says so). Asking for it where it
    cannot hold raises ``ValueError``.
    """
    cpu_ok = cpu_kernels.supported(dtype, device)
    if config.batch_invariant is None:
        if device.type == "cpu" and not cpu_ok:
            logger.warning("%s on the CPU is not batch-invariant: a request's output may depend on "
                           "what else is batched (use --dtype bfloat16 or float32)", dtype_name(dtype))
        return cpu_ok
    if config.batch_invariant and device.type == "cpu" and not cpu_ok:
        raise ValueError(f"--batch-invariant on the CPU needs --dtype bfloat16 or float32, not {dtype_name(dtype)}")
    return config.batch_invariant


def use_cpu_attention(config: WorkerConfig, device: torch.device, batch_invariant: bool) -> str | None:
    """Sets the CPU attention kernel's form for this process (``--cpu-attention``) and
    returns it; None where the CPU kernels do not run (CUDA, or the CPU without batch
    invariance, where a named form is refused: ``ValueError``, as for a form this CPU
    lacks)."""
    if device.type != "cpu" or not batch_invariant:
        if config.cpu_attention != "auto":
            raise ValueError(f"--cpu-attention {config.cpu_attention} needs the CPU's batch-invariant kernels "
                             "(--device cpu, bfloat16 or float32, not --no-batch-invariant)")
        return None
    try:
        cpu_kernels.set_attention_kernel(config.cpu_attention)
    except RuntimeError as err:
        raise ValueError(f"--cpu-attention {config.cpu_attention}: {str(err).splitlines()[0]}") from None
    form = cpu_kernels.attention_kernel()
    logger.info("CPU attention kernel: %s", form)
    return form


class ModelTimer:
    """Time of forward + logits: host time on the CPU, GPU time between two events on CUDA.
    One per runner, started at each step (the events are made once, and recorded on the
    device's current stream found by index, ``cuda_index``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.started = self.elapsed = 0.0
        if self.cuda:
            self.index = cuda_index(device)
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.cuda:
            self.start_event.record(torch.cuda.current_stream(self.index))

    def stop(self) -> None:
        if self.cuda:
            self.end_event.record(torch.cuda.current_stream(self.index))
        else:
            self.elapsed = time.perf_counter() - self.started

    def sync(self) -> None:
        """Wait for the device (a step that samples nothing has no other sync)."""
        if self.cuda:
            self.end_event.synchronize()

    def seconds(self) -> float:
        """Call after the device passed ``stop`` (the results' copy, or ``sync``)."""
        if self.cuda:
            return self.start_event.elapsed_time(self.end_event) / 1000
        return self.elapsed
