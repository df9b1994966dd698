"""The transformers backend's key/value memory: prompt prefixes reused across calls (exact to generating
without them, bounded, never served across a weight change) and a preallocated cache written in place."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from agl_core.gateway.backend import BackendError, ChatRequest, Completion

SYSTEM = "You are a careful assistant that solves arithmetic word problems with a calculator. " * 6
QUESTIONS = [f"Question {i}: what is {i} times {i + 3}?" + " Show it." * (i % 3) for i in range(6)]


def _request(question: str, *, max_tokens: int = 10, n: int = 1, system: str = SYSTEM) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        n=n,
    )


async def _collect(backend: Any, request: ChatRequest) -> list[Completion]:
    return [e async for e in backend.generate("tiny", request) if isinstance(e, Completion)]


def _together(backend: Any, requests: list[ChatRequest]) -> list[list[Completion]]:
    async def run() -> list[list[Completion]]:
        return list(await asyncio.gather(*(_collect(backend, r) for r in requests)))

    return asyncio.run(run())


def _generate(model: Any, prompt_ids: tuple[int, ...], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from transformers' own ``generate()`` (no prefix cache)."""
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _assert_as_generate(model: Any, completion: Completion) -> None:
    tokens, logprobs = _generate(model, completion.prompt_ids, len(completion.response_ids))
    assert list(completion.response_ids) == tokens
    assert list(completion.response_logprobs) == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture
