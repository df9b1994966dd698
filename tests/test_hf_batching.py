"""Continuous batching in the transformers backend: a request that arrives while a batch decodes joins it
at the next token (it does not wait for the batch to finish), and generates exactly what it would alone."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from agl_core.gateway.backend import ChatRequest, Completion


class _Hold:
    """Logits processor: keeps generation from ever stopping early (the stop tokens are masked), and,
    once armed, blocks the decoding thread at the third token of the prompt ``trigger`` until released."""

    def __init__(self, stop_ids: frozenset[int]) -> None:
        self.stop_ids = sorted(stop_ids)
        self.trigger: tuple[int, ...] | None = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, prompt_ids: Any, response: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.stop_ids] = float("-inf")
        if self.trigger is not None and tuple(prompt_ids) == self.trigger and len(response) == 3:
            self.reached.set()
            assert self.release.wait(30), "the test never released the decoding thread"
        return logits


def _request(text: str, max_tokens: int, n: int = 1) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0.0, n=n
    )


async def _collect(backend: Any, request: ChatRequest) -> list[Completion]:
    return [e async for e in backend.generate("tiny", request) if isinstance(e, Completion)]


def _count_prefill_passes(backend: Any, passes: list[int]) -> None:
    """Record the number of prompts in each prefill pass of ``backend``'s batches."""
    new_batch = backend._new_batch

    def counting(version: int) -> Any:
        state = new_batch(version)
        for name in ("_prefill", "_prefill_packed"):  # padded passes (both caches), packed ones (slots)
            if hasattr(state, name):
                one_pass = getattr(state, name)
                setattr(
                    state,
                    name,
                    lambda jobs, *rest, run=one_pass: passes.append(len(jobs)) or run(jobs, *rest),
                )
        return state

    backend._new_batch = counting


@pytest.mark.parametrize("kv_cache", ["slots", "dynamic"])
@pytest.mark.parametrize("prefill_tokens", [2048, 1])
@pytest.mark.timing
def test_requests_arriving_mid_batch_join_it_and_generate_what_they_would_alone(
    tiny_policy, prefill_tokens, kv_cache
):
    """With ``prefill_tokens`` 1 every prompt is prefilled in a pass of its own and the passes merged
    (the same tokens and logprobs either way), whichever way the keys and values are kept."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(
        model,
        tokenizer,
        model_name="tiny",
        default_max_tokens=16,
        prefill_tokens=prefill_tokens,
        kv_cache=kv_cache,
    )
    assert backend.kv_cache == kv_cache
    passes: list[int] = []
    _count_prefill_passes(backend, passes)
    hold = _Hold(backend.stop_ids)
    backend.logits_processor = hold
    long, short, pair = (
        _request("a long answer", 24),
        _request("b", 6),
        _request("a pair of samples, please", 8, n=2),
    )
    try:
        alone = {id(r): asyncio.run(_collect(backend, r)) for r in (long, short, pair)}
        assert backend.joined_requests == 0 and backend.peak_batch == 2  # the pair's two choices

        hold.trigger = tuple(backend._prepare(long, lambda e: None).prompt_ids)
        backend.peak_batch = 0
        passes.clear()

        async def together() -> list[list[Completion]]:
            first = asyncio.create_task(_collect(backend, long))
            await asyncio.to_thread(hold.reached.wait, 30)
            # the long request is decoding (held at its third token): these arrive mid-batch
            others = [asyncio.create_task(_collect(backend, r)) for r in (short, pair)]
            while len(backend._queue) < 2:
                await asyncio.sleep(0.005)
            hold.release.set()
            return [await first, *[await t for t in others]]

        started = time.monotonic()
        results = asyncio.run(together())
        assert time.monotonic() - started < 60
        assert backend.joined_requests == 2, "the requests waited for the batch to end instead of joining it"
        assert backend.peak_batch == 4  # the long request, the short one and the pair's two choices
        # the long request alone, then the two that joined: in one pass, or one pass each
        assert passes == ([1, 2] if prefill_tokens > 100 else [1, 1, 1])
        for request, got in zip((long, short, pair), results, strict=True):
            expected = alone[id(request)]
            assert len(got) == len(expected) == request.n
            for a, b in zip(
                sorted(expected, key=lambda c: c.index), sorted(got, key=lambda c: c.index), strict=True
            ):
                assert b.response_ids == a.response_ids
                assert len(b.response_ids) == request.max_tokens
                assert b.response_logprobs == pytest.approx(a.response_logprobs, abs=1e-4)
                assert b.prompt_ids == a.prompt_ids
    finally:
        hold.release.set()
        backend.close()


def test_a_request_arriving_as_the_last_row_ends_starts_afresh_and_is_not_counted_as_joining(tiny_policy):
    """A request sent the moment the previous one completed can be queued before the worker is done with
    the batch that has no row left. It starts the next batch, is served the same, and is not counted
    among the requests that joined a batch."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny", default_max_tokens=16)
    backend.logits_processor = _Hold(backend.stop_ids)
    first, second = _request("first", 5), _request("second", 4)
    alone = asyncio.run(_collect(backend, second))
    queued_before_the_batch_ended = threading.Event()
    complete = backend._complete

    def slow_complete(row: Any, version: int) -> None:
        complete(row, version)  # the first request's answer is out: the client sends the next one
        if not queued_before_the_batch_ended.is_set():
            # a busy machine: the next request is queued before the worker goes on
            deadline = time.monotonic() + 30
            while not backend._queue and time.monotonic() < deadline:
                time.sleep(0.005)
            queued_before_the_batch_ended.set()

    backend._complete = slow_complete  # type: ignore[method-assign]
    try:

        async def back_to_back() -> list[Completion]:
            await _collect(backend, first)
            return await _collect(backend, second)

        got = asyncio.run(back_to_back())
        assert queued_before_the_batch_ended.is_set()
        assert backend.joined_requests == 0
        assert [c.response_ids for c in got] == [c.response_ids for c in alone]
    finally:
        backend.close()


