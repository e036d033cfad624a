"""The scheduler process: gRPC server, tokenizer, engine loop.

Start order: bind gRPC (health NOT_SERVING, calls get UNAVAILABLE), the
metrics port and the OpenAI door, bind the ZeroMQ sockets, load the
tokenizer, wait for the worker's Ready handshake, size the scheduler from
the cache geometry it reports, then serve. A door whose port cannot be
bound (another server listens there) stops the start with exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

from jitney.common.arg_types import int_in, non_negative_float, positive_float, positive_int, tcp_port
from jitney.common.ports import bind_problem
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.admission import AdmissionLimits
from jitney.scheduler.security.keys import KeyLimiter
from jitney.scheduler.core.config import MAX_SPECULATIVE_TOKENS, SchedulerConfig, SchedulingPolicy, max_model_len_for
from jitney.scheduler.core.fairness import FAIRNESS_MODES, FairnessMode, check_weights, parse_weight
from jitney.scheduler.core.speculative import SPECULATIVE_METHODS, SpeculativeMethod
from jitney.scheduler.api.sampling_defaults import SamplingDefaults
from jitney.scheduler.core.engine import Engine
from jitney.common.model_files import (ModelFiles, ModelNotFoundError, ModelSettingsError, cache_root,
                                       generation_config, load_tokenizer, model_name, read_chat_template,
                                       resolve_model, use_chat_template)
from jitney.common.zmq_security import (ServerKeys, add_link_security_arguments, check_endpoint,
                                         load_server_keys)
from jitney.scheduler.api.grpc import grpc_server, set_health
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.security.tls import (SecurityError, ServerSecurity, add_security_arguments,
                                       exposure_warning, listen_grpc, load_security, security_fields)
from jitney.scheduler.lifecycle import Lifecycle, add_production_arguments, production_fields
from jitney.scheduler.core.trace import StepTracer
from jitney.scheduler.core.worker_link import WorkerLink, WorkerLinkError
from jitney.scheduler.api.lora_service import LoraService, read_lora_modules

if TYPE_CHECKING:
    from jitney.scheduler.api.http.openai_responses.store import StoreConfig

log = logging.getLogger("jitney.scheduler")


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """Settings of the scheduler process (flags of `jitney scheduler`)."""

    model: str | None            # model path for the tokenizer; None = bundled default
    host: str                    # gRPC bind address (loopback unless told otherwise)
    port: int                    # gRPC port
    max_num_seqs: int | None            # seats: sequences in one step; None = the worker's
    max_num_batched_tokens: int | None  # token budget of one step; None = the worker's
    policy: SchedulingPolicy     # continuous | static | sequential
    plan_addr: str               # ZeroMQ endpoint the scheduler binds for plans
    result_addr: str             # ZeroMQ endpoint the scheduler binds for results
    trace: str | None = None     # write a JSONL step trace here (see scheduler/core/trace.py)
    prefix_cache: bool = True    # share cached prompt prefixes (off: --no-prefix-cache)
    max_queued_requests: int = 256       # waiting requests; beyond: RESOURCE_EXHAUSTED
    max_queued_tokens: int = 262_144     # tokens of waiting requests; beyond: RESOURCE_EXHAUSTED
    max_request_seconds: float | None = None  # server cap on a request's life (+ its deadline)
    worker_timeout: float = 30.0         # a worker silent this long is lost
    drain_seconds: float = 30.0          # SIGTERM: grace for running requests
    metrics_port: int = 0                # Prometheus /metrics on host:port; 0 = off
    log_prompts: bool = False            # put prompts in the per-request log line
    openai_port: int = 0                 # OpenAI-compatible HTTP API on host:port; 0 = off
    tls_cert: str | None = None          # PEM certificate chain: TLS on both doors (with tls_key)
    tls_key: str | None = None           # PEM private key of tls_cert
    tls_client_ca: str | None = None     # PEM CA that client certificates must chain to (mTLS)
    api_key_file: str | None = None      # keys that calls must bear (scheduler/security/tls.py)
    max_requests_per_key: int | None = None  # generation requests in flight per key; None = any
    curve_keys: str | None = None        # folder of the link's Curve keys (jitney.common.zmq_security)
    insecure_plaintext_zmq: bool = False  # allow a tcp:// link without keys
    served_model_names: tuple[str, ...] = ()  # the API's names of the model, primary first; () = its own
    chat_template: str | None = None     # a Jinja file that replaces the model's chat template
    generation_config: str = "auto"      # sampling defaults: auto (the model's), none, or a folder
    responses_store: str | None = None   # the Responses API's store folder; None = default_store_dir()
    responses_store_enabled: bool = True  # off: --no-responses-store (nothing stored)
    responses_store_max_mb: float = 512.0      # stored responses' bytes cap (MiB); oldest evicted first
    responses_store_max_age: float = 30 * 24 * 3600.0  # seconds a stored response is kept
    tool_call_parser: str = "auto"       # tool-call format: auto (from the chat template) or a family
    reasoning_parser: str = "auto"       # <think> output split off: auto (from the template), on, off
    speculative: SpeculativeMethod = "off"   # speculative decoding: off | ngram | suffix | draft (core/speculative.py)
    num_speculative_tokens: int = 4      # the most drafts a sequence verifies in one step
    max_step_ms: float = 0.0             # a step with decodes: predicted model ms at most this; 0 = off
    jump_forward: bool = True            # off: --no-jump-forward (grammar-forced tokens sampled one a step)
    fairness: FairnessMode = "off"       # off | tenant: share between tenants (core/fairness.py)
    tenant_weights: tuple[tuple[str, float], ...] = ()  # --tenant-weight NAME=W (with the key file's)
    lora_modules: tuple[str, ...] = ()   # --lora-modules NAME=PATH: adapters served from the start

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "SchedulerProcessConfig":
        return cls(ns.model, ns.host, ns.port, ns.max_num_seqs, ns.max_num_batched_tokens,
                   ns.policy, ns.plan_addr, ns.result_addr, ns.trace,
                   not ns.no_prefix_cache, **production_fields(ns), openai_port=ns.openai_port,
                   curve_keys=ns.curve_keys, insecure_plaintext_zmq=ns.insecure_plaintext_zmq,
                   served_model_names=tuple(ns.served_model_name or ()), chat_template=ns.chat_template,
                   generation_config=ns.generation_config, **security_fields(ns),
                   responses_store=ns.responses_store, responses_store_enabled=not ns.no_responses_store,
                   responses_store_max_mb=ns.responses_store_max_mb,
                   responses_store_max_age=ns.responses_store_max_age,
                   tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                   speculative=ns.speculative, num_speculative_tokens=ns.num_speculative_tokens,
                   max_step_ms=ns.max_step_ms, jump_forward=not ns.no_jump_forward,
                   fairness=ns.fairness, tenant_weights=tuple(tenant_weight(w) for w in ns.tenant_weight or ()),
                   lora_modules=tuple(ns.lora_modules or ()))

    def weights(self, security: ServerSecurity) -> tuple[tuple[str, float], ...]:
        """Tenant weights of the key file and --tenant-weight. Raises ValueError."""
        if self.tenant_weights and self.fairness != "tenant":
            raise ValueError("--tenant-weight needs --fairness tenant")
        keyed = security.keys.weights if security.keys is not None else {}
        for tenant, _ in self.tenant_weights:
            if tenant in keyed:
                raise ValueError(f"--tenant-weight {tenant}: the key file gives that key a weight already")
        weights = tuple(keyed.items()) + self.tenant_weights if self.fairness == "tenant" else ()
        check_weights(weights)      # a tenant given twice
        return weights

    def load_security(self) -> tuple[ServerSecurity, list[str]]:
        """The TLS credentials and API keys of the flags, and warnings. Raises SecurityError."""
        return load_security(self.tls_cert, self.tls_key, self.tls_client_ca, self.api_key_file,
                             self.max_requests_per_key)


def add_scheduler_arguments(parser: argparse.ArgumentParser, *, with_shared: bool = True) -> None:
    """Flags of the scheduler process; ``with_shared=False`` leaves out those
    the worker's flags already define (for `jitney serve`)."""
    if with_shared:
        parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
        parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                            help="seats: most sequences running at once (default: the worker's)")
        parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                            help="token budget of one step (default: the worker's)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address of the gRPC port, the OpenAI door and the metrics port "
                             "(default 127.0.0.1)")
    parser.add_argument("--port", type=tcp_port, default=50051,
                        help="gRPC port (default 50051); one in use by another server stops the start (exit 2)")
    parser.add_argument("--openai-port", type=_port_or_off, default=0, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                             "/v1/completions, /v1/models) on --host:PORT; 0 = off (default)")
    parser.add_argument("--policy", choices=["continuous", "static", "sequential"], default="continuous",
                        help="batching policy")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="turn off prefix caching (sharing the KV blocks of common prompt prefixes)")
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS, default="off",
                        help="speculative decoding: off (default); ngram (drafts looked up in the "
                             "sequence's own prompt and output) or suffix (also in the recent finished "
                             "sequences of its cache_salt) or draft (a small model's greedy tokens, run by the "
                             "worker: needs the worker's --draft-model); drafts are verified inside the batch (the same "
                             "tokens and logprobs as off) and made only while they pay at the current load")
    parser.add_argument("--num-speculative-tokens", type=int_in(1, MAX_SPECULATIVE_TOKENS,
                                                                meaning=f"an integer in 1..{MAX_SPECULATIVE_TOKENS}"),
                        default=4, metavar="K",
                        help="the most drafts one sequence verifies in a step (default 4; must be below "
                             "the step budget)")
    parser.add_argument("--max-step-ms", type=non_negative_float, default=0.0, metavar="MS",
                        help="while decodes run, cut each step's prefill chunks so the model's predicted "
                             "time of the step (a cost model fitted to measured steps) stays under MS "
                             "milliseconds: shorter token stalls for streaming users while long prompts "
                             "prefill; the first prefill chunk of a step still gets one KV block. "
                             "0 = off (default): chunks fill the token budget")
    parser.add_argument("--no-jump-forward", action="store_true",
                        help="sample every token of structured output and tool calls, one a step, also "
                             "where the grammar allows only one (by default such forced runs ride the "
                             "next step as known tokens: the same output in fewer steps; requests that "
                             "read logprobs, use penalties or min_tokens, and gRPC's, always sample)")
    parser.add_argument("--fairness", choices=FAIRNESS_MODES, default="off",
                        help="off (default): waiting requests board by priority, then arrival; tenant: "
                             "the least-served tenant's request boards first and the most-served tenant's "
                             "is preempted first (Virtual Token Counter; a prompt token counts 1, an output "
                             "token 2, divided by the tenant's weight), priority ordering within a tenant; "
                             "a tenant is the API key's name, else the request's user (OpenAI) or tenant "
                             "(gRPC), else one shared tenant")
    parser.add_argument("--tenant-weight", type=_tenant_weight_flag, action="append", default=None,
                        metavar="NAME=W",
                        help="the weight of a tenant under --fairness tenant (repeatable; default 1; "
                             "a weight-2 tenant gets twice the share); keys can also carry it in the "
                             "key file (NAME:KEY:WEIGHT)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write a JSONL step trace (one line per step) for `jitney plot`")
    add_model_setting_arguments(parser)
    add_responses_store_arguments(parser)
    add_production_arguments(parser)
    add_security_arguments(parser)
    if with_shared:
        parser.add_argument("--plan-addr", default="tcp://0.0.0.0:5557", help="ZeroMQ endpoint to bind for step plans")
        parser.add_argument("--result-addr", default="tcp://0.0.0.0:5558", help="ZeroMQ endpoint to bind for step results")
        add_link_security_arguments(parser)