def backend_of(tiny_policy):
    made: list[Any] = []

    def make(model: Any = None, **kwargs: Any) -> Any:
        from agl_trainer.generation.hf_backend import HFBackend

        base, tokenizer = tiny_policy
        kwargs.setdefault("prefix_block_tokens", 8)
        backend = HFBackend(model if model is not None else base, tokenizer, model_name="tiny", **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def test_a_shared_prefix_is_computed_once_and_generates_what_generate_does(backend_of, tiny_policy):
    """The system prompt's blocks, computed for the first call, serve every later call under the same
    policy version; every call's tokens and logprobs are those of ``generate()`` without any cache."""
    model, _ = tiny_policy
    backend = backend_of()
    first = _together(backend, [_request(QUESTIONS[0])])[0][0]
    assert backend.reused_tokens == 0
    prompt = len(first.prompt_ids)
    assert backend.prefilled_tokens == prompt
    system = len(backend.render_prompt([{"role": "system", "content": SYSTEM}], None))

    later = _together(backend, [_request(q) for q in QUESTIONS[1:]])
    # each later prompt took at least the system prompt's whole blocks from the cache
    assert backend.reused_tokens >= len(QUESTIONS[1:]) * (system // 8 * 8) > 0
    assert backend.prefix_cache.stats.hit_rate > 0.5
    for completion in [first, *(got[0] for got in later)]:
        _assert_as_generate(model, completion)

    # the same prompt again: all of it but its last token comes from the cache, the answer is the same
    again = _together(backend, [_request(QUESTIONS[0])])[0][0]
    assert again.response_ids == first.response_ids
    assert again.response_logprobs == pytest.approx(first.response_logprobs, abs=1e-5)


def test_several_choices_and_joining_requests_start_from_the_cache_exactly(backend_of, tiny_policy):
    model, _ = tiny_policy
    backend = backend_of()
    _together(backend, [_request(QUESTIONS[0])])
    results = _together(backend, [_request(QUESTIONS[1], n=3), _request(QUESTIONS[2], max_tokens=4)])
    assert [len(got) for got in results] == [3, 1]
    for got in results:
        for completion in got:
            _assert_as_generate(model, completion)


def test_the_same_prefix_is_recomputed_after_the_weights_change(backend_of, tiny_policy):
    """A new policy version, or weights changed under the backend's lock, empties the prefix cache: the
    next call computes its prompt afresh with the new weights (never the old keys and values)."""
    base, tokenizer = tiny_policy
    from agl_trainer.model import tiny_model

    model = tiny_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    backend = backend_of(model)
    request = _request(QUESTIONS[1])
    _together(backend, [_request(QUESTIONS[0])])
    warm = _together(backend, [request])[0][0]
    assert backend.reused_tokens > 0

    # weights changed under the lock, version published: the cache is gone and the answer is new
    with backend.lock:
        with torch.no_grad():
            for p in model.model.layers[0].self_attn.parameters():
                p.mul_(3.0)
        backend.policy_version = 1
    assert len(backend.prefix_cache) == 0
    reused = backend.reused_tokens
    changed = _together(backend, [request])[0][0]
    assert backend.reused_tokens == reused, "the new version reused keys computed by the old one"
    assert changed.policy_version == 1
    _assert_as_generate(model, changed)
    assert changed.response_logprobs != pytest.approx(warm.response_logprobs, abs=1e-3)

    # a version published without the lock (a serving process told of a new version) also starts afresh
    backend.policy_version = 2
    reused = backend.reused_tokens
    _together(backend, [request])
    assert backend.reused_tokens == reused


def test_a_request_queued_while_the_weights_change_mid_prefix_is_not_served_stale(backend_of, tiny_policy):
    """Call A computes the shared prefix under version 0 and is still decoding when an update asks for the
    lock; call B, with the same prefix, arrives meanwhile. B waits for the update (it does not join A's
    batch), and is computed from scratch with the new weights."""
    _, tokenizer = tiny_policy
    from agl_trainer.model import tiny_model

    model = tiny_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    backend = backend_of(model)
    reached, release = threading.Event(), threading.Event()
    a, b = _request(QUESTIONS[0], max_tokens=8), _request(QUESTIONS[1], max_tokens=8)
    a_prompt = tuple(backend._prepare(a, lambda e: None).prompt_ids)

    def hold(prompt_ids: Any, response: list[int], logits: torch.Tensor) -> torch.Tensor:
        if tuple(prompt_ids) == a_prompt and len(response) == 2:
            reached.set()
            assert release.wait(30)
        return logits

    backend.logits_processor = hold
    updated = threading.Event()

    def update() -> None:
        with backend.lock:
            with torch.no_grad():
                for p in model.model.layers[1].mlp.parameters():
                    p.mul_(-2.0)
            backend.policy_version = 1
        updated.set()

    async def run() -> tuple[Completion, Completion]:
        first = asyncio.create_task(_collect(backend, a))
        await asyncio.to_thread(reached.wait, 30)
        updater = threading.Thread(target=update)
        updater.start()
        while not backend.lock.contended:
            await asyncio.sleep(0.005)
        second = asyncio.create_task(_collect(backend, b))
        while not backend._queue:
            await asyncio.sleep(0.005)
        reused = backend.reused_tokens
        release.set()
        got_a = (await first)[0]
        got_b = (await second)[0]
        assert updated.wait(30)
        updater.join(30)
        assert backend.reused_tokens == reused, "B reused the prefix computed before the update"
        return got_a, got_b

    got_a, got_b = asyncio.run(run())
    assert backend.joined_requests == 0
    assert (got_a.policy_version, got_b.policy_version) == (0, 1)
    _assert_as_generate(model, got_b)


def test_the_prefix_cache_evicts_to_stay_within_its_bound_and_stays_exact(backend_of, tiny_policy):
    """A bound of a few blocks: every call still generates what ``generate()`` does, the cache never holds
    more bytes than its bound, and it evicted to get there."""
    model, _ = tiny_policy
    backend = backend_of(prefix_cache_mb=0.05)  # 52 KB: the tiny model's 8-token block is 4 KB
    bound = backend.prefix_cache.max_bytes
    sizes: list[int] = []
    for i in range(8):
        system = f"Assistant number {i}. " * 10  # every prompt its own prefix
        got = _together(backend, [_request(QUESTIONS[i % 6], system=system, max_tokens=4)])[0][0]
        sizes.append(backend.prefix_cache.nbytes)
        _assert_as_generate(model, got)
    assert max(sizes) <= bound
    assert backend.prefix_cache.stats.evicted_blocks > 0
    assert sizes[-1] > 0  # the latest prompt's blocks are in


def test_prefix_cache_blocks_follow_the_exact_token_chain_and_the_least_recently_used_go():
    from agl_trainer.generation.kv_cache import PrefixCache

    block = torch.zeros(2, 2, 1, 4, 2)  # layers, k/v, heads, tokens, dim: 128 bytes
    cache = PrefixCache(block_tokens=4, max_bytes=4 * block.numel() * 4)  # four blocks

    def read(tag: float) -> Any:
        return lambda start, end: torch.full_like(block, tag + start)

    head = list(range(8))
    cache.insert(0, "a", [*head, 20, 21, 22, 23], read(100.0))
    assert len(cache) == 3
    # the chain: the same third block after another second block is not a hit
    assert len(cache.lookup(0, "a", [0, 1, 2, 3, 9, 9, 9, 9, 20, 21, 22, 23, 5], 12)) == 1
    found = cache.lookup(0, "a", [*head, 20, 21, 22, 23, 7], 12)
    assert [float(b[0, 0, 0, 0, 0]) for b in found] == [100.0, 104.0, 108.0]
    # at most `limit` tokens (the last block's first columns)
    assert [b.shape[3] for b in cache.lookup(0, "a", [*head, 20, 21, 22, 23], 11)] == [4, 4, 3]
    # another adapter, another version: nothing
    assert cache.lookup(0, "b", [*head, 20], 8) == []
    assert cache.lookup(1, "a", [*head, 20], 8) == [] and len(cache) == 0
    # LRU within the bound: a second prompt sharing the head evicts the older tail, not the head
    cache.insert(1, "a", [*head, 20, 21, 22, 23], read(0.0))
    cache.lookup(1, "a", [*head, 30], 8)  # the head was used last
    cache.insert(1, "a", [*head, 30, 31, 32, 33, 40, 41, 42, 43], read(0.0))
    assert cache.nbytes <= cache.max_bytes and cache.stats.evicted_blocks == 1
    assert len(cache.lookup(1, "a", [*head, 30, 31, 32, 33, 40, 41, 42, 43, 0], 16)) == 4
    assert len(cache.lookup(1, "a", [*head, 20, 21, 22, 23, 0], 12)) == 2  # its tail went
    # a prompt bigger than the whole bound keeps what fits of its head, and evicts nothing of its own
    cache.clear()
    cache.insert(1, "a", list(range(40)), read(0.0))
    assert len(cache) == 4 and cache.nbytes == cache.max_bytes
    assert len(cache.lookup(1, "a", list(range(40)), 39)) == 4
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=0)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)