def test_no_request_joins_while_a_weight_update_waits(tiny_policy):
    """A batch stops admitting newcomers once the trainer waits for the lock, so the update gets in after
    the rows already decoding, not after every request that keeps arriving."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny", default_max_tokens=16)
    hold = _Hold(backend.stop_ids)
    backend.logits_processor = hold
    long, late = _request("a long answer", 12), _request("late", 4)
    hold.trigger = tuple(backend._prepare(long, lambda e: None).prompt_ids)
    got_lock = threading.Event()
    try:

        async def run() -> tuple[list[Completion], list[Completion]]:
            first = asyncio.create_task(_collect(backend, long))
            await asyncio.to_thread(hold.reached.wait, 30)
            updater = threading.Thread(
                target=lambda: (backend.lock.acquire(), got_lock.set(), backend.lock.release())
            )
            updater.start()
            while not backend.lock.contended:
                await asyncio.sleep(0.005)
            second = asyncio.create_task(_collect(backend, late))
            while not backend._queue:
                await asyncio.sleep(0.005)
            hold.release.set()
            out = await first
            assert got_lock.wait(30)
            updater.join(30)
            return out, await second

        first, second = asyncio.run(run())
        assert backend.joined_requests == 0
        assert len(first[0].response_ids) == 12 and len(second[0].response_ids) == 4
    finally:
        hold.release.set()
        backend.close()


class _Relay:
    """Logits processor: masks the stop tokens, and signals when a prompt's row has generated ``at``
    tokens (so the test can send the next request while that one is still decoding). Once ``armed``,
    it then holds the decoding thread until ``queued()`` says the next request is in the queue (or the
    prompt is in ``last``), so a busy machine cannot end the batch before the request gets there."""

    def __init__(self, stop_ids: frozenset[int], at: int) -> None:
        self.stop_ids = sorted(stop_ids)
        self.at = at
        self.reached: dict[tuple[int, ...], threading.Event] = {}
        self.armed = False
        self.queued: Any = lambda: True
        self.last: set[tuple[int, ...]] = set()

    def __call__(self, prompt_ids: Any, response: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.stop_ids] = float("-inf")
        if len(response) == self.at:
            self.reached.setdefault(tuple(prompt_ids), threading.Event()).set()
            if self.armed and tuple(prompt_ids) not in self.last:
                deadline = time.monotonic() + 30
                while not self.queued() and time.monotonic() < deadline:
                    time.sleep(0.001)
        return logits


@pytest.mark.parametrize("kv_cache", ["slots", "dynamic"])
def test_a_batch_kept_alive_by_joining_requests_stays_as_wide_as_its_rows(tiny_policy, kv_cache):
    """Eight requests, each sent while the one before it is half-way through, keep one batch decoding
    from the first to the last. The cache is as wide as the rows still in it need (the columns of rows
    that left are dropped), not one column more for every step the batch has lived, and every request
    generates what it would alone."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny", default_max_tokens=12, kv_cache=kv_cache)
    relay = _Relay(backend.stop_ids, at=6)
    backend.logits_processor = relay
    requests = [_request(f"request {i}" + " and some more words" * (i % 3), 12) for i in range(8)]
    widths: list[int] = []
    forward = backend.forward
    # the mask's last dimension: the columns attention reads (2-D mask: dynamic cache; 4-D: slots)
    # (a packed prefill pass has no mask: its width is each prompt's own)
    backend.forward = lambda **kw: (
        (  # type: ignore[method-assign]
            kw.get("attention_mask") is not None and widths.append(kw["attention_mask"].shape[-1])
        )
        or forward(**kw)
    )
    if backend._direct is not None:  # decoding steps through the model's modules read positions.max() + 1
        step = backend._direct.step
        backend._direct.step = lambda *args: (  # type: ignore[method-assign]
            widths.append(int(args[2].max()) + 1) or step(*args)
        )
    try:
        alone = [asyncio.run(_collect(backend, r)) for r in requests]
        prompts = [tuple(backend._prepare(r, lambda e: None).prompt_ids) for r in requests]
        for prompt in prompts:
            relay.reached[prompt] = threading.Event()
        relay.armed, relay.queued, relay.last = True, lambda: bool(backend._queue), {prompts[-1]}
        widths.clear()

        async def relayed() -> list[list[Completion]]:
            tasks = []
            for request, prompt in zip(requests, prompts, strict=True):
                tasks.append(asyncio.create_task(_collect(backend, request)))
                assert await asyncio.to_thread(relay.reached[prompt].wait, 30)
            return [await t for t in tasks]

        results = asyncio.run(relayed())
        assert backend.joined_requests == 7, "the requests did not join one batch"
        longest = max(len(p) for p in prompts) + 12
        # one batch for 8 x 6 + 6 = 54 decoding steps: without dropping the columns of rows that left,
        # it would have been the first prompt's width plus 54 at the end
        assert max(widths) <= longest + 1, (max(widths), longest)
        for expected, got in zip(alone, results, strict=True):
            assert got[0].response_ids == expected[0].response_ids
            assert got[0].response_logprobs == pytest.approx(expected[0].response_logprobs, abs=1e-4)
    finally:
        backend.close()


