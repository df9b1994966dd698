"""``agl gateway serve``: flag validation, and a real run in front of a (fake) vLLM with spans into the
store."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from agl_core import semconv
from agl_core.cli import main
from agl_core.gateway import rollout_base_url
from agl_core.gateway.backend import ChatRequest, Completion
from agl_core.server import BackgroundServer

from .fake_vllm import FakeVLLM


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--backend", "openai"], "needs --upstream URL"),
        (["--backend", "openai", "--upstream", "http://h/v1"], "needs --upstream-model"),
        (["--backend", "openai", "--upstream", "ftp://h/v1", "--upstream-model", "m"], "http(s) URL"),
        (["--backend", "vllm"], "--upstream URL (a running 'vllm serve') or --model"),
        (
            ["--backend", "vllm", "--upstream", "http://h/v1", "--vllm-arg=--enforce-eager"],
            "only applies when the gateway launches",
        ),
        (["--backend", "hf", "--upstream", "http://h/v1"], "do not apply to --backend hf"),
        (
            ["--backend", "openai", "--upstream", "http://h/v1", "--upstream-model", "m", "--max-batch", "4"],
            "only apply to --backend hf",
        ),
        (
            [
                "--backend",
                "openai",
                "--upstream",
                "http://h/v1",
                "--upstream-model",
                "m",
                "--prefix-cache-mb",
                "0",
            ],
            "--prefix-cache-mb, --packed-weights-mb, --matmul-dtype and --dtype only apply to --backend hf",
        ),
        (["--matmul-dtype", "bfloat16", "--dtype", "bfloat16"], "drop one of them"),
    ],
)
def test_bad_flag_combinations_are_explained(argv, fragment, capsys):
    assert main(["gateway", "serve", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--port", "70000"], "--port"),
        (["--max-batch", "0"], "must be at least 1"),
        (["--backend", "tgi"], "invalid choice"),
        (["--prefix-cache-mb", "-1"], "between 0 (off) and 1048576 MiB"),
        (["--prefix-cache-mb", "lots"], "'lots' is not a number of MiB"),
        (["--dtype", "float16"], "invalid choice"),
        (["--matmul-dtype", "float16"], "invalid choice"),
        (["--packed-weights-mb", "-5"], "between 0 (off) and 1048576 MiB"),
    ],
)
def test_bad_flag_values_stop_argparse(argv, fragment, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["gateway", "serve", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "error:" in err and fragment in err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_in_front_of_vllm_sends_spans_to_the_store(tiny_policy, store_server, client):
    import openai

    fake = FakeVLLM(tiny_policy[1], served_model_name="policy")
    port = _free_port()
    with BackgroundServer(fake.app()) as upstream:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "gateway",
                "serve",
                "--backend",
                "vllm",
                "--upstream",
                upstream.url + "/v1",
                "--served-name",
                "policy",
                "--port",
                str(port),
                "--store",
                store_server.url,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.1)
            oa = openai.OpenAI(base_url=rollout_base_url(url, "ro-cli", "at-cli"), api_key="x", max_retries=0)
            reply = oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": "ping"}])
        finally:
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=30)
    assert process.returncode == 143, err  # stopped by SIGTERM, cleanly
    assert f"agl gateway: http://127.0.0.1:{port}/v1 serving policy (vLLM at {upstream.url}/v1)" in out
    (span,) = client.query_spans(rollout_ids=["ro-cli"])
    assert span.attempt_id == "at-cli"
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == reply.id
    assert (
        tiny_policy[1].decode(list(span.attributes[semconv.RESPONSE_TOKEN_IDS]), skip_special_tokens=True)
        == "echo: ping"
    )


def test_gateway_modules_and_cli_stay_light():
    code = (
        "import sys, agl_core.cli, agl_core.gateway.vllm_backend, agl_core.gateway.openai_backend,"
        " agl_core.gateway.cli\n"
        "print([m for m in ('torch', 'transformers', 'vllm', 'peft', 'openai') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "[]"


def test_hf_serving_flags_reach_the_backend():
    """``agl gateway serve --backend hf`` builds its backend from the flags: the prefix cache's bound (0:
    off) and the dtype."""

    import torch

    from agl_core.cli import _parser
    from agl_trainer.generation.hf_backend import serve_with_transformers

    def served(*flags: str) -> object:
        args = _parser().parse_args(["gateway", "serve", "--model", "tiny", *flags])
        return serve_with_transformers(args).backend

    default, off, half = (
        served(),
        served("--prefix-cache-mb", "0"),
        served("--dtype", "bfloat16", "--prefix-cache-mb", "8"),
    )
    try:
        assert default.prefix_cache.max_bytes == 128 * 2**20 and off.prefix_cache is None
        assert half.prefix_cache.max_bytes == 8 * 2**20
        assert (
            next(half.model.parameters()).dtype == torch.bfloat16
            and half._slots.shape.dtype == torch.bfloat16
        )
        assert half._linears is None  # the oneDNN copies are for float32 weights
        request = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)

        async def ask() -> list[object]:
            return [e async for e in half.generate("agl-policy", request) if isinstance(e, Completion)]

        (completion,) = asyncio.run(ask())
        assert len(completion.response_ids) == 3 and all(lp <= 0 for lp in completion.response_logprobs)
    finally:
        for backend in (default, off, half):
            backend.close()


def test_hf_packing_flags_reach_the_backend():
    """``--packed-weights-mb`` is the packed copies' budget and ``--matmul-dtype`` their dtype (bfloat16
    where this CPU and PyTorch have oneDNN's bfloat16; refused with the reason where not)."""
    import torch

    from agl_core.cli import _parser
    from agl_trainer.generation import fast_linear
    from agl_trainer.generation.hf_backend import serve_with_transformers

    def served(*flags: str) -> object:
        args = _parser().parse_args(["gateway", "serve", "--model", "tiny", *flags])
        return serve_with_transformers(args).backend

    if not fast_linear.available():
        pytest.skip("this PyTorch has no oneDNN packed linear")
    small = served("--packed-weights-mb", "0")
    try:
        assert small._linears.budget_bytes == 0 and small._linears.dtype == torch.float32
    finally:
        small.close()
    if fast_linear.available(torch.bfloat16):
        rounded = served("--matmul-dtype", "bfloat16")
        try:
            assert rounded._linears.dtype == torch.bfloat16
        finally:
            rounded.close()
    else:
        with pytest.raises(ValueError, match="set matmul_dtype to float32"):
            served("--matmul-dtype", "bfloat16")
