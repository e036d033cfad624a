"""End to end, one test per sampling parameter and output option, on a tiny
random model served by `jitney serve` (scheduler and worker processes).

The exact math of each processor is tested against references in
tests/worker/test_sampling_params*.py; here each parameter is shown to
travel the whole way (client -> validation -> plan -> worker -> result ->
stream) and to do what its definition says.
"""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest

from tests.support.server_harness import Server, free_port, running_server
from tests.support.tiny_models import EOS_TOKEN_ID, make_tiny_llama
from jitney.client.client import Sampling, make_params
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from tests.support.waiting import wait_idle

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 23, 64, 11, 150, 3, 77, 201]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)


OPENAI_PORT = free_port()


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--model", str(model), "--num-blocks", "128", "--block-size", "16",
            "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--dtype", "float32",
            "--openai-port", str(OPENAI_PORT)]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def stream(server: Server, prompt: list[int], **sampling: object) -> list[pb.GenerateStreamResponse]:
    params = make_params(prompt, sampling=Sampling(**sampling))  # type: ignore[arg-type]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return list(stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=60))


def generate(server: Server, prompt: list[int], **sampling: object) -> pb.GenerateResponse:
    params = make_params(prompt, sampling=Sampling(**sampling))  # type: ignore[arg-type]
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(params=params), timeout=60)


def tokens(msgs: list[pb.GenerateStreamResponse], index: int = 0) -> list[int]:
    return [t for m in msgs if m.sample_index == index for t in m.token_ids]


def test_n_samples(server: Server) -> None:
    """n = 3: distinct seeded samples, sample 0 = the n = 1 output of the
    same seed, usage counts the prompt once, every block comes back."""
    common = dict(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    msgs = stream(server, PROMPT, n=3, **common)
    outs = [tokens(msgs, i) for i in range(3)]
    assert all(len(o) == 12 for o in outs)
    assert len({tuple(o) for o in outs}) == 3
    assert outs[0] == tokens(stream(server, PROMPT, **common))
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.sample_index for m in finals) == [0, 1, 2]
    assert msgs[-1].usage.prompt_tokens == len(PROMPT) and msgs[-1].usage.completion_tokens == 36
    assert sum(m.HasField("usage") for m in msgs) == 1
    unary = generate(server, PROMPT, n=3, **common)
    assert [list(s.token_ids) for s in unary.samples] == outs
    assert list(unary.token_ids) == outs[0] and unary.usage.completion_tokens == 36
    assert wait_idle(server).kv_blocks_used == 0


def test_top_logprobs(server: Server) -> None:
    """Greedy: the first alternative is the sampled token, with its logprob;
    alternatives are most likely first."""
    msgs = stream(server, PROMPT, max_tokens=6, ignore_eos=True, top_logprobs=5)
    for m in msgs:
        (top,) = m.top_logprobs
        assert len(top.token_ids) == 5
        assert top.token_ids[0] == m.token_ids[0]
        assert math.isclose(top.logprobs[0], m.logprobs[0], abs_tol=1e-6)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)


def test_prompt_logprobs(server: Server) -> None:
    """The logprob of a prompt's last token equals the logprob the model gave
    that token when it generated it after the rest of the prompt."""
    first = stream(server, PROMPT, max_tokens=1, ignore_eos=True)[0]
    extended = PROMPT + [first.token_ids[0]]
    msgs = stream(server, extended, max_tokens=1, ignore_eos=True, prompt_logprobs=3)
    entries = list(msgs[0].prompt_logprobs)
    assert [e.token_id for e in entries] == extended
    assert not entries[0].HasField("logprob")
    assert all(e.HasField("logprob") and len(e.top.token_ids) == 3 for e in entries[1:])
    assert math.isclose(entries[-1].logprob, first.logprobs[0], abs_tol=1e-4)
    assert all(not m.prompt_logprobs for m in msgs[1:])


def test_logit_bias(server: Server) -> None:
    assert tokens(stream(server, PROMPT, max_tokens=5, ignore_eos=True, logit_bias={123: 100.0})) == [123] * 5