@pytest.mark.parametrize("direct", [True, False], ids=["direct-steps", "forward-steps"])
def test_decoding_writes_into_one_preallocated_cache(backend_of, direct):
    """Every decoding step of a batch writes into the same tensor (no per-step reallocation); a joining
    row that needs more columns grows it once, keeping the rows already there. Decoding steps through
    the model's modules or through its forward pass alike."""
    backend = backend_of(prefix_cache_mb=0, direct_decode=direct)
    assert (backend._direct is not None) == direct
    pointers: list[tuple[int, int]] = []
    forward = backend.forward

    def recording(**kwargs: Any) -> Any:
        out = forward(**kwargs)
        if not direct or kwargs["input_ids"].shape[1] > 1:  # with direct steps: only the first step's check
            pointers.append((kwargs["input_ids"].shape[1], backend._slots._data.data_ptr()))
        return out

    backend.forward = recording
    if direct:
        step = backend._direct.step

        def recording_step(*args: Any) -> torch.Tensor:
            out = step(*args)
            pointers.append((1, backend._slots._data.data_ptr()))
            return out

        backend._direct.step = recording_step
    _together(backend, [_request(q, max_tokens=12) for q in QUESTIONS[:4]])
    # a decoding step (one token per row) writes where the pass before it did: the tensor changes only
    # when rows join (a prefill pass, many tokens per row) and need more room
    steps = [i for i, (width, _) in enumerate(pointers) if width == 1]
    assert len(steps) >= 10 and steps[0] > 0
    assert all(pointers[i][1] == pointers[i - 1][1] for i in steps)
    assert len({ptr for _, ptr in pointers}) <= len(pointers) - len(steps)
    # the next batch writes into it too; the memory goes back when someone takes the lock (an update)
    kept = backend._slots.data_ptr
    _together(backend, [_request(QUESTIONS[0], max_tokens=3)])
    assert backend._slots.data_ptr == kept
    with backend.lock:
        assert backend._slots._data is None


