"""Pre-packed oneDNN linears (bf16, CPU) compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jitney.worker.kernels.cpu.packed import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                                reason="this torch build has no oneDNN linear packing")


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    x = torch.randn(rows, 64).bfloat16()
    expected = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    got = PackedLinear(weight, b)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # bf16 output: within bf16 rounding of the fp32 product.
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)
    # Each row is the same whatever else is in the batch.
    torch.testing.assert_close(PackedLinear(weight, b)(x[:1]), got[:1], atol=0, rtol=0)


def test_pack_linears_replaces_every_linear_and_keeps_outputs() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False))).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    before = net(x)
    assert pack_linears(net) == 2
    assert not any(isinstance(m, nn.Linear) for m in net.modules())
    torch.testing.assert_close(net(x).float(), before.float(), atol=0.05, rtol=0.02)


def test_only_bf16_on_cpu_is_packed() -> None:
    assert not packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("cuda"))
