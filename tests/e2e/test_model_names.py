"""How the server presents its model: ``--served-model-name`` on both doors
and GetModelInfo, the default name, ``--chat-template`` and the generation
config's sampling defaults (``--generation-config``).

The end-to-end tests share one `jitney serve` on a tiny random model whose
folder holds a generation_config.json with sampling values; the start-up
refusals run `jitney scheduler` / `jitney serve` and watch them exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.server_harness import ROOT, Server, free_port, running_server
from tests.support.tiny_models import make_tiny_llama
from jitney.client.client import Sampling, make_params
from jitney.common.model_files import (ModelFiles, ModelSettingsError, generation_config, gguf_metadata,
                                       model_name, read_chat_template, resolve_model)
from jitney.scheduler.api.sampling_defaults import SamplingDefaults
from jitney.scheduler.api.http.openai.protocol import parse_request
from jitney.v1 import generation_pb2 as pb

PRIMARY, ALIAS = "tiny-primary", "team/tiny:latest"
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                     "repetition_penalty": 1.3, "max_new_tokens": 12}
# Not ChatML (the tiny model's own template): a rendering shows which one ran.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
PROMPT = [5, 17, 42, 99, 7, 23]


# -- the model's own name, and the files' settings (no server) ---------------------------


def test_the_bundled_model_is_named_without_its_quantization() -> None:
    assert model_name(resolve_model(None)) == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("file,name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
    ("Mistral-7B-v0.1.IQ3_XXS.gguf", "Mistral-7B-v0.1"),
    ("model-BF16-00001-of-00002.gguf", "model"),
    ("phi-2.gguf", "phi-2"),
    ("Q8_0.gguf", "Q8_0"),          # nothing but an encoding: kept
])
def test_gguf_names(file: str, name: str) -> None:
    assert model_name(ModelFiles(Path("/models"), file)) == name


def test_a_folder_is_named_by_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert model_name(ModelFiles(folder, None)) == "my-model"
    assert model_name(ModelFiles(Path(folder / "."), None)) == "my-model"


def test_the_gguf_metadata_reader_agrees_with_gguf() -> None:
    """The fast key-value reader against gguf's own (which parses every array)."""
    import gguf

    files = resolve_model(None)
    path = files.directory / str(files.gguf_file)
    reader = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items()
                if not k.startswith("GGUF.") and f.types and f.types[0] != gguf.GGUFValueType.ARRAY}
    got = gguf_metadata(path, lambda key: True)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value) if isinstance(value, float) else got[key] == value, key
    # The bundled file states no sampling defaults: nothing changes for it.
    assert generation_config(files) == ({}, None)


def test_a_gguf_files_sampling_metadata_is_its_generation_config(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "m.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "m")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.95)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_int32("general.sampling.penalty_last_n", 64)    # a llama.cpp window Jitney does not have
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    values, source = generation_config(ModelFiles(tmp_path, path.name))
    assert values == {"temperature": pytest.approx(0.6), "top_k": 20, "top_p": pytest.approx(0.95),
                      "repetition_penalty": pytest.approx(1.1)}
    assert source is not None and "general.sampling" in source
    assert generation_config(ModelFiles(tmp_path, path.name), "none") == ({}, None)


def test_generation_config_values_are_checked(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 1, "top_k": -1,
                                                                 "eos_token_id": 2, "max_length": 99}))
    values, source = generation_config(ModelFiles(tmp_path, None))
    assert values == {"temperature": 1, "top_k": -1}      # only the sampling keys it sets
    defaults = SamplingDefaults.from_config(values, str(source))
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (1.0, 0, None, None)
    for bad in ({"temperature": -0.5}, {"top_p": 0}, {"top_k": 2.5}, {"max_new_tokens": 0},
                {"repetition_penalty": "high"}, {"min_p": True}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            SamplingDefaults.from_config(bad, "f.json")
    with pytest.raises(ModelSettingsError, match="no generation_config.json"):
        generation_config(ModelFiles(tmp_path, None), str(tmp_path / "elsewhere"))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelSettingsError, match="cannot read it as JSON"):
        generation_config(ModelFiles(tmp_path, None))


def test_defaults_fill_only_unset_fields() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_k=500, max_tokens=12, source="x")
    sampling = pb.SamplingParams(temperature=0.0)
    assert defaults.needs_fill(sampling)
    defaults.fill(sampling, vocab_size=320)
    assert (sampling.temperature, sampling.top_k, sampling.HasField("top_p")) == (0.0, 320, False)
    assert defaults.max_tokens_for(pb.SamplingParams(), resolved=100, min_tokens=0) == 12
    assert defaults.max_tokens_for(pb.SamplingParams(), resolved=8, min_tokens=0) == 8     # the context's room
    assert defaults.max_tokens_for(pb.SamplingParams(), resolved=100, min_tokens=30) == 30
    assert defaults.max_tokens_for(pb.SamplingParams(max_tokens=50), resolved=50, min_tokens=0) == 50
    assert not SamplingDefaults().needs_fill(pb.SamplingParams())