_port_or_off = int_in(0, 65535, meaning="a TCP port (1-65535) or 0 (off)")


def tenant_weight(text: str) -> tuple[str, float]:
    """``NAME=W`` of --tenant-weight. Raises ValueError."""
    name, sep, weight = text.rpartition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=WEIGHT, got {text!r}")
    return name, parse_weight(weight)


def _tenant_weight_flag(text: str) -> str:
    """--tenant-weight checked, kept as written (`jitney serve` passes it on)."""
    try:
        tenant_weight(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text

# The scheduler's listening ports: (config field, what it serves, its flag).
DOORS = (("port", "gRPC", "--port"), ("openai_port", "the OpenAI API", "--openai-port"),
         ("metrics_port", "metrics", "--metrics-port"))


def door_refused(host: str, port: int, flag: str, why: object) -> str:
    """The message of a door that cannot listen: the port, what it is for, why."""
    what = next(what for _, what, f in DOORS if f == flag)
    return f"cannot listen on {host}:{port} for {what} ({flag} {port}): {why}"


def busy_door(scheduler_argv: list[str]) -> str | None:
    """Why the scheduler of this command line would not start (a door's port
    that cannot be bound now: another server listens there), or None; for
    `jitney serve` to refuse before it starts any process."""
    parser = argparse.ArgumentParser(add_help=False)
    add_scheduler_arguments(parser)
    ns, _ = parser.parse_known_args(scheduler_argv)
    for field_name, _, flag in DOORS:
        port = getattr(ns, field_name)
        if port and (problem := bind_problem(ns.host, port)) is not None:
            return door_refused(ns.host, port, flag, problem.strerror or problem)
    return None


def add_model_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """How the API presents the model: its names, chat template, sampling defaults."""
    parser.add_argument("--served-model-name", action="append", type=_model_name, default=None, metavar="NAME",
                        help="the model's name in the API (repeatable: every one is accepted as the OpenAI "
                             "`model`; the first is the one responses, /v1/models first and GetModelInfo give); "
                             "default: the model's own (its folder's name, or its GGUF file's without the "
                             "quantization label)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template that replaces the model's own, for chat prompts on both doors "
                             "(checked at start: it must render a one-message conversation)")
    parser.add_argument("--tool-call-parser", default="auto",
                        choices=("auto", "hermes", "generic", "llama3", "mistral", "harmony"),
                        help="how the model writes tool calls (scheduler/api/tools/formats.py): auto (default) "
                             "reads the chat template (<|channel|> harmony, gpt-oss's channels; <tool_call> hermes, "
                             "[TOOL_CALLS] mistral, <|python_tag|> llama3; a template without tools: generic, the "
                             "tools described in the system turn)")
    parser.add_argument("--reasoning-parser", default="auto", choices=("auto", "on", "off"),
                        help="split <think>...</think> output off as reasoning_content: auto (default) where the "
                             "chat template mentions </think>, on, off")
    parser.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                        help="default sampling parameters for fields a request leaves unset: auto (default) "
                             "takes the model's generation_config.json (temperature, top_p, top_k, min_p, "
                             "repetition_penalty, max_new_tokens as max_tokens) or a GGUF's general.sampling.* "
                             "metadata; none keeps the server's own; FOLDER reads FOLDER/generation_config.json")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) "
                             "served under NAME, which the OpenAI `model` and gRPC lora_adapter select; "
                             "checked at start against the worker's --max-loras/--max-lora-rank and "
                             "modules (a bad one stops the start); more load at runtime "
                             "(POST /v1/load_lora_adapter, LoadLoraAdapter)")


