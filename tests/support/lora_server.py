"""One `jitney serve` with LoRA adapters, as the README's "LoRA adapters"
section starts it, for tests/e2e/test_e2e_lora.py and for regenerating that
section's shown outputs (tests/e2e/test_readme.py --write).

The server runs the section's `jitney serve` command on a tiny random Llama
(`--model`, `--dtype float32` and a small cache added), each `/adapters/NAME`
folder replaced by a random PEFT adapter of that model (``ADAPTERS``; plus
``other-model``, an adapter of another base model's shapes).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from tests.support.lora_folders import write_adapter
from tests.support.readme_examples import LORA, README, Doors, Example, examples, run_shell, wait_openai
from tests.support.server_harness import Server, free_port, running_server
from tests.support.tiny_lora import ATTENTION, MLP, make_peft_adapter
from tests.support.tiny_models import make_tiny_llama

# The README's adapters (sql, chat: --lora-modules; math: loaded at runtime), and one of a
# rank above --max-lora-rank (lora_server adds one of another base model's shapes).
ADAPTERS: dict[str, dict[str, Any]] = {
    "sql": dict(rank=8, alpha=16, seed=1),
    "chat": dict(rank=4, alpha=8, targets=ATTENTION, seed=2),
    "math": dict(rank=16, alpha=32, targets=MLP, seed=3),
    "too-big": dict(rank=32, alpha=32, seed=4),
}
LORA_EXAMPLES = examples(README.read_text(), LORA)
SERVE = [ex for ex in LORA_EXAMPLES if ex.source.startswith("jitney serve")]


@dataclass
class Lora:
    """The running server, its OpenAI door's port, the model folder and the adapters' (by name)."""

    server: Server
    openai_port: int
    model: Path
    adapters: dict[str, Path]

    @property
    def base(self) -> str:
        return self.model.name

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.openai_port}/v1", api_key="unused",
                             timeout=120, max_retries=0)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.openai_port}{path}",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                text = reply.read().decode()
                return reply.status, json.loads(text) if text.startswith("{") else text
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def models(self) -> dict[str, dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.openai_port}/v1/models", timeout=60) as reply:
            return {m["id"]: m for m in json.loads(reply.read())["data"]}



def adapted(source: str, adapters: dict[str, Path]) -> str:
    """A README command with each `/adapters/NAME` folder replaced by ``adapters[NAME]``."""
    return re.sub(r"/adapters/([\w-]+)", lambda m: shlex.quote(str(adapters[m.group(1)])), source)


def serve_args(openai_port: int, adapters: dict[str, Path], model: Path) -> list[str]:
    """The README's `jitney serve` command's flags, on ``model`` and ``adapters``."""
    assert len(SERVE) == 1, "the LoRA section shows one `jitney serve` command"
    argv = shlex.split(adapted(SERVE[0].source, adapters))
    assert argv[:2] == ["jitney", "serve"] and "--openai-port" in argv, argv
    argv[argv.index("--openai-port") + 1] = str(openai_port)
    return [*argv[2:], "--model", str(model), "--dtype", "float32", "--num-blocks", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]


@contextmanager
def lora_server(tmp: Path) -> Iterator[Lora]:
    """The model, the adapters and the server's log under ``tmp``; the server until the block ends."""
    model = make_tiny_llama(tmp / "llama", max_position_embeddings=4096)
    adapters = {name: make_peft_adapter(model, tmp / "adapters" / name, **kw) for name, kw in ADAPTERS.items()}
    adapters["other-model"] = write_adapter(tmp / "adapters" / "other-model", shapes={"q_proj": (96, 96)})
    port = free_port()
    with running_server(serve_args(port, adapters, model), tmp) as server:
        wait_openai(server, port)
        yield Lora(server, port, model, adapters)


def readme_outputs(found: list[Example]) -> list[tuple[Example, str]]:
    """What the LoRA section's commands print (test_readme.py's --write)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, lora_server(Path(tmp)) as lora:
        return [(ex, run_readme(ex, lora)) for ex in found if ex not in SERVE]


def run_readme(ex: Example, lora: Lora) -> str:
    """Run one of the section's commands against ``lora``'s server; its stdout."""
    assert ex.kind == "shell", ex.label
    doors = Doors(lora.server.target, f"127.0.0.1:{lora.openai_port}")
    return run_shell(dataclasses.replace(ex, source=adapted(ex.source, lora.adapters)), doors)
