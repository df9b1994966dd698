"""The vLLM backend: ``vllm serve`` behind the gateway, through vLLM's documented OpenAI-server extensions.

* Exact tokens: every request carries ``return_token_ids: true`` (vLLM then reports ``prompt_token_ids``
  and each choice's ``token_ids``, in streams too) and asks for the sampled tokens' ``logprobs``.
* Tool calls: tools and ``tool_choice`` go through; vLLM parses calls with the parser it was started with
  (``--enable-auto-tool-choice --tool-call-parser hermes``; :meth:`VLLMBackend.launch` passes both).
* New policy versions: a LoRA adapter is loaded with ``POST /v1/load_lora_adapter`` (the server needs
  ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) and requests then name the adapter as
  their model; the adapter before the previous one is unloaded (``POST /v1/unload_lora_adapter``). Full
  weights of a server this backend launched are loaded by restarting it on the new directory.
* A policy per agent (vLLM's multi-LoRA): with ``route``, each request is served by the adapter of the
  policy its agent belongs to, loaded under the name ``<model>-<policy>-v<version>``; a new version of one
  policy replaces that policy's adapter only. A policy whose first adapter has not been published yet is
  served by the base model, which a fresh LoRA adapter leaves unchanged.

vllm itself is never imported: the server runs in its own process (``vllm serve``), on a GPU machine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx

from ..policies import BASE
from ._http import ConnectFailed, HTTPFailure, Response
from .backend import (
    BackendError,
    BackendUnavailableError,
    ChatRequest,
    Completion,
    Event,
    PolicyUpdate,
    UpstreamError,
)
from .openai_backend import OpenAIBackend, _error_message

__all__ = ["VLLMBackend"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMBackend(OpenAIBackend):
    """A vLLM OpenAI-compatible server at ``base_url`` (ending with ``/v1``), serving a trainable policy."""

    kind = "vllm"
    trainable = True

    def __init__(
        self, base_url: str, *, model_name: str, upstream_model: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(base_url, model_name=model_name, upstream_model=upstream_model, **kwargs)
        self._adapter: str | None = None
        self._loaded: collections.deque[str] = collections.deque()
        self._process: subprocess.Popen[bytes] | None = None
        self._launch_args: dict[str, Any] | None = None
        self._update_lock: asyncio.Lock | None = None
        #: With a policy per agent: the calling agent's name -> its policy (``None``: the base model).
        self.route: Callable[[str | None], str | None] | None = None
        #: Per policy, the names of its loaded adapters, the serving one last.
        self._policy_loaded: dict[str, collections.deque[str]] = {}

    # -- wire format ------------------------------------------------------------------------------

    def _policy_of(self, request: ChatRequest) -> str | None:
        assert self.route is not None
        try:
            return self.route(request.agent)
        except ValueError as exc:  # an agent two policies match
            raise UpstreamError(400, str(exc)) from exc

    def _served_model(self, request: ChatRequest) -> str:
        if self.route is None:
            return self._adapter or self.upstream_model
        policy = self._policy_of(request)
        loaded = self._policy_loaded.get(policy) if policy is not None else None
        return loaded[-1] if loaded else self.upstream_model

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        """As :meth:`OpenAIBackend.generate`; with ``route``, each completion names the policy that
        served it."""
        policy = BASE
        if self.route is not None:
            policy = self._policy_of(request) or BASE
        async for event in super().generate(model, request):
            if self.route is not None and isinstance(event, Completion):
                event = dataclasses.replace(event, policy_name=policy)
            yield event

    def _extensions(self, request: ChatRequest) -> dict[str, Any]:
        if request.is_chat:
            return {"return_token_ids": True, "logprobs": True, "top_logprobs": request.top_logprobs or None}
        # /v1/completions: ``logprobs`` is the number of alternatives; 0 still reports the sampled token's.
        return {"return_token_ids": True, "logprobs": request.top_logprobs}

    # -- new policy versions --------------------------------------------------------------------------

    async def update_policy(self, update: PolicyUpdate) -> None:
        """Serve ``update`` from the next request on. Raises :class:`BackendError` when vLLM refuses."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if update.kind == "lora":
                await self._load_adapter(update)
            else:
                await asyncio.to_thread(self._restart_with, update.path)
                self._adapter = None
                self._loaded.clear()
                self._policy_loaded.clear()
            self.policy_version = update.version

    async def _post(self, path: str, body: dict[str, Any]) -> Response:
        try:
            return await self._pool().send("POST", f"/{path}", body)
        except ConnectFailed as exc:
            raise BackendUnavailableError(f"{self.base_url}: {exc}") from None
        except HTTPFailure as exc:
            raise BackendError(f"{self.base_url}: {exc}") from None

    async def _load_adapter(self, update: PolicyUpdate) -> None:
        policy = update.policy
        prefix = self._names[0] if policy is None else f"{self._names[0]}-{policy}"
        name = f"{prefix}-v{update.version}"
        response = await self._post("load_lora_adapter", {"lora_name": name, "lora_path": update.path})
        # A 404 about the adapter is vLLM's answer; a bare "Not Found" means the route is not there.
        if response.status == 404 and "adapter" not in _error_message(response).lower():
            raise BackendError(
                "vLLM has no /v1/load_lora_adapter: start it with --enable-lora and the environment variable"
                " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
        if response.status != 200:
            raise BackendError(f"vLLM refused LoRA adapter {update.path}: {_error_message(response)}")
        if policy is None:
            self._adapter = name
            loaded = self._loaded
        else:
            loaded = self._policy_loaded.setdefault(policy, collections.deque())
        loaded.append(name)
        # Keep the previous adapter: requests that started before the switch may still be using it.
        while len(loaded) > 2:
            old = loaded.popleft()
            gone = await self._post("unload_lora_adapter", {"lora_name": old})
            if gone.status != 200:
                raise BackendError(f"vLLM could not unload LoRA adapter {old}: {_error_message(gone)}")

    # -- a server this backend runs itself --------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        model: str,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        tool_call_parser: str | None = "hermes",
        enable_lora: bool = True,
        max_lora_rank: int | None = None,
        extra_args: Sequence[str] = (),
        command: Sequence[str] = ("vllm", "serve"),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900.0,
    ) -> VLLMBackend:
        """Start ``vllm serve MODEL`` and return a backend talking to it once ``/health`` answers.

        The server's output goes to this process's stderr. :meth:`close` stops it.
        """
        launch = {
            "model": model,
            "model_name": model_name,
            "host": host,
            "port": port or _free_port(host),
            "tool_call_parser": tool_call_parser,
            "enable_lora": enable_lora,
            "max_lora_rank": max_lora_rank,
            "extra_args": tuple(extra_args),
            "command": tuple(command),
            "env": dict(env or {}),
            "startup_timeout_s": startup_timeout_s,
        }
        backend = cls(f"http://{host}:{launch['port']}/v1", model_name=model_name)
        backend._launch_args = launch
        backend._start(model)
        return backend

    def _argv(self, model: str) -> list[str]:
        a = self._launch_args or {}
        argv = [
            *a["command"],
            model,
            "--host",
            a["host"],
            "--port",
            str(a["port"]),
            "--served-model-name",
            a["model_name"],
        ]
        if a["tool_call_parser"]:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", a["tool_call_parser"]]
        if a["enable_lora"]:
            argv.append("--enable-lora")
            if a["max_lora_rank"]:
                argv += ["--max-lora-rank", str(a["max_lora_rank"])]
        return argv + list(a["extra_args"])

    def _start(self, model: str) -> None:
        a = self._launch_args or {}
        env = {**os.environ, **a["env"]}
        if a["enable_lora"]:
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        argv = self._argv(model)
        try:
            self._process = subprocess.Popen(argv, env=env, stdout=sys.stderr, stderr=sys.stderr)
        except OSError as exc:
            raise BackendUnavailableError(
                f"cannot start {' '.join(argv[:2])}: {exc}; is vllm installed (agl[gpu])?"
            ) from None
        root = self.base_url.removesuffix("/v1")
        deadline = time.monotonic() + a["startup_timeout_s"]
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise BackendUnavailableError(
                    f"{' '.join(argv)} exited with status {code} before it was ready"
                )
            try:
                if httpx.get(f"{root}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self._stop_process()
        raise BackendUnavailableError(f"{' '.join(argv)} was not ready after {a['startup_timeout_s']:.0f}s")

    def _restart_with(self, path: str) -> None:
        if self._launch_args is None:
            raise BackendError(
                "loading full weights into a vLLM server this gateway did not start needs a restart of that"
                " server on the new checkpoint; publish a LoRA adapter instead, or let the gateway launch"
                " vLLM"
            )
        self._stop_process()
        self._start(path)

    def close(self) -> None:
        """Close idle connections, and stop the server :meth:`launch` started (if it did)."""
        super().close()
        self._stop_process()

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
