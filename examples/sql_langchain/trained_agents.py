"""Which agents' LLM calls a finished run trained on, step by step, read back from its store.

For each training step it takes the step's rollouts from ``output_dir/store.sqlite``, turns their spans
into transitions and applies the config's agent selection, credit and advantages with the trainer's own
functions, then checks the counts against ``metrics.jsonl`` (``transitions``: every LLM call of the
step's rollouts; ``trained_transitions``: the samples of the update):

    PYTHONPATH=src:trainer python examples/sql_langchain/trained_agents.py examples/sql_langchain/config.yaml
    step  calls: checker rewriter writer | trained: checker rewriter writer | metrics: transitions trained
       1              3        3     12  |                0        2      8  |                18       10  ok
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

AGENTS = ("checker", "rewriter", "writer")


@dataclasses.dataclass(frozen=True)
class StepAudit:
    step: int
    #: LLM calls (transitions) of the step's rollouts, by agent.
    calls: Counter
    #: Transitions that went into the update, by agent.
    trained: Counter
    #: The step's row of metrics.jsonl.
    metrics: dict
    #: What the update would have trained with ``algorithm.agents`` empty (every agent), by agent.
    trained_without_selection: Counter

    @property
    def matches_metrics(self) -> bool:
        from agl_trainer.run.loop import UNNAMED_AGENT

        per_agent = {
            name or UNNAMED_AGENT: {"calls": self.calls[name], "trained": self.trained[name]}
            for name in self.calls
        }
        return (
            sum(self.calls.values()) == self.metrics["transitions"]
            and sum(self.trained.values()) == self.metrics["trained_transitions"]
            and per_agent == self.metrics.get("agents", per_agent)
        )


def audit(config_path: str | Path, overrides: tuple[str, ...] = ()) -> list[StepAudit]:
    """One :class:`StepAudit` per training step of the run that ``config_path`` (with ``overrides``)
    describes."""
    from agl_core.pipeline.credit import assign_rewards
    from agl_core.pipeline.transitions import spans_to_transitions
    from agl_core.records import RolloutStatus
    from agl_core.store import SqliteStore
    from agl_trainer.config import load_config
    from agl_trainer.learning.algo import compute_advantages

    config = load_config(config_path, overrides)
    out = config.output_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = {row["step"]: row for row in rows if row.get("kind") == "train"}
    store = SqliteStore(out / config.store.path)
    try:
        spans = store.query_spans(limit=10_000_000)
        by_rollout = defaultdict(list)
        for span in spans:
            if span.rollout_id:
                by_rollout[span.rollout_id].append(span)
        rollouts = store.get_rollouts(list(by_rollout))
    finally:
        store.close()
    algo = config.algorithm
    audits = []
    for step, row in sorted(metrics.items()):
        used = [
            r
            for r in rollouts
            if r.metadata.get("split") == "train"
            and r.metadata.get("step") == step
            and r.status == RolloutStatus.SUCCEEDED
        ]
        step_spans = [s for r in used for s in by_rollout[r.rollout_id]]
        result = spans_to_transitions(step_spans)
        groups = {r.rollout_id: r.group_id or r.rollout_id for r in used}

        def trained(agents: list[str], result=result, step_spans=step_spans, groups=groups) -> Counter:
            credit = assign_rewards(
                result,
                step_spans,
                strategy=algo.credit,
                gamma=algo.gamma,
                weights=algo.reward_weights(),
                agents=agents,
            )
            kept = [t for t in credit.transitions if t.prompt_ids and t.response_ids]
            samples, _ = compute_advantages(kept, groups, algo.name, scores=credit.scores)
            return Counter(s.transition.agent_name for s in samples)

        audits.append(
            StepAudit(
                step,
                Counter(t.agent_name for t in result.transitions),
                trained(config.trained_agents()),  # algorithm.agents, or the policies' agents
                row,
                trained([]),
            )
        )
    return audits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the run's config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the run's overrides")
    args = parser.parse_args()
    audits = audit(args.config, tuple(args.set))
    if not audits:
        sys.exit("no training step in metrics.jsonl")
    names = " ".join(f"{a:>8}" for a in AGENTS)
    print(f"step  calls: {names} | trained: {names} | metrics: transitions trained")
    totals_calls, totals_trained, totals_all = Counter(), Counter(), Counter()
    ok = True
    for a in audits:
        totals_calls.update(a.calls)
        totals_trained.update(a.trained)
        totals_all.update(a.trained_without_selection)
        ok &= a.matches_metrics
        print(
            f"{a.step:4d}         {' '.join(f'{a.calls[n]:8d}' for n in AGENTS)} |"
            f"          {' '.join(f'{a.trained[n]:8d}' for n in AGENTS)} |"
            f" {a.metrics['transitions']:20d} {a.metrics['trained_transitions']:7d}"
            f"  {'ok' if a.matches_metrics else 'MISMATCH'}"
        )
    print(
        f"all          {' '.join(f'{totals_calls[n]:8d}' for n in AGENTS)} |"
        f"          {' '.join(f'{totals_trained[n]:8d}' for n in AGENTS)} |"
    )
    print(f"without algorithm.agents the updates would have trained {dict(sorted(totals_all.items()))}")
    others = set(totals_calls) - set(AGENTS)
    if others:
        print(f"calls of other agents: {dict((k, totals_calls[k]) for k in others)}")
    if not ok:
        sys.exit("the recomputed counts differ from metrics.jsonl")


if __name__ == "__main__":
    main()
