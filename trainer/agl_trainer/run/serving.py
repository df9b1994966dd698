"""Serving the policy during training: the gateway's backend, and how each new policy version reaches it.

:func:`start_serving` builds what ``serving:`` in the config asks for and returns a :class:`HFServing` or a
:class:`VLLMServing`. Both offer the same five things to the training loop:

* ``backend``: the gateway backend (``create_gateway_app(serving.backend, renderer=serving.renderer)``);
* ``lock``: held while the trainer changes weights the backend reads (the transformers backend shares the
  trained model object; a vLLM server has its own copy, so there it is a no-op);
* ``publish(model, version, policies=None)``: serve ``model``'s current weights as policy ``version`` from
  the next call (with a policy per agent, ``policies`` names the adapters that changed; default: all);
* ``publish_adapters({policy: path}, version)``: serve saved adapters (a checkpoint's) to their policies;
* ``close()``: stop what :func:`start_serving` started.

vLLM is never imported here: the server is its own process (``vllm serve``), reached over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agl_core.gateway.backend import PolicyUpdate

from ..config import TrainerConfig
from .step import GenerationCounters

__all__ = ["HFServing", "VLLMServing", "start_serving", "vllm_launch_kwargs", "vllm_max_lora_rank"]

T = TypeVar("T")

#: The values vLLM accepts for ``--max-lora-rank`` (``MaxLoRARanks`` in ``vllm/config/lora.py``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that fits adapters of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; model.lora.r is {r}")


def vllm_launch_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """Keyword arguments of :meth:`VLLMBackend.launch` for ``serving.vllm.launch`` (LoRA on, sized for
    ``model.lora.r``; two adapters at once, so calls in flight finish on the previous version)."""
    launch = config.serving.vllm.launch
    if config.model.lora is None and not config.policies:
        raise ValueError("serving.backend vllm needs model.lora")
    loras = [p.lora for p in config.policies] + [config.model.lora]
    ranks = [lora.r for lora in loras if lora is not None]
    args = [
        "--tensor-parallel-size",
        str(launch.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(launch.gpu_memory_utilization),
        "--max-loras",
        # each policy's adapter and its previous version (calls in flight), in one batch
        str(2 * max(1, len(config.policies))),
    ]
    if launch.max_model_len is not None:
        args += ["--max-model-len", str(launch.max_model_len)]
    if config.model.chat_template is not None:  # vLLM renders chat requests itself: with the same template
        args += ["--chat-template", config.model.chat_template]
    return {
        "model": launch.model or config.model.source,
        "model_name": config.model.served_name,
        "tool_call_parser": launch.tool_call_parser,
        "enable_lora": True,
        "max_lora_rank": vllm_max_lora_rank(max(ranks)),
        "extra_args": [*args, *launch.extra_args],
        "command": tuple(launch.command),
        "env": dict(launch.env),
        "startup_timeout_s": launch.startup_timeout_s,
    }


class HFServing:
    """The transformers backend in this process, serving the very model object being trained."""

    kind = "hf"

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        #: The transformers backend renders prompts itself: no drift check needed.
        self.renderer = None
        #: The backend's generation lock: hold it around the optimizer step.
        self.lock = backend.lock

    @property
    def policy_version(self) -> int:
        return int(self.backend.policy_version)

    def generation_counters(self) -> GenerationCounters:
        """What the backend has generated since it started, and how long it took (the step metrics)."""
        b = self.backend
        return GenerationCounters(
            seconds=float(b.generation_s),
            tokens=int(b.generated_tokens),
            prefill_s=float(b.prefill_s),
            decode_s=float(b.decode_s),
            prefilled_tokens=int(b.prefilled_tokens),
            reused_tokens=int(b.reused_tokens),
        )

    def publish(self, model: Any, version: int, policies: Sequence[str] | None = None) -> None:
        """Serve ``model`` as policy ``version`` from the next batch on (an in-place swap, no copy; every
        policy's adapter lives in ``model``, so ``policies`` changes nothing here)."""
        _check_version(self.policy_version, version)
        with self.backend.lock:
            if model is not self.backend.model:
                self.backend.model = model
            self.backend.policy_version = version

    def publish_adapter(self, path: str | Path, version: int) -> None:
        """Load the LoRA adapter in ``path`` (a PEFT directory) as policy ``version``."""
        _check_version(self.policy_version, version)
        self.backend.load_policy(PolicyUpdate(version, str(path), "lora"))

    def publish_adapters(self, adapters: Mapping[str, str | Path], version: int) -> None:
        """Serve each policy's LoRA adapter directory in ``adapters`` to its agents, as policy ``version``."""
        _check_version(self.policy_version, version)
        for policy, path in adapters.items():
            self.backend.load_policy(PolicyUpdate(version, str(path), "lora", policy=policy))

    def close(self) -> None:
        self.backend.close()


class VLLMServing:
    """A vLLM server (launched, or running at ``serving.vllm.url``) that loads each version's LoRA adapter.

    :meth:`publish` writes the adapter to ``<adapter_dir>/v<version>`` and has the server load it
    (``/v1/load_lora_adapter``); requests then name it, so every span records the version that served it.
    The backend unloads the adapter before the previous one; directories beyond the newest ``keep`` are
    deleted.
    """

    kind = "vllm"

    def __init__(self, backend: Any, *, adapter_dir: Path, keep: int = 3, renderer: Any = None) -> None:
        self.backend = backend
        #: Renders each prompt with the trainer's tokenizer, so the gateway flags calls where vLLM's
        #: template produced other token ids.
        self.renderer = renderer
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self.adapter_dir = Path(adapter_dir).resolve()
        self.keep = max(2, keep)
        self._loop = _LoopThread("agl-vllm-publish")
        #: With a policy per agent: each policy's adapter directories vLLM has loaded (the previous one and
        #: the serving one). vLLM may read an adapter again (its cache is bounded), so pruning keeps them.
        self._serving: dict[str, list[Path]] = {}

    @property
    def policy_version(self) -> int:
        return int(self.backend.policy_version)

    def publish(self, model: Any, version: int, policies: Sequence[str] | None = None) -> None:
        """Save ``model``'s LoRA adapter and serve it as policy ``version``.

        With a policy per agent, ``model`` holds an adapter per policy, and only those in ``policies`` (all
        of them when ``None``) are saved and loaded, each replacing its policy's previous adapter; the
        others keep serving. Raises ``ValueError`` for a model without a LoRA adapter (vLLM would need a
        restart to load full weights) and :class:`~agl_core.gateway.BackendError` when vLLM refuses the
        adapter.
        """
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            raise ValueError(
                "vLLM serving loads new policy versions as LoRA adapters, and this model has none; train with"
                " model.lora set (loading full weights would restart vLLM at every step)"
            )
        _check_version(self.policy_version, version)
        changed: list[str] = []
        if self.backend.route is not None:
            changed = list(model.peft_config) if policies is None else list(policies)
            if not changed:  # no policy trained this step: the same adapters serve under the new version
                self.backend.policy_version = version
                return
        target = self.adapter_dir / f"v{version}"
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.", dir=self.adapter_dir))
        try:
            # with several adapters, PEFT writes each to a subdirectory named after it
            if changed:
                model.save_pretrained(str(tmp), selected_adapters=changed)
            else:
                model.save_pretrained(str(tmp))
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if changed:
            self.publish_adapters({name: target / name for name in changed}, version)
        else:
            self.publish_adapter(target, version)

    def publish_adapters(self, adapters: Mapping[str, str | Path], version: int) -> None:
        """Have the server load each policy's adapter directory in ``adapters`` (a policy per agent), each
        replacing that policy's previous adapter, as policy ``version``."""
        _check_version(self.policy_version, version)
        if self.backend.route is None:
            raise ValueError("adapters per policy need serving with policies: (this server has one policy)")
        for policy, path in adapters.items():
            path = Path(path).resolve()
            if not (path / "adapter_config.json").is_file():
                raise ValueError(f"{path} is not a LoRA adapter directory (no adapter_config.json)")
            update = PolicyUpdate(version, str(path), "lora", policy=policy)
            self._loop.run(self.backend.update_policy(update))
            self._serving[policy] = [*self._serving.get(policy, [])[-1:], path]
        self._prune()

    def publish_adapter(self, path: str | Path, version: int) -> None:
        """Have the server load the LoRA adapter directory ``path`` as policy ``version``."""
        _check_version(self.policy_version, version)
        path = Path(path).resolve()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"{path} is not a LoRA adapter directory (no adapter_config.json)")
        self._loop.run(self.backend.update_policy(PolicyUpdate(version, str(path), "lora")))
        self._prune()

    def _prune(self) -> None:
        versions = []
        for child in self.adapter_dir.iterdir() if self.adapter_dir.is_dir() else ():
            found = re.fullmatch(r"v(\d+)", child.name)
            if found and child.is_dir():
                versions.append((int(found.group(1)), child))
        in_use = {path.parent for paths in self._serving.values() for path in paths}
        for _, child in sorted(versions)[: -self.keep]:
            if child.resolve() not in in_use:
                shutil.rmtree(child, ignore_errors=True)

    def close(self) -> None:
        """Stop the publishing thread, close the backend's connections and stop a server it launched."""
        self._loop.close()
        self.backend.close()


