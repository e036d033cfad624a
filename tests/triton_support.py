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


def interpret_without_cuda() -> ModuleType:
    """Triton, interpreted where there is no CUDA; skips the module without Triton."""
    if DEVICE.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return pytest.importorskip("triton")


def skip_unless_interpreted(triton: ModuleType) -> None:
    """Call after importing the kernels: on a CPU they must be interpreted."""
    if DEVICE.type == "cpu" and not triton.knobs.runtime.interpret:
        pytest.skip("the kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


def compile_for_gpus(body: str) -> None:
    """Run ``body`` (which calls ``build`` and ends by printing "compiled") without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _BUILD + body], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
