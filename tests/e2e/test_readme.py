"""The README's "Use it" section, executed against the default model.

Every command and Python snippet of that section runs against one
`jitney serve --openai-port P` on the bundled model, and what the README
shows after it must be what the program prints:

    shown after               compared
    a greedy command          exactly (`...` in the shown text stands for anything,
                              `[...]` in shown JSON for any value)
    a sampled command         by shape (`--temperature` > 0: the same sample
    (--temperature > 0)       headers, each sample's text not empty), since a
                              seed's bits belong to one CPU and build
    a ```python block         its stdout, by the ```text block right after it, if any
    a grpcurl command         that it succeeds: run by grpcurl where it is on the PATH,
                              else the same call made the way grpcurl makes it (the
                              method and message types read through server reflection,
                              the body parsed with protobuf's JSON mapping)

The README's addresses (`127.0.0.1:50051`, `http://127.0.0.1:8000`) are
replaced by the test server's, and a `jitney` client command without
`--target` gets the server's. The "LoRA adapters" section's commands are
compared the same way by tests/e2e/test_e2e_lora.py, on its own server
(tests/support/lora_server.py: a tiny model, random adapters in place of
`/adapters/NAME`). The parsing, running and comparing live in
tests/support/readme_examples.py. To regenerate
the shown outputs from the program (after a change that alters them, on
the default model, and the LoRA section's on that server):

    .venv/bin/python tests/e2e/test_readme.py --write
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]   # the repository (this file is in tests/<part>/)
if str(ROOT) not in sys.path:   # run as a script (--write)
    sys.path.insert(0, str(ROOT))

from tests.support.readme_examples import (  # noqa: E402
    LORA, README, Doors, Example, examples, mismatch, run_python, run_shell, shown_form, wait_openai)
from tests.support.server_harness import free_port, running_server  # noqa: E402


# --- the test ------------------------------------------------------------------

@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Doors]:
    openai_port = free_port()
    with running_server(["--openai-port", str(openai_port)], tmp_path_factory.mktemp("readme")) as server:
        wait_openai(server, openai_port)
        yield Doors(server.target, f"127.0.0.1:{openai_port}")


README_EXAMPLES = examples(README.read_text())


def test_the_use_it_section_has_examples() -> None:
    # Commands with shown output, commands without, and Python snippets: a
    # parser that lost any of them would leave the README unchecked.
    assert sum(ex.kind == "shell" and ex.shown is not None for ex in README_EXAMPLES) >= 3
    assert sum(ex.kind == "shell" and ex.shown is None for ex in README_EXAMPLES) >= 3
    assert sum(ex.source.startswith("grpcurl") for ex in README_EXAMPLES) >= 3
    assert sum(ex.kind == "python" for ex in README_EXAMPLES) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("ex", README_EXAMPLES, ids=lambda ex: f"line{ex.line}")
def test_readme_example(ex: Example, doors: Doors) -> None:
    actual = run_shell(ex, doors) if ex.kind == "shell" else run_python(ex, doors)
    if ex.shown is not None:
        problem = mismatch(ex, actual)
        assert problem is None, f"{ex.label}: the README and the program disagree "\
                                f"(`python tests/e2e/test_readme.py --write` regenerates):\n{problem}"


def test_the_comparison_can_fail() -> None:
    """The matcher itself: a shown output that differs is caught."""
    greedy = Example("shell", 'jitney generate "x"', "The capital is Paris.\n", 1)
    assert mismatch(greedy, "The capital is Paris.\n") is None
    assert mismatch(greedy, "The capital is Lyon.\n") is not None
    shown_json = Example("shell", "jitney generate x --json", '{"text": "a", "token_ids": [...],\n "n": 3}\n', 1)
    assert mismatch(shown_json, '{"text": "a", "token_ids": [1, 2], "n": 3}') is None
    assert mismatch(shown_json, '{"text": "a", "token_ids": [1, 2], "n": 4}') is not None
    assert mismatch(shown_json, '{"text": "a", "token_ids": [1], "n": 3, "extra": 1}') is not None
    structured = Example("shell", "jitney generate x --json-schema S", '{"city": "Lyon"}\n', 1)
    assert mismatch(structured, '{"city": "Lyon"}\n') is None
    assert mismatch(structured, '{\n  "city": "Lyon"\n}\n') is not None    # the layout counts
    sampled = Example("shell", "jitney generate x -n 2 --temperature 0.9",
                      "--- sample 0 ---\nab\n--- end of sample 0 (length) ---\n"
                      "--- sample 1 ---\ncd\n--- end of sample 1 (stop) ---\n", 1)
    assert mismatch(sampled, "--- sample 0 ---\nzz\n--- end of sample 0 (stop) ---\n"
                             "--- sample 1 ---\nyy\n--- end of sample 1 (length) ---\n") is None
    assert mismatch(sampled, "--- sample 0 ---\nzz\n--- end of sample 0 (stop) ---\n") is not None
    assert mismatch(sampled, "--- sample 0 ---\n\n--- end of sample 0 (stop) ---\n"
                             "--- sample 1 ---\nyy\n--- end of sample 1 (length) ---\n") is not None
    assert shown_form(shown_json, '{"request_id": "ab12", "token_ids": [1], "samples": [{"token_ids": [1, 2]}]}') \
        == '{"request_id": [...],\n "token_ids": [...],\n "samples": [{"token_ids": [...]}]}\n'


# --- regenerating ----------------------------------------------------------------

def write_shown_outputs() -> int:
    """Start a server, run every example, and rewrite the README's shown outputs
    (the "LoRA adapters" section's on tests/support/lora_server.py's)."""
    import tempfile

    from tests.support.lora_server import readme_outputs

    text = README.read_text()
    found = [ex for ex in examples(text) if ex.shown_span is not None]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            running_server(["--openai-port", str(port)], Path(tmp)) as server:
        wait_openai(server, port)
        doors = Doors(server.target, f"127.0.0.1:{port}")
        outputs = [(ex, run_shell(ex, doors) if ex.kind == "shell" else run_python(ex, doors)) for ex in found]
    outputs += readme_outputs([ex for ex in examples(text, LORA) if ex.shown_span is not None])
    for ex, actual in sorted(outputs, key=lambda pair: -pair[0].shown_span[0]):   # type: ignore[index]
        start, end = ex.shown_span   # type: ignore[misc]
        text = text[:start] + shown_form(ex, actual) + text[end:]
        print(f"{ex.label}\n{shown_form(ex, actual)}")
    README.write_text(text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print(__doc__)
        sys.exit(2)
    sys.exit(write_shown_outputs())