def _check_version(current: int, version: int) -> None:
    if version <= current:
        raise ValueError(f"policy version {version} is not newer than the one served ({current})")


class _LoopThread:
    """An event loop on a daemon thread, for calling the backend's coroutines from the training loop.

    The backend keeps its HTTP connections per event loop; one long-lived loop reuses them across steps.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def start_serving(config: TrainerConfig, model: Any, tokenizer: Any) -> HFServing | VLLMServing:
    """Start serving the policy as ``serving:`` says, at policy version 0.

    ``model`` is the policy being trained (served in place by ``hf``; ``vllm`` starts from the base model,
    which a fresh LoRA adapter leaves unchanged) and ``tokenizer`` its tokenizer. Launching vLLM waits
    until the server answers (``serving.vllm.launch.startup_timeout_s``).
    """
    if config.serving.backend == "hf":
        from ..generation.hf_backend import HFBackend

        router = config.router()
        hf = config.serving.hf
        return HFServing(
            HFBackend(
                model,
                tokenizer,
                model_name=config.model.served_name,
                default_max_tokens=config.gateway.default_max_tokens,
                route=None if router is None else router.policy_for,
                seed=config.train.seed,
                max_batch=hf.max_batch,
                kv_cache=hf.kv_cache,
                prefix_cache_mb=hf.prefix_cache_mb,
                prefix_block_tokens=hf.prefix_block_tokens,
                packed_weights_mb=hf.packed_weights_mb,
                direct_decode=hf.direct_decode,
                matmul_dtype=hf.matmul_dtype,
            )
        )

    from agl_core.gateway.render import TemplateRenderer
    from agl_core.gateway.vllm_backend import VLLMBackend

    vllm = config.serving.vllm
    if vllm.url is not None:
        backend = VLLMBackend(
            vllm.url.rstrip("/"), model_name=config.model.served_name, upstream_model=vllm.upstream_model
        )
    else:
        backend = VLLMBackend.launch(**vllm_launch_kwargs(config))
    router = config.router()
    if router is not None:
        backend.route = router.policy_for
    renderer = TemplateRenderer(tokenizer) if tokenizer is not None else None
    return VLLMServing(
        backend, adapter_dir=config.output_dir / vllm.lora_dir, keep=vllm.keep_adapters, renderer=renderer
    )
