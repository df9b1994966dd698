"""The retrieval example (``examples/rag_openai_agents``): its BM25 index, reward and data, the agent's
search flow against the real gateway (scripted policy), and a reduced training run with the real SmolLM2."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agl_core import semconv

from ._training import metrics_rows, train_cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rag_openai_agents"


def _load(name: str) -> Any:
    """An example module by file, under a private name (the example's modules have generic names)."""
    spec = importlib.util.spec_from_file_location(f"_rag_example_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bm25 = _load("bm25")
reward = _load("reward")
make_data = _load("make_data")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- BM25 -------------------------------------------------------------------------------------------------
DOCS = [
    {"id": "d0", "title": "Quillfield", "text": "Quillfield is a city in the province of Ardent."},
    {"id": "d1", "title": "Mara Voss", "text": "Mara Voss was born in Quillfield. Mara Voss is a weaver."},
    {"id": "d2", "title": "Ardent", "text": "Ardent is a province. The capital of Ardent is Quillfield."},
]


def test_tokenize_drops_case_punctuation_and_stopwords():
    assert bm25.tokenize("In which city was Mara Voss born?") == ["city", "mara", "voss", "born"]


def test_bm25_scores_follow_the_okapi_formula():
    index = bm25.BM25Index.build(DOCS, k1=1.2, b=0.75)
    lengths = [len(bm25.tokenize(f"{d['title']} {d['text']}")) for d in DOCS]
    avg = sum(lengths) / 3
    # "weaver" occurs once, in d1 only: idf = ln(1 + (3 - 1 + 0.5) / (1 + 0.5))
    idf = math.log(1 + 2.5 / 1.5)
    expected = idf * 1 * 2.2 / (1 + 1.2 * (1 - 0.75 + 0.75 * lengths[1] / avg))
    assert index.scores("weaver") == pytest.approx([0.0, expected, 0.0])


def test_bm25_ranks_the_rare_name_first_and_limits_k():
    index = bm25.BM25Index.build(DOCS)
    hits = index.search("Where was Mara Voss born?", k=3)
    assert [d["id"] for _, d in hits][0] == "d1"
    assert all(s > 0 for s, _ in hits)
    assert [s for s, _ in hits] == sorted((s for s, _ in hits), reverse=True)
    assert len(index.search("Quillfield", k=2)) == 2
    assert index.search("nothing matches zebra", k=3) == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search("Ardent", k=0)


def test_bm25_breaks_ties_by_corpus_order():
    docs = [{"id": f"d{i}", "title": "same", "text": "twin words here"} for i in range(3)]
    assert [d["id"] for _, d in bm25.BM25Index.build(docs).search("twin", k=3)] == ["d0", "d1", "d2"]


def test_load_index_caches_by_corpus_content(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    cache = tmp_path / "cache"
    first = bm25.load_index(corpus, cache_dir=cache)
    files = list(cache.glob("bm25-*.json"))
    assert len(files) == 1
    again = bm25.load_index(corpus, cache_dir=cache)
    assert again.scores("Mara Voss") == first.scores("Mara Voss")
    # a damaged cache file is rebuilt, not trusted
    files[0].write_text("{not json")
    assert bm25.load_index(corpus, cache_dir=cache).scores("weaver") == first.scores("weaver")
    assert json.loads(files[0].read_text())["docs"] == DOCS
    # an edited corpus gets its own cache entry
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS[:2]))
    assert len(bm25.load_index(corpus, cache_dir=cache).docs) == 2
    assert len(list(cache.glob("bm25-*.json"))) == 2


def test_read_corpus_names_the_bad_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(DOCS[0]) + "\n" + json.dumps({"id": "x", "text": "no title"}) + "\n")
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: .*'title'"):
        bm25.read_corpus(corpus)


