"""Tensor parallelism: one model over a group of N worker processes.

The ranks form one ``torch.distributed`` group (NCCL on CUDA, one GPU per
rank; gloo on the CPU). Each holds its shard of the weights
(``sharding.py``) and its KV heads' share of the cache; the forward sums
each layer's row-parallel outputs with an all-reduce (``model.py``).

    rank 0 (main.py's ZeroMQ loop)               ranks 1 .. N-1 (``follow``)
    a plan it runs: RankStep bytes ──broadcast──► set the relayed samples,
                                                 execute the same plan
    forward: all-reduce after o_proj, down ◄────► the same all-reduces
    logits, sampling, prompt logprobs, reply     no logits, no sampling, no reply
    plans discarded after a failed step: not relayed
    Shutdown: RankMessage(shutdown) ────────────► exit 0
    idle for a second: heartbeat ───────────────► hang watchdog re-armed

Why the ranks never diverge: a rank's state (sequences, block tables, the
persistent batch, the cache's content) is a function of the plans it ran and
of the tokens sampled for ``last_token_from_sample``. Every rank runs the
same plans in the same order, starting from the same warm-up (which rank 0
relays too); only rank 0 samples, and it sends the ids it sampled with the
next RankStep, so every rank reads the same token. Validation is a pure
function of (state, plan), so a plan refused on rank 0 is refused on every
rank before any state changes; a masked step's masks only reach rank 0's
sampler, after the forward. An error anywhere else (a collective failing, a
peer gone) ends that rank's process, and the group with it: the ranks'
collectives fail once a peer's connection closes, and `jitney serve` kills
and restarts the whole group when any rank exits.

The relay is its own gloo group, so the plan bytes stay on the CPU under
NCCL too: a fixed 4 KiB frame (length, then the first bytes; a decode
step's plan fits) and, for a larger plan, a second broadcast of the rest.
Protobuf bytes, never pickle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from jitney.engine.v1 import engine_pb2
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.plan_checks import PlanError
from jitney.worker.distributed.sharding import Shard
from jitney.worker.runner.watchdog import Watchdog

if TYPE_CHECKING:
    from jitney.worker.runner.model_runner import ModelRunner

logger = logging.getLogger("jitney.worker")

FRAME_BYTES = 4096
_LENGTH_BYTES = 8


@dataclass
class TensorParallelGroup:
    """This process's place in its group, and the group's collectives."""

    rank: int
    size: int
    relay: dist.ProcessGroup     # gloo: the plan relay and small host-side collectives

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``model.Reduce``). With two ranks
        the sum is ``a + b`` on both, which addition's commutativity makes the
        same bits whatever the algorithm: batch invariance holds."""
        dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks (the KV-cache blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.relay)
        return int(t.item())

    def send(self, message: engine_pb2.RankMessage) -> None:
        """Rank 0: broadcast one message to the other ranks."""
        data = message.SerializeToString()
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:_LENGTH_BYTES] = torch.frombuffer(bytearray(len(data).to_bytes(_LENGTH_BYTES, "little")),
                                                 dtype=torch.uint8)
        head = data[:FRAME_BYTES - _LENGTH_BYTES]
        if head:
            frame[_LENGTH_BYTES:_LENGTH_BYTES + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.relay)
        rest = data[len(head):]
        if rest:
            dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=self.relay)

    def receive(self) -> engine_pb2.RankMessage:
        """Ranks > 0: the next message rank 0 broadcast."""
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.relay)
        raw = frame.numpy().tobytes()
        length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
        data = raw[_LENGTH_BYTES:_LENGTH_BYTES + length]
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.relay)
            data += rest.numpy().tobytes()
        return engine_pb2.RankMessage.FromString(data)

    def heartbeat(self) -> None:
        self.send(engine_pb2.RankMessage(heartbeat=engine_pb2.Heartbeat()))

    def shutdown(self) -> None:
        """Rank 0: tell the others to exit."""
        self.send(engine_pb2.RankMessage(shutdown=engine_pb2.Shutdown()))

    def close(self) -> None:
        """Leave the group (after a Shutdown was sent or received).

        ``destroy_process_group`` only unregisters the groups: a gloo group
        and its threads live as long as a Python reference does, and this
        object holds one (``relay``). Kept until the interpreter exits, those
        threads are torn down during its finalization, which now and then
        aborts the process ("terminate called without an active exception",
        SIGABRT after a clean shutdown: 2 of 75 two-rank runs on a loaded
        2-core machine). So the reference is dropped here (and
        ``init_group`` keeps torch from taking one), and the threads are
        joined now, while the interpreter is whole."""
        dist.destroy_process_group()
        del self.relay


def init_group(config: WorkerConfig) -> TensorParallelGroup | None:
    """Join the group of ``config.tp_size`` ranks (None when there is no group).

    Blocks until every rank has joined, up to ``config.dist_timeout``; that
    timeout bounds every collective after it too. On CUDA, rank r takes GPU
    ``r % device_count`` (one GPU per rank, whether the ranks share a
    machine or not)."""
    if config.tp_size == 1:
        return None
    backend = "nccl" if config.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(config.tp_rank % torch.cuda.device_count())
    timeout = timedelta(seconds=config.dist_timeout)
    # torch.distributed.nn.functional binds ``group.WORLD`` as a default argument
    # when first imported, and transformers imports it (through fsdp) while a
    # model loads. Imported after this group exists, it would hold the group
    # (and gloo's threads) until the interpreter exits; see ``close``. (As
    # ``from``: ``import torch.distributed...`` would make ``torch`` a local
    # name of this function, unbound at ``torch.cuda`` above.)
    from torch.distributed.nn import functional  # noqa: F401
    logger.info("tensor parallelism: rank %d of %d joining %s (%s)", config.tp_rank, config.tp_size,
                config.dist_init, backend)
    dist.init_process_group(backend, init_method=config.dist_init, rank=config.tp_rank,
                            world_size=config.tp_size, timeout=timeout)
    relay = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    assert relay is not None
    return TensorParallelGroup(config.tp_rank, config.tp_size, relay)


def follow(runner: ModelRunner, group: TensorParallelGroup, watchdog: Watchdog) -> int:
    """A rank > 0's loop: run every plan rank 0 relays, until its Shutdown (0).

    A plan refused here was refused by rank 0 too (same state, same plan),
    which answered it. Any other error propagates and ends the process."""
    assert group.rank > 0
    while True:
        watchdog.arm()
        message = group.receive()
        kind = message.WhichOneof("kind")
        if kind == "shutdown":
            logger.info("rank %d: shutdown relayed by rank 0", group.rank)
            return 0
        if kind != "step":
            continue
        step = message.step
        runner.note_samples(step.sampled_seq_ids, step.sampled_token_ids)
        try:
            runner.execute(step.plan)
        except PlanError as err:
            logger.debug("rank %d: step %d refused (as on rank 0): %s", group.rank, step.plan.step_id, err)
