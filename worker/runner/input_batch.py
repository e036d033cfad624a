"""The worker's persistent batch: one row per live sequence, and the step's inputs.

Two kinds of buffers, each a host tensor (pinned on CUDA) with a device twin
(the same tensor on the CPU):

* **Per sequence, persistent** (``max_num_seqs`` rows): the block table and
  the sampling parameters. A sequence takes a free row when it arrives and
  gives it back when it is freed; a plan's diffs write only the new rows and
  the new block ids. A table that changed is copied to the device once, at
  the next step. Penalised sequences also have a row of token counts
  (``TokenCounts``, on the device), built from the tokens their chunks compute.
* **Per step, staging**: one int64 buffer with a fixed layout (below). The
  host fills the used prefix of each region from the plan; the whole buffer
  goes to the device in one non-blocking copy. Fixed offsets mean fixed
  device addresses, so captured CUDA graphs read their inputs straight from
  it. Slot mapping and the step's block tables are computed on the device.

    # region           length  holds, for the step's T tokens / B sequences / S samples
    # input_ids        T       token ids, sequences in step order (decodes first)
    # positions        T       absolute position of each token
    # token_rows       T       persistent row of each token's sequence; -1 = padding
    # query_start_loc  B + 1   cumulative query counts
    # seq_lens         B       context length including the new tokens; 0 = padding
    # seq_rows         B       persistent row of each sequence
    # sample_tokens    S       flat token index of each sampled row (plan order)
    # sample_rows      S       persistent row of each sampled sequence
    # sample_pos       S       position of the token being sampled
    # plain, filtered  S, S    sampled rows (0..S) that sample randomly / with top-k/p
    #                          (S <= T: a chunk verifying d drafts samples d + 1 rows)
    # tile_seq, tile_idx N, N  the attention's tile map for a graph-captured mixed step
    #                          (sequence and index of each tile of query tokens; -1: none)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from jitney.worker.attention.backend import AttentionMetadata
from jitney.worker.runner.device import cuda_index
from jitney.worker.runner.plan_checks import NO_PROCESSORS, ProcessorParams
from jitney.worker.runner.sampler import (LogitsProcessors, Penalties, RowGroups, SamplingBatch, random_row_masks,
                                   split_seed)

REGIONS = ("input_ids", "positions", "token_rows", "query_start_loc", "seq_lens", "seq_rows",
           "sample_tokens", "sample_rows", "sample_pos", "plain", "filtered", "tile_seq", "tile_idx")


def _layout(max_tokens: int, max_seqs: int, max_tiles: int) -> dict[str, tuple[int, int]]:
    """Region -> (offset, capacity) in the staging buffer."""
    rows = max(max_seqs, max_tokens)   # sampled rows: one per token at most (drafts verified)
    sizes = {"input_ids": max_tokens, "positions": max_tokens, "token_rows": max_tokens,
             "query_start_loc": max_seqs + 1, "tile_seq": max_tiles, "tile_idx": max_tiles,
             "sample_tokens": rows, "sample_rows": rows, "sample_pos": rows, "plain": rows, "filtered": rows}
    layout, offset = {}, 0
    for name in REGIONS:
        size = sizes.get(name, max_seqs)
        layout[name] = (offset, size)
        offset += size
    return layout


def tile_map(query_lens: np.ndarray | list[int], block_q: int, num_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_idx) of a ragged batch for the attention's tile-mapped launch:
    sequence and index of each tile of ``block_q`` query tokens, padded with -1 / 0
    to ``num_tiles``. Raises ``ValueError`` when the tiles do not fit."""
    counts = -(-np.asarray(query_lens, dtype=np.int64) // block_q)
    total = int(counts.sum())
    if total > num_tiles:
        raise ValueError(f"{total} query tiles exceed the map's {num_tiles}")
    seqs = np.full(num_tiles, -1, dtype=np.int64)
    idx = np.zeros(num_tiles, dtype=np.int64)
    seqs[:total] = np.repeat(np.arange(len(counts)), counts)
    idx[:total] = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return seqs, idx


class StepChunk(NamedTuple):
    """One scheduled chunk as the runner hands it over: tokens resolved (a
    named tuple: the runner makes one per sequence per step)."""

    seq_id: int
    start: int                      # position of the first token
    tokens: np.ndarray | list[int]  # the chunk's token ids (int64), a sampled placeholder filled in
    sample: bool
    plan_index: int     # where the plan lists it: results keep the plan's order
    num_drafts: int = 0  # the last tokens are drafts: it samples at each of the last num_drafts + 1 positions


class TokenCounts:
    """Per-row token counts for the penalties, on the device: ``output``
    (rows, V) int32, each token's occurrences in the output so far, and
    ``prompt`` (rows, V) bool, the tokens of the prompt.

    Every token a chunk computes is counted (``add``) before the step samples:
    a sampled token is an input of the sequence's next step, so when a row
    samples, its counts cover exactly its prompt and its output so far. A
    preempted sequence comes back as a new one and is recomputed: its row,
    zeroed when it takes it, is rebuilt from the recompute's chunks.

    Memory: 256 seats x 49152 tokens is 50 MB of int32 and 12.5 MB of bool.
    Allocated at the first penalised sequence, not at start-up: most servers
    never see one (on CUDA the cache is sized before, and the 10% of the card
    the sizing leaves free absorbs it). Only penalised rows are ever zeroed,
    written or read, so the steps of other sequences never touch it.
    """

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.shape, self.device = (max_num_seqs, vocab_size), device
        self.output: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None

    def reset(self, row: int) -> None:
        """Zero ``row`` for a new sequence (allocating the counts the first time)."""
        if self.output is None or self.prompt is None:
            self.output = torch.zeros(self.shape, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
            return
        self.output[row].zero_()
        self.prompt[row].zero_()

    def add(self, output_rows: torch.Tensor, output_ids: torch.Tensor,
            prompt_rows: torch.Tensor, prompt_ids: torch.Tensor) -> None:
        """Count output tokens (rows, ids) and mark prompt tokens, (N,) int64 each."""
        assert self.output is not None and self.prompt is not None
        if output_rows.numel():
            ones = torch.ones(output_rows.shape, dtype=torch.int32, device=self.device)
            self.output.index_put_((output_rows, output_ids), ones, accumulate=True)
        if prompt_rows.numel():
            self.prompt[prompt_rows, prompt_ids] = True


def _device_ints(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Host int64 arrays -> device tensors, in one copy (none on the CPU)."""
    sizes = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]))
    return list(_to_device(flat, device).split(sizes))


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``: itself on the CPU; on CUDA through pinned
    memory, without waiting (torch's pinned-memory cache keeps the staging
    block until the copy is done)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class StagedStep:
    """Host facts about a step whose inputs are staged (and on their way to the device).

    ``padded_seqs`` >= ``num_seqs``: rows past the real ones are padding for
    a captured decode graph of that many rows (one token each, no cache
    write, no keys). Per sampled row (plan order): its persistent row, the
    position of the token it samples, the flat index of that token and its
    top_logprobs count.
    ``processed``: some sampled row has a penalty, a bias or a min_tokens
    ban (masks come later); ``uses_min_p``: some random row has min-p.
    """

    num_tokens: int
    num_seqs: int
    padded_seqs: int
    query_start_loc: tuple[int, ...]   # (num_seqs + 1,)
    seq_lens: tuple[int, ...]          # (num_seqs,)
    num_decodes: int                   # leading one-token sequences
    sampled_seq_ids: list[int]         # (S,) plan order
    num_plain: int
    num_filtered: int
    sampled_rows: np.ndarray
    sample_positions: np.ndarray
    sample_tokens: np.ndarray          # (S,) flat token index of each sampled row (the staged region's values)
    top_n: np.ndarray
    processed: bool = False
    uses_min_p: bool = False
    # Speculative decoding, per sampled row (index into the S) that verifies a
    # draft position: the drafts after its position (not yet in the sequence
    # there), which the row's penalty counts must not count.
    unseen_drafts: dict[int, np.ndarray] | None = None

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_seq_ids)


class InputBatch:
    """Persistent per-sequence rows and the step's staging buffer."""

    def __init__(self, *, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, tile_block_q: int = 0, vocab_size: int = 0) -> None:
        self.device, self.block_size = device, block_size
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        pin = device.type == "cuda"
        self.rows: dict[int, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._num_blocks = np.zeros(max_num_seqs, dtype=np.int64)   # blocks held per row
        self._host_table = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self._table = self._host_table.numpy()
        self.block_table = self._host_table if not pin else torch.zeros_like(self._host_table, device=device)
        self._table_dirty = False
        # Sampling parameters per row: temperature, top_p, min_p, repetition, presence and
        # frequency penalties (float32); top_k, seed lo/hi (int64).
        self._host_fparams = torch.zeros((6, max_num_seqs), dtype=torch.float32, pin_memory=pin)
        self._host_iparams = torch.zeros((3, max_num_seqs), dtype=torch.int64, pin_memory=pin)
        self._fvalues, self._ivalues = self._host_fparams.numpy(), self._host_iparams.numpy()
        self.fparams = self._host_fparams if not pin else torch.zeros_like(self._host_fparams, device=device)
        self.iparams = self._host_iparams if not pin else torch.zeros_like(self._host_iparams, device=device)
        self._params_dirty = False
        # Each row's sampling kind, from its stored parameters: random (plain), random with top-k/p
        # (filtered), or neither (greedy).
        self._plain = np.zeros(max_num_seqs, dtype=bool)
        self._filtered = np.zeros(max_num_seqs, dtype=bool)
        # The rest of each row's parameters, host-side: the per-step index building reads them.
        self.vocab_size = vocab_size
        self._params: list[ProcessorParams] = [NO_PROCESSORS] * max_num_seqs
        self._penalised = np.zeros(max_num_seqs, dtype=bool)
        self._extras = np.zeros(max_num_seqs, dtype=bool)   # params beyond the defaults
        self.counts = TokenCounts(max_num_seqs, vocab_size, device)
        # Tile maps (query tokens per tile: tile_block_q) have room for every tile of a full step.
        self.tile_block_q = tile_block_q
        self.max_tiles = -(-max_num_tokens // tile_block_q) + max_num_seqs if tile_block_q else 0
        self.layout = _layout(max_num_tokens, max_num_seqs, self.max_tiles)
        size = sum(n for _, n in self.layout.values())
        self._host_staging = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._staging = self._host_staging.numpy()
        self.staging = self._host_staging if not pin else torch.zeros_like(self._host_staging, device=device)
        self._copied: torch.cuda.Event | None = None   # the last host-to-device copies, when pending
        if pin:   # (made once; recorded on the current stream found by index: ``cuda_index``)
            self._copy_event = torch.cuda.Event()
            self._cuda_index = cuda_index(device)

    # -- persistent rows -----------------------------------------------------

    def add(self, seq_id: int, temperature: float, top_p: float, top_k: int, seed: int,
            params: ProcessorParams = NO_PROCESSORS) -> None:
        """Give a new sequence a row (the plan was validated: a row is free)."""
        self._wait_for_copies()
        row = self._free_rows.pop()
        self.rows[seq_id] = row
        self._num_blocks[row] = 0
        self._fvalues[:, row] = (temperature, top_p, params.min_p, params.repetition_penalty,
                                 params.presence_penalty, params.frequency_penalty)
        lo, hi = split_seed(seed)
        self._ivalues[:, row] = (top_k, lo, hi)
        self._params_dirty = True
        self._plain[row], self._filtered[row] = random_row_masks(self._fvalues[0, row], self._fvalues[1, row],
                                                                   self._ivalues[0, row])
        self._params[row] = params
        self._penalised[row] = params.penalised
        self._extras[row] = params != NO_PROCESSORS
        if params.penalised:
            self.counts.reset(row)

    def remove(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id)
        self._params[row] = NO_PROCESSORS
        self._penalised[row] = self._extras[row] = self._plain[row] = self._filtered[row] = False
        self._free_rows.append(row)

    def extend_blocks(self, seq_id: int, block_ids: Sequence[int]) -> None:
        """Append a sequence's new blocks to its row."""
        if not block_ids:
            return
        self._wait_for_copies()
        row = self.rows[seq_id]
        start = int(self._num_blocks[row])
        self._table[row, start:start + len(block_ids)] = block_ids
        self._num_blocks[row] = start + len(block_ids)
        self._table_dirty = True

    # -- one step ------------------------------------------------------------

    def region(self, name: str, length: int) -> torch.Tensor:
        """Device view of the first ``length`` entries of a staging region."""
        offset, capacity = self.layout[name]
        assert length <= capacity, (name, length, capacity)
        return self.staging[offset:offset + length]

    def _fill(self, name: str, values: np.ndarray | list[int], pad_to: int = 0, pad: int = 0) -> None:
        offset, _ = self.layout[name]
        n = len(values)
        self._staging[offset:offset + n] = values
        if pad_to > n:
            self._staging[offset + n:offset + pad_to] = pad

    def stage(self, chunks: list[StepChunk], pad_seqs_to: int = 0, pad_tokens_to: int = 0) -> StagedStep:
        """Write ``chunks`` (decodes first) into the staging buffer and start
        its copy to the device (with any changed tables and parameters).

        Padding for a captured graph: ``pad_seqs_to`` alone (a decode graph)
        gives each padding row one padding token; with ``pad_tokens_to`` (a
        mixed graph) padding rows have no tokens, padding tokens no row, and
        the tile map is written.
        """
        self._wait_for_copies()
        n = len(chunks)
        qlens = np.fromiter((len(c.tokens) for c in chunks), dtype=np.int64, count=n)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        rows = np.fromiter((self.rows[c.seq_id] for c in chunks), dtype=np.int64, count=n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        num_tokens, padded = int(qsl[-1]), max(pad_seqs_to, n)
        seq_lens = starts + qlens
        if pad_tokens_to:   # mixed graph: padding rows hold no token
            total = max(pad_tokens_to, num_tokens)
            pad_qsl = np.full(padded - n, num_tokens)
            self._fill_tiles(qlens)
        else:               # decode graph (or none): one padding token per padding row
            total = num_tokens + padded - n
            pad_qsl = np.arange(num_tokens + 1, num_tokens + 1 + padded - n)
        ones = qlens == 1
        num_decodes = n if ones.all() else int(np.argmin(ones))
        self._fill_ids(chunks, num_decodes, total)
        self._fill("positions", np.arange(num_tokens) + np.repeat(starts - qsl[:-1], qlens), total)
        self._fill("token_rows", np.repeat(rows, qlens), total, pad=-1)
        self._fill("query_start_loc", np.concatenate((qsl, pad_qsl)))
        self._fill("seq_lens", seq_lens, padded)
        self._fill("seq_rows", rows, padded)
        # Sampled rows in plan order (the result lists them so), whatever the step's order.
        sampled = np.flatnonzero(np.fromiter((c.sample for c in chunks), dtype=bool, count=n))
        order = np.fromiter((chunks[i].plan_index for i in sampled.tolist()), dtype=np.int64, count=len(sampled))
        if len(order) > 1 and (np.diff(order) < 0).any():
            sampled = sampled[np.argsort(order, kind="stable")]
        drafts = np.fromiter((c.num_drafts for c in chunks), dtype=np.int64, count=n)
        unseen = None
        if drafts[sampled].any():   # a chunk verifying d drafts samples at its last d + 1 positions
            counts = drafts[sampled] + 1
            sampled = np.repeat(sampled, counts)
            back = np.repeat(drafts[sampled[np.cumsum(counts) - 1]], counts) - (
                np.arange(len(sampled)) - np.repeat(np.cumsum(counts) - counts, counts))
            unseen = {i: np.asarray(chunks[c].tokens[len(chunks[c].tokens) - b:], dtype=np.int64)
                      for i, (c, b) in enumerate(zip(sampled.tolist(), back.tolist())) if b}
        else:
            back = np.zeros(len(sampled), dtype=np.int64)
        sampled_rows, positions = rows[sampled], seq_lens[sampled] - back
        sample_tokens = qsl[1:][sampled] - 1 - back
        self._fill("sample_tokens", sample_tokens)
        self._fill("sample_rows", sampled_rows)
        self._fill("sample_pos", positions)
        plain, filtered = self._row_groups(sampled_rows)
        self._fill("plain", plain)
        self._fill("filtered", filtered)
        self._copy_to_device()
        if self._penalised[rows].any():
            self._count_tokens(chunks, rows)
        top_n, processed, uses_min_p = np.zeros(len(sampled), dtype=np.int64), False, False
        if self._extras[sampled_rows].any():   # else: no row has anything beyond the basics
            params = [self._params[r] for r in sampled_rows]
            top_n[:] = [p.top_logprobs for p in params]
            processed = any(p.penalised or p.logit_bias_ids or p.bans_at(int(pos))
                            for p, pos in zip(params, positions))
            random = sampled_rows[np.concatenate((plain, filtered))]
            uses_min_p = bool((self._fvalues[2, random] > 0).any())
        return StagedStep(
            num_tokens, n, padded, tuple(qsl.tolist()), tuple(seq_lens.tolist()), num_decodes,
            [chunks[i].seq_id for i in sampled.tolist()], len(plain), len(filtered),
            sampled_rows=sampled_rows, sample_positions=positions, sample_tokens=sample_tokens, top_n=top_n,
            processed=processed, uses_min_p=uses_min_p, unseen_drafts=unseen,
        )

    def _fill_ids(self, chunks: list[StepChunk], num_decodes: int, pad_to: int) -> None:
        """The step's token ids: the leading decodes' one id each, then the other chunks'."""
        offset, _ = self.layout["input_ids"]
        ids = self._staging[offset:offset + pad_to]
        ids[:num_decodes] = [c.tokens[0] for c in chunks[:num_decodes]]
        end = num_decodes
        for c in chunks[num_decodes:]:
            ids[end:end + len(c.tokens)] = c.tokens
            end += len(c.tokens)
        ids[end:] = 0

    @property
    def any_penalised(self) -> bool:
        """Whether some live sequence has penalties (token counts)."""
        return bool(self._penalised.any())

    def count_context(self, seq_id: int, token_ids: np.ndarray | Sequence[int]) -> None:
        """Count a penalised sequence's positions 0.. that it will not compute
        (a cached or shared prefix), as if a chunk had computed them."""
        row = self.rows[seq_id]
        self._count_tokens([StepChunk(seq_id, 0, np.asarray(token_ids, dtype=np.int64), False, 0)], np.array([row]))

    def _count_tokens(self, chunks: list[StepChunk], rows: np.ndarray) -> None:
        """Count the tokens of the step's penalised chunks into their rows
        (``TokenCounts``): the prompt's part and the output's part."""
        out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
        for chunk, row in zip(chunks, rows):
            if not self._penalised[row]:
                continue
            # Positions start.. : those before num_prompt_tokens are the prompt.
            tokens = np.asarray(chunk.tokens, dtype=np.int64)
            split = min(max(self._params[row].num_prompt_tokens - chunk.start, 0), len(tokens))
            prompt_ids.append(tokens[:split])
            prompt_rows.append(np.full(split, row))
            out_ids.append(tokens[split:])
            out_rows.append(np.full(len(tokens) - split, row))
        self.counts.add(*_device_ints(self.device, *(np.concatenate(parts, dtype=np.int64)
                                                     for parts in (out_rows, out_ids, prompt_rows, prompt_ids))))

    def _fill_tiles(self, qlens: np.ndarray) -> None:
        """The tile map of the step's sequences, padded to the region's end."""
        seqs, idx = tile_map(qlens, self.tile_block_q, self.max_tiles)
        self._fill("tile_seq", seqs)
        self._fill("tile_idx", idx)

    def step_metadata(self, step: StagedStep) -> AttentionMetadata:
        """The (unpadded) step's attention metadata, computed on the device."""
        return self.metadata(step.num_tokens, step.num_seqs, query_start_loc_host=step.query_start_loc,
                             seq_lens_host=step.seq_lens, num_decodes=step.num_decodes)

    def metadata(self, num_tokens: int, num_seqs: int, *, query_start_loc_host: tuple[int, ...],
                 seq_lens_host: tuple[int, ...], num_decodes: int, tiles: bool = False) -> AttentionMetadata:
        """Attention metadata over the first ``num_tokens``/``num_seqs`` staged entries.

        Block tables (an ``index_select`` of the persistent table) and the slot
        mapping are computed on the device from the staging buffer, so a CUDA
        graph captured around this call recomputes them at every replay.
        """
        token_rows, positions = self.region("token_rows", num_tokens), self.region("positions", num_tokens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping(token_rows, positions),
            query_start_loc=self.region("query_start_loc", num_seqs + 1),
            seq_lens=self.region("seq_lens", num_seqs),
            block_tables=self.block_table.index_select(0, self.region("seq_rows", num_seqs)),
            num_decodes=num_decodes,
            query_start_loc_host=query_start_loc_host,
            seq_lens_host=seq_lens_host,
            block_size=self.block_size,
            tiles=(self.region("tile_seq", self.max_tiles), self.region("tile_idx", self.max_tiles)) if tiles else None,
        )

    def sampling(self, step: StagedStep) -> tuple[torch.Tensor, SamplingBatch, RowGroups]:
        """(flat token index of each sampled row, its parameters, its row groups), on the device."""
        s = step.num_sampled
        rows = self.region("sample_rows", s)
        f = self.fparams.index_select(1, rows)
        i = self.iparams.index_select(1, rows)
        params = SamplingBatch(temperature=f[0], top_p=f[1], top_k=i[0], seed_lo=i[1], seed_hi=i[2],
                               position=self.region("sample_pos", s), min_p=f[2] if step.uses_min_p else None)
        # CUDA sorts filtered rows fully (no sync); the CPU tries the top candidates first.
        groups = RowGroups(self.region("plain", step.num_plain), self.region("filtered", step.num_filtered),
                           full_sort=self.device.type == "cuda")
        return self.region("sample_tokens", s), params, groups

    def processors(self, step: StagedStep, masks: tuple[np.ndarray, np.ndarray] | None = None
                   ) -> LogitsProcessors | None:
        """The step's logits processors, or None when no sampled row has any.

        ``masks``: the sampled rows (indices into the step's S) that are
        constrained, and their bitmasks (M, ceil(V / 32)) int32, every row
        allowing some token. Where a mask allows only tokens that min_tokens
        bans, the grammar wins: that row's ban is dropped for this step (the
        grammar can only end there). Only the rows that some processor
        processes are copied and processed (``LogitsProcessors.rows``).
        """
        if not step.processed and masks is None:
            return None
        params = [self._params[r] for r in step.sampled_rows]
        pen = np.array([i for i, p in enumerate(params) if p.penalised], dtype=np.int64)
        bias_rows = _ints(np.repeat(np.arange(len(params)), [len(p.logit_bias_ids) for p in params]))
        bias_ids = _ints(t for p in params for t in p.logit_bias_ids)
        bias_values = np.array([v for p in params for v in p.logit_bias_values], dtype=np.float32)
        banning = {i: _ints(p.min_tokens_banned_ids) for i, (p, pos) in enumerate(zip(params, step.sample_positions))
                   if p.bans_at(int(pos))}
        mask_rows = np.zeros(0, dtype=np.int64)
        if masks is not None:
            mask_rows, words = masks
            for row, word in zip(mask_rows.tolist(), words):
                if row in banning and _allows_only(word, banning[row]):
                    del banning[row]
        ban_rows = _ints(i for i, ids in banning.items() for _ in ids)
        ban_ids = _ints(t for ids in banning.values() for t in ids)
        processed = np.zeros(len(params), dtype=bool)
        for part_rows in (pen, bias_rows, ban_rows, mask_rows):
            processed[part_rows] = True
        rows = np.flatnonzero(processed)
        if not len(rows):
            return None
        within = np.cumsum(processed) - 1   # a processed row's index among them
        # The processed rows among the staged groups' (found again here): their positions there.
        plain, filtered = self._row_groups(step.sampled_rows)
        at_plain, at_filtered = np.flatnonzero(processed[plain]), np.flatnonzero(processed[filtered])
        (rows_d, pen_d, pen_rows_d, bias_rows_d, bias_ids_d, ban_rows_d, ban_ids_d, mask_rows_d,
         at_plain_d, src_plain_d, at_filtered_d, src_filtered_d) = _device_ints(
            self.device, rows, within[pen], step.sampled_rows[pen], within[bias_rows], bias_ids, within[ban_rows],
            ban_ids, within[mask_rows], at_plain, within[plain[at_plain]], at_filtered, within[filtered[at_filtered]])
        penalties = None
        if len(pen):
            counts = self.counts
            assert counts.output is not None and counts.prompt is not None
            f = self.fparams.index_select(1, pen_rows_d)
            kinds = (any(params[i].repetition_penalty != 1.0 for i in pen),
                     any(params[i].presence_penalty != 0.0 for i in pen),
                     any(params[i].frequency_penalty != 0.0 for i in pen))
            output_counts = counts.output.index_select(0, pen_rows_d)
            if step.unseen_drafts:   # a draft position counts only the drafts before it
                _uncount(output_counts, [step.unseen_drafts.get(int(i)) for i in pen], self.device)
            penalties = Penalties(pen_d, output_counts,
                                  counts.prompt.index_select(0, pen_rows_d), f[3], f[4], f[5], kinds)
        bias = None
        if len(bias_ids):
            bias = (bias_rows_d, bias_ids_d, _to_device(torch.from_numpy(bias_values), self.device))
        mask = None
        if masks is not None:
            mask = (mask_rows_d, _to_device(torch.from_numpy(np.ascontiguousarray(masks[1], dtype=np.int32)),
                                            self.device))
        return LogitsProcessors(rows_d, (at_plain_d, src_plain_d), (at_filtered_d, src_filtered_d),
                                penalties=penalties, bias=bias,
                                ban=(ban_rows_d, ban_ids_d) if len(ban_ids) else None, mask=mask)

    def uncount_rejected(self, seq_id: int, token_ids: np.ndarray) -> None:
        """A penalised sequence's rejected drafts: counted when its chunk was
        staged, never part of its output."""
        row = self.rows[seq_id]
        if self._penalised[row] and len(token_ids):
            assert self.counts.output is not None
            _uncount(self.counts.output[row:row + 1], [token_ids], self.device)

    def truncate_blocks(self, seq_id: int, num_blocks: int) -> None:
        """The sequence's table keeps its first ``num_blocks`` entries (after
        verified drafts; the entries past them are never read and are overwritten
        by the next ``extend_blocks``)."""
        row = self.rows[seq_id]
        self._num_blocks[row] = min(int(self._num_blocks[row]), num_blocks)

    def _row_groups(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sampled rows (indices into ``rows``) that sample randomly, plain and filtered."""
        return np.flatnonzero(self._plain[rows]), np.flatnonzero(self._filtered[rows])

    def _copy_to_device(self) -> None:
        if self.staging is self._host_staging:
            return
        self.staging.copy_(self._host_staging, non_blocking=True)
        if self._table_dirty:
            self.block_table.copy_(self._host_table, non_blocking=True)
        if self._params_dirty:
            self.fparams.copy_(self._host_fparams, non_blocking=True)
            self.iparams.copy_(self._host_iparams, non_blocking=True)
        self._table_dirty = self._params_dirty = False
        self._copy_event.record(torch.cuda.current_stream(self._cuda_index))
        self._copied = self._copy_event

    def _wait_for_copies(self) -> None:
        """Host buffers may be rewritten only once their last copy has left them."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of each token, on the device; -1 for padding tokens (row -1)."""
        block = self.block_table[token_rows.clamp(min=0), positions // self.block_size]
        slots = block.to(torch.int64) * self.block_size + positions % self.block_size
        return slots.masked_fill_(token_rows < 0, -1)


def _uncount(counts: torch.Tensor, unseen: Sequence[np.ndarray | None], device: torch.device) -> None:
    """Take one occurrence of each id of ``unseen[k]`` off row k of ``counts`` (K, V) int32."""
    parts = [(k, ids) for k, ids in enumerate(unseen) if ids is not None and len(ids)]
    if not parts:
        return
    rows = np.concatenate([np.full(len(ids), k, dtype=np.int64) for k, ids in parts])
    ids = np.concatenate([ids for _, ids in parts]).astype(np.int64)
    rows_d, ids_d = _device_ints(device, rows, ids)
    minus = torch.full(rows_d.shape, -1, dtype=torch.int32, device=device)
    counts.index_put_((rows_d, ids_d), minus, accumulate=True)


def _ints(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """An int64 array (possibly empty) from any iterable of ints."""
    return np.fromiter(values, dtype=np.int64)


def _allows_only(words: np.ndarray, ids: np.ndarray) -> bool:
    """Whether a bitmask row (ceil(V / 32) int32, padding bits clear) allows no token outside ``ids``."""
    allowed = int(np.unpackbits(words.view(np.uint8)).sum())
    return allowed == int(((words[ids >> 5] >> (ids & 31)) & 1).sum())