def test_the_openai_door_leaves_its_own_defaults_to_the_generation_config() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_request(chat, chat=True).params.sampling.temperature == 1.0     # OpenAI's
    with_defaults = SamplingDefaults(temperature=0.7, max_tokens=12)
    s = parse_request(chat, chat=True, defaults=with_defaults).params.sampling
    assert not s.HasField("temperature")            # the servicer fills in 0.7
    s = parse_request({**chat, "temperature": 0.2}, chat=True, defaults=with_defaults).params.sampling
    assert s.temperature == pytest.approx(0.2)
    assert parse_request({"prompt": "x"}, chat=False).params.sampling.max_tokens == 16
    assert not parse_request({"prompt": "x"}, chat=False,
                             defaults=with_defaults).params.sampling.HasField("max_tokens")


def test_chat_template_files_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "good.jinja"
    good.write_text(TEMPLATE)
    assert read_chat_template(good) == TEMPLATE
    generation = tmp_path / "generation.jinja"    # transformers' own {% generation %} tag parses
    generation.write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    read_chat_template(generation)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    for path, why in ((broken, "not a valid Jinja template: line 1"), (empty, "empty"),
                      (binary, "UTF-8"), (tmp_path / "missing.jinja", "no such file"), (tmp_path, "folder")):
        with pytest.raises(ModelSettingsError, match=why) as err:
            read_chat_template(path)
        assert "--chat-template" in str(err.value)


def test_served_names_reach_the_scheduler_process_in_order() -> None:
    from jitney.cli import build_parser
    from jitney.scheduler.main import SchedulerProcessConfig
    from jitney.scheduler.launch.supervisor import child_argv

    parser = build_parser()
    serve = parser.parse_args(["serve", "--served-model-name", "b", "--served-model-name", "a",
                               "--chat-template", "t.jinja", "--generation-config", "none"])
    sched = parser._subparsers._group_actions[0].choices["scheduler"]  # type: ignore[union-attr]
    cfg = SchedulerProcessConfig.from_namespace(sched.parse_args(child_argv(sched, serve)))
    assert (cfg.served_model_names, cfg.chat_template, cfg.generation_config) == (("b", "a"), "t.jinja", "none")
    assert SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler"])).served_model_names == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--served-model-name", ""])


# -- one server: names, template, defaults ----------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    config = json.loads((folder / "generation_config.json").read_text())   # what save_pretrained wrote
    (folder / "generation_config.json").write_text(json.dumps({**config, **GENERATION_CONFIG}))
    return folder


OPENAI_PORT = free_port()


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--model", str(model), "--num-blocks", "128", "--dtype", "float32", "--openai-port", str(OPENAI_PORT),
            "--served-model-name", PRIMARY, "--served-model-name", ALIAS, "--chat-template", str(template)]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{OPENAI_PORT}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def generate(server: Server, **sampling: object) -> pb.GenerateResponse:
    params = make_params(PROMPT, sampling=Sampling(seed=11, ignore_eos=True, **sampling))  # type: ignore[arg-type]
    return server.stub().Generate(pb.GenerateRequest(params=params), timeout=60)


@pytest.mark.slow
def test_get_model_info_names_the_primary(server: Server) -> None:
    assert server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name == PRIMARY
    assert f"ready on {server.target}: {PRIMARY} " in server.log()


