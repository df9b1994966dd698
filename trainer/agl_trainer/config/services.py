"""``store``, ``gateway``, ``runner`` and ``serving``: what a run starts to serve its policy to the agent."""

from __future__ import annotations

from typing import Literal

import pydantic

from .base import _Strict


class StoreConfig(_Strict):
    #: SQLite file of the embedded store, relative to ``output_dir``. Ignored when ``url`` is set.
    path: str = "store.sqlite"
    #: Use a running ``agl store serve`` instead of the embedded one.
    url: str | None = pydantic.Field(None, pattern=r"^https?://")


class GatewayConfig(_Strict):
    #: Where the gateway listens. Runners on other machines (``runner.workers: 0`` and ``agl run`` there)
    #: need an address they reach; beyond localhost, ``token`` is required.
    host: str = "127.0.0.1"
    port: int = pydantic.Field(0, ge=0, le=65535)
    #: Required of every model request (as the API key); default ``$AGL_GATEWAY_TOKEN``. The runners get it
    #: from the store with the gateway's URL and hand it to the agent as ``llm.api_key``.
    token: str | None = pydantic.Field(None, min_length=8)
    #: The gateway URL runners are told (``http://HOST:PORT``), when ``host`` is not an address they can
    #: reach as it is (a wildcard such as ``0.0.0.0``, a NAT); default: the address it listens on.
    advertise_url: str | None = pydantic.Field(None, pattern=r"^https?://[^/]+$")

    @pydantic.model_validator(mode="after")
    def _reachable_needs_token(self) -> GatewayConfig:
        from agl_core.settings import gateway_token, is_loopback

        if not is_loopback(self.host) and gateway_token(self.token) is None:
            raise ValueError(
                f"gateway.host {self.host!r} is reachable from other machines: set gateway.token (or"
                " AGL_GATEWAY_TOKEN) to a secret of 8 or more characters; runners pass it to the agent"
            )
        if self.host.strip("[]") in ("0.0.0.0", "::") and self.advertise_url is None:
            raise ValueError(
                f"gateway.host {self.host!r} listens on every address, and runners need one they reach:"
                " set gateway.advertise_url (http://HOST:PORT), or gateway.host to that address"
            )
        return self

    #: Response length when a request does not say (``serving.backend: hf``; a vLLM server generates up to
    #: the end of its context window).
    default_max_tokens: int = pydantic.Field(256, ge=1)


class RunnerConfig(_Strict):
    #: Rollouts the trainer's own runner runs at once. 0 starts no local runner: start ``agl run`` runners
    #: (on any machine that reaches the store and the gateway) instead; the trainer prints the command.
    workers: int = pydantic.Field(2, ge=0, le=256)
    #: How the agent runs: ``thread``; ``process`` (one worker process each; a hung agent is killed at its
    #: timeout, a crashing one fails only its attempt); ``async`` (one event loop, for ``async def``
    #: agents); ``auto`` picks ``async`` for ``async def`` agents and ``thread`` otherwise.
    mode: Literal["auto", "thread", "process", "async"] = "auto"
    #: Seconds one rollout may run before its attempt ends as ``timed_out`` (and is retried while
    #: ``max_attempts`` allows); ``null`` = no limit. In thread mode the agent's thread cannot be stopped and
    #: runs on detached; use ``process`` for agents that may hang.
    rollout_timeout_s: float | None = pydantic.Field(None, gt=0)
    #: How long a training step waits for its rollouts before it goes on without the late ones.
    step_timeout_s: float = pydantic.Field(600.0, gt=0)
    max_attempts: int = pydantic.Field(1, ge=1, le=10)


class VLLMLaunchConfig(_Strict):
    #: What ``vllm serve`` loads; default: ``model.source``.
    model: str | None = None
    tensor_parallel_size: int = pydantic.Field(1, ge=1, le=64)
    #: Share of each GPU's memory vLLM may take (weights + KV cache). Leave room for the trainer when
    #: both use the same GPU.
    gpu_memory_utilization: float = pydantic.Field(0.9, gt=0.0, le=1.0)
    #: Context window (``--max-model-len``); ``null``: the model's own.
    max_model_len: int | None = pydantic.Field(None, ge=16)
    #: vLLM's tool-call parser (``--tool-call-parser``); ``null`` turns tool calling off.
    tool_call_parser: str | None = "hermes"
    #: More ``vllm serve`` arguments, passed as they are (for example ``["--dtype", "bfloat16"]``).
    extra_args: list[str] = []
    #: Environment variables for the server (for example ``CUDA_VISIBLE_DEVICES: "1"``).
    env: dict[str, str] = {}
    #: The command that starts the server; the model and the flags follow it.
    command: list[str] = pydantic.Field(default_factory=lambda: ["vllm", "serve"], min_length=1)
    startup_timeout_s: float = pydantic.Field(900.0, gt=0.0)