def test_the_dynamic_cache_path_is_kept_and_agrees(backend_of, tiny_policy):
    model, _ = tiny_policy
    slots, dynamic = backend_of(), backend_of(kv_cache="dynamic")
    assert dynamic.prefix_cache is None and dynamic.kv_cache == "dynamic"
    requests = [_request(q, n=2) for q in QUESTIONS[:3]]
    for a, b in zip(_together(slots, requests), _together(dynamic, requests), strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.response_ids == y.response_ids
            assert x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="kv_cache must be one of slots, dynamic"):
        backend_of(kv_cache="paged")
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        backend_of(prefix_cache_mb=-1)


def test_a_failed_batch_fails_the_requests_that_joined_it_too(backend_of):
    """A forward pass that raises after a request joined the batch answers both requests with an error
    (none is left waiting)."""
    backend = backend_of()
    reached = threading.Event()
    first, second = _request(QUESTIONS[0], max_tokens=8), _request(QUESTIONS[1], max_tokens=8)
    first_prompt = tuple(backend._prepare(first, lambda e: None).prompt_ids)

    def hold(prompt_ids: Any, response: list[int], logits: torch.Tensor) -> torch.Tensor:
        if tuple(prompt_ids) == first_prompt and len(response) == 2 and not reached.is_set():
            reached.set()
            deadline = time.monotonic() + 30
            while not backend._queue and time.monotonic() < deadline:
                time.sleep(0.001)
        return logits

    backend.logits_processor = hold
    forward = backend.forward
    calls: list[int] = []

    def failing(**kwargs: Any) -> Any:
        if backend.joined_requests:
            calls.append(1)
            raise RuntimeError("out of memory (test)")
        return forward(**kwargs)

    backend.forward = failing

    async def run() -> list[Any]:
        a = asyncio.create_task(_collect(backend, first))
        await asyncio.to_thread(reached.wait, 30)
        b = asyncio.create_task(_collect(backend, second))
        return list(await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 60))

    results = asyncio.run(run())
    assert calls and backend.joined_requests == 1
    assert all(isinstance(r, BackendError) and "out of memory (test)" in str(r) for r in results), results


