"""The dashboard's view of a rollout as this trainer trains on it (entry point
``agl.rollout_explainers``: ``trainer``): the group's batch built by
:func:`agl_trainer.learning.batch.build_batch` with the run's config, and the run's tokenizer when it is on
this machine."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.records import Rollout, RolloutStatus, Span, Transition

from ..config import TrainerConfig
from ..learning.batch import build_batch

__all__ = ["ROLLOUT_EXPLAINER", "TrainerExplainer"]

logger = logging.getLogger(__name__)


def _config(config: Mapping[str, Any] | None) -> TrainerConfig:
    if not config:
        return TrainerConfig()
    try:
        return TrainerConfig.model_validate(dict(config))
    except Exception:  # a run's config from another version: the defaults still explain the calls
        return TrainerConfig()


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str) -> Any:
    from ..model import load_tokenizer

    return load_tokenizer(source)


class TrainerExplainer:
    def explain(
        self, rollouts: Sequence[Rollout], spans: Sequence[Span], config: Mapping[str, Any] | None
    ) -> tuple[Sequence[Transition], dict[tuple[str, int], float], dict[str, str]]:
        used = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
        batch = build_batch(_config(config), used, spans)
        advantages = {(s.transition.rollout_id, s.transition.call_index): s.advantage for s in batch.samples}
        untrained = dict(batch.untrained)
        trained = {rid for rid, _ in advantages}
        for r in used:
            if r.rollout_id in trained or r.rollout_id in untrained:
                continue
            peers = [p for p in used if (p.group_id or p.rollout_id) == (r.group_id or r.rollout_id)]
            if len(peers) < 2:
                untrained[r.rollout_id] = (
                    "no other rollout of its group succeeded: an advantage compares a group's rollouts"
                )
            elif len({p.reward for p in peers}) == 1:
                untrained[r.rollout_id] = "its group's rollouts all scored the same: no advantage"
        return batch.credit.transitions, advantages, untrained

    def tokenizer(self, config: Mapping[str, Any] | None) -> Any:
        """Only a model on this machine: the bundled SmolLM2 (or the tiny test model), a local directory."""
        source = (config or {}).get("model", {}).get("source") if isinstance(config, Mapping) else None
        source = source if isinstance(source, str) else "smollm2"
        if source not in ("smollm2", "tiny") and not Path(source).is_dir():
            return None
        try:
            return _tokenizer(source)
        except Exception as exc:  # transformers missing, a damaged directory
            logger.info("no tokenizer for %s (%s)", source, exc)
            return None


ROLLOUT_EXPLAINER = TrainerExplainer()
