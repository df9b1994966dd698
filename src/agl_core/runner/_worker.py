"""The body of a process-mode worker process. Light on purpose: it imports the tracing and outcome code,
not the store or the gateway, so a fresh worker is ready quickly."""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from opentelemetry.trace import SpanContext, TraceFlags

from ..capture.agent_header import register_gateway
from ..tracing import join_rollout, setup_tracing
from ._outcome import call_agent, interpret


def worker_main(conn: Connection, agent: Any, otlp_endpoint: str, token: str | None) -> None:
    """Body of a worker process: run jobs from ``conn`` until told to stop or the runner goes away."""
    # The runner decides when its workers stop: a Ctrl-C in a terminal goes to the whole process group,
    # so leave it and start a group of our own, which the runner kills whole (with any subprocesses the
    # agent started) when it must stop a hung rollout.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setpgrp()
    except (AttributeError, OSError):
        pass
    provider = setup_tracing(otlp_endpoint, token=token, service_name="agl-agent")
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break  # the runner is gone
        if job is None:
            break
        rollout, trace_id, span_id, task_input, llm = job
        with contextlib.suppress(ValueError):  # as the runner did: the adapters may name agents to it
            register_gateway(llm.base_url)
        parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        with join_rollout(rollout, parent):
            result, error = call_agent(agent, task_input, llm)
            outcome = interpret(result, error, provider)
        provider.force_flush()
        try:
            conn.send(outcome)
        except (BrokenPipeError, OSError):
            break
    provider.shutdown()
