"""The security flags and the API key file (scheduler/security/tls.py,
scheduler/security/keys.py), and the real `jitney serve` with TLS and keys on
a tiny random model: the flags reach the scheduler process, and nothing its
processes print shows a prompt or a key. The doors themselves, served in this
process, are in test_security.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.certs import Pki
from tests.support.security_keys import ALICE, BOB, PROMPT, TIMEOUT, WRONG
from tests.support.server_harness import running_server
from tests.support.waiting import wait_for
from jitney.client.channel import TlsFiles
from jitney.scheduler.main import SchedulerProcessConfig
from jitney.scheduler.security.keys import bearer_token
from jitney.scheduler.security.tls import (SecurityError, ServerSecurity, check_flags, exposure_warning,
                                       load_security, parse_api_keys)
from jitney.v1 import generation_pb2 as pb


# -- flags and the key file -----------------------------------------------------------


def test_key_file_names_comments_and_warnings() -> None:
    keys, warnings = parse_api_keys(f"# comment\n\n{ALICE}\nbob:{BOB}\n  ci.build-2 : short-key \n")
    assert keys.names == ["key-3", "bob", "ci.build-2"]
    assert keys.identify(ALICE) == "key-3" and keys.identify(BOB) == "bob"
    assert keys.identify("short-key") == "ci.build-2"
    assert keys.identify(WRONG) is None and keys.identify(None) is None and keys.identify("") is None
    assert len(warnings) == 1 and "'ci.build-2'" in warnings[0] and "short-key" not in warnings[0]


@pytest.mark.parametrize("text,error", [
    (f"a:{ALICE}\na:{BOB}\n", "line 2: the name 'a' is already used on line 1"),
    (f"a:{ALICE}\nb:{ALICE}\n", "line 2: the same key as line 1"),
    (f"{ALICE}\nkey-1:{BOB}\n", "line 2: the name 'key-1' is already used on line 1"),
    ("a:\n", "line 1: key 'a' is empty"),
    (f"a b:{ALICE}\n", "line 1: a key name is"),
    (f"a:{ALICE} extra\n", "line 1: a key is printable ASCII without spaces"),
    ("# nothing\n\n", "no keys"),
])
def test_key_file_errors_name_the_line_never_the_key(text: str, error: str) -> None:
    with pytest.raises(SecurityError) as err:
        parse_api_keys(text)
    assert error in str(err.value)
    assert ALICE not in str(err.value) and BOB not in str(err.value)


def test_flag_combinations_and_files(tmp_path: Path, pki: Pki, key_file: Path) -> None:
    for args, error in [((str(pki.server_cert), None, None, None, None), "go together"),
                        ((None, str(pki.server_key), None, None, None), "go together"),
                        ((None, None, str(pki.ca), None, None), "--tls-client-ca needs"),
                        ((None, None, None, None, 3), "needs --api-key-file")]:
        with pytest.raises(SecurityError, match=error):
            check_flags(*args)
    missing = str(tmp_path / "missing.pem")
    for args, error in [((missing, str(pki.server_key), None, None, None), "--tls-cert .*cannot read"),
                        ((str(pki.server_cert), str(pki.client_key), None, None, None),
                         "not a PEM certificate chain and the private key that matches it"),
                        ((str(pki.server_cert), str(key_file), None, None, None), "not a PEM file"),
                        ((None, None, None, missing, None), "--api-key-file .*cannot read")]:
        with pytest.raises(SecurityError, match=error):
            load_security(*args)
    security, warnings = load_security(str(pki.server_cert), str(pki.server_key), str(pki.ca),
                                       str(key_file), 4)
    assert security.tls is not None and security.tls.client_ca is not None and warnings == []


def test_jitney_serve_hands_the_flags_to_its_scheduler() -> None:
    from jitney.cli import build_parser
    from jitney.scheduler.launch.supervisor import child_argv

    parser = build_parser()
    flags = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
             "--api-key-file", "keys.txt", "--max-requests-per-key", "3"]
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    argv = child_argv(sub["scheduler"], parser.parse_args(["serve", *flags]))
    cfg = SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler", *argv]))
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.api_key_file, cfg.max_requests_per_key) \
        == ("c.pem", "k.pem", "ca.pem", "keys.txt", 3)
    plain = SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler"]))
    assert (plain.tls_cert, plain.api_key_file, plain.max_requests_per_key) == (None, None, None)


def test_jitney_refuses_to_start_on_bad_security_flags(tmp_path: Path, pki: Pki,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from jitney.cli import main

    assert main(["serve", "--tls-cert", str(pki.server_cert)]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert main(["scheduler", "--api-key-file", str(tmp_path / "none")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_exposure_warning_for_plaintext_off_loopback() -> None:
    assert exposure_warning("127.0.0.1", ServerSecurity()) is None
    assert exposure_warning("localhost", ServerSecurity()) is None
    assert exposure_warning("::1", ServerSecurity()) is None
    assert "clear text" in (exposure_warning("0.0.0.0", ServerSecurity()) or "")
    assert bearer_token("Bearer  abc ") == "abc" and bearer_token("abc") is None


# -- real processes -----------------------------------------------------------------------


@pytest.mark.slow
def test_jitney_serve_with_tls_and_keys(model: Path, pki: Pki, tmp_path: Path) -> None:
    """`jitney serve` passes the flags to its scheduler; the client commands use
    TLS and keys; nothing either process prints shows the prompt, its token ids
    or a key (without --log-prompts), and the request line names the key."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nshort:abc123\n")
    tls = TlsFiles(pki.ca)
    args = ["--model", str(model), "--num-blocks", "64", "--dtype", "float32", "--log-level", "debug",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--api-key-file", str(keys), "--max-requests-per-key", "4"]
    with running_server(args, tmp_path, tls=tls, api_key=ALICE) as server:
        cli = [sys.executable, "-m", "jitney.cli"]
        env = {**os.environ, "JITNEY_API_KEY": ALICE}
        health = subprocess.run([*cli, "health", "--target", server.target, "--tls-ca", str(pki.ca)],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
        generate = [*cli, "generate", PROMPT, "--target", server.target, "--tls-ca", str(pki.ca),
                    "--max-tokens", "4", "--ignore-eos"]
        ok = subprocess.run(generate, capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0, ok.stderr
        refused = subprocess.run([*generate, "--api-key", WRONG], capture_output=True, text=True,
                                 timeout=60, env=env)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        ids = list(server.stub().Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=TIMEOUT).token_ids)
        wait_for(lambda: "key=alice" in server.log(), what="no request line")
    log = server.log()
    assert "gRPC listening on" in log and "(TLS, 2 API keys, at most 4 in flight each;" in log
    assert log.count("'short'") == 1 and "abc123" not in log        # warned once, never shown
    assert "key=alice tokens in=" in log and "rejected UNAUTHENTICATED" in log
    for secret in (PROMPT, "quokka", ", ".join(map(str, ids)), " ".join(map(str, ids)), ALICE, WRONG):
        assert secret not in log, secret
