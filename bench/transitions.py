"""Benchmark: spans -> transitions, on synthetic 20-span rollouts.

Each rollout: a rollout span, 3 agent steps, 4 framework LLM spans each joined to a gateway span with
~200 prompt and ~50 response token ids, 7 tool spans, 1 reward span (20 spans, 4 transitions).
Reference (DESIGN.md, same machine kind): Agent Lightning 0.3.0 needs about 1.07 ms per 20-span trace.

    python bench/transitions.py [--rollouts 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from agl_core import semconv as S
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.records import Span

REFERENCE_MS_PER_TRACE = 1.07


def rollout_spans(i: int) -> list[Span]:
    rid = f"ro-{i}"
    trace = f"{i + 1:032x}"
    counter = iter(range(1, 100))
    ids = {S.ROLLOUT_ID: rid, S.ATTEMPT_ID: f"at-{i}"}

    def span(name, attrs, parent=None):
        n = next(counter)
        return Span(
            trace,
            f"{i * 100 + n:016x}",
            parent.span_id if parent else None,
            name,
            n * 10,
            n * 10 + 5,
            {**ids, **attrs},
        )

    root = span(S.SPAN_ROLLOUT, {S.TASK_ID: f"task-{i % 50}"})
    out = [root]
    steps = [span("agent", {S.GEN_AI_AGENT_NAME: f"agent{k}"}, root) for k in range(3)]
    out += steps
    for k in range(4):
        parent = steps[k % 3]
        rid_k = f"chatcmpl-{i}-{k}"
        out.append(span("chat m", {S.GEN_AI_OPERATION_NAME: S.OP_CHAT, S.GEN_AI_RESPONSE_ID: rid_k}, parent))
        out.append(
            span(
                "chat m",
                {
                    S.SOURCE: S.SOURCE_GATEWAY,
                    S.GEN_AI_RESPONSE_ID: rid_k,
                    S.POLICY_VERSION: 1,
                    S.PROMPT_TOKEN_IDS: list(range(200)),
                    S.RESPONSE_TOKEN_IDS: list(range(50)),
                    S.RESPONSE_LOGPROBS: [-0.5] * 50,
                },
            )
        )
    for k in range(7):
        out.append(span("execute_tool t", {S.GEN_AI_OPERATION_NAME: S.OP_EXECUTE_TOOL}, steps[k % 3]))
    out.append(span(S.SPAN_REWARD, {S.REWARD_VALUE: 1.0, S.REWARD_NAME: "episode"}, root))
    assert len(out) == 20
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spans = [s for i in range(args.rollouts) for s in rollout_spans(i)]
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = spans_to_transitions(spans)
        times.append(time.perf_counter() - start)
        assert len(result.transitions) == 4 * args.rollouts and not result.problems
    median = statistics.median(times)
    ms_per_trace = median * 1000 / args.rollouts
    print(f"{'rollouts':>10} {'spans':>8} {'median s':>9} {'transitions/s':>14} {'ms/20-span trace':>17}")
    print(
        f"{args.rollouts:>10} {len(spans):>8} {median:>9.3f} {4 * args.rollouts / median:>14.0f}"
        f" {ms_per_trace:>17.3f}"
    )
    ok = ms_per_trace <= REFERENCE_MS_PER_TRACE
    print(
        f"transitions: {ms_per_trace:.3f} ms per 20-span trace, reference {REFERENCE_MS_PER_TRACE} ms "
        f"({REFERENCE_MS_PER_TRACE / ms_per_trace:.1f}x faster), target <= {REFERENCE_MS_PER_TRACE}: "
        f"{'ok' if ok else 'missed'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
