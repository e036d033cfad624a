"""LoRA adapters in the worker: outputs equal PEFT's, a mixed batch equals each row
alone (through the CPU's C++ layer stack, which gives the op-by-op path's bits), loads
replace a slot whole, a failed load names the adapter, start refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.config import WorkerConfig
from jitney.worker.models.llama import DecoderLayer
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.runner_driver import BLOCK, NUM_BLOCKS, PROMPTS, LoraDriver
from tests.support.tiny_lora import ATTENTION, MLP, make_peft_adapter, peft_reference
from tests.support.tiny_models import make_tiny_llama, make_tiny_phi3, make_tiny_qwen3

STEPS = 6


class LoggingLoraDriver(LoraDriver):
    """The LoRA driver recording each sampled token's logprob (its logits' bits, in effect)."""

    def __init__(self, runner: ModelRunner, slots: dict[int, int], loads: list[tuple[int, str, Path]]) -> None:
        super().__init__(runner, slots, loads)
        self.logprobs: dict[int, list[float]] = {}

    def step(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> dict[int, int]:
        result = self.runner.execute(self.plan(budget, freed))
        for sid, token, logprob in zip(result.seq_ids, result.token_ids, result.logprobs):
            self.seqs[sid].tokens.append(token)
            self.logprobs.setdefault(sid, []).append(logprob)
        return dict(zip(result.seq_ids, result.token_ids))


def _op_by_op(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a layer ran op by op")


@pytest.fixture
def stack_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step through the C++ layer stack: running a layer op by op fails the test."""
    monkeypatch.setattr(DecoderLayer, "forward", _op_by_op)


def _config(model: Path, dtype: str = "float32", max_loras: int = 3, rank: int = 16) -> WorkerConfig:
    return WorkerConfig(model=str(model), dtype=dtype, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=64, max_num_seqs=8, max_loras=max_loras, max_lora_rank=rank)


def _generate(runner: ModelRunner, sids: list[int], slots: dict[int, int], loads: list[tuple[int, str, Path]],
              chunk: int = 64, steps: int = STEPS) -> LoggingLoraDriver:
    driver = LoggingLoraDriver(runner, slots, loads)
    for sid in sids:
        driver.add(sid, PROMPTS[sid])
    driver.generate(sids, steps, chunk=chunk)
    return driver


def _peft_greedy(base: Path, adapter: Path, prompt: list[int]) -> list[int]:
    model: Any = peft_reference(base, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("lora") / "llama")


@pytest.fixture(scope="module")
def adapters(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all16": make_peft_adapter(llama, root / "all16", rank=16, alpha=32, seed=1),
        "attn4": make_peft_adapter(llama, root / "attn4", rank=4, alpha=8, targets=ATTENTION, seed=2),
        "mlp8": make_peft_adapter(llama, root / "mlp8", rank=8, alpha=4, targets=MLP, seed=3),
        "pattern": make_peft_adapter(llama, root / "pattern", rank=8, alpha=16, seed=4,
                                     rank_pattern={"q_proj": 4, "down_proj": 12}, alpha_pattern={"v_proj": 3.0}),
    }


@pytest.mark.parametrize("name", ["all16", "attn4", "mlp8", "pattern"])
@pytest.mark.usefixtures("stack_only")
def test_llama_matches_peft(llama: Path, adapters: dict[str, Path], name: str) -> None:
    runner = ModelRunner(_config(llama))
    driver = _generate(runner, [1, 2], {1: 1}, [(1, name, adapters[name])])
    tokens = driver.seqs[1].tokens[len(PROMPTS[1]):]
    assert tokens == _peft_greedy(llama, adapters[name], PROMPTS[1])
    # the adapter changes the output (else the comparison tests nothing), the base row is the base model's
    base = _generate(ModelRunner(_config(llama)), [1, 2], {}, [])
    assert tokens != base.seqs[1].tokens[len(PROMPTS[1]):]
    assert driver.seqs[2].tokens == base.seqs[2].tokens


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
@pytest.mark.usefixtures("stack_only")
def test_other_families_match_peft(tmp_path: Path, family: str) -> None:
    base = (make_tiny_qwen3 if family == "qwen3" else make_tiny_phi3)(tmp_path / family)
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if family == "phi3" else ATTENTION + MLP
    adapter = make_peft_adapter(base, tmp_path / "adapter", rank=8, alpha=16, targets=targets, seed=5)
    runner = ModelRunner(_config(base))
    assert {m.name for m in runner.ready_message().lora_modules} == set(targets)
    driver = _generate(runner, [1], {1: 2}, [(2, "a", adapter)])
    assert driver.seqs[1].tokens[len(PROMPTS[1]):] == _peft_greedy(base, adapter, PROMPTS[1])