def test_the_question_finds_its_entry_in_the_shipped_corpus():
    index = bm25.load_index(EXAMPLE / "corpus.jsonl")
    for split in ("dev", "dev_2hop"):
        for task in _jsonl(EXAMPLE / f"{split}.jsonl"):
            ((_, top),) = index.search(task["question"], k=1)
            assert top["title"] == task["entities"][0], task


# --- reward -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("Quillfield", "Quillfield", 1.0),
        ("the Quillfield.", "quillfield", 1.0),  # case, punctuation and articles do not count
        ("Mara Voss was born in Quillfield", "Quillfield", 2 / 7),  # precision 1/6, recall 1
        ("copper kettles", "copper kettles and bells", 2 * 1 * 0.5 / 1.5),
        ("Ardent", "Quillfield", 0.0),
        ("", "Quillfield", 0.0),
    ],
)
def test_f1(predicted, gold, expected):
    assert reward.f1(predicted, gold) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("reply", "answer", "formatted"),
    [
        ("Answer: Quillfield", "Quillfield", True),
        ("  answer:  Quillfield.\nBecause the passage says so.", "Quillfield.", True),
        ("**Answer:** Ardent", "Ardent", True),
        ("Mara Voss was born in Quillfield.", "Mara Voss was born in Quillfield.", False),
        (
            "The passage says\nAnswer: Quillfield",
            "The passage says\nAnswer: Quillfield",
            False,
        ),  # first line only
        ("Answer:", "Answer:", False),
    ],
)
def test_extract_answer(reply, answer, formatted):
    assert reward.extract_answer(reply) == (answer, formatted)


def test_score_combines_f1_and_format_within_0_and_1():
    assert reward.score("Answer: Quillfield", "Quillfield") == pytest.approx(1.0)
    assert reward.score("Quillfield", "Quillfield") == pytest.approx(0.9)
    assert reward.score("Answer: Ardent", "Quillfield") == pytest.approx(0.1)
    assert reward.score("Answer: Mara Voss was born in Quillfield", "Quillfield") == pytest.approx(
        0.9 * 2 / 7 + 0.1
    )
    assert reward.score("", "Quillfield") == 0.0


