"""A scripted worker on the engine link's ZeroMQ sockets, for in-process schedulers
(tests/support/door_harness.py, tests/scheduler/test_security.py).

Its plans go through the real worker's checks (``tests/support/fake_worker.py``);
its "model" spells ``PLAIN`` then EOS, or, in a chunk the scheduler marks as
grammar-masked, ``JSON_DOC``, and it never samples a token the mask forbids.
``make_tokenizer`` is a tokenizer for it (byte-level BPE, a ChatML template).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq.asyncio

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.worker_link import WorkerLink
from jitney.worker.runner.plan_checks import PlanLimits
from tests.support.engine_sockets import WorkerSockets
from tests.support.fake_worker import FakeWorker, PlanError

MODEL = "tiny-scripted"
VOCAB = 320
EOS = 2                          # <|im_end|>
BLOCK = 16
SEATS = 4
PLAIN = "hello jitney, tokens go in and tokens come out"
JSON_DOC = '{"answer": "yes"}'
SYSTEM = "you are a jitney: pick up passengers anywhere along the route, then drop them off"


def make_tokenizer(extra_special: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE of VOCAB tokens with a ChatML template (tests/support/tiny_models.py's, without torch);
    ``extra_special``: more special tokens, ids 3, 4, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([PLAIN, JSON_DOC, SYSTEM, "the quick brown fox jumps over the lazy dog"] * 20,
                            trainer=trainer)
    missing = VOCAB - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=list(extra_special))
    fast.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


READY = engine_pb2.Ready(
    protocol_version=engine_pb2.PROTOCOL_VERSION_2, model_name=MODEL, vocab_size=VOCAB,
    context_length=1024, eos_token_ids=[EOS], num_blocks=256, block_size=BLOCK, dtype="float32",
    device="cpu", worker_pid=0, max_num_seqs=SEATS, max_num_batched_tokens=256)


def allowed(mask: bytes, token: int) -> bool:
    """Bit ``token`` of a little-endian int32 bitmask row."""
    return bool(mask[token >> 3] >> (token & 7) & 1)


class ScriptedWorker(FakeWorker):
    """Each sequence samples its script in order (cycling); see the module docstring."""

    def __init__(self, tokenizer: Any, ready: engine_pb2.Ready = READY) -> None:
        self.ready = r = ready
        super().__init__(r.num_blocks, r.block_size, limits=PlanLimits(
            num_blocks=r.num_blocks, block_size=r.block_size, context_length=r.context_length,
            vocab_size=r.vocab_size, max_num_batched_tokens=r.max_num_batched_tokens,
            max_num_seqs=r.max_num_seqs), max_loras=r.max_loras)
        self.plain = tokenizer(PLAIN, add_special_tokens=False)["input_ids"] + [EOS]
        self.json = tokenizer(JSON_DOC, add_special_tokens=False)["input_ids"] + [EOS]
        # seq_id -> the position of its first sample: the script is read by output position, so a
        # grammar's forced run fed as input (engine.py's jump-forward) moves it on as samples would
        self.first_sample: dict[int, int] = {}
        self.top_n: dict[int, int] = {}
        self.masks: dict[int, bytes] = {}
        self.masked_samples = 0
        self.step_seconds = 0.0

    def run(self, plan: engine_pb2.StepPlan, masks: engine_pb2.StepMasks | None) -> engine_pb2.StepResult:
        for seq_id in plan.freed_seq_ids:
            self.first_sample.pop(seq_id, None)
        for new in plan.new_sequences:
            self.first_sample.pop(new.seq_id, None)
            self.top_n[new.seq_id] = new.sampling.top_logprobs
        self.masks = {}
        if masks is not None and masks.seq_ids:
            row = len(masks.bitmask) // len(masks.seq_ids)
            self.masks = {s: masks.bitmask[i * row:(i + 1) * row] for i, s in enumerate(masks.seq_ids)}
        result = self.execute(plan)
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            n = self.top_n.get(seq_id, 0)
            if n:   # the sampled token first, then the next ids
                result.top_token_ids.extend([token] + [(token + k) % VOCAB for k in range(1, n)])
                result.top_logprobs.extend([-0.25 - k for k in range(n)])
        return result

    def _run_chunk(self, chunk: engine_pb2.ScheduledChunk) -> int | None:
        if super()._run_chunk(chunk) is None:
            return None
        position = chunk.start_position + len(chunk.token_ids) + chunk.last_token_from_sample
        k = position - self.first_sample.setdefault(chunk.seq_id, position)
        script = self.json if chunk.masked else self.plain
        token = script[k % len(script)]
        if chunk.masked:
            self.masked_samples += 1
            mask = self.masks.get(chunk.seq_id)
            if mask is None:
                raise PlanError(f"fake worker: seq {chunk.seq_id} is masked in step {self.last_step_id}, "
                                f"whose masks have no row for it (rows: {sorted(self.masks)})")
            if not allowed(mask, token):
                token = next(t for t in range(VOCAB) if allowed(mask, t))
        self.seqs[chunk.seq_id].last_sampled = token
        return token


async def serve_worker(link: WorkerLink, worker: ScriptedWorker) -> None:
    """The worker's side of the ZeroMQ protocol: Ready, then plan -> (masks) -> result."""
    ctx = zmq.asyncio.Context()
    sockets = WorkerSockets(ctx, link.plan_addr, link.result_addr)
    heartbeat = engine_pb2.WorkerMessage(heartbeat=engine_pb2.Heartbeat(worker_pid=0))
    try:
        await sockets.send(engine_pb2.WorkerMessage(ready=worker.ready))
        plans: deque[engine_pb2.StepPlan] = deque()
        masks: dict[int, engine_pb2.StepMasks] = {}
        while True:
            if not await sockets.plans.poll(500):
                await sockets.send(heartbeat)
                continue
            msg = await sockets.recv()
            kind = msg.WhichOneof("kind")
            if kind == "shutdown":
                return
            if kind == "plan":
                plans.append(msg.plan)
            elif kind == "masks":
                masks[msg.masks.step_id] = msg.masks
            # A plan with masked chunks waits for its step's masks, which the
            # scheduler sends before the next plan: a plan that still waits
            # when the next one comes would wait forever; it fails instead.
            while plans and (plans[0].step_id in masks or not any(c.masked for c in plans[0].chunks)
                             or len(plans) > 1):
                plan = plans.popleft()
                if worker.step_seconds:
                    await asyncio.sleep(worker.step_seconds)
                try:
                    if any(c.masked for c in plan.chunks) and plan.step_id not in masks:
                        raise PlanError(f"fake worker: step {plan.step_id} has masked chunks, but "
                                        f"step {plans[0].step_id}'s plan came before its masks")
                    reply = engine_pb2.WorkerMessage(result=worker.run(plan, masks.pop(plan.step_id, None)))
                except Exception as exc:    # PlanError, or a broken contract: the step fails, not the worker
                    reply = engine_pb2.WorkerMessage(error=engine_pb2.StepError(step_id=plan.step_id,
                                                                                message=str(exc)))
                await sockets.send(reply)
    finally:
        sockets.close()
        ctx.term()
