"""``agl gateway serve``: build the chosen backend, wire spans to the store, serve until stopped.

``openai`` and ``vllm`` are built in; other backends (``hf``, from agl's trainer) come from the
``agl.gateway_backends`` entry-point group (:mod:`agl_core.plugins`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import settings
from ..plugins import (
    GatewayBackendFactory,
    PluginError,
    ServedBackend,
    gateway_backend_names,
    load_gateway_backend,
)

if TYPE_CHECKING:
    from .render import TemplateRenderer

__all__ = ["add_serve_arguments", "run_gateway_serve"]

logger = logging.getLogger(__name__)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not 0 <= value <= 1_048_576:
        raise argparse.ArgumentTypeError(f"{text} must be between 0 (off) and 1048576 MiB")
    return value


#: The options of ``agl gateway serve`` that depend on nothing at run time: (flags, keyword arguments of
#: ``add_argument``).
_SERVE_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--model",),
        dict(
            default=None,
            help="hf: smollm2, tiny or a local model directory (default: smollm2); vllm: the model"
            " 'vllm serve' loads when the gateway launches it",
        ),
    ),
    (
        ("--served-name",),
        dict(
            default=None,
            help="model name clients use (default: agl-policy for hf and vllm, the upstream model for"
            " openai)",
        ),
    ),
    (
        ("--upstream",),
        dict(
            default=None,
            metavar="URL",
            help="base URL of a running server, ending with /v1 (required for openai; vllm connects instead"
            " of launching)",
        ),
    ),
    (
        ("--upstream-model",),
        dict(default=None, help="model name the upstream server knows (default: --served-name)"),
    ),
    (("--api-key",), dict(default=None, help="bearer token for the upstream server")),
    (
        ("--store", "--store-url"),
        dict(
            dest="store",
            default=None,
            metavar="URL",
            help="collector-store receiving the spans, and with --capture the rollouts of sessions (default:"
            f" $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})",
        ),
    ),
    (
        ("--store-token",),
        dict(default=None, metavar="TOKEN", help="the store's bearer token (default: $AGL_STORE_TOKEN)"),
    ),
    (
        ("--capture",),
        dict(
            action="store_true",
            help="production capture: a call naming no rollout joins the rollout of its session"
            " (x-agl-session-id, metadata.session_id, traceparent, then user), registered in the store",
        ),
    ),
    (
        ("--tokenizer",),
        dict(
            default=None,
            metavar="DIR",
            help="tokenizer directory for the drift check of vllm / openai calls (default: --model when it is"
            " a directory)",
        ),
    ),
    (
        ("--no-drift-check",),
        dict(action="store_true", help="do not render prompts to check the backend's token ids"),
    ),
    (
        ("--max-batch",),
        dict(type=_positive, default=16, help="hf: most sequences decoded together (default: %(default)s)"),
    ),
    (
        ("--max-tokens",),
        dict(
            type=_positive,
            default=256,
            help="hf: response length when a request does not say (default: %(default)s)",
        ),
    ),
    (
        ("--threads",),
        dict(type=_positive, default=None, help="hf: torch CPU threads (default: torch's choice)"),
    ),
    (
        ("--prefix-cache-mb",),
        dict(
            type=_megabytes,
            default=128.0,
            metavar="MIB",
            help="hf: memory for the keys and values of prompt prefixes reused across calls; 0 turns reuse"
            " off (default: %(default)s)",
        ),
    ),
    (
        ("--dtype",),
        dict(
            choices=["float32", "bfloat16"],
            default="float32",
            help="hf: the model's weights and keys/values (bfloat16 halves the memory a step reads, on a GPU;"
            " default: %(default)s)",
        ),
    ),
    (
        ("--packed-weights-mb",),
        dict(
            type=_megabytes,
            default=128.0,
            metavar="MIB",
            help="hf on the CPU: memory for weight copies packed for oneDNN, largest first (SmolLM2 needs 520"
            " in float32, 260 in bfloat16, for all of them; default: %(default)s)",
        ),
    ),
    (
        ("--matmul-dtype",),
        dict(
            choices=["float32", "bfloat16"],
            default="float32",
            help="hf on the CPU, a float32 model: the packed copies' dtype; bfloat16 rounds each product's"
            " weights, input and result (3-5x quicker products on CPUs with AMX; default: %(default)s)",
        ),
    ),
    (
        ("--admin-token",),
        dict(
            default=None,
            help="require 'Authorization: Bearer TOKEN' to publish policy versions (default:"
            " $AGL_GATEWAY_ADMIN_TOKEN; required when --host is not a loopback address)",
        ),
    ),
    (
        ("--insecure-no-admin-token",),
        dict(
            action="store_true",
            help="listen beyond localhost with no admin token: anyone who reaches the port can load a policy",
        ),
    ),
    (
        ("--spool-dir",),
        dict(
            default=None,
            metavar="DIR",
            help="keep spans the store has not acknowledged in files here (sent when it is back, even after a"
            " restart of the gateway); default: in memory",
        ),
    ),
    (
        ("--spool-max-mb",),
        dict(
            type=_megabytes,
            default=256.0,
            metavar="MIB",
            help="most span data waiting for the store; past it new spans are dropped, counted in /metrics"
            " and logged (default: %(default)s)",
        ),
    ),
    (
        ("--max-recorded-prompt-mb",),
        dict(
            type=_megabytes,
            default=1.0,
            metavar="MIB",
            help="most bytes of a call's input messages (and of its tool definitions) a span records; a"
            " longer one is cut with a marker and its original size (default: %(default)s)",
        ),
    ),
    (
        ("--vllm-arg",),
        dict(
            dest="vllm_args",
            action="append",
            default=[],
            metavar="ARG",
            help="extra argument for 'vllm serve' when the gateway launches it (repeatable)",
        ),
    ),
)


def add_serve_arguments(serve: argparse.ArgumentParser, port_type: Any) -> None:
    choices = [*(n for n in gateway_backend_names() if n not in _BUILT_IN_BACKENDS), *_BUILT_IN_BACKENDS]
    default = "hf" if "hf" in choices else None
    serve.add_argument(
        "--backend",
        choices=choices,
        default=default,
        required=default is None,
        help="hf: transformers in this process (CPU or one GPU; needs the trainer extra); vllm: a vLLM"
        " server (launched, or --upstream); openai: any OpenAI-compatible endpoint, evaluation only;"
        " others come from installed plugins (default: %(default)s)",
    )
    for flags, options in _SERVE_OPTIONS:
        serve.add_argument(*flags, **options)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument(
        "--port", type=port_type, default=8000, help="port to listen on (default: %(default)s)"
    )


class _UsageError(Exception):
    pass


def _check(args: argparse.Namespace) -> None:
    if args.admin_token is None:
        args.admin_token = os.environ.get("AGL_GATEWAY_ADMIN_TOKEN") or None
    if args.admin_token is not None and not args.admin_token.strip():
        raise _UsageError(
            '--admin-token is empty; pass a secret, e.g. --admin-token "$(openssl rand -hex 16)"'
        )
    if args.capture and args.admin_token is None and not settings.is_loopback(args.host):
        raise _UsageError(
            f"--capture on --host {args.host} needs an admin token (--admin-token TOKEN or"
            " AGL_GATEWAY_ADMIN_TOKEN; --insecure-no-admin-token is not accepted with --capture): a capturing"
            " gateway reachable from other machines writes what they send into the store"
        )
    if args.admin_token is None and not settings.is_loopback(args.host) and not args.insecure_no_admin_token:
        raise _UsageError(
            f"--host {args.host} is reachable from other machines, and without an admin token anyone there"
            " could publish a policy (the backend loads the path they send); pass --admin-token TOKEN or set"
            " AGL_GATEWAY_ADMIN_TOKEN (or --insecure-no-admin-token to accept that)"
        )
    if args.spool_max_mb * 1024 * 1024 < 1024 * 1024:
        raise _UsageError(f"--spool-max-mb must be at least 1 (MiB), got {args.spool_max_mb}")
    if args.max_recorded_prompt_mb * 1024 * 1024 < 1024:
        raise _UsageError(
            f"--max-recorded-prompt-mb must be at least 0.001 (1 KiB), got {args.max_recorded_prompt_mb}"
        )
    if args.spool_dir is not None and Path(args.spool_dir).exists() and not Path(args.spool_dir).is_dir():
        raise _UsageError(
            f"--spool-dir {args.spool_dir} is a file; give a directory (it is created if missing)"
        )
    if args.backend == "openai":
        if not args.upstream:
            raise _UsageError(
                "--backend openai needs --upstream URL (the OpenAI-compatible endpoint, ending with /v1)"
            )
        if not (args.upstream_model or args.served_name):
            raise _UsageError(
                "--backend openai needs --upstream-model (or --served-name): the model to ask for"
            )
    if args.backend == "vllm" and not (args.upstream or args.model):
        raise _UsageError(
            "--backend vllm needs --upstream URL (a running 'vllm serve') or --model (to launch one)"
        )
    if args.backend == "vllm" and args.upstream and args.vllm_args:
        raise _UsageError(
            "--vllm-arg only applies when the gateway launches vLLM; drop it or drop --upstream"
        )
    if args.upstream and not args.upstream.startswith(("http://", "https://")):
        raise _UsageError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    hf_only = args.threads or args.max_batch != 16 or args.max_tokens != 256
    hf_only = hf_only or args.prefix_cache_mb != 128.0 or args.dtype != "float32"
    hf_only = hf_only or args.packed_weights_mb != 128.0 or args.matmul_dtype != "float32"
    if args.backend != "hf" and hf_only:
        raise _UsageError(
            "--threads, --max-batch, --max-tokens, --prefix-cache-mb, --packed-weights-mb, --matmul-dtype"
            " and --dtype only apply to --backend hf"
        )
    if args.matmul_dtype != "float32" and args.dtype != "float32":
        raise _UsageError(
            "--matmul-dtype bfloat16 rounds the products of a float32 model; with --dtype bfloat16 every"
            " product is bfloat16 already: drop one of them"
        )
    if args.backend == "hf" and (args.upstream or args.vllm_args):
        raise _UsageError("--upstream and --vllm-arg do not apply to --backend hf")


def _drift_renderer(args: argparse.Namespace) -> TemplateRenderer | None:
    """The renderer checking an upstream's prompt ids: from --tokenizer, else a --model directory."""
    from .render import load_renderer

    tokenizer_dir = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    return None if args.no_drift_check or not tokenizer_dir else load_renderer(tokenizer_dir)