# --- the generated data -----------------------------------------------------------------------------------
def test_make_data_reproduces_the_checked_in_files(tmp_path):
    make_data.main(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert names == sorted(p.name for p in EXAMPLE.glob("*.jsonl"))
    for name in names:
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name


def test_splits_are_disjoint_and_answers_are_in_the_corpus():
    corpus = {d["title"]: d["text"] for d in _jsonl(EXAMPLE / "corpus.jsonl")}
    assert len(corpus) == 200
    for suffix, hops in (("", 1), ("_2hop", 2)):
        splits = {name: _jsonl(EXAMPLE / f"{name}{suffix}.jsonl") for name in ("train", "val", "dev")}
        questions = {name: {t["question"] for t in tasks} for name, tasks in splits.items()}
        assert all(len(questions[n]) == len(splits[n]) for n in splits)  # no question twice within a split
        assert not questions["train"] & questions["val"]
        assert not questions["train"] & questions["dev"]
        assert not questions["val"] & questions["dev"]
        for tasks in splits.values():
            for t in tasks:
                assert t["hops"] == hops == len(t["entities"])
                # each entry on the path names the next entity; the last one holds the answer
                path = [corpus[e] for e in t["entities"]]
                for text, nxt in zip(path, t["entities"][1:], strict=False):  # the last entry names none
                    assert nxt in text
                assert t["answer"] in path[-1], t


# --- the agent against the real gateway, with a scripted policy -------------------------------------------
_ANSWERS = [
    ("province", r"province of ([A-Z]\w+)"),
    ("work for", r"works for ([A-Z]\w+ [A-Z]\w+)"),
    ("born", r"born in ([A-Z]\w+)"),
]


def _policy(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A good reader for person questions: searches the person, then (two hops) the city they were born
    in, then answers from the last passages in the requested format."""
    from agl_core.testing import tool_call

    user = next(str(m["content"]) for m in messages if m["role"] == "user")
    question = [line for line in user.splitlines() if line.endswith("?")][-1]
    results = [str(m["content"]) for m in messages if m["role"] == "tool"]
    if tools:
        if not results:
            return tool_call(
                "search", {"query": re.search(r"(?:was|does) ([A-Z]\w+ [A-Z]\w+)", question).group(1)}
            )
        return tool_call("search", {"query": re.search(r"born in ([A-Z]\w+)", results[-1]).group(1)})
    passages = results[-1] if results else user
    pattern = next(p for key, p in _ANSWERS if key in question)
    return "Answer: " + re.search(pattern, passages).group(1)


@pytest.fixture
def scripted(tmp_path) -> Iterator[tuple[Any, Any, Any, Any]]:
    """``(agent module, LLM factory, store client, tracer provider)``: the example's agent with agl's
    trace processor on a test provider, a store, and the gateway serving the scripted policy."""
    import agl_openai_agents
    from agl_core.runner import LLM
    from agl_core.testing import AglTestStack
    from agl_trainer.model import load_tokenizer

    sys.path.insert(0, str(EXAMPLE))
    try:
        agent = importlib.import_module("agent")  # instruments the SDK with the global provider ...
    finally:
        sys.path.remove(str(EXAMPLE))
    agl_openai_agents.uninstrument()  # ... which this test replaces with its own
    with AglTestStack(
        script=_policy, tokenizer=load_tokenizer("tiny"), model_name="policy", path=tmp_path / "store.sqlite"
    ) as stack:
        agl_openai_agents.instrument(tracer_provider=stack.provider, replace_processors=True)
        try:
            yield (
                agent,
                lambda rid: LLM(stack.base_url(rid, f"{rid}-a1"), "policy"),
                stack.client,
                stack.provider,
            )
        finally:
            agl_openai_agents.uninstrument()
            for name in ("agent", "bm25", "reward"):
                sys.modules.pop(name, None)


def _run(scripted: Any, fn: str, task: dict[str, Any], rollout_id: str) -> tuple[float, list[Any]]:
    from agl_core.tracing import emit_reward, rollout_scope

    agent, llm, client, provider = scripted
    with rollout_scope(rollout_id, f"{rollout_id}-a1", task["id"], tracer_provider=provider):
        value = getattr(agent, fn)(task, llm(rollout_id))
        emit_reward(value, tracer_provider=provider)  # what the runner does with the returned reward
    provider.force_flush()
    return value, client.query_spans(rollout_ids=[rollout_id])


def _by_op(spans: list[Any], op: str) -> list[Any]:
    return sorted(
        (
            s
            for s in spans
            if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == op
            and s.attributes.get(semconv.SOURCE) == semconv.SOURCE_OPENAI_AGENTS
        ),
        key=lambda s: s.start_ns,
    )


def test_solve_searches_in_code_and_the_model_answers_from_the_passage(scripted):
    task = next(t for t in _jsonl(EXAMPLE / "dev.jsonl") if "work for" in t["question"])
    value, spans = _run(scripted, "solve", task, "rag-solve")
    assert value == pytest.approx(1.0)
    (tool,) = _by_op(spans, semconv.OP_EXECUTE_TOOL)
    assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == "search"
    (chat,) = [s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY]
    from agl_core.pipeline.transitions import spans_to_transitions

    result = spans_to_transitions(spans)
    assert result.problems == ()
    (transition,) = result.transitions
    assert transition.agent_name == "researcher" and transition.response_ids
    assert chat.attributes[semconv.RESPONSE_TOKEN_IDS]


def test_solve_agentic_lets_the_model_search_each_hop(scripted):
    task = next(t for t in _jsonl(EXAMPLE / "dev_2hop.jsonl") if "province was" in t["question"])
    value, spans = _run(scripted, "solve_agentic", task, "rag-agentic")
    assert value == pytest.approx(1.0), task
    tools = _by_op(spans, semconv.OP_EXECUTE_TOOL)
    assert [t.attributes[semconv.GEN_AI_TOOL_NAME] for t in tools] == ["search", "search"]
    assert all(t.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) for t in tools)  # joined to the calls that asked
    from agl_core.pipeline.transitions import spans_to_transitions

    result = spans_to_transitions(spans)
    assert result.problems == ()
    assert len(result.transitions) == 3  # search, search, answer
    assert all(t.agent_name == "researcher" and t.reward == pytest.approx(1.0) for t in result.transitions)


# --- the reduced training run with the real SmolLM2 -------------------------------------------------------
@pytest.mark.slow
def test_train_rag_example_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("agents")
    out = tmp_path / "run"
    done = train_cli(
        EXAMPLE / "config.yaml",
        "--set",
        "train.steps=2",
        "--set",
        "train.tasks_per_step=2",
        "--set",
        "train.rollouts_per_task=2",
        "--set",
        "validation.max_tasks=2",
        "--set",
        "runner.workers=4",
        "--set",
        f"output_dir={out}",
        timeout=600,
    )
    assert re.search(
        r"held-out reward: before [\d.]+ ± [\d.]+ \(SE, n=2 tasks\) -> after [\d.]+", done.stdout
    ), done.stdout
    assert "reward curve: " in done.stdout and (out / "reward_curve.png").is_file()

    val, train = metrics_rows(out, "val"), metrics_rows(out, "train")
    assert [r["step"] for r in val] == [0, 2] and all(r["n"] == 2 for r in val)
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollouts"] == 4 and r["transitions"] == 4 for r in train), train

    from agl_core.pipeline.transitions import episode_rewards
    from agl_core.store import SqliteStore

    store = SqliteStore(out / "store.sqlite")
    try:
        spans = store.query_spans(limit=100_000)
        records = store.get_rollouts(sorted({s.rollout_id for s in spans if s.rollout_id}))
    finally:
        store.close()
    # GRPO trains the two transitions of each group whose two sampled answers scored differently, and no
    # others (a tied group has no advantage); the policy changes exactly when some group differed
    rewards = episode_rewards(spans)
    groups: dict[str, list[float]] = {}
    for rollout in records:
        if rollout.metadata.get("split") == "train":
            groups.setdefault(rollout.group_id, []).append(rewards[rollout.rollout_id])
    assert len(groups) == 4 and all(len(g) == 2 for g in groups.values()), groups
    differing = sum(len(set(g)) > 1 for g in groups.values())
    assert sum(r["trained_transitions"] for r in train) == 2 * differing, (groups, train)
    assert (train[-1]["policy_version"] >= 1) == (differing > 0), (groups, train)
    rollouts = (
        2 * 2 * 2 + 2 * 2
    )  # training (2 steps x 2 tasks x 2 rollouts) + validation (before, after: 2 tasks)
    searches = [
        s
        for s in spans
        if s.attributes.get(semconv.GEN_AI_TOOL_NAME) == "search"
        and s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL
    ]
    assert len(searches) == rollouts and len({s.rollout_id for s in searches}) == rollouts
    calls = [s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY]
    assert len(calls) == rollouts and all(s.attributes[semconv.RESPONSE_TOKEN_IDS] for s in calls)


def test_both_configs_are_valid():
    from agl_trainer.config import load_config

    cpu = load_config(EXAMPLE / "config.yaml")
    assert cpu.agent == "agent:solve" and cpu.tasks.val is not None and cpu.model.source == "smollm2"
    gpu = load_config(EXAMPLE / "config.gpu.yaml")
    assert gpu.agent == "agent:solve_agentic" and gpu.tasks.train.name == "train_2hop.jsonl"
    assert gpu.serving.backend == "vllm" and gpu.model.source == "Qwen/Qwen2.5-1.5B-Instruct"
