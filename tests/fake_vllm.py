"""A stand-in for ``vllm serve`` (vLLM does not run on a CPU machine), faithful to its documented protocol.

What it reproduces, as vLLM's OpenAI-compatible server documents and its own tests show:
* ``POST /v1/chat/completions`` and ``/v1/completions``, streamed or not. The prompt is the model's chat
  template applied by the server (``apply_chat_template`` with ``tools``, ``add_generation_prompt``).
  With ``return_token_ids: true`` a chat response carries top-level ``prompt_token_ids`` and per-choice
  ``token_ids``; a completion carries both per choice; in a stream ``prompt_token_ids`` comes in the
  first chunk only and ``token_ids`` are the delta's tokens. Response ids include the end-of-turn token.
* ``logprobs`` (chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; completions:
  ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``), ``n``, ``max_tokens``,
  ``stream_options.include_usage``.
* Tool calls with ``--enable-auto-tool-choice --tool-call-parser hermes``: ``<tool_call>{json}</tool_call>``
  in the generated text becomes ``message.tool_calls`` and ``finish_reason: "tool_calls"``; "auto" without
  those flags is a 400.
* ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``{"lora_name", "lora_path"}``), attached
  only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; a loaded adapter is listed by ``/v1/models`` and is
  requested by its name as the model. An adapter whose rank (``r`` in its ``adapter_config.json``) exceeds
  ``--max-lora-rank`` (default 16) is refused.
* Errors as ``{"error": {"message", "type", "param", "code"}}``, including the context-length 400.

The "model" is a script: it answers deterministically (an echo of the last user message, or a tool call
to the first tool when the prompt offers tools), with logprobs ``-0.01 * (position + 1)``.
Run it as a server: ``python -m tests.fake_vllm serve MODEL --port P [vllm flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agl_core.gateway.tools import parse_tool_calls


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


class FakeVLLM:
    def __init__(
        self,
        tokenizer: Any,
        *,
        served_model_name: str,
        max_model_len: int = 2048,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        allow_runtime_lora: bool = False,
        model_path: str = "",
        extra_prompt_token: int | None = None,
        max_lora_rank: int = 16,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.auto_tools = enable_auto_tool_choice and tool_call_parser == "hermes"
        self.allow_runtime_lora = allow_runtime_lora
        self.model_path = model_path
        #: Simulates a server whose template differs from the model's (the drift the gateway must catch).
        self.extra_prompt_token = extra_prompt_token
        self.max_lora_rank = max_lora_rank
        self.loras: dict[str, str] = {}
        self.requests: list[dict[str, Any]] = []
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    # -- the "model" --------------------------------------------------------------------------------

    def _reply(self, body: dict[str, Any], model: str, index: int) -> str:
        tools = body.get("tools") or []
        if body.get("messages") is None:
            text = f"completion of {body['prompt'] if isinstance(body['prompt'], str) else 'ids'}"
        elif tools and body.get("tool_choice", "auto") != "none" and body["messages"][-1]["role"] != "tool":
            name = tools[0]["function"]["name"]
            text = f'<tool_call>\n{{"name": "{name}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
        else:
            last = next(
                (m for m in reversed(body["messages"]) if m["role"] in ("user", "tool")), {"content": ""}
            )
            text = f"echo: {last.get('content') or ''}"
        if model != self.served_model_name:
            text = f"[{model}] {text}"
        return text + (f" #{index}" if index else "")

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        if body.get("messages") is None:
            prompt = body["prompt"]
            return list(prompt) if isinstance(prompt, list) else list(self.tokenizer.encode(prompt))
        messages = [{**m, "content": m.get("content") or ""} for m in body["messages"]]
        ids = self.tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if self.extra_prompt_token is not None:
            ids.insert(1, self.extra_prompt_token)
        return ids

    def _generate(
        self, body: dict[str, Any], prompt_len: int, model: str, index: int
    ) -> tuple[list[int], str]:
        ids = list(self.tokenizer.encode(self._reply(body, model, index))) + [self.end_id]
        limit = body.get("max_tokens") or (self.max_model_len - prompt_len)
        if len(ids) > limit:
            return ids[:limit], "length"
        return ids, "stop"

    def _entry(self, token: int, position: int, top: int) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        lp = -0.01 * (position + 1)
        alternatives = [{"token": text, "logprob": lp, "bytes": list(text.encode())}][:top]
        return {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alternatives}

    # -- endpoints ------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": self.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": self.model_path,
                "parent": None,
            }
        ]
        data += [
            {
                "id": n,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": p,
                "parent": self.served_model_name,
            }
            for n, p in self.loras.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(self, request: Request) -> Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.loras:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if not os.path.isdir(path):
            return _error(404, f"No adapter found for {path}", "NotFoundError")
        config_file = os.path.join(path, "adapter_config.json")
        if os.path.isfile(config_file):
            with open(config_file) as fh:
                rank = int(json.load(fh).get("r", 0))
            if rank > self.max_lora_rank:
                return _error(400, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.")
        self.loras[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        name = (await request.json()).get("lora_name")
        if name not in self.loras:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "Invalid JSON")
        self.requests.append(body)
        model = body.get("model")
        if model != self.served_model_name and model not in self.loras:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        if chat and body.get("tools") and body.get("tool_choice", "auto") == "auto" and not self.auto_tools:
            return _error(
                400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        prompt_ids = self._prompt_ids(body)
        if body.get("max_tokens") and len(prompt_ids) + body["max_tokens"] > self.max_model_len:
            return _error(
                400,
                (
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you"
                    f" requested {len(prompt_ids) + body['max_tokens']} tokens ({len(prompt_ids)} in the"
                    f" messages, {body['max_tokens']} in the completion). Please reduce the length of the"
                    " messages or completion."
                ),
            )
        choices = [self._generate(body, len(prompt_ids), model, i) for i in range(body.get("n") or 1)]
        if body.get("stream"):
            return StreamingResponse(
                self._stream(body, chat, model, prompt_ids, choices), media_type="text/event-stream"
            )
        return JSONResponse(self._whole(body, chat, model, prompt_ids, choices))

    def _tools_of(self, body: dict[str, Any], text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if not (self.auto_tools and body.get("tools") and body.get("tool_choice", "auto") != "none"):
            return text, []
        content, calls = parse_tool_calls(text, "hermes")
        return (content.strip() or None, calls) if calls else (text, [])

    def _whole(
        self,
        body: dict[str, Any],
        chat: bool,
        model: str,
        prompt_ids: list[int],
        choices: list[tuple[list[int], str]],
    ) -> dict[str, Any]:
        want_ids = bool(body.get("return_token_ids"))
        out_choices = []
        for index, (ids, finish) in enumerate(choices):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if chat:
                top = int(body.get("top_logprobs") or 0)
                content, calls = self._tools_of(body, text)
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": calls,
                    "reasoning_content": None,
                }
                choice: dict[str, Any] = {
                    "index": index,
                    "message": message,
                    "finish_reason": "tool_calls" if calls else finish,
                    "logprobs": {"content": [self._entry(t, p, top) for p, t in enumerate(ids)]}
                    if body.get("logprobs")
                    else None,
                    "stop_reason": None,
                }
                if want_ids:
                    choice["token_ids"] = ids
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "logprobs": self._text_logprobs(ids, body.get("logprobs")),
                    "prompt_logprobs": None,
                }
                choice["prompt_token_ids"] = prompt_ids if want_ids else None
                choice["token_ids"] = ids if want_ids else None
            out_choices.append(choice)
        completion_tokens = sum(len(ids) for ids, _ in choices)
        out = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": out_choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
        if chat and want_ids:
            out["prompt_token_ids"] = prompt_ids
        return out

    def _text_logprobs(self, ids: list[int], top: int | None) -> dict[str, Any] | None:
        if top is None:
            return None
        entries = [self._entry(t, p, top) for p, t in enumerate(ids)]
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    async def _stream(
        self,
        body: dict[str, Any],
        chat: bool,
        model: str,
        prompt_ids: list[int],
        choices: list[tuple[list[int], str]],
    ) -> AsyncIterator[bytes]:
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        want_ids = bool(body.get("return_token_ids"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        top = int(body.get("top_logprobs") or 0) if chat else int(body.get("logprobs") or 0)
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None

        def chunk(choice_list: list[dict[str, Any]], first: bool = False) -> bytes:
            out: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choice_list,
            }
            if first and want_ids and chat:
                out["prompt_token_ids"] = prompt_ids
            return b"data: " + json.dumps(out).encode() + b"\n\n"

        for index, (ids, finish) in enumerate(choices):
            if chat:
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    first=index == 0,
                )
            text_so_far = ""
            full = self.tokenizer.decode(ids, skip_special_tokens=True)
            content, calls = self._tools_of(body, full) if chat else (full, [])
            for position, token in enumerate(ids):
                text = self.tokenizer.decode(ids[: position + 1], skip_special_tokens=True)
                piece, text_so_far = text[len(text_so_far) :], text
                if calls:  # the hermes parser holds tool-call text back; the tokens still stream
                    piece = ""
                last = position == len(ids) - 1
                entry = self._entry(token, position, top)
                if chat:
                    delta: dict[str, Any] = {"content": piece} if piece else {}
                    if last and calls:
                        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                    choice: dict[str, Any] = {
                        "index": index,
                        "delta": delta,
                        "logprobs": {"content": [entry]} if want_lp else None,
                        "finish_reason": ("tool_calls" if calls else finish) if last else None,
                    }
                else:
                    choice = {
                        "index": index,
                        "text": piece,
                        "finish_reason": finish if last else None,
                        "logprobs": {
                            "tokens": [entry["token"]],
                            "token_logprobs": [entry["logprob"]],
                            "top_logprobs": [{entry["token"]: entry["logprob"]}],
                            "text_offset": [0],
                        }
                        if want_lp
                        else None,
                    }
                    if position == 0 and want_ids:
                        choice["prompt_token_ids"] = prompt_ids
                if want_ids:
                    choice["token_ids"] = [token]
                yield chunk([choice])
        if usage:
            n = sum(len(ids) for ids, _ in choices)
            tail = {
                "id": cid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": n,
                    "total_tokens": len(prompt_ids) + n,
                },
            }
            yield b"data: " + json.dumps(tail).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        if self.allow_runtime_lora:
            routes += [
                Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
            ]
        return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.fake_vllm serve MODEL [flags]``: the subset of ``vllm serve`` flags agl uses."""
    parser = argparse.ArgumentParser(prog="fake-vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--tool-call-parser", default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    # accepted as vLLM does; a CPU fake has no GPUs to spread over
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)
    from agl_core.server import serve_forever
    from agl_trainer.model import load_tokenizer

    fake = FakeVLLM(
        load_tokenizer("tiny"),
        served_model_name=args.served_model_name or args.model,
        max_model_len=args.max_model_len,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        allow_runtime_lora=args.enable_lora
        and os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        model_path=args.model,
        max_lora_rank=args.max_lora_rank or 16,
    )
    print(f"fake vllm serving {args.model} on {args.host}:{args.port}", file=sys.stderr, flush=True)
    serve_forever(fake.app(), args.host, args.port, log_level="warning")


if __name__ == "__main__":
    main()
