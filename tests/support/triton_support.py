"""What the Triton kernel tests share.

Triton picks interpreted or compiled when a kernel is *decorated*, i.e. when
its module is first imported: ``interpret_without_cuda`` sets
``TRITON_INTERPRET=1`` on a machine without CUDA before the test module
imports its kernels (nothing imported earlier in a session imports them).
``compile_for_gpus`` lowers kernels to PTX for Ampere and Hopper in a fresh
process, which the interpreter cannot check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# ``build(fn, types, consts, arch)``: compile one kernel for one architecture.
_BUILD = '''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, consts, arch):
    names = fn.arg_names
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", arch, 32))
'''


def interpret_when_no_cuda() -> None:
    """Where there is no CUDA, have Triton interpret what it decorates from now on, without
    importing it: for a module that imports Triton only in some tests, called before
    anything that may import it (transformers' masking_utils does), since Triton's own
    library functions are decorated when Triton is first imported."""
    if DEVICE.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpret_without_cuda() -> ModuleType:
    """Triton, interpreted where there is no CUDA; skips the module without Triton.

    Interpreted, ``tl.dot`` sums each output over K in order (``fixed_order_dot``)."""
    interpret_when_no_cuda()
    triton = pytest.importorskip("triton")
    if DEVICE.type == "cpu":
        from triton.runtime import interpreter

        interpreter.InterpreterBuilder.create_dot = fixed_order_dot
    return triton


def fixed_order_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """The interpreter's ``tl.dot`` (``InterpreterBuilder.create_dot``), every output
    element summed over K in order, in the accumulator's dtype, then added to it.

    The interpreter's own form is ``np.matmul``, i.e. the host's BLAS, whose
    sums can depend on where a row sits in the tile: numpy's OpenBLAS on an
    AMD Zen 5 (family 26) gives a tile's rows 6 and on other bits than the
    same row at row 0 (rows 0-5 agree), so the batch-invariance tests failed
    there for the BLAS, not for the kernel. In this form a row's sums depend
    on its own values only, on any host."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    acc = d.data.dtype
    x, y = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
            (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
        raise NotImplementedError("fp8 operands: the tests do not use them")
    x, y = x.astype(acc), y.astype(acc)
    out = np.zeros((*x.shape[:-1], y.shape[-1]), dtype=acc)
    for k in range(x.shape[-1]):
        out += x[..., :, k : k + 1] * y[..., k : k + 1, :]
    return TensorHandle(out + d.data, d.dtype.scalar)


def skip_unless_interpreted(triton: ModuleType) -> None:
    """Call after importing the kernels: on a CPU they must be interpreted."""
    if DEVICE.type == "cpu" and not triton.knobs.runtime.interpret:
        pytest.skip("the kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


def compile_for_gpus(body: str) -> None:
    """Run ``body`` (which calls ``build`` and ends by printing "compiled") without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _BUILD + body], env=env, capture_output=True, text=True,
                          timeout=480)   # a hang guard: ~220 s of compiles on 2 loaded cores
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