def test_min_tokens(server: Server) -> None:
    """EOS pushed to the top by a bias: without min_tokens it ends the output
    at once; with min_tokens = 4 it comes only as the 5th token."""
    bias = {EOS_TOKEN_ID: 100.0}
    msgs = stream(server, PROMPT, max_tokens=10, logit_bias=bias)
    assert tokens(msgs) == [EOS_TOKEN_ID]
    msgs = stream(server, PROMPT, max_tokens=10, logit_bias=bias, min_tokens=4)
    out = tokens(msgs)
    assert len(out) == 5 and out[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in out[:4]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE


def test_min_p_one_is_greedy(server: Server) -> None:
    """min_p = 1 keeps only the most likely token, whatever the temperature."""
    greedy = tokens(stream(server, PROMPT, max_tokens=8, ignore_eos=True))
    assert tokens(stream(server, PROMPT, max_tokens=8, ignore_eos=True, temperature=2.0, seed=3, min_p=1.0)) == greedy


def test_repetition_penalty_matches_transformers(server: Server, model: Path) -> None:
    """Greedy with repetition_penalty against transformers' own generate."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                      eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert tokens(stream(server, PROMPT, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)) == ref


@pytest.mark.parametrize("kind", ["presence", "frequency"])
def test_presence_and_frequency_penalties(server: Server, kind: str) -> None:
    """Each greedy token is the argmax of the raw logprobs minus the penalty
    over the output so far (checked wherever the winner is provably among the
    20 alternatives returned: some alternative is not penalised)."""
    penalty = {f"{kind}_penalty": 1.5}
    msgs = stream(server, PROMPT, max_tokens=24, ignore_eos=True, top_logprobs=20, **penalty)
    out, checked = [], 0
    for m in msgs:
        (top,) = m.top_logprobs
        counts = {t: out.count(t) for t in top.token_ids}
        penalised = {t: lp - (1.5 * (counts[t] > 0) if kind == "presence" else 1.5 * counts[t])
                     for t, lp in zip(top.token_ids, top.logprobs)}
        if any(counts[t] == 0 for t in top.token_ids):
            assert m.token_ids[0] == max(penalised, key=lambda t: (penalised[t], -t))
            checked += 1
        out.append(m.token_ids[0])
    assert checked >= 20
    plain = tokens(stream(server, PROMPT, max_tokens=24, ignore_eos=True))
    assert plain != out   # the penalty changed something on this repetitive model


def test_bad_sampling_value_is_invalid_argument(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stream(server, PROMPT, max_tokens=4, n=17)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.sampling.n" in info.value.details()



def test_every_parameter_same_output_batched_and_preempted(server: Server) -> None:
    """Same seed, same output, whatever else is batched, with every new
    parameter: 16 requests mixing them, first each alone, then all at once on
    a cache too small for them (preemptions, recompute, penalty counts
    rebuilt). Tokens, logprobs and top logprobs are bit-identical."""
    from concurrent.futures import ThreadPoolExecutor

    mixes: list[dict[str, object]] = [
        dict(temperature=0.9, repetition_penalty=1.3),
        dict(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, top_k=40),
        dict(temperature=1.2, min_p=0.05, top_p=0.9),
        dict(logit_bias={7: 3.0, 11: -100.0}, top_logprobs=3),
        dict(temperature=0.8, min_tokens=20, logit_bias={EOS_TOKEN_ID: 4.0}),
        dict(repetition_penalty=0.7, frequency_penalty=-0.5),
        dict(temperature=1.0, top_logprobs=2, presence_penalty=-1.0),
        dict(),
    ]
    # ignore_eos: every request lives its 100 tokens, so the 16 together need 16 x 13 blocks at the end.
    jobs = [(list(range(3 + i, 103 + i)), dict(seed=100 + i, max_tokens=100, ignore_eos=True, **mixes[i % len(mixes)]))
            for i in range(16)]

    def run(job: tuple[list[int], dict[str, object]]) -> list[tuple[list[int], list[float], list[str]]]:
        prompt, sampling = job
        msgs = stream(server, prompt, **sampling)
        return [(list(m.token_ids), list(m.logprobs), [str(t) for t in m.top_logprobs]) for m in msgs]

    alone = [run(job) for job in jobs]
    before = wait_idle(server).preemptions
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs))
    assert wait_idle(server).preemptions > before      # 16 x 13 blocks do not fit in 128
    assert together == alone


def test_openai_door_over_real_processes(server: Server) -> None:
    """`jitney serve --openai-port` with its real worker, through the official
    client: n = 2 chat with logprobs, a JSON-schema response, a streamed
    completion, and a bad request; the gRPC stats see it all end."""
    import json

    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{OPENAI_PORT}/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list()]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, seed=3, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(len(c.logprobs.content) == 5 for c in chat.choices if c.logprobs is not None)
    assert chat.usage.completion_tokens == 10
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "json please"}], max_tokens=400, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
    # A random model may pad with whitespace (the grammar allows up to 64 between tokens): room enough.
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content or "") in ({"ok": True}, {"ok": False})
    chunks = list(client.completions.create(model=model, prompt="once", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert sum(len(c.choices) for c in chunks) >= 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=17)
    assert wait_idle(server).kv_blocks_used == 0
