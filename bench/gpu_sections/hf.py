"""The transformers baseline: its continuous batching on the same card and the same requests."""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_sections.plumbing import Run, dtype_name, free_device_memory, load_items, log, version_of

if TYPE_CHECKING:
    from jitney.client.bench import WorkItem


def _kwargs_for(func: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``func`` accepts (transformers' API moves between 5.x releases)."""
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def hf_manager(model: Any, items: list[WorkItem]) -> Any:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(i.max_tokens for i in items), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    hints: Any = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(i.prompt_token_ids) for i in items),
                              max_generated_length=max(i.max_tokens for i in items), num_requests=len(items))
    except (ImportError, TypeError):
        pass
    init = model.init_continuous_batching
    return init(**_kwargs_for(init, generation_config=config, workload_hints=hints,
                              continuous_batching_config=hf_cpu_config(items, model)))


def hf_cpu_config(items: list[WorkItem], model: Any) -> Any:
    """On CPU a small paged cache (its default takes a share of all host memory: seconds to allocate).
    On CUDA None: transformers sizes it, as generate_batch does."""
    if model.device.type == "cuda":
        return None
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    pages = sum(math.ceil((len(i.prompt_token_ids) + i.max_tokens) / 256) for i in items) + 8
    return ContinuousBatchingConfig(**_kwargs_for(ContinuousBatchingConfig, num_blocks=pages, page_size=256,
                                                  max_batch_tokens=512))


def hf_generate(manager: Any, items: list[WorkItem], deadline: float) -> tuple[float, dict[str, int]]:
    """Add every request, collect every result; (wall, tokens per request id)."""
    produced: dict[str, int] = {}
    started = time.perf_counter()
    for item in items:
        manager.add_request(**_kwargs_for(manager.add_request, input_ids=item.prompt_token_ids,
                                          request_id=item.id, max_new_tokens=item.max_tokens, eos_token_id=-1))
    while len(produced) < len(items):
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers continuous batching: {len(produced)}/{len(items)} done at the budget")
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread ended early")
            continue
        if result.is_finished():
            if getattr(result, "error", None):
                raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
            produced[result.request_id] = len(result.generated_tokens)
    return time.perf_counter() - started, produced


def run_hf(model_dir: Path, items: list[WorkItem], run: Run) -> dict[str, Any]:
    """transformers' continuous batching on the same requests: greedy, no EOS, per-request max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype_name(run.args)))
    model = model.to(run.args.device).eval()
    manager = hf_manager(model, items)
    warmup_s = 0.0
    try:
        with torch.no_grad():   # as generate_batch runs it
            if hasattr(manager, "warmup"):   # builds the batch processor, captures CUDA graphs
                started = time.perf_counter()
                manager.warmup()
                warmup_s = time.perf_counter() - started
            manager.start()
            wall, produced = hf_generate(manager, items, time.monotonic() + run.budget.left())
    finally:
        # hard_stop: nothing is pending after a full run; after a timeout, do not wait for the rest.
        manager.stop(**_kwargs_for(manager.stop, block=True, timeout=30, hard_stop=True))
        del model
        free_device_memory(run.args)
    want = {i.id: i.max_tokens for i in items}
    output_tokens = sum(min(produced.get(k, 0), v) for k, v in want.items())
    return {"case": "transformers continuous batching", "requests": len(items),
            "completed": sum(produced.get(k) == v for k, v in want.items()), "wall_s": wall,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / wall if wall > 0 else 0.0,
            "warmup_s": warmup_s, "per_request_max_new_tokens": True}


def section_hf(shape: str, model: Path, run: Run) -> None:
    if run.args.no_hf:
        run.skip(f"{shape} hf", "--no-hf")
        return
    if not run.budget.allows(run.args.hf_reserve_s):
        run.skip(f"{shape} hf", f"{run.budget.left():.0f} s left of the budget")
        return
    log(f"== {shape} transformers continuous batching ({version_of('transformers')})")
    try:
        row = run_hf(model, load_items(run.args, "offline-64.jsonl"), run)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is skipped with its reason
        run.skip(f"{shape} hf", f"{type(exc).__name__}: {str(exc)[:500]}")
        return
    run.shape(shape)["hf"] = row
    log(f"   wall {row['wall_s']:.2f} s, {row['completed']}/{row['requests']} completed "
        f"(warm-up {row['warmup_s']:.1f} s, not timed)")