def add_responses_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The OpenAI door's Responses API store (scheduler/api/http/openai_responses/store.py)."""
    parser.add_argument("--responses-store", default=None, metavar="DIR",
                        help="folder of the Responses API's store (/v1/responses with store: true, "
                             "previous_response_id), an SQLite file kept across restarts; default "
                             "$JITNEY_STATE_DIR/responses, else $XDG_STATE_HOME/jitney/responses, else "
                             "~/.local/state/jitney/responses")
    parser.add_argument("--no-responses-store", action="store_true",
                        help="store no responses: /v1/responses still answers, GET /v1/responses/ID "
                             "and previous_response_id find nothing")
    parser.add_argument("--responses-store-max-mb", type=positive_float, default=512.0, metavar="MB",
                        help="most MiB of stored responses; beyond, the oldest are evicted (default 512)")
    parser.add_argument("--responses-store-max-age", type=positive_float, default=30 * 24 * 3600.0,
                        metavar="SECONDS", help="how long a stored response is kept (default 30 days)")


def responses_store_config(cfg: SchedulerProcessConfig) -> "StoreConfig":
    """The Responses store of the flags (its folder None when off)."""
    from jitney.scheduler.api.http.openai_responses.store import StoreConfig, default_store_dir

    if not cfg.responses_store_enabled:
        return StoreConfig(None)
    directory = Path(cfg.responses_store) if cfg.responses_store else default_store_dir()
    return StoreConfig(directory, int(cfg.responses_store_max_mb * 1024 * 1024), cfg.responses_store_max_age)


