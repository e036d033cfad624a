"""Fixtures of the scheduler's tests.

The grammar tests (test_grammar.py, test_grammar_json.py): the served
tokenizer (SmolLM2's), a logits width wider than it (``PAD``, so the padding
ids are checked too), one event loop and one compiler per module.

The security tests (test_security.py, test_security_flags.py): throw-away
certificates, an API key file, a tiny random model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from jitney.scheduler.core.grammar import GrammarCompiler
from tests.support.certs import Pki, make_pki
from tests.support.grammar_formats import PAD
from tests.support.security_keys import ALICE, BOB

T = TypeVar("T")


# -- grammar --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(None), cache_root())


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> int:
    return len(tokenizer) + PAD


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def run(loop: asyncio.AbstractEventLoop) -> Callable[[Coroutine[Any, Any, T]], T]:
    return loop.run_until_complete


@pytest.fixture(scope="module")
def compiler(tokenizer: Any, vocab: int) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, vocab)
    yield c
    c.close()


@pytest.fixture(scope="module")
def token_bytes(compiler: GrammarCompiler, tokenizer: Any) -> list[bytes]:
    return [compiler.engine_tokenizer.decode_bytes([i]) for i in range(len(tokenizer))]


@pytest.fixture(scope="module")
def special(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in tokenizer.all_special_ids}
    return ids | {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}


# -- security -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# the test's keys\nalice:{ALICE}\n\nbob:{BOB}\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