def _build_openai(args: argparse.Namespace) -> ServedBackend:
    from .openai_backend import OpenAIBackend

    renderer = _drift_renderer(args)
    upstream_model = args.upstream_model or args.served_name
    backend = OpenAIBackend(
        args.upstream,
        model_name=args.served_name or upstream_model,
        upstream_model=upstream_model,
        api_key=args.api_key,
    )
    return ServedBackend(backend, f"{upstream_model} at {args.upstream} (evaluation only)", renderer)


def _build_vllm(args: argparse.Namespace) -> ServedBackend:
    from .vllm_backend import VLLMBackend

    renderer = _drift_renderer(args)
    name = args.served_name or "agl-policy"
    if args.upstream:
        backend = VLLMBackend(
            args.upstream, model_name=name, upstream_model=args.upstream_model, api_key=args.api_key
        )
        return ServedBackend(backend, f"vLLM at {args.upstream}", renderer)
    backend = VLLMBackend.launch(args.model, model_name=name, extra_args=args.vllm_args)
    return ServedBackend(
        backend, f"{args.model} with a vLLM server it launched at {backend.base_url}", renderer
    )


_BUILT_IN_BACKENDS: dict[str, GatewayBackendFactory] = {"vllm": _build_vllm, "openai": _build_openai}


