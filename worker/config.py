"""The worker's one frozen configuration object and its command-line flags.

Derived values (the resolved dtype, the number of cache blocks) are computed
from this object and returned by the code that needs them; nothing is ever
written back into it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jitney.common.arg_types import int_in, non_negative_int, positive_float, positive_int
from jitney.common.zmq_security import add_link_security_arguments

DType = Literal["float32", "bfloat16", "float16", "auto"]
Device = Literal["cpu", "cuda"]
Quantization = Literal["none", "int8", "int4"]
QUANTIZATION_CHOICES: tuple[Quantization, ...] = ("none", "int8", "int4")
CPU_ATTENTION_CHOICES = ("auto", "amx", "avx512bf16", "avx512", "avx2", "portable")  # cpu_kernels.set_attention_kernel's names

DTYPE_CHOICES: tuple[str, ...] = ("float32", "bfloat16", "float16", "auto")
DEVICE_CHOICES: tuple[str, ...] = ("cpu", "cuda")
AttentionBackendName = Literal["auto", "torch", "triton"]
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "triton")
# The most token rows of a skinny linear launch (``triton_skinny.MAX_ROWS``).
MAX_SKINNY_ROWS = 64
# Shortest watchdog timeout: an idle worker's loop waits up to 1 s for a message.
MIN_HANG_TIMEOUT = 2.0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker process needs to know, fixed at start.

    Fields:
      model: path to a Hugging Face model folder or a ``.gguf`` file;
        ``None`` means the bundled default (SmolLM2-135M-Instruct, GGUF).
      dtype: weight, activation and KV-cache dtype. ``auto`` picks bfloat16
        on CUDA and on CPUs with native bf16 math (AVX512-BF16 or AMX),
        float32 otherwise.
      device: ``cpu`` or ``cuda``.
      block_size: tokens per KV-cache block (the scheduler's block size).
      num_blocks: exact number of KV-cache blocks; exclusive with
        ``kv_cache_gib``.
      kv_cache_gib: KV-cache size in GiB; exclusive with ``num_blocks``. When
        both are ``None`` the cache takes 2 GiB on CPU; on CUDA the GPU
        memory left free after the model, a profiled step of the full token
        budget and the CUDA graphs, less 10% of the card
        (``kv_cache.size_cache``).
      max_num_batched_tokens: most tokens in one fused step (the scheduler's
        token budget); a plan over it is rejected. ``None``: the device's
        default (``device.STEP_DEFAULTS``: 512 on CPU, 2048 on CUDA).
      max_num_seqs: most sequences alive (and in one fused step); a plan
        over it is rejected. ``None``: 64 on CPU, 256 on CUDA.
      plan_addr: ZeroMQ endpoint the worker connects its PULL socket to
        (step plans come in here). ``None`` only until the launcher fills it.
      result_addr: ZeroMQ endpoint the worker connects its PUSH socket to
        (Ready, step results and errors go out here).
      curve_keys: folder holding ``worker.key_secret`` and ``server.key``
        (``jitney keys``; ``jitney.common.zmq_security``): the link runs
        CurveZMQ, encrypted and authenticated both ways. ``None``: no keys,
        allowed only on ``ipc://`` in a private folder, or with
        ``insecure_plaintext_zmq``.
      insecure_plaintext_zmq: allow a ``tcp://`` link without keys.
      threads: torch intra-op threads; ``None`` keeps torch's default.
      max_model_len: cap on the context length (prompt + output tokens);
        ``None`` means the model's own limit.
      hang_timeout: seconds the serve loop may spend in one step or one wait
        for a message before the watchdog (``worker/runner/watchdog.py``) dumps the
        stacks and exits the process (status 1); 0 = off, else at least
        ``MIN_HANG_TIMEOUT`` (an idle worker waits 1 s between heartbeats).
        Matches the scheduler's ``--worker-timeout`` default: a worker that
        long silent has been declared lost anyway.
      attention_backend: ``auto`` (Triton kernels on CUDA, torch on CPU),
        ``torch`` or ``triton`` (on CPU only under ``TRITON_INTERPRET=1``).
      batch_invariant: whether a token's results are kept independent of the
        batch it is computed in. ``None`` = the device's default: on for the CPU
        (the CPU path is batch-invariant by construction), off on CUDA until
        its cost is measured on a GPU; ``True`` on CUDA swaps the model's
        linear layers for the Triton batch-invariant matmul
        (``worker/kernels/triton/matmul.py``); ``False`` on the CPU uses oneDNN's
        faster but batch-size-dependent kernels.
      cpu_attention: the CPU attention kernel's form (``cpu_kernels.set_attention_kernel``):
        ``auto`` (bfloat16: ``avx512bf16`` where the CPU has AVX-512 BF16; else, and for
        float32, ``avx512``, else ``avx2``, else ``portable``: the same bits), ``amx``
        (AMX-BF16: faster on long prompts, its own bits), ``avx512bf16``, ``avx512``,
        ``avx2`` or ``portable``.
      quantization: ``int8``: every linear layer and the logits' head keep
        int8 weights with one scale per output channel, quantized at load from
        the model's weights (``cpu_kernels.Int8Linear``, CPU only); the
        embedding, norms and KV cache keep ``dtype``. ``int4``: the linear
        layers in 4 bits with a scale per 32 inputs (``cpu_kernels.Int4Linear``),
        the head in int8, CPU only. ``none``: weights in ``dtype``.
      skinny_rows: steps of at most this many tokens run their linear layers
        through the skinny Triton kernels, with the norms, residual adds and
        SiLU·mul folded in (``worker/kernels/triton/skinny.py``): Triton attention
        without batch invariance only. ``None`` = the device's default
        (``device.SKINNY_ROWS`` on CUDA, 0 elsewhere); 0 = never; at most 64.
      weights_cache: folder of the converted-weights cache
        (``worker/loading/weights_cache.py``); ``None`` = ``$JITNEY_WEIGHTS_CACHE`` or
        ``~/.cache/jitney/weights``.
      use_weights_cache: False loads from the model's files every time.
      tp_rank, tp_size: this process's rank in a tensor-parallel group of
        ``tp_size`` worker processes (``worker/distributed/parallel.py``); 1 = no tensor
        parallelism. Rank 0 talks to the scheduler and relays every plan to
        the others, which need no ZeroMQ endpoints.
      dist_init: the group's ``torch.distributed`` rendezvous,
        ``tcp://HOST:PORT`` (rank 0 listens there); needed when ``tp_size`` > 1.
      dist_timeout: seconds a rank waits for the group to form and for any
        collective (gloo's timeout); it must cover the slowest rank's load.
        Hangs while serving are ended sooner by ``hang_timeout``.
      draft_model: a small model sharing the target's tokenizer (a Hugging
        Face folder or a ``.gguf`` file) that proposes drafts for
        speculative decoding (the scheduler's ``--speculative draft``;
        ``worker/runner/draft_model.py``); ``None``: none.
      draft_num_blocks: blocks of the draft model's own KV cache (its own
        pool, never the scheduler's); ``None``: as many as the target's
        cache has, so every sequence the target holds fits (on CUDA, a
        cache sized from the free memory is then shared so both fit).
      max_loras: LoRA adapter slots resident at once (0: LoRA off); refused with
        tensor parallelism and with the transformers fallback.
      max_lora_rank: the rank every slot is padded to (1..256).
    """

    model: str | None = None
    dtype: DType = "auto"
    device: Device = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    plan_addr: str | None = None
    result_addr: str | None = None
    curve_keys: str | None = None
    insecure_plaintext_zmq: bool = False
    threads: int | None = None
    max_model_len: int | None = None
    hang_timeout: float = 30.0
    attention_backend: AttentionBackendName = "auto"
    batch_invariant: bool | None = None
    cpu_attention: str = "auto"
    quantization: Quantization = "none"
    skinny_rows: int | None = None
    weights_cache: str | None = None
    use_weights_cache: bool = True
    tp_rank: int = 0
    tp_size: int = 1
    dist_init: str | None = None
    dist_timeout: float = 300.0
    draft_model: str | None = None
    draft_num_blocks: int | None = None
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        # Guards programmatic construction; the CLI reports the same errors
        # earlier through argparse.
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKEND_CHOICES}, got {self.attention_backend!r}"
            )
        if self.num_blocks is not None and self.kv_cache_gib is not None:
            raise ValueError("num_blocks and kv_cache_gib are mutually exclusive")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.draft_num_blocks is not None and self.draft_model is None:
            raise ValueError("draft_num_blocks needs a draft_model")
        for name in ("num_blocks", "draft_num_blocks", "threads", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cpu_attention not in CPU_ATTENTION_CHOICES:
            raise ValueError(f"cpu_attention must be one of {CPU_ATTENTION_CHOICES}, got {self.cpu_attention!r}")
        if self.cpu_attention != "auto" and self.device != "cpu":
            raise ValueError(f"--cpu-attention {self.cpu_attention} runs on the CPU only (--device cpu)")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU only (--device cpu)")
        if self.skinny_rows is not None and not 0 <= self.skinny_rows <= MAX_SKINNY_ROWS:
            raise ValueError(f"skinny_rows must be in [0, {MAX_SKINNY_ROWS}], got {self.skinny_rows}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError("kv_cache_gib must be > 0")
        if self.hang_timeout != 0 and not MIN_HANG_TIMEOUT <= self.hang_timeout < float("inf"):
            raise ValueError(f"hang_timeout must be 0 (off) or a finite number >= {MIN_HANG_TIMEOUT:g}, "
                             f"got {self.hang_timeout}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size = {self.tp_size}), got {self.tp_rank}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_lora_rank must be in 1..256, got {self.max_lora_rank}")
        if self.max_loras and self.tp_size > 1:
            raise ValueError("max_loras > 0 (LoRA adapters) is not supported with tensor parallelism (tp_size > 1)")
        if self.tp_size > 1 and not self.dist_init:
            raise ValueError("a tensor-parallel group (tp_size > 1) needs dist_init (tcp://HOST:PORT)")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every seat must be able to decode in one step")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> WorkerConfig:
        """Build from parsed flags (those added by ``add_worker_arguments``).

        Missing attributes keep their defaults, so a namespace from a parser
        that lacks ``--plan-addr``/``--result-addr`` works too.
        """
        defaults = cls()
        values = {
            name: getattr(ns, name, getattr(defaults, name))
            for name in cls.__dataclass_fields__
        }
        return cls(**values)


_skinny_rows = int_in(0, MAX_SKINNY_ROWS)


def _hang_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != 0 and not MIN_HANG_TIMEOUT <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a finite number >= {MIN_HANG_TIMEOUT:g}, got {text}")
    return value


def _model_path(text: str) -> str:
    # Checked early so a typo fails at the command line, not after fork.
    path = Path(text)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise argparse.ArgumentTypeError(f"not a model folder or .gguf file: {text!r}")
    return text


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the worker's flags to ``parser`` (dest names = field names)."""
    group = parser.add_argument_group("worker")
    group.add_argument("--model", type=_model_path, default=None,
                       help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="model and KV-cache dtype (default: auto)")
    group.add_argument("--device", choices=DEVICE_CHOICES, default="cpu",
                       help="where the model runs (default: cpu)")
    group.add_argument("--block-size", dest="block_size", type=positive_int, default=16,
                       help="tokens per KV-cache block (default: 16)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", dest="num_blocks", type=positive_int, default=None,
                      help="number of KV-cache blocks")
    size.add_argument("--kv-cache-gib", dest="kv_cache_gib", type=positive_float, default=None,
                      help="KV-cache size in GiB (default: 2 on CPU; on CUDA the GPU memory left after the "
                           "model, a profiled step of the full token budget and the CUDA graphs, less 10%% "
                           "of the card)")
    group.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens",
                       type=positive_int, default=None,
                       help="token budget of one step (default: 512 on CPU, 2048 on CUDA)")
    group.add_argument("--max-num-seqs", dest="max_num_seqs", type=positive_int, default=None,
                       help="seats: most sequences running at once (default: 64 on CPU, 256 on CUDA)")
    group.add_argument("--plan-addr", dest="plan_addr", default=None,
                       help="ZeroMQ endpoint to pull step plans from (connect)")
    group.add_argument("--result-addr", dest="result_addr", default=None,
                       help="ZeroMQ endpoint to push results to (connect)")
    add_link_security_arguments(group)
    group.add_argument("--threads", type=positive_int, default=None,
                       help="torch intra-op threads (default: torch's choice)")
    group.add_argument("--max-model-len", dest="max_model_len", type=positive_int, default=None,
                       help="cap on context length (default: the model's)")
    group.add_argument("--hang-timeout", dest="hang_timeout", type=_hang_timeout, default=30.0,
                       metavar="SECONDS",
                       help="a step or a wait for a message longer than this dumps the stacks and exits "
                            "(status 1) so the worker is restarted; 0 = off, else >= 2 (default 30, the scheduler's "
                            "--worker-timeout)")
    group.add_argument("--attention-backend", dest="attention_backend", choices=ATTENTION_BACKEND_CHOICES,
                       default="auto",
                       help="auto: Triton kernels on CUDA, torch on CPU; triton on CPU needs "
                            "TRITON_INTERPRET=1 (default: auto)")
    group.add_argument("--batch-invariant", dest="batch_invariant", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="a token's results never depend on its batch: the Triton matmul on CUDA (slower); "
                            "--no-batch-invariant runs oneDNN's matmuls and SDPA on the CPU, which on the "
                            "Zen 5 test machine took 2.1x as long on offline-64 (bench/invariance_cost.py) "
                            "(default: on for the CPU, off on CUDA)")
    group.add_argument("--cpu-attention", dest="cpu_attention", choices=CPU_ATTENTION_CHOICES, default="auto",
                       help="the CPU attention kernel: auto (bfloat16 in avx512bf16 where the CPU has AVX-512 BF16, "
                            "else avx512, else avx2, else portable: the same bits); amx (AMX-BF16: 0.62x "
                            "avx512's wall of 8 x 3,000-token prompts on a Xeon) and avx512bf16 (AVX-512 BF16 dot "
                            "products: 0.71-0.76x on a Zen 5) take bfloat16, each with its own bits, batch-invariant "
                            "still: replicas that must agree run the same one on all machines; avx512, avx2 or portable "
                            "(default: auto)")
    group.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="none",
                       help="int8: weight-only int8 linear layers and head, per-channel scales computed at load; "
                            "about half the weight bytes per step. int4: the linear layers in 4 bits (a scale per "
                            "32 inputs), the head in int8; about a third of the bytes, the fastest decode at "
                            "few sequences. Both batch-invariant (CPU only; default: none)")
    group.add_argument("--skinny-rows", dest="skinny_rows", type=_skinny_rows, default=None, metavar="N",
                       help="steps of at most N tokens run the skinny Triton linear kernels (norms, residual "
                            "adds and SiLU folded in); 0 = never (default: measured per device; CUDA only, "
                            "not with --batch-invariant)")
    group.add_argument("--weights-cache", dest="weights_cache", default=None, metavar="DIR",
                       help="keep converted weights here, so later starts load in seconds "
                            "(default: $JITNEY_WEIGHTS_CACHE or ~/.cache/jitney/weights)")
    group.add_argument("--draft-model", dest="draft_model", type=_model_path, default=None, metavar="PATH",
                       help="speculative decoding's draft model (needs --speculative draft): a small HF folder or "
                            ".gguf file sharing the model's tokenizer, run by the worker with its own KV cache")
    group.add_argument("--max-loras", dest="max_loras", type=non_negative_int, default=0, metavar="N",
                       help="LoRA adapter slots resident at once (default 0: LoRA off)")
    group.add_argument("--max-lora-rank", dest="max_lora_rank", type=positive_int, default=16, metavar="R",
                       help="the largest LoRA rank a slot holds, 1..256 (default 16)")
    group.add_argument("--draft-num-blocks", dest="draft_num_blocks", type=positive_int, default=None, metavar="N",
                       help="KV-cache blocks of the draft model (default: as many as the model's cache)")
    group.add_argument("--no-weights-cache", dest="use_weights_cache", action="store_false",
                       help="always convert the model from its files; write no cache")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of one rank of a tensor-parallel group (`jitney worker` only:
    `jitney serve --tensor-parallel-size N` passes them to the ranks it starts)."""
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument("--tp-rank", dest="tp_rank", type=non_negative_int, default=0,
                       help="this worker's rank in its tensor-parallel group; rank 0 connects to the scheduler "
                            "and relays plans to the others (default 0)")
    group.add_argument("--tp-size", dest="tp_size", type=positive_int, default=1,
                       help="ranks in the group: the model's heads and MLP are split N ways (default 1)")
    group.add_argument("--dist-init", dest="dist_init", default=None, metavar="tcp://HOST:PORT",
                       help="the group's torch.distributed rendezvous; rank 0 listens on it "
                            "(required with --tp-size > 1)")
    add_dist_timeout_argument(group)


def add_dist_timeout_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--dist-timeout``: `jitney worker`'s, and `jitney serve`'s, which passes it to its ranks."""
    parser.add_argument("--dist-timeout", dest="dist_timeout", type=positive_float, default=300.0,
                        metavar="SECONDS",
                        help="tensor parallelism: longest wait for the group to form or for one collective "
                             "(default 300; --hang-timeout ends hangs while serving sooner)")