@pytest.mark.slow
def test_the_openai_door_answers_to_every_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [PRIMARY, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    for name in (PRIMARY, ALIAS):
        reply = client.completions.create(model=name, prompt="hello", max_tokens=2)
        assert reply.model == PRIMARY
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert err.value.code == "model_not_found"
    assert PRIMARY in err.value.message and ALIAS in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny")


@pytest.mark.slow
def test_the_chat_template_flag_replaces_the_models(server: Server, client: openai.OpenAI, model: Path) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello jitney"}]
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in messages])
    reply = server.stub().Tokenize(pb.TokenizeRequest(chat=chat), timeout=10)
    assert "".join(reply.tokens) == "[system] be brief\n[user] hello jitney\n[assistant] "
    own = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    assert own.startswith("<|im_start|>system")      # what the flag replaced
    # The OpenAI door renders with it too.
    answer = client.chat.completions.create(model=PRIMARY, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.prompt_tokens == len(reply.token_ids)


@pytest.mark.slow
def test_generation_config_defaults_apply_where_the_request_sets_nothing(server: Server, model: Path) -> None:
    assert (f"sampling defaults from {model / 'generation_config.json'}: temperature=0.7, top_p=0.9, "
            "top_k=40, repetition_penalty=1.3, max_tokens (max_new_tokens)=12" in server.log())
    unset = generate(server)
    assert len(unset.token_ids) == 12 and unset.finish_reason == pb.FINISH_REASON_LENGTH
    spelled_out = generate(server, temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.3, max_tokens=12)
    assert list(unset.token_ids) == list(spelled_out.token_ids)
    assert list(unset.logprobs) == list(spelled_out.logprobs)
    # The gRPC door's own defaults (greedy, no penalty) would give another output.
    assert list(generate(server, temperature=0, top_p=1, top_k=0, repetition_penalty=1).token_ids) \
        != list(unset.token_ids)


@pytest.mark.slow
def test_a_requests_own_values_override_the_defaults(server: Server) -> None:
    assert len(generate(server, max_tokens=5).token_ids) == 5
    assert len(generate(server, max_tokens=30).token_ids) == 30
    assert len(generate(server, min_tokens=20).token_ids) == 20   # the default gives way to min_tokens
    greedy = generate(server, temperature=0)
    assert list(greedy.token_ids) == list(generate(server, temperature=0, top_p=0.9, top_k=40,
                                                   repetition_penalty=1.3).token_ids)
    assert list(greedy.token_ids) != list(generate(server).token_ids)
    # repetition_penalty 1 set by the request: not the default's 1.3.
    assert list(generate(server, temperature=0, repetition_penalty=1).token_ids) == list(
        generate(server, temperature=0, top_p=0.9, top_k=40, repetition_penalty=1).token_ids)


@pytest.mark.slow
def test_the_openai_door_takes_the_defaults_too(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=PRIMARY, prompt="hello", extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 12    # not OpenAI's 16
    assert client.completions.create(model=PRIMARY, prompt="hello", max_tokens=3,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3  # type: ignore[union-attr]
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model=PRIMARY, messages=messages, seed=4,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True})
    unset = str(reply.choices[0].message.content)
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert unset == chat_with(client, messages, temperature=0.7, top_p=0.9, max_tokens=12, top_k=40,
                              repetition_penalty=1.3)
    assert unset != chat_with(client, messages, temperature=1.0, top_p=0.9, max_tokens=12, top_k=40,
                              repetition_penalty=1.3)      # OpenAI's temperature 1 is not the default here


def chat_with(client: openai.OpenAI, messages: list[dict[str, str]], *, temperature: float, top_p: float,
              max_tokens: int, top_k: int, repetition_penalty: float) -> str:
    reply = client.chat.completions.create(
        model=PRIMARY, messages=messages, seed=4, temperature=temperature, top_p=top_p,  # type: ignore[arg-type]
        max_tokens=max_tokens, extra_body={"ignore_eos": True, "top_k": top_k,
                                           "repetition_penalty": repetition_penalty})
    return str(reply.choices[0].message.content)


# -- start-up refusals -------------------------------------------------------------------


def start(command: str, args: list[str], tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `jitney COMMAND` to its end (it is expected to refuse to start)."""
    link = ["--plan-addr", f"ipc://{tmp}/p", "--result-addr", f"ipc://{tmp}/r"] if command == "scheduler" else []
    cmd = [sys.executable, "-m", "jitney.cli", command, "--port", str(free_port()), *link, *args]
    if command == "serve":
        cmd.append("--no-standby-worker")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("template,why", [
    (None, "no such file"),
    ("{% for m in messages %}{{ m.content }", "not a valid Jinja template"),
    ("{{ raise_exception('this template takes no user turn') }}", "this template takes no user turn"),
    ("{% for m in messages %}hi{% endfor %}", "without its content"),
])
def test_a_bad_chat_template_stops_the_scheduler_with_status_2(model: Path, tmp_path: Path, template: str | None,
                                                               why: str) -> None:
    path = tmp_path / "chat.jinja"
    if template is not None:
        path.write_text(template)
    done = start("scheduler", ["--model", str(model), "--chat-template", str(path)], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--chat-template" in done.stderr and why in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_bad_chat_template_stops_serve_with_status_2(model: Path, tmp_path: Path) -> None:
    done = start("serve", ["--model", str(model), "--chat-template", str(tmp_path / "missing.jinja")], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--chat-template" in done.stderr and "no such file" in done.stderr


@pytest.mark.slow
def test_a_bad_generation_config_stops_the_scheduler_with_status_2(model: Path, tmp_path: Path) -> None:
    done = start("scheduler", ["--model", str(model), "--generation-config", str(tmp_path)], tmp_path)
    assert done.returncode == 2 and "--generation-config" in done.stderr, done.stderr
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 500}))
    done = start("scheduler", ["--model", str(model), "--generation-config", str(tmp_path)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "temperature must be in [0, 100], got 500" in done.stderr and "--generation-config none" in done.stderr


@pytest.mark.slow
def test_the_default_name_on_the_default_server(default_server: Server) -> None:
    info = default_server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == "SmolLM2-135M-Instruct"