def _factory(name: str) -> GatewayBackendFactory:
    built_in = _BUILT_IN_BACKENDS.get(name)
    if built_in is not None:
        return built_in
    try:
        return load_gateway_backend(name)
    except PluginError as exc:
        raise _UsageError(str(exc)) from None


def run_gateway_serve(args: argparse.Namespace) -> int:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from ..server import StopSignals, listen, serve_forever
    from ..tracing import make_otlp_exporter
    from .app import create_gateway_app
    from .backend import BackendError
    from .capture import Capture

    try:
        _check(args)
    except (_UsageError, PluginError) as exc:
        print(f"agl gateway serve: {exc}", file=sys.stderr)
        return 2
    try:  # before the model loads: a port in use is said at once, and nothing claims to serve
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"agl gateway serve: {exc} (--port PORT)", file=sys.stderr)
        return 2
    try:
        served = _factory(args.backend)(args)
    except (_UsageError, PluginError) as exc:
        sock.close()
        print(f"agl gateway serve: {exc}", file=sys.stderr)
        return 2
    except (BackendError, OSError, RuntimeError, ValueError) as exc:
        sock.close()
        print(f"agl gateway serve: cannot start the {args.backend} backend: {exc}", file=sys.stderr)
        return 2
    if args.admin_token is None and not settings.is_loopback(args.host):
        print(
            "agl gateway serve: WARNING: --insecure-no-admin-token: anyone who can reach"
            f" {args.host}:{args.port} can publish a policy",
            file=sys.stderr,
        )
    backend, renderer, description = served.backend, served.renderer, served.description
    store = settings.store_url(args.store)
    token = settings.store_token(args.store_token)
    provider = TracerProvider(resource=Resource.create({"service.name": "agl-gateway"}))
    exporter = make_otlp_exporter(
        store, token=token, spool_dir=args.spool_dir, max_spool_bytes=int(args.spool_max_mb * 1024 * 1024)
    )
    # A queue of 16,384 spans: while the spool is being filled the processor's queue must not overflow.
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=200, max_queue_size=16_384)
    )
    capture = Capture(store, token=token) if args.capture else None
    app = create_gateway_app(
        backend,
        tracer_provider=provider,
        renderer=renderer,
        admin_token=args.admin_token,
        capture=capture,
        span_exporter=exporter,
        max_recorded_prompt_bytes=int(args.max_recorded_prompt_mb * 1024 * 1024),
    )
    port = sock.getsockname()[1]
    print(
        f"agl gateway: http://{args.host}:{port}/v1 serving {', '.join(backend.model_names)!s}"
        f" ({description});"
        f" spans to {store}"
        + ("" if capture is None else "; capturing sessions as rollouts")
        + ("" if renderer is None else "; checking prompt token ids"),
        flush=True,
    )
    # uvicorn stops on SIGINT / SIGTERM and then re-raises the signal to the handler it found; a handler
    # that returns lets this function flush the spans still buffered instead of dying with them.
    stop = StopSignals()
    try:
        serve_forever(app, args.host, args.port, sock=sock)
    except OSError as exc:
        print(f"agl gateway serve: {exc} (--port PORT)", file=sys.stderr)
        return 2
    finally:
        if capture is not None:
            capture.close()
        provider.shutdown()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if stop.received is not None:
        print(
            f"agl gateway serve: stopped by {stop.name}; the spans of the calls it answered were sent to"
            f" {store}" + (" (or spooled where the store could not take them)" if args.spool_dir else ""),
            file=sys.stderr,
        )
    return stop.exit_code