def _model_name(text: str) -> str:
    if not text or len(text) > 256 or not text.isprintable() or text != text.strip():
        raise argparse.ArgumentTypeError(
            f"must be 1-256 printable characters without leading or trailing spaces, got {text[:64]!r}")
    return text


@dataclass(frozen=True)
class ModelSettings:
    """What ``model_settings`` read: the model's files, the names, the template's
    text, the defaults."""

    files: ModelFiles
    names: tuple[str, ...]
    chat_template: str | None
    sampling_defaults: SamplingDefaults


def model_settings(cfg: SchedulerProcessConfig) -> ModelSettings:
    """The model's API names, ``--chat-template``'s text (parsed, not yet rendered)
    and the generation config's defaults. Raises ModelNotFoundError,
    ModelSettingsError or ValueError (a default out of range), each naming the
    flag or the file."""
    files = resolve_model(cfg.model)
    names = tuple(dict.fromkeys(cfg.served_model_names)) or (model_name(files),)
    template = read_chat_template(cfg.chat_template) if cfg.chat_template else None
    values, source = generation_config(files, cfg.generation_config)
    defaults = SamplingDefaults.from_config(values, source) if source else SamplingDefaults()
    return ModelSettings(files, names, template, defaults)


async def serve(cfg: SchedulerProcessConfig, *, stop: asyncio.Event | None = None,
                drain: asyncio.Event | None = None) -> int:
    """Run the scheduler process until stopped. ``stop`` / ``drain`` stand for
    SIGINT / SIGTERM; when given, no signal handler is installed (in-process tests)."""
    try:
        security, warnings = cfg.load_security()
        weights = cfg.weights(security)
        settings = model_settings(cfg)
        lora_modules = read_lora_modules(cfg.lora_modules)
        for name, _, _ in lora_modules:
            if name in settings.names:
                raise ValueError(f"--lora-modules {name}: the name is the served model's (--served-model-name)")
    except (SecurityError, ModelNotFoundError, ValueError) as exc:    # ModelSettingsError is a ValueError
        print(f"jitney: {exc}", file=sys.stderr, flush=True)
        return 2
    exposed = exposure_warning(cfg.host, security)
    for warning in [*warnings, *([exposed] if exposed else [])]:
        print(f"jitney: warning: {warning}", file=sys.stderr, flush=True)
    curve_keys = _link_keys(cfg)     # before anything binds: a LinkSecurityError stops the start
    servicer = GenerationServicer(api_keys=security.keys is not None,
                                  key_limits=KeyLimiter(security.max_requests_per_key),
                                  model_names=settings.names, sampling_defaults=settings.sampling_defaults,
                                  tool_call_parser=cfg.tool_call_parser, reasoning=cfg.reasoning_parser,
                                  lora=LoraService(lora_modules))
    if settings.sampling_defaults.values():
        print(f"jitney: {settings.sampling_defaults.describe()}", flush=True)
    health_servicer = health.aio.HealthServicer()
    server = grpc_server(servicer, health_servicer, security)
    await set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    if (refused := listen_grpc(server, cfg.host, cfg.port, security)) is not None:
        print(f"jitney: {door_refused(cfg.host, cfg.port, '--port', refused)}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    print(f"jitney: gRPC listening on {address} ({_door_security(security)}; waiting for the worker)",
          flush=True)
    openai_server = None
    signals: asyncio.AbstractEventLoop | None = None    # the loop, once it handles SIGINT and SIGTERM
    opened_link: WorkerLink | None = None     # (closed at the end when opened)
    tracer: StepTracer | None = None
    try:
        if cfg.metrics_port:
            try:
                servicer.metrics.serve_http(cfg.host, cfg.metrics_port)
            except OSError as exc:
                print(f"jitney: {door_refused(cfg.host, cfg.metrics_port, '--metrics-port', exc.strerror or exc)}",
                      file=sys.stderr, flush=True)
                return 2
            print(f"jitney: metrics on http://{cfg.host}:{cfg.metrics_port}/metrics", flush=True)
        servicer.metrics.log_prompts = cfg.log_prompts
        if cfg.openai_port:
            # Imported only when asked for: aiohttp stays out of a plain gRPC server.
            from jitney.scheduler.api.http.app import OpenAIServer
            from jitney.scheduler.api.http.openai_responses.store import StoreError

            try:
                openai = OpenAIServer(servicer, security.keys, responses_store_config(cfg))
            except StoreError as exc:
                print(f"jitney: {exc} (--responses-store)", file=sys.stderr, flush=True)
                return 2
            try:    # aiohttp's TCPSite: SO_REUSEADDR, never SO_REUSEPORT (reuse_port stays None)
                await openai.start(cfg.host, cfg.openai_port,
                                   security.tls.ssl_context() if security.tls else None)
            except OSError as exc:
                print(f"jitney: {door_refused(cfg.host, cfg.openai_port, '--openai-port', exc.strerror or exc)}",
                      file=sys.stderr, flush=True)
                return 2
            openai_server = openai
            scheme = "https" if security.tls else "http"
            print(f"jitney: OpenAI-compatible API on {scheme}://{cfg.host}:{cfg.openai_port}/v1",
                  flush=True)
        link = opened_link = WorkerLink(cfg.plan_addr, cfg.result_addr, worker_timeout=cfg.worker_timeout,
                                        curve_keys=curve_keys, insecure_plaintext=cfg.insecure_plaintext_zmq)
        # One trace for the process: engines of restarted workers append to it.
        tracer = StepTracer(Path(cfg.trace)) if cfg.trace else None
        if stop is None or drain is None:
            stop, drain = asyncio.Event(), asyncio.Event()
            signals = asyncio.get_running_loop()
            signals.add_signal_handler(signal.SIGINT, stop.set)     # end now
            signals.add_signal_handler(signal.SIGTERM, drain.set)   # drain, then end
        tokenizer = await asyncio.to_thread(load_tokenizer, settings.files, cache_root())
        if settings.chat_template is not None:
            assert cfg.chat_template is not None
            try:
                use_chat_template(tokenizer, settings.chat_template, cfg.chat_template)
            except ModelSettingsError as exc:
                print(f"jitney: {exc}", file=sys.stderr, flush=True)
                return 2
            print(f"jitney: chat template from {cfg.chat_template}", flush=True)
        life = Lifecycle(link, servicer, lambda status: set_health(health_servicer, status),
                         lambda ready: _make_engine(cfg, link, tokenizer, ready, tracer, weights), tokenizer,
                         address, cfg.drain_seconds, stop, drain)
        return await life.run()
    finally:
        if signals is not None:
            # The end is decided: a second SIGTERM (a process group's and then the
            # supervisor's) must not kill the exit, as it would once asyncio.run
            # restored SIGTERM's default on closing the loop.
            signals.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=1.0)
        if openai_server is not None:
            await openai_server.stop()
        if opened_link is not None:
            opened_link.close()
        if tracer is not None:
            tracer.close()


