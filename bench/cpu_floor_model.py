"""bench/cpu_floor.py's FLOP and byte model: what a workload, a request and each traced step must compute and read.

Counted from a model's config (the worker's ``ModelConfig``) and a workload's requests or a run's step
trace, with nothing measured: the measured peak and read rate (``bench/cpu_floor_measure.py``) turn
these counts into floor seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jitney.client.bench import WorkItem
from jitney.worker.models.llama import ModelConfig


# ---------------------------------------------------------------- FLOPs

def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """The model's matmuls as ``(name, in_features, out_features, uses per token)``: each
    layer's fused qkv, o, gate_up and down (``num_layers`` uses), and the head (one use)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    return [("qkv_proj", h, q + 2 * kv, n), ("o_proj", q, h, n), ("gate_up_proj", h, 2 * i, n),
            ("down_proj", i, h, n), ("lm_head", h, cfg.vocab_size, 1)]


def weight_count(cfg: ModelConfig, head: bool = True) -> int:
    """Linear weights a token meets: every layer's, and the head's unless ``head`` is False."""
    return sum(k * n * uses for name, k, n, uses in linear_shapes(cfg) if head or name != "lm_head")


def attention_flops_per_key(cfg: ModelConfig) -> int:
    """FLOPs of one query-key pair over all layers: QK^T and PV, 2 per multiply-add, every head."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of one token's K and V in every layer, ``dtype_bytes`` a value (2: bf16)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def request_flops(cfg: ModelConfig, prompt_tokens: int, max_tokens: int) -> dict[str, int]:
    """Matmul FLOPs of one greedy request of ``prompt_tokens`` + ``max_tokens`` tokens, none cached.

    Positions computed: every prompt token and every output token but the last
    (it is sampled, never fed back): P + M - 1. Each costs 2 x the layers'
    linear weights (bias adds not counted). The head runs only where a token
    is sampled: the prompt's last position and the M - 1 decodes, M in all.
    Attention, causal: the token at position p attends p + 1 keys, 4 x keys x
    heads x head_dim per layer (QK^T and PV, 2 FLOPs a multiply-add each).
    """
    positions = max(0, prompt_tokens + max_tokens - 1)
    keys = positions * (positions + 1) // 2
    return {"positions": positions,
            "linear": 2 * weight_count(cfg, head=False) * positions,
            "head": 2 * cfg.hidden_size * cfg.vocab_size * max_tokens,
            "attention": attention_flops_per_key(cfg) * keys}


def workload_flops(cfg: ModelConfig, items: Iterable[WorkItem]) -> dict[str, Any]:
    """``request_flops`` summed over a workload, plus ``total`` and the matmul FLOPs ``by_shape``."""
    out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "positions": 0, "linear": 0,
                           "head": 0, "attention": 0}
    for item in items:
        out["requests"] += 1
        out["prompt_tokens"] += len(item.prompt_token_ids)
        out["output_tokens"] += item.max_tokens
        for key, value in request_flops(cfg, len(item.prompt_token_ids), item.max_tokens).items():
            out[key] += value
    out["total"] = out["linear"] + out["head"] + out["attention"]
    # The same matmul FLOPs by shape: each layer shape on every position, the head where one samples.
    out["by_shape"] = {name: 2 * k * n * uses * (out["positions"] if name != "lm_head" else out["output_tokens"])
                       for name, k, n, uses in linear_shapes(cfg)}
    return out


def workload_bytes(cfg: ModelConfig, items: Iterable[WorkItem], dtype_bytes: int = 2) -> dict[str, Any]:
    """Bytes a workload's decodes must read from memory at the least, with weights and cache in
    ``dtype_bytes`` (2: bf16).

    Each decode step reads every linear weight once (the layers' and the head's), whatever its
    batch; a request of M output tokens is M - 1 decode steps after its prefill, one after another,
    so a run takes at least max(M) - 1 of them. Each decode at position p reads the K and V of
    its p keys before it in every layer. Prefill steps (compute-bound) and activations are not
    counted: this is a lower bound on the bytes, as the FLOP count is on the arithmetic.
    """
    weights = dtype_bytes * weight_count(cfg)
    kv_per_token = kv_bytes_per_token(cfg, dtype_bytes)
    steps = keys = 0
    for item in items:
        prompt, m = len(item.prompt_token_ids), item.max_tokens
        steps = max(steps, m - 1)
        # decode j (1 .. m - 1) feeds the token at position prompt + j - 1, attending prompt + j keys
        keys += sum(prompt + j for j in range(1, m))
    return {"weights_per_step": weights, "decode_steps": steps, "weights": weights * steps,
            "kv_per_token": kv_per_token, "kv": kv_per_token * keys, "total": weights * steps + kv_per_token * keys}


def weight_bytes_split(cfg: ModelConfig, kind: str = "bf16") -> tuple[int, int]:
    """Bytes of the layers' linear weights and of the head's: bf16 two a weight; int8 one a
    weight and a float32 scale an output channel (``cpu_kernels.Int8Linear``; the head is int8 too)."""
    if kind not in ("bf16", "int8"):
        raise ValueError(f"unknown weight kind {kind!r}")
    sizes = {name: (2 * k * n if kind == "bf16" else k * n + 4 * n) * uses for name, k, n, uses in linear_shapes(cfg)}
    head = sizes.pop("lm_head")
    return sum(sizes.values()), head


def weight_bytes(cfg: ModelConfig, kind: str = "bf16") -> int:
    """Bytes of every linear weight a decode step reads (the layers' and the head's), ``weight_bytes_split``."""
    return sum(weight_bytes_split(cfg, kind))


PROMPT_GROUP = "with prompt work"
# decode-only steps by their number of sequences: (group, the least it holds)
DECODE_GROUPS: tuple[tuple[str, int], ...] = (("decode, 32+ sequences", 32), ("decode, 8-31 sequences", 8),
                                              ("decode, 1-7 sequences", 1))


def step_floors(cfg: ModelConfig, steps: Iterable[dict[str, Any]], peak_gflops: float,
                rate_gbs: float, weight_kind: str = "bf16") -> dict[str, Any]:
    """Each step of a run's trace (``jitney serve --trace``) against its own floor: the larger of
    its FLOPs at ``peak_gflops`` and its bytes at ``rate_gbs``, with ``weight_kind`` weights
    (``weight_bytes_split``; the K/V cache is bf16 either way).

    A step's FLOPs: 2 x the layers' weights per token computed, 2 x the head's per sampled row
    (``samples``), 4 x heads x head_dim x layers per query-key pair (``attended_keys``). Its bytes:
    the layers' weights once, whatever its batch, the head's where it samples, and the K/V of each
    chunk's sequence up to the chunk's end (``context_tokens``) in every layer; activations left
    out. A lower bound on each step's time, so their sum bounds the run's model time from below
    under the run's own step plan.

    ``phases_s``: a tighter bound that still holds. A step's linears, its attention and its head
    run one after another (each op on every thread, none overlapping another), so the step takes
    at least the sum of the three phases' floors, each the larger of that phase's FLOPs at the
    peak and its bytes at the rate: a 64-sequence decode cannot hide attention's K/V stream under
    the linears' arithmetic. (Within the linears, every layer weight meets the same rows, so
    their FLOPs and bytes keep one ratio and one floor covers them.)

    Steps without seats (ones that only free) are skipped. Grouped: the steps with prompt work
    (``PROMPT_GROUP``), and the decode-only steps by their number of sequences (``DECODE_GROUPS``)."""
    layer_params = weight_count(cfg, head=False)
    head_params = cfg.hidden_size * cfg.vocab_size
    layer_bytes, head_bytes = weight_bytes_split(cfg, weight_kind)
    attention = attention_flops_per_key(cfg)
    kv_per_token = kv_bytes_per_token(cfg)
    flop_s, byte_s = 1 / (peak_gflops * 1e9), 1 / (rate_gbs * 1e9)
    groups: dict[str, dict[str, Any]] = {
        name: {"group": name, "steps": 0, "model_s": 0.0, "floor_s": 0.0, "phases_s": 0.0, "flops_bound": 0}
        for name in (PROMPT_GROUP, *(n for n, _ in DECODE_GROUPS))}
    for step in steps:
        if not step["seats"]:
            continue
        tokens = step["prefill_tokens"] + step["decode_tokens"]
        # (FLOPs, bytes) of each phase; no head where nothing samples
        phases = [(2 * layer_params * tokens, layer_bytes),
                  (2 * head_params * step["samples"], head_bytes if step["samples"] else 0),
                  (attention * step["attended_keys"], kv_per_token * step["context_tokens"])]
        flops_s = sum(f for f, _ in phases) * flop_s
        bytes_s = sum(b for _, b in phases) * byte_s
        if step["prefill_tokens"]:
            name = PROMPT_GROUP
        else:
            name = next(n for n, least in DECODE_GROUPS if step["decode_tokens"] >= least)
        g = groups[name]
        g["steps"] += 1
        g["model_s"] += step["model_s"]
        g["floor_s"] += max(flops_s, bytes_s)
        g["phases_s"] += sum(max(f * flop_s, b * byte_s) for f, b in phases)
        g["flops_bound"] += flops_s >= bytes_s
    rows = [g for g in groups.values() if g["steps"]]
    return {"peak_gflops": peak_gflops, "rate_gbs": rate_gbs, "groups": rows,
            "steps": sum(g["steps"] for g in rows), "model_s": sum(g["model_s"] for g in rows),
            "floor_s": sum(g["floor_s"] for g in rows), "phases_s": sum(g["phases_s"] for g in rows)}


def model_config(model: str | None) -> ModelConfig:
    """The worker's ModelConfig of ``model`` (None: the bundled default), read as the worker reads it."""
    from jitney.common.model_files import resolve_model
    from jitney.worker.loading.loader import load_hf_config, model_config_from_hf

    return model_config_from_hf(load_hf_config(resolve_model(model)))