class VLLMServingConfig(_Strict):
    #: A running vLLM server (``http://HOST:PORT/v1``), started with ``--enable-lora`` and the environment
    #: variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; ``null`` launches one (see ``launch``).
    url: str | None = pydantic.Field(None, pattern=r"^https?://[^/]+(/.*)?/v1/?$")
    #: The name the running server serves the base model under (its ``--served-model-name``); default:
    #: ``model.served_name``. Only with ``url``.
    upstream_model: str | None = None
    #: How to start ``vllm serve`` when ``url`` is ``null``.
    launch: VLLMLaunchConfig = VLLMLaunchConfig()
    #: Directory of the LoRA adapter of each policy version, relative to ``output_dir``; the vLLM server
    #: must be able to read it (same machine or a shared file system).
    lora_dir: str = "adapters"
    #: How many of the newest adapter directories to keep on disk (at least 2: the previous version may
    #: still serve calls in flight).
    keep_adapters: int = pydantic.Field(3, ge=2)

    @pydantic.model_validator(mode="after")
    def _url_or_launch(self) -> VLLMServingConfig:
        if self.url is not None and "launch" in self.model_fields_set:
            raise ValueError(
                "serving.vllm: set either 'url' (a running server) or 'launch' (start one), not both"
            )
        if self.url is None and self.upstream_model is not None:
            raise ValueError(
                "serving.vllm.upstream_model names the model of a running server; it needs serving.vllm.url"
                " (a launched server serves model.served_name)"
            )
        return self


class HFServingConfig(_Strict):
    #: How the transformers backend keeps keys and values: ``slots`` (a preallocated cache written in
    #: place, prompt prefixes reused) or ``dynamic`` (transformers' own cache, every prompt prefilled
    #: whole: the backend as it was before, for comparison).
    kv_cache: Literal["slots", "dynamic"] = "slots"
    #: Memory for the keys and values of prompt prefixes shared by calls under one policy version (the
    #: agent's system prompt and tool schemas), in MiB; least recently used blocks go first; 0 turns
    #: prefix reuse off. SmolLM2-135M in float32 takes 45 KiB per token: 128 MiB is about 2,900 tokens.
    prefix_cache_mb: float = pydantic.Field(128.0, ge=0.0, le=1_048_576.0)
    #: Tokens per prefix-cache block (a prompt reuses the blocks it shares with one seen before, and the
    #: first columns of the block where they part).
    prefix_block_tokens: int = pydantic.Field(16, ge=1, le=4096)
    #: On the CPU, generation multiplies float32 weights through oneDNN; the largest get a copy packed
    #: in its layout within this many MiB (dropped while the weights are updated). SmolLM2's output layer
    #: takes 128 and gains most per byte; 700 packs every layer, which measured no faster on 2 cores.
    packed_weights_mb: float = pydantic.Field(128.0, ge=0.0, le=1_048_576.0)
    #: The packed copies' dtype on the CPU. ``bfloat16``: copies rounded to bfloat16 (half the bytes, so
    #: SmolLM2 needs 260 MiB of ``packed_weights_mb`` for all of them; a layer left out multiplies in
    #: float32), each product's input and result rounded too, by oneDNN's bfloat16 kernels: 3-5x quicker
    #: than float32 at 16 rows on CPUs with bfloat16 matrix units (AMX); norms, attention and the cache
    #: stay float32. Tokens are then sampled by the rounded model and the recorded logprobs are its own,
    #: which the update's importance ratio uses. Refused where the CPU or PyTorch has no oneDNN bfloat16,
    #: or the model is not a float32 model on the CPU.
    matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    #: Decoding steps run the model's modules directly, without its forward pass's per-call machinery
    #: (Llama, Mistral and Qwen2; other architectures always use the forward pass). The first step after
    #: each weight change is checked against the forward pass. ``false``: every step through the forward
    #: pass.
    direct_decode: bool = True
    #: Most sequences decoded together (a request's ``n`` choices count each).
    max_batch: int = pydantic.Field(16, ge=1, le=4096)


class ServingConfig(_Strict):
    #: ``hf``: transformers in the trainer's process, sharing the trained weights (CPU, or one GPU);
    #: ``vllm``: a vLLM server that loads the LoRA adapter of each new policy version at runtime.
    backend: Literal["hf", "vllm"] = "hf"
    #: Settings of ``backend: hf``.
    hf: HFServingConfig = HFServingConfig()
    #: Settings of ``backend: vllm``.
    vllm: VLLMServingConfig = VLLMServingConfig()

    @pydantic.model_validator(mode="after")
    def _vllm_only_with_vllm(self) -> ServingConfig:
        if self.backend != "vllm" and "vllm" in self.model_fields_set:
            raise ValueError("serving.vllm applies only with serving.backend: vllm")
        if self.backend != "hf" and "hf" in self.model_fields_set:
            raise ValueError("serving.hf applies only with serving.backend: hf")
        return self