def _link_keys(cfg: SchedulerProcessConfig) -> ServerKeys | None:
    """The link's Curve keys (None without --curve-keys), once the endpoints are known to be allowed."""
    keys = load_server_keys(cfg.curve_keys) if cfg.curve_keys else None
    for endpoint in (cfg.plan_addr, cfg.result_addr):
        check_endpoint(endpoint, have_keys=keys is not None, insecure_plaintext=cfg.insecure_plaintext_zmq)
    return keys


def _door_security(security: ServerSecurity) -> str:
    tls = "plaintext" if security.tls is None else (
        "mutual TLS" if security.tls.client_ca is not None else "TLS")
    if security.keys is None:
        return tls
    limit = f", at most {security.max_requests_per_key} in flight each" if security.max_requests_per_key else ""
    return f"{tls}, {len(security.keys.names)} API keys{limit}"


def _make_engine(cfg: SchedulerProcessConfig, link: WorkerLink, tokenizer: object,
                 ready: engine_pb2.Ready, tracer: StepTracer | None,
                 tenant_weights: tuple[tuple[str, float], ...] = ()) -> Engine:
    if (cfg.speculative == "draft") != bool(ready.draft_model):
        raise WorkerLinkError(draft_model_mismatch(cfg.speculative, ready.draft_model))
    budget = _step_limit("max_num_batched_tokens", cfg.max_num_batched_tokens, ready.max_num_batched_tokens)
    sched_cfg = SchedulerConfig(
        max_num_seqs=_step_limit("max_num_seqs", cfg.max_num_seqs, ready.max_num_seqs),
        max_num_batched_tokens=budget,
        block_size=ready.block_size,
        num_blocks=ready.num_blocks,
        max_model_len=max_model_len_for(ready.context_length, ready.num_blocks, ready.block_size,
                                        ready.sliding_window, budget),
        sliding_window=ready.sliding_window,
        max_loras=ready.max_loras,
        policy=cfg.policy,
        enable_prefix_caching=cfg.prefix_cache,
        speculative=cfg.speculative,
        num_speculative_tokens=cfg.num_speculative_tokens,
        max_step_ms=cfg.max_step_ms,
        jump_forward=cfg.jump_forward,
        fairness=cfg.fairness,
        tenant_weights=tenant_weights,
    )
    admission = AdmissionLimits(cfg.max_queued_requests, cfg.max_queued_tokens,
                                cfg.max_request_seconds)
    return Engine(sched_cfg, link, tokenizer, frozenset(ready.eos_token_ids),
                  tracer=tracer, admission=admission, vocab_size=ready.vocab_size)


def draft_model_mismatch(speculative: str, draft_model: str) -> str:
    """Why a scheduler's --speculative and a worker's --draft-model do not go together."""
    if draft_model:
        return (f"the worker runs a draft model ({draft_model}, --draft-model) but --speculative is "
                f"{speculative}: use --speculative draft, or start the worker without --draft-model")
    return "--speculative draft needs the worker's --draft-model PATH (a small model sharing the tokenizer)"


def _step_limit(name: str, asked: int | None, worker: int) -> int:
    """The scheduler's flag, or the worker's value when unset; never more than the worker accepts."""
    if asked is None:
        return worker
    if asked > worker:
        log.warning("--%s %d is more than the worker accepts (%d): using %d",
                       name.replace("_", "-"), asked, worker, worker)
        return worker
    return asked


def run_scheduler(cfg: SchedulerProcessConfig) -> int:
    return asyncio.run(serve(cfg))