def test_ready_lists_llama_modules(llama: Path) -> None:
    ready = ModelRunner(_config(llama, max_loras=2, rank=8)).ready_message()
    assert (ready.max_loras, ready.max_lora_rank) == (2, 8)
    h, q, kv, inter = 64, 64, 32, 144
    assert [(m.name, m.in_features, m.out_features, m.num_layers) for m in ready.lora_modules] == [
        ("q_proj", h, q, 2), ("k_proj", h, kv, 2), ("v_proj", h, kv, 2), ("o_proj", q, h, 2),
        ("gate_proj", h, inter, 2), ("up_proj", h, inter, 2), ("down_proj", inter, h, 2)]
    off = ModelRunner(_config(llama, max_loras=0)).ready_message()
    assert (off.max_loras, list(off.lora_modules)) == (0, [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("stack_only")
def test_mixed_batch_equals_each_alone(llama: Path, adapters: dict[str, Path], dtype: str) -> None:
    """Base rows and three adapters in one batch, chunked prefill beside decodes: every
    row's tokens and logprobs equal the row run alone in one chunk, bit for bit."""
    loads = [(1, "all16", adapters["all16"]), (2, "attn4", adapters["attn4"]), (3, "pattern", adapters["pattern"])]
    slots = {1: 1, 2: 0, 3: 2}
    # (chunks of 5: the longest prompt takes 5 steps before its first token)
    together = _generate(ModelRunner(_config(llama, dtype)), [1, 2, 3], slots, loads, chunk=5, steps=STEPS + 5)
    for sid in (1, 2, 3):
        alone = _generate(ModelRunner(_config(llama, dtype)), [sid], slots, loads)
        n = len(alone.logprobs[sid])
        assert together.seqs[sid].tokens[: len(alone.seqs[sid].tokens)] == alone.seqs[sid].tokens, sid
        assert together.logprobs[sid][:n] == alone.logprobs[sid], sid
    # the third adapter, in chunks of 3 beside others
    mixed = _generate(ModelRunner(_config(llama, dtype)), [1, 2, 3], {1: 3, 3: 1}, loads, chunk=3, steps=STEPS + 8)
    alone = _generate(ModelRunner(_config(llama, dtype)), [1], {1: 3}, loads)
    assert mixed.logprobs[1][: len(alone.logprobs[1])] == alone.logprobs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_gives_the_op_by_op_bits(llama: Path, adapters: dict[str, Path], dtype: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Base rows and three adapters in chunks beside decodes, through the C++ stack and
    op by op from Python (layers/program.py's run): every token and logprob the same bits."""
    loads = [(1, "all16", adapters["all16"]), (2, "mlp8", adapters["mlp8"]), (3, "pattern", adapters["pattern"])]
    runs = []
    for stack in (True, False):
        runner = ModelRunner(_config(llama, dtype))
        runner.model.use_layer_stack = stack
        assert runner.model.layer_stack(runner.cache) is not None
        with monkeypatch.context() as patch:
            if stack:
                patch.setattr(DecoderLayer, "forward", _op_by_op)
            runs.append(_generate(runner, [1, 2, 3], {1: 1, 2: 3, 3: 2}, loads, chunk=4, steps=STEPS + 6))
    for sid in (1, 2, 3):
        assert runs[0].seqs[sid].tokens == runs[1].seqs[sid].tokens, sid
    assert runs[0].logprobs == runs[1].logprobs


def test_a_load_reaches_the_stack(llama: Path, adapters: dict[str, Path]) -> None:
    """The stack holds the slots' own tensors: a slot loaded after the stack was made is used."""
    runner = ModelRunner(_config(llama, "bfloat16"))
    stack = runner.model.layer_stack(runner.cache)
    assert stack is not None
    late = _generate(runner, [1], {1: 2}, [(2, "attn4", adapters["attn4"])])
    assert runner.model.layer_stack(runner.cache) is stack
    fresh = ModelRunner(_config(llama, "bfloat16"))
    fresh.model.use_layer_stack = False
    assert late.logprobs == _generate(fresh, [1], {1: 2}, [(2, "attn4", adapters["attn4"])]).logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reload_replaces_slot(llama: Path, adapters: dict[str, Path], dtype: str) -> None:
    """A slot reloaded in place after steps ran: the next step (through the C++ stack, whose
    bf16 kernel keeps each slot's adapters in its own layout) uses the new adapter."""
    runner = ModelRunner(_config(llama, dtype))
    _generate(runner, [1], {1: 1}, [(1, "all16", adapters["all16"])])
    runner.execute(pb.StepPlan(step_id=100, reset=True))
    assert runner.lora is not None
    runner.lora.load(1, "attn4", str(adapters["attn4"]))
    for (layer, module), a in runner.lora.a.items():
        b = runner.lora.b[(layer, module)]
        if module not in ATTENTION:
            assert not a[1].any() and not b[1].any(), module
        assert not a[1, 4:].any() and not b[1, :, 4:].any(), module   # rank 4 after 16: no residue
    after = _generate(runner, [1], {1: 1}, [])
    fresh = _generate(ModelRunner(_config(llama, dtype)), [1], {1: 1}, [(1, "attn4", adapters["attn4"])])
    assert after.logprobs[1] == fresh.logprobs[1]


def test_failed_load_names_adapter(llama: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    runner = ModelRunner(_config(llama))
    assert runner.lora is not None
    runner.lora.load(2, "all16", str(adapters["all16"]))
    plan = pb.StepPlan(step_id=0)
    plan.lora_loads.add(slot=2, name="gone", path=str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"LoRA adapter 'gone' \(.*missing\)"):
        runner.execute(plan)
    assert all(not a[2].any() for a in runner.lora.a.values()) and 2 not in runner.lora.names


def test_plan_with_slot_beyond_max_is_refused(llama: Path) -> None:
    from jitney.worker.runner.plan_checks import PlanError

    runner = ModelRunner(_config(llama, max_loras=1))
    plan = pb.StepPlan(step_id=0)
    plan.new_sequences.add(seq_id=1, lora_slot=2)
    with pytest.raises(PlanError, match="lora_slot 2"):
        runner.execute(plan)


def test_start_refusals(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensor parallelism"):
        WorkerConfig(model=str(llama), max_loras=1, tp_size=2, dist_init="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="max_lora_rank"):
        WorkerConfig(model=str(llama), max_loras=1, max_lora_rank=300)
    from tests.support.tiny_hf_models import make_tiny_hf

    fallback = make_tiny_hf(tmp_path / "starcoder2", "starcoder2")
    with pytest.raises(ValueError, match="transformers fallback"):
        ModelRunner(_config(fallback))
