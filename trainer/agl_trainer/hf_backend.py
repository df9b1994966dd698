"""Serving the policy with transformers on CPU (or one GPU), behind the gateway's ``Backend`` interface.

The backend samples token by token itself, so it knows exactly which ids the model saw and produced and
the log-probability of each sampled token under the raw (temperature 1) distribution, which is what
PPO's importance ratio needs. The model object is shared with the trainer: after an update the next call
already serves the new weights; ``policy_version`` says which.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from agl_core.gateway.backend import BackendError, ChatRequest, Completion, ContextTooLongError

__all__ = ["HFBackend"]


class HFBackend:
    """One model under one or more served names. Calls are served one at a time (``lock``)."""

    trainable = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = "agl-policy",
        default_max_tokens: int = 256,
        context_window: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._names = (model_name,)
        self.default_max_tokens = default_max_tokens
        config = getattr(model, "config", None)
        self.context_window = context_window or int(getattr(config, "max_position_embeddings", 2048))
        self.policy_version = 0
        #: Held while generating; the trainer holds it while updating the weights.
        self.lock = threading.RLock()
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
        if isinstance(im_end, int):
            eos.add(im_end)
        self.stop_ids = frozenset(eos)

    @property
    def model_names(self) -> Sequence[str]:
        return self._names

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        """Token ids of the chat template applied to ``messages``, ending with the assistant turn's start."""
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def chat(self, model: str, request: ChatRequest) -> Completion:
        try:
            prompt_ids = self.render_prompt(request.messages, request.tools)
        except Exception as exc:  # a template that cannot render these messages
            raise BackendError(f"cannot apply the chat template: {exc}") from exc
        max_new = request.max_tokens or self.default_max_tokens
        if len(prompt_ids) + max_new > self.context_window:
            raise ContextTooLongError(len(prompt_ids), max_new, self.context_window)
        with self.lock:
            return self._sample(prompt_ids, max_new, request)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], max_new: int, request: ChatRequest) -> Completion:
        generator = torch.Generator()
        if request.seed is not None:
            generator.manual_seed(request.seed)
        else:
            generator.seed()
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            response: list[int] = []
            logprobs: list[float] = []
            finish = "length"
            text = ""
            for _ in range(max_new):
                token = self._pick(logits, request, generator)
                response.append(token)
                logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
                if token in self.stop_ids:
                    finish = "stop"
                    break
                if request.stop:
                    text = self.tokenizer.decode(response, skip_special_tokens=True)
                    if any(s in text for s in request.stop):
                        finish = "stop"
                        break
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
        finally:
            if was_training:
                self.model.train()
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        for stop in request.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return Completion(
            text=text,
            finish_reason=finish,
            prompt_ids=tuple(prompt_ids),
            response_ids=tuple(response),
            response_logprobs=tuple(logprobs),
            policy_version=self.policy_version,
            response_tokens=tuple(self.tokenizer.convert_ids_to_tokens(response)),
        )

    @staticmethod
    def _pick(logits: torch.Tensor, request: ChatRequest, generator: torch.Generator) -> int:
        if request.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / request.temperature, dim=-1)
        if request.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < request.top_p
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        return int(torch.multinomial(probs, 1, generator=generator))