def test_sampling_draws_each_token_as_often_as_its_probability_and_never_an_impossible_one():
    from agl_trainer.generation.requests import sample

    weights = torch.tensor([0.2, 0.0, 1.2, 0.6, 0.0])  # not normalised: 0.1, 0, 0.6, 0.3, 0
    generator = torch.Generator().manual_seed(7)
    draws = [sample(weights, generator) for _ in range(20000)]
    counts = [draws.count(t) / len(draws) for t in range(5)]
    assert counts[1] == counts[4] == 0.0
    assert counts[0] == pytest.approx(0.1, abs=0.01)
    assert counts[2] == pytest.approx(0.6, abs=0.015)
    assert counts[3] == pytest.approx(0.3, abs=0.015)
    again = torch.Generator().manual_seed(7)
    assert [sample(weights, again) for _ in range(200)] == draws[:200]  # a seeded request repeats itself
    # one possible token, at either end of the vocabulary
    assert {sample(torch.tensor([0.0, 0.0, 3.0]), generator) for _ in range(50)} == {2}
    assert {sample(torch.tensor([5.0, 0.0, 0.0]), generator) for _ in range(50)} == {0}


def _sampled(backend: Any, prompts: list[str], *, together: bool, seed: int | None = None) -> list[tuple]:
    """The responses (token ids) to ``prompts``, asked all at once or one after another, sorted per prompt."""

    def ask(text: str) -> ChatRequest:
        return ChatRequest(
            messages=[{"role": "user", "content": text}], max_tokens=8, temperature=1.0, seed=seed
        )

    async def run() -> list[list[Completion]]:
        if together:
            return list(await asyncio.gather(*(_collect(backend, ask(p)) for p in prompts)))
        return [await _collect(backend, ask(p)) for p in prompts]

    results = asyncio.run(run())
    return sorted((p, tuple(c.response_ids)) for p, got in zip(prompts, results, strict=True) for c in got)


def test_a_seeded_backend_samples_the_same_responses_whatever_order_requests_arrive_in(tiny_policy):
    """``HFBackend(seed=...)`` (``train.seed`` in a run): a group of rollouts asking the same prompt gets the
    same set of samples whether its requests arrive together, one by one, or in another order; another seed,
    another policy version, or no seed samples differently; a request's own seed still decides its own."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    group = ["two plus two", "two plus two", "two plus two", "nine minus one", "nine minus one"]

    def backend(seed: int | None) -> HFBackend:
        return HFBackend(model, tokenizer, model_name="tiny", seed=seed)

    first, second, other, unseeded = backend(3), backend(3), backend(4), backend(None)
    try:
        batched = _sampled(first, group, together=True)
        assert len({r for _, r in batched}) == len(group)  # every rollout of the group drew its own sample
        assert _sampled(second, group[::-1], together=False) == batched
        assert _sampled(other, group, together=True) != batched
        assert _sampled(unseeded, group, together=True) != batched

        # a new policy version starts the prompts' seed sequences afresh: new samples, the same for both
        first.policy_version = second.policy_version = 1
        at_v1 = _sampled(first, group, together=True)
        assert at_v1 != batched and _sampled(second, group, together=False) == at_v1

        # a request's own seed wins over the backend's: the same sample from every backend
        mine = _sampled(first, group[:1], together=True, seed=11)
        assert _sampled(other, group[:1], together=True, seed=11) == mine
        assert _sampled(unseeded, group[:1], together=True, seed=11) == mine
    finally:
        for b in (first, second, other, unseeded):
            b.close()