def test_fixed_shape_decoding_for_cuda_graphs_generates_the_same(backend_of, tiny_policy):
    """The decoding step a CUDA graph captures (every slot of the cache and its whole width, slots past the
    batch's rows masked) gives what the narrow step gives, here on the CPU, where it runs eagerly; rows
    that leave and join keep it exact."""
    model, _ = tiny_policy
    static, narrow = backend_of(static_decode=True), backend_of()
    assert static._static is not None and narrow._static is None
    assert not static._static.graphs  # no GPU: no graph, the same shapes eagerly
    requests = [_request(q, max_tokens=4 + 3 * i, n=1 + i % 2) for i, q in enumerate(QUESTIONS[:5])]
    shapes: list[tuple[tuple[int, ...], tuple[int, int]]] = []
    eager = static._static._eager

    def recording(batch: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        shapes.append((tuple(inputs["mask"].shape), (static._slots.slots, static._slots.capacity)))
        return eager(batch, inputs)

    static._static._eager = recording
    for a, b in zip(_together(static, requests), _together(narrow, requests), strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.response_ids == y.response_ids
            assert x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-4)
            _assert_as_generate(model, x)
    assert len(shapes) >= 10
    assert all(mask == (slots, 1, 1, capacity) for mask, (slots, capacity) in shapes)
    # with adapters per agent the steps keep their narrow shapes
    routed = backend_of(static_decode=True, route=lambda agent: None)
    assert routed._static is None


def test_prompts_that_arrive_together_compute_their_shared_prefix_once(backend_of, tiny_policy):
    """Into an empty prefix cache, four prompts sharing a long system prompt arrive in one batch: the first
    is prefilled whole, the other three wait for it and start from its blocks (to the token where they
    differ, not the block boundary before it)."""
    model, _ = tiny_policy
    backend = backend_of()
    passes: list[int] = []
    new_batch = backend._new_batch

    def counting(version: int) -> Any:
        state = new_batch(version)
        run = state._prefill_packed
        state._prefill_packed = lambda jobs, *rest: passes.append(len(jobs)) or run(jobs, *rest)
        return state

    backend._new_batch = counting
    requests = [_request(q) for q in QUESTIONS[:4]]
    prompts = [backend._prepare(r, lambda e: None).prompt_ids for r in requests]
    from agl_trainer.generation.kv_cache import common_prefix

    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared > 3 * 8
    # all four in one batch: queue them before the worker starts
    jobs = [backend._prepare(r, lambda e: None) for r in requests]
    results: list[list[Completion]] = [[] for _ in requests]
    for job, out in zip(jobs, results, strict=True):
        job.sink = lambda event, out=out: out.append(event) if isinstance(event, Completion) else None
        backend._queue.append(job)
    backend._submit(backend._queue.pop())  # starts the worker, which takes all four at once
    deadline = time.monotonic() + 60
    while any(not out for out in results) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert passes[:2] == [1, 3], passes
    assert backend.reused_tokens >= 3 * shared  # token-exact: the followers reuse all they share
    assert backend.prefilled_tokens == sum(len(p) for p in prompts) - backend.reused_tokens
    for out in results:
        _assert_as_generate(model, out[0])


def test_reuse_ends_inside_a_block_where_the_prompts_part():
    from agl_trainer.generation.kv_cache import PrefixCache, common_prefix

    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([], [1]) == 0 and common_prefix([5] * 1000 + [1], [5] * 1000 + [2]) == 1000
    assert common_prefix([1, 2, 3], (1, 2, 4)) == 2  # a prompt's list against a block's tuple
    cache = PrefixCache(block_tokens=4)
    block = torch.arange(4.0).reshape(1, 1, 1, 4, 1).expand(2, 2, 1, 4, 2).contiguous()
    cache.insert(0, None, [1, 2, 3, 4, 5, 6, 7, 8], lambda start, end: block + start)
    found = cache.lookup(0, None, [1, 2, 3, 4, 5, 6, 9, 9, 9], 8)
    assert [b.shape[3] for b in found] == [4, 2]  # one whole block, then two columns of the next
    assert found[1][0, 0, 0, :, 0].tolist() == [4.0, 5.0]
    assert cache.stats.reused_tokens == 6
    # never past the limit, and nothing when the first token differs
    assert sum(b.shape[3] for b in cache.lookup(0, None, [1, 2, 3, 4, 5, 6, 7, 8], 7)) == 7
    assert cache.lookup(0, None, [9, 2, 3], 2) == []


def test_padded_prefill_passes_of_the_slots_stay_exact(backend_of, tiny_policy):
    """Prompts of several adapters cannot share a packed pass; the padded pass they take instead (forced
    here) gives what ``generate()`` does too."""
    import dataclasses

    model, _ = tiny_policy
    backend = backend_of()
    backend._slots.shape = dataclasses.replace(backend._slots.shape, packed=False)
    _together(backend, [_request(QUESTIONS[0])])
    for got in _together(backend, [_request(q, n=2) for q in QUESTIONS[1:4]]):
        for completion in got:
            _assert_as_generate(model, completion)
    assert backend.reused_tokens > 0


def test_rows_sharing_a_prefix_decode_reading_it_once_and_generate_the_same(
    backend_of, tiny_policy, monkeypatch
):
    """Rows after the same long system prompt decode with one copy of its columns for all of them (the
    attention of each row merged from the shared part and its own): the tokens of ``generate()``; rows of
    another adapter never share."""
    from agl_trainer.generation import attention, decoding

    model, _ = tiny_policy
    shared_steps: list[int] = []
    real = attention._shared
    monkeypatch.setattr(
        attention, "_shared", lambda state, *rest: shared_steps.append(state.length) or real(state, *rest)
    )
    backend = backend_of()
    system = len(backend.render_prompt([{"role": "system", "content": SYSTEM}], None))
    assert system >= decoding.SHARED_PREFIX_MIN
    for got in _together(backend, [_request(q, max_tokens=8) for q in QUESTIONS[:4]]):
        _assert_as_generate(model, got[0])
    assert shared_steps and min(shared_steps) >= system
    # a short shared prefix: plain attention
    shared_steps.clear()
    _together(backend, [_request(q, max_tokens=4, system="Hi.") for q in QUESTIONS[:3]])
    assert not shared_steps


def test_the_shared_prefix_merge_equals_attention_over_all_columns():
    """The cascade split (shared columns once, each row's own, merged by log-sum-exp) against plain
    attention over every column, with both attention kernels (the CPU flash kernel and plain products)."""
    from agl_trainer.generation import attention

    torch.manual_seed(0)
    rows, kv_heads, groups, width, shared, dim = 5, 2, 3, 40, 25, 16
    keys = torch.randn(rows, kv_heads, width, dim)
    values = torch.randn(rows, kv_heads, width, dim)
    keys[1:, :, :shared], values[1:, :, :shared] = keys[0, :, :shared], values[0, :, :shared]
    query = torch.randn(rows, kv_heads * groups, 1, dim)
    lengths = torch.tensor([30, 39, 26, 35, 33])
    mask = (torch.arange(width)[None, :] <= lengths[:, None])[:, None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), attn_mask=mask
    )
    got = attention._shared(attention.SharedPrefix(shared), query, keys, values, mask, None)
    assert torch.allclose(got.transpose(1, 2), expected, atol=1e-5)
    q, k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    some = torch.rand(2, 1, 3, 7) > 0.3
    some[..., 0] = True
    for a, b in zip(
        attention._attend(q, k, v, some, 0.3), attention.attend_plain(q, k, v, some, 0.3), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_trainers_publish_empties_the_prefix_cache_and_config_reaches_the_backend(tmp_path, tiny_policy):
    """``start_serving`` builds the backend from ``serving.hf``; the trainer's publish (under the backend's
    lock) leaves no cached prefix of the old version behind."""
    from agl_trainer.config import TrainerConfig
    from agl_trainer.run.serving import start_serving

    model, tokenizer = tiny_policy
    raw: dict[str, Any] = {
        "agent": "agent:solve",
        "tasks": str(tmp_path / "tasks.jsonl"),
        "output_dir": str(tmp_path / "run"),
        "serving": {"hf": {"prefix_cache_mb": 32, "prefix_block_tokens": 8, "max_batch": 4}},
    }
    serving = start_serving(TrainerConfig.model_validate(raw), model, tokenizer)
    raw["serving"]["hf"]["direct_decode"] = False  # every decoding step through the forward pass
    other = start_serving(TrainerConfig.model_validate(raw), model, tokenizer)
    other.close()
    assert other.backend._direct is None
    try:
        backend = serving.backend
        assert backend.prefix_cache.max_bytes == 32 * 2**20 and backend.prefix_cache.block_tokens == 8
        assert backend.max_batch == 4 and backend.kv_cache == "slots" and backend._direct is not None
        _together(backend, [_request(QUESTIONS[0])])
        assert len(backend.prefix_cache) > 0 and serving.generation_counters().prefilled_tokens > 0
        serving.publish(model, 1)
        assert len(backend.prefix_cache) == 0 and backend.policy_version == 1
        got = _together(backend, [_request(QUESTIONS[0])])[0][0]
        assert got.policy_version == 1 and backend.prefix_cache.stats.reused_tokens == 0
    finally:
        serving.close()


class _WrongGraph:
    """Stands in for a CUDA graph whose replay computes something else (a capture gone wrong)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def replay(self) -> None:
        self.logits.add_(5.0)


def test_a_graph_whose_replay_disagrees_with_the_step_is_dropped(backend_of, tiny_policy, caplog):
    """The first replay of each captured decoding step is checked against the same step run eagerly; a
    graph that disagrees is logged and dropped, and generation goes on eagerly with the right tokens.
    (The capture itself needs a GPU; here a fake graph stands in for a faulty one.)"""
    from agl_trainer.generation import decoding

    model, _ = tiny_policy
    backend = backend_of(static_decode=True)
    static = backend._static
    static.graphs = True  # as on a GPU

    def capture(batch: Any, inputs: dict[str, torch.Tensor], key: tuple[int, int, int]) -> torch.Tensor:
        logits = static._eager(batch, inputs)
        static._inputs, static._logits = inputs, logits.clone()
        static._graph, static._key, static._checked = _WrongGraph(static._logits), key, False
        return logits

    static._capture = capture
    with caplog.at_level("WARNING", logger=decoding.__name__):
        got = _together(backend, [_request(q, max_tokens=6) for q in QUESTIONS[:2]])
    assert not static.graphs and "gave other logits than the step itself" in caplog.text
    for completion in got:
        _assert_as_generate(model, completion[0])


def test_a_graph_replay_is_checked_within_its_dtype_rounding_not_beyond() -> None:
    """bfloat16 logits of 30 that two kernels round apart by 0.4 match; the same gap in float32, or a
    difference of several units in bfloat16, does not (the backend then decodes eagerly)."""
    from agl_trainer.generation.decoding import attention_kernels
    from agl_trainer.generation.direct_decode import logits_match as replay_matches

    eager = torch.tensor([[30.0, 12.0, -4.0]])
    assert replay_matches((eager + torch.tensor([[0.4, 0.0, 0.0]])).bfloat16(), eager.bfloat16())
    assert not replay_matches(eager + torch.tensor([[0.4, 0.0, 0.0]]), eager)
    assert replay_matches(eager + 1e-4, eager)
    assert not replay_matches((eager + torch.tensor([[0.0, 5.0, 0.0]])).bfloat16(), eager.bfloat16())
    # on a CPU, or in float32, the attention kernel is left to PyTorch
    with attention_kernels(torch.device("cpu"), torch.bfloat16):
        pass


@pytest.mark.parametrize("direct", [True, False], ids=["direct-steps", "forward-steps"])
def test_narrow_decoding_steps_ask_for_the_same_attention_kernels(backend_of, monkeypatch, direct):
    """Decoding steps without a fixed shape (the CPU's, and a GPU's with a policy per agent) run inside
    ``attention_kernels`` for the cache's device and dtype, as prefill and the fixed-shape steps do (on a
    GPU in 16 bits: the memory-efficient kernel rather than cuDNN's)."""
    import contextlib

    from agl_trainer.generation import decoding

    asked: list[tuple[str, torch.dtype]] = []

    def recording(device: torch.device, dtype: torch.dtype) -> Any:
        asked.append((device.type, dtype))
        return contextlib.nullcontext()

    monkeypatch.setattr(decoding, "attention_kernels", recording)
    backend = backend_of(prefix_cache_mb=0, direct_decode=direct)
    [completion] = _together(backend, [_request(QUESTIONS[0], max_tokens=6)])[0]
    assert len(completion.response_ids) == 6
    # one per decoding step (the first token comes from the prefill)
    assert backend.decode_steps >= 5 and asked == [("cpu", torch.float32)] * backend.decode_steps
