"""The parallel linears load their own part of each checkpoint tensor
(``layers/linear.py``), and a model loads from separate or already-fused
q/k/v and gate/up tensors alike (``models/weights.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jitney.worker.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                         ReplicatedLinear, RowParallelLinear, Shard)
from jitney.worker.models.llama import STACKED
from jitney.worker.models.weights import load_checkpoint

GEN = torch.Generator().manual_seed(3)
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 16, 4, 4, 2, 24


def _filled(layer: torch.nn.Module) -> torch.nn.Module:
    """``layer`` with real, NaN-filled parameters: a part left unloaded shows."""
    for name, param in list(layer.named_parameters()):
        setattr(layer, name, torch.nn.Parameter(torch.full(param.shape, float("nan")), requires_grad=False))
    return layer


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def _load(layer: torch.nn.Module, name: str, leaf: str, loaded: object, part: object = None) -> None:
    with torch.no_grad():
        layer.weight_loader(name, leaf, loaded, part)  # type: ignore[operator]


@pytest.mark.parametrize("size", [1, 2])
def test_qkv_ranks_take_their_heads_from_separate_and_fused_tensors(size: int) -> None:
    q, k, v = _rand(HEADS * HEAD_DIM, HIDDEN), _rand(KV_HEADS * HEAD_DIM, HIDDEN), _rand(KV_HEADS * HEAD_DIM, HIDDEN)
    qb, kb, vb = _rand(HEADS * HEAD_DIM), _rand(KV_HEADS * HEAD_DIM), _rand(KV_HEADS * HEAD_DIM)
    for rank in range(size):
        made = [_filled(QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS // size, KV_HEADS // size, bias=True,
                                          shard=Shard(rank, size))) for _ in range(2)]
        separate, fused = made
        for part, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            _load(separate, f"{part}_proj.weight", "weight", w, part)
            _load(separate, f"{part}_proj.bias", "bias", b, part)
        _load(fused, "qkv_proj.weight", "weight", torch.cat((q, k, v)))
        _load(fused, "qkv_proj.bias", "bias", torch.cat((qb, kb, vb)))
        qw, kw = HEADS // size * HEAD_DIM, KV_HEADS // size * HEAD_DIM
        expected = torch.cat((q[rank * qw:(rank + 1) * qw], k[rank * kw:(rank + 1) * kw], v[rank * kw:(rank + 1) * kw]))
        expected_bias = torch.cat((qb[rank * qw:(rank + 1) * qw], kb[rank * kw:(rank + 1) * kw],
                                   vb[rank * kw:(rank + 1) * kw]))
        for layer in made:
            assert torch.equal(layer.weight, expected) and torch.equal(layer.bias, expected_bias)


def test_column_and_row_shards_cover_each_tensor_once() -> None:
    gate, up, down = _rand(INTER, HIDDEN), _rand(INTER, HIDDEN), _rand(HIDDEN, INTER)
    down_bias, col = _rand(HIDDEN), _rand(INTER, HIDDEN)
    merged, rows, cols = [], [], []
    for rank in range(2):
        shard = Shard(rank, 2)
        m = _filled(MergedColumnParallelLinear(HIDDEN, (INTER // 2, INTER // 2), bias=False, shard=shard))
        _load(m, "up_proj.weight", "weight", up, 1)       # any order
        _load(m, "gate_proj.weight", "weight", gate, 0)
        r = _filled(RowParallelLinear(INTER // 2, HIDDEN, bias=True, shard=shard))
        _load(r, "down_proj.weight", "weight", down)
        _load(r, "down_proj.bias", "bias", down_bias)
        c = _filled(ColumnParallelLinear(HIDDEN, (INTER // 2,), bias=False, shard=shard))
        _load(c, "c.weight", "weight", col)
        merged.append(m)
        rows.append(r)
        cols.append(c)
    half = INTER // 2
    assert torch.equal(torch.cat([m.weight[:half] for m in merged]), gate)
    assert torch.equal(torch.cat([m.weight[half:] for m in merged]), up)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), down)
    assert torch.equal(rows[0].bias, down_bias) and not rows[1].bias.any()   # added once, by rank 0
    assert torch.equal(torch.cat([c.weight for c in cols]), col)
    x = _rand(3, INTER)
    partial = sum(r(x[:, i * half:(i + 1) * half]) for i, r in enumerate(rows))
    torch.testing.assert_close(partial, torch.nn.functional.linear(x, down, down_bias))


def test_a_wrong_shape_is_refused_naming_the_tensor() -> None:
    layer = _filled(QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS // 2, KV_HEADS // 2, bias=False, shard=Shard(0, 2)))
    with pytest.raises(ValueError, match=r"k_proj.weight: shape \(4, 16\), expected \(8, 16\)"):
        _load(layer, "k_proj.weight", "weight", _rand(4, HIDDEN), "k")
    with pytest.raises(ValueError, match=r"o.weight: shape \(16, 8\), expected \(16, 16\)"):
        _load(_filled(RowParallelLinear(8, HIDDEN, bias=False, shard=Shard(1, 2))), "o.weight", "weight",
              _rand(HIDDEN, 8))


def test_safetensors_slices_read_only_a_ranks_part(tmp_path: Path) -> None:
    down, q = _rand(HIDDEN, INTER), _rand(HEADS * HEAD_DIM, HIDDEN)
    save_file({"down": down, "q": q}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu") as f:
        row = _filled(RowParallelLinear(INTER // 2, HIDDEN, bias=False, shard=Shard(1, 2)))
        _load(row, "down", "weight", f.get_slice("down"))
        qkv = _filled(QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS // 2, KV_HEADS // 2, bias=False, shard=Shard(1, 2)))
        _load(qkv, "q", "weight", f.get_slice("q"), "q")
    assert torch.equal(row.weight, down[:, INTER // 2:])
    assert torch.equal(qkv.weight[:HEADS // 2 * HEAD_DIM], q[HEADS // 2 * HEAD_DIM:])


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False)
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, (INTER, INTER), bias=False)
        self.norm = torch.nn.LayerNorm(HIDDEN, elementwise_affine=True, bias=False)
        self.head = ReplicatedLinear(HIDDEN, 8, bias=False)


def test_a_model_loads_from_separate_or_fused_tensors_and_names_what_is_missing() -> None:
    tensors = {"m.q_proj.weight": _rand(HEADS * HEAD_DIM, HIDDEN), "m.k_proj.weight": _rand(KV_HEADS * HEAD_DIM, HIDDEN),
               "m.v_proj.weight": _rand(KV_HEADS * HEAD_DIM, HIDDEN), "m.gate_proj.weight": _rand(INTER, HIDDEN),
               "m.up_proj.weight": _rand(INTER, HIDDEN), "m.norm.weight": _rand(HIDDEN), "m.head.weight": _rand(8, HIDDEN),
               "m.extra": _rand(2)}
    fused = {"m.qkv_proj.weight": torch.cat([tensors[f"m.{p}_proj.weight"] for p in "qkv"]),
             "m.gate_up_proj.weight": torch.cat([tensors["m.gate_proj.weight"], tensors["m.up_proj.weight"]]),
             **{k: tensors[k] for k in ("m.norm.weight", "m.head.weight")}}
    loaded = []
    for source in (tensors, fused):
        with torch.device("meta"):
            model = torch.nn.Module()
            model.m = _Block()
        unused = load_checkpoint(model, source.items(), STACKED, torch.float32, torch.device("cpu"))
        assert unused == (["m.extra"] if source is tensors else [])
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])
    assert torch.equal(loaded[0]["m.qkv_proj.weight"], fused["m.qkv_proj.weight"])
    with torch.device("meta"):
        model = torch.nn.Module()
        model.m = _Block()
    partial = {k: v for k, v in tensors.items() if k not in ("m.k_proj.weight", "m.norm.weight")}
    with pytest.raises(ValueError, match=r"checkpoint lacks m\.k_proj\.weight, m\.norm\.weight"):
        load_checkpoint(model, partial.items(), STACKED, torch.float32, torch.device("cpu"))
