"""The README's examples as tests run them (tests/e2e/test_readme.py, and the
"LoRA adapters" section in tests/e2e/test_e2e_lora.py): the commands and
snippets of a section parsed out with the output shown after each, run
against a test server's doors, and compared with what the README shows
(test_readme.py's docstring has the rules).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.server_harness import ROOT, Server

README = ROOT / "README.md"
GRPC_ADDRESS = "127.0.0.1:50051"
OPENAI_ADDRESS = "127.0.0.1:8000"
CLIENT_COMMANDS = ("generate", "health", "bench")
ANY = "\u2026any\u2026"          # what `[...]` becomes when shown JSON is parsed
COMMAND_SECONDS = 120.0          # a hang guard, not a speed claim


@dataclass
class Example:
    kind: str                    # "shell" or "python"
    source: str                  # the command (continuations joined) or the code
    shown: str | None            # the output the README shows (None: none shown)
    line: int                    # of the command or the block's fence, 1-based
    shown_span: tuple[int, int] | None = None   # the shown output's character range in the README

    @property
    def label(self) -> str:
        return f"README.md:{self.line}: {self.source.splitlines()[0][:70]}"


# --- parsing -----------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


USE_IT = "Use it"
LORA = "LoRA adapters"          # run by tests/e2e/test_e2e_lora.py, on tests/support/lora_server.py


def readme_section(text: str, heading: str) -> tuple[int, str]:
    """The "## ``heading``" section (to the next "## " heading) and its offset in ``text``."""
    start = text.index(f"\n## {heading}\n") + 1
    end = text.find("\n## ", start + 1)
    return start, text[start:end if end >= 0 else len(text)]


def examples(text: str, heading: str = USE_IT) -> list[Example]:
    offset, section = readme_section(text, heading)
    found: list[Example] = []
    blocks = list(FENCE.finditer(section))
    for i, block in enumerate(blocks):
        lang, body = block.group(1), block.group(2)
        body_at = offset + block.start(2)
        fence_line = text.count("\n", 0, offset + block.start()) + 1
        if lang == "sh":
            found += _shell_examples(text, body, body_at)
        elif lang == "python":
            shown, span = None, None
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            if nxt is not None and nxt.group(1) == "text" and not section[block.end():nxt.start()].strip():
                shown = nxt.group(2)
                span = (offset + nxt.start(2), offset + nxt.end(2))
            found.append(Example("python", body, shown, fence_line, span))
    return found


def _shell_examples(text: str, body: str, body_at: int) -> list[Example]:
    """The commands of one ```sh block. With `$ ` prompts, the lines after a
    command (to the next prompt) are its shown output; without, every line
    is a command."""
    lines = body.splitlines(keepends=True)
    prompted = any(line.startswith("$ ") for line in lines)
    found: list[Example] = []
    pos, i = body_at, 0
    while i < len(lines):
        line = lines[i]
        start_line = text.count("\n", 0, pos) + 1
        if prompted and not line.startswith("$ ") or not line.strip():
            pos += len(line)
            i += 1
            continue
        command = line.removeprefix("$ ")
        pos += len(line)
        i += 1
        while (command.endswith("\\\n") or _open_quote(command)) and i < len(lines):
            command += lines[i]
            pos += len(lines[i])
            i += 1
        shown, span = None, None
        if prompted:
            out_start = pos
            while i < len(lines) and not lines[i].startswith("$ "):
                pos += len(lines[i])
                i += 1
            shown_text = text[out_start:pos]
            stripped = shown_text.rstrip("\n")
            if stripped.strip():
                shown, span = stripped + "\n", (out_start, out_start + len(stripped) + 1)
        source = re.sub(r"\\\n\s*", " ", command).strip()
        found.append(Example("shell", re.sub(r"\s+# [^'\"]*$", "", source), shown, start_line, span))
    return found


def _open_quote(command: str) -> bool:
    """Whether a shell quote opened in ``command`` is still open (a newline inside a
    quoted argument continues the command)."""
    try:
        shlex.split(command.replace("\\\n", " "))
    except ValueError:
        return True
    return False


# --- running -----------------------------------------------------------------

@dataclass
class Doors:
    grpc: str
    openai: str


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}


def _addressed(source: str, doors: Doors) -> str:
    return source.replace(GRPC_ADDRESS, doors.grpc).replace(OPENAI_ADDRESS, doors.openai)


def run_shell(ex: Example, doors: Doors) -> str:
    """Run one shell command of the README; its stdout (a failure raises)."""
    argv = shlex.split(_addressed(ex.source, doors))
    if argv[0] == "grpcurl":
        return _grpcurl(argv, doors)
    if argv[0] == "jitney" and len(argv) > 1 and argv[1] in CLIENT_COMMANDS and "--target" not in argv:
        argv += ["--target", doors.grpc]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=COMMAND_SECONDS)
    if proc.returncode != 0:
        raise AssertionError(f"{ex.label}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def run_python(ex: Example, doors: Doors) -> str:
    proc = subprocess.run([sys.executable, "-c", _addressed(ex.source, doors)], capture_output=True,
                          text=True, env=_env(), cwd=ROOT, timeout=COMMAND_SECONDS)
    if proc.returncode != 0:
        raise AssertionError(f"{ex.label}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _grpcurl(argv: list[str], doors: Doors) -> str:
    if shutil.which("grpcurl"):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_SECONDS)
        if proc.returncode != 0:
            raise AssertionError(f"grpcurl exit {proc.returncode}: {proc.stderr}")
        return proc.stdout
    return _grpcurl_by_reflection(argv)


def _grpcurl_by_reflection(argv: list[str]) -> str:
    """What grpcurl does for `-plaintext [-d BODY] ADDRESS (list | SERVICE/METHOD)`:
    reads the schema through server reflection, parses BODY with protobuf's
    JSON mapping, calls, and prints each response as JSON."""
    import grpc
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    args = argv[1:]
    body = "{}"
    if "-d" in args:
        body = args[args.index("-d") + 1]
        del args[args.index("-d"):args.index("-d") + 2]
    if "-plaintext" not in args:
        raise AssertionError(f"the README's grpcurl examples are plaintext: {argv}")
    args.remove("-plaintext")
    if len(args) != 2 or any(a.startswith("-") for a in args):
        raise AssertionError(f"a grpcurl form this test does not know: {argv}")
    address, what = args
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        if what == "list":
            return "".join(f"{name}\n" for name in sorted(db.get_services()))
        service_name, method_name = what.rsplit("/", 1)
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName(service_name).FindMethodByName(method_name)
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(body, request_cls())
        path = f"/{service_name}/{method_name}"
        kind = channel.unary_stream if method.server_streaming else channel.unary_unary
        call = kind(path, request_serializer=request_cls.SerializeToString,
                    response_deserializer=response_cls.FromString)
        result = call(request, timeout=COMMAND_SECONDS)
        replies = list(result) if method.server_streaming else [result]
        if not replies:
            raise AssertionError(f"{what}: no response")
        return "".join(json_format.MessageToJson(r) + "\n" for r in replies)


# --- comparing ---------------------------------------------------------------

SAMPLE_HEADER = re.compile(r"^--- sample (\d+) ---$", re.M)
SAMPLE_END = re.compile(r"^--- end of sample (\d+) \((\w+)\) ---$\n?", re.M)   # not part of the text


def is_sampled(ex: Example) -> bool:
    argv = shlex.split(ex.source)
    if "--temperature" in argv:
        return float(argv[argv.index("--temperature") + 1]) > 0
    return False


def mismatch(ex: Example, actual: str) -> str | None:
    """Why ``actual`` is not what the README shows after ``ex`` (None: it is)."""
    assert ex.shown is not None
    if ex.kind == "shell" and is_sampled(ex):
        return _shape_mismatch(ex.shown, actual)
    shown_json = _shown_json(ex.shown) if prints_json_document(ex) else None
    if shown_json is not None:
        try:
            actual_json = json.loads(actual)
        except json.JSONDecodeError:
            return f"the README shows JSON, the program printed:\n{actual}"
        return None if _json_matches(shown_json, actual_json) else (
            f"shown:\n{ex.shown}\nprinted:\n{actual}")
    pattern = ".*?".join(re.escape(part) for part in ex.shown.rstrip("\n").split("..."))
    if re.fullmatch(pattern, actual.rstrip("\n"), re.S):
        return None
    return f"shown:\n{ex.shown}\nprinted:\n{actual}"


def prints_json_document(ex: Example) -> bool:
    """A `jitney` client command with `--json`: its output is compared as JSON."""
    return ex.kind == "shell" and "--json" in shlex.split(ex.source)


def _shape_mismatch(shown: str, actual: str) -> str | None:
    shown_heads = [m.group(1) for m in SAMPLE_HEADER.finditer(shown)]
    actual_heads = [m.group(1) for m in SAMPLE_HEADER.finditer(actual)]
    if shown_heads != actual_heads:
        return f"sample headers {shown_heads} shown, {actual_heads} printed:\n{actual}"
    heads = list(SAMPLE_HEADER.finditer(actual))
    ends = [h.start() for h in heads[1:]] + [len(actual)]
    texts = [SAMPLE_END.sub("", actual[h.end():end]) for h, end in zip(heads, ends)] if heads else [actual]
    if any(not t.strip() for t in texts):
        return f"an empty sample:\n{actual}"
    return None


def _shown_json(shown: str) -> object | None:
    text = shown.strip()
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text.replace("[...]", json.dumps(ANY)))
    except json.JSONDecodeError:
        return None


def _json_matches(shown: object, actual: object) -> bool:
    if shown == ANY:
        return True
    if isinstance(shown, dict):
        return (isinstance(actual, dict) and shown.keys() == actual.keys()
                and all(_json_matches(v, actual[k]) for k, v in shown.items()))
    if isinstance(shown, list):
        return (isinstance(actual, list) and len(shown) == len(actual)
                and all(_json_matches(s, a) for s, a in zip(shown, actual)))
    return bool(shown == actual and type(shown) is type(actual))


def shown_form(ex: Example, actual: str) -> str:
    """What the README should show for ``actual`` (``--write``): a `--json`
    document one line per top-level key, with ids elided as `[...]`; anything
    else as printed (a structured output's own layout is part of what it shows)."""
    as_printed = actual if actual.endswith("\n") else actual + "\n"
    if not prints_json_document(ex):
        return as_printed
    try:
        obj = json.loads(actual)
    except json.JSONDecodeError:
        return as_printed
    if not isinstance(obj, dict):
        return actual
    parts = [f"{json.dumps(k)}: " + ("[...]" if k in ELIDED else _elided(json.dumps(v, ensure_ascii=False)))
             for k, v in obj.items()]
    return "{" + ",\n ".join(parts) + "}\n"


ELIDED = ("token_ids", "request_id")     # ids that differ by build or call


def _elided(text: str) -> str:
    """Nested token id lists (the samples') as `[...]` too."""
    return re.sub(r'("token_ids": )\[[^\]]*\]', r"\1[...]", text)


# --- the server ----------------------------------------------------------------

def wait_openai(server: Server, port: int) -> None:
    """Until the server's OpenAI door (``port``) answers /health."""
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"OpenAI door not up:\n{server.log()}")
        time.sleep(0.3)
