"""``agl improve``: the continuous-improvement service and its two companions.

    agl improve CONFIG [--set KEY=VALUE ...]      run the service (until stopped, or improve.rounds)
    agl improve status CONFIG [--json]            the lineage: versions, gate numbers, live reward, gateways
    agl improve rollback CONFIG VERSION           serve VERSION again (the running service applies it)

Imports no torch until the service starts, so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from agl_core.settings import masked_url

from ..config import ConfigError, TrainerConfig, add_override_argument, load_config

__all__ = ["IMPROVE_COMMAND"]

_VERBS = ("status", "rollback")


def _load(path: str, overrides: list[str]) -> TrainerConfig:
    config = load_config(path, overrides, required=())
    if config.improve is None:
        raise ConfigError(
            f"{path} has no improve: section; agl improve needs one (docs/improve.md), and agl train runs"
            " a config without it"
        )
    return config


def _run(config: TrainerConfig) -> int:
    from ..run.signals import received, stop_on_signals
    from .service import ImproveError, ImproveService
    from .state import StateError

    with stop_on_signals():
        try:
            service = ImproveService(config, echo=lambda line: print(line, flush=True))
            service.run()
        except (ImproveError, StateError) as exc:
            print(masked_url(f"agl improve: {exc}"), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            how = 143 if received and received[-1] == 15 else 130
            print(
                "agl improve: stopped; the state is in "
                f"{config.output_dir / 'improve.json'}, and the same command resumes it",
                file=sys.stderr,
            )
            return how
    return 0


def _status(config: TrainerConfig, as_json: bool) -> int:
    from .service import liveness, read_lineage, status_lines
    from .state import STATE_FILE, ImproveState, StateError

    assert config.improve is not None and config.traces is not None
    try:
        state = ImproveState.load(config.output_dir / STATE_FILE, config.improve.name)
    except StateError as exc:
        print(f"agl improve status: {exc}", file=sys.stderr)
        return 2
    source = str(config.output_dir / STATE_FILE)
    alive = liveness(config.output_dir, state) if state is not None else None
    if state is None:  # not run here: the lineage the service keeps in the store
        try:
            lineage = read_lineage(config.traces.store, config.improve.name)
        except Exception as exc:
            print(
                masked_url(f"agl improve status: no state in {config.output_dir}, and the store: {exc}"),
                file=sys.stderr,
            )
            return 1
        if lineage is None:
            print(
                f"agl improve status: service {config.improve.name!r} has not run: no {source}, no lineage in"
                f" {masked_url(config.traces.store)}; start it with: agl improve CONFIG",
                file=sys.stderr,
            )
            return 1
        lineage.setdefault("consumed", [])
        lineage.pop("consumed_count", None)
        state = ImproveState.from_json(lineage)
        source = f"the store {masked_url(config.traces.store)}"
    live, ignored = _live_rewards(config)
    if as_json:
        data: dict[str, Any] = state.to_json(with_consumed=False)
        data["live_rewards"] = {str(k): v for k, v in (live or {}).items()}
        data["live_rewards_left_out"] = {str(k): n for k, n in ignored.items()}
        data["service"] = alive
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(f"(from {source})")
    for line in status_lines(state, live, ignored, alive):
        print(line)
    return 0


def _live_rewards(config: TrainerConfig) -> tuple[dict[int, list[float]] | None, dict[int, int]]:
    from .watch import StoreWatcher

    assert config.traces is not None and config.improve is not None
    watcher = StoreWatcher(config.traces)
    try:
        watcher.refresh()
        return watcher.live_rewards(config.improve.rollback.reward_range), watcher.ignored_rewards
    except Exception:
        return None, {}  # the store is down: status shows what the state knows
    finally:
        watcher.close()


def _rollback(config: TrainerConfig, version: str) -> int:
    from .service import ImproveError, apply_rollback
    from .state import StateError

    try:
        number = int(version.lstrip("v"))
    except ValueError:
        print(
            f"agl improve rollback: VERSION must be a version number such as 2 or v2, got {version!r}",
            file=sys.stderr,
        )
        return 2
    try:
        state = apply_rollback(config, number, echo=lambda line: print(line, flush=True))
    except (ImproveError, StateError) as exc:
        print(f"agl improve rollback: {exc}", file=sys.stderr)
        return 2
    assert config.improve is not None
    labels = [g.label for g in config.improve.gateways]
    missing = [
        f"{label} ({t.state}{': ' + t.message if t.message else ''})"
        if t is not None
        else f"{label} (not asked)"
        for label in labels
        for t in [state.targets.get(label)]
        if t is None or t.state != "ok" or t.serving != state.serving
    ]
    if missing:
        print(
            f"v{state.serving} is the serving version, but not every gateway serves it: {'; '.join(missing)}."
            " (a gateway that is down gets it when it answers; one that refused it is not sent it again)",
            file=sys.stderr,
        )
        return 1
    print(f"v{state.serving} serves" + (f" on {', '.join(labels)}" if labels else " (no gateway configured)"))
    return 0


@dataclasses.dataclass(frozen=True)
class _ImproveCommand:
    name: str = "improve"
    help: str = "keep an agent improving from its stored traffic: train, gate, publish, roll back"
    extra: str = "trainer"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = (
            "agl improve CONFIG [--set KEY=VALUE ...]\n"
            "       agl improve status CONFIG [--json]\n"
            "       agl improve rollback CONFIG VERSION"
        )
        parser.add_argument(
            "words",
            nargs="+",
            metavar="CONFIG | status CONFIG | rollback CONFIG VERSION",
            help="the service's YAML config (improve: and traces: sections); 'status CONFIG' shows its"
            " lineage, 'rollback CONFIG VERSION' serves an earlier version again",
        )
        add_override_argument(parser, "improve.min_new_rollouts=16")
        parser.add_argument("--json", action="store_true", help="with status: print the lineage as JSON")

    def run(self, args: argparse.Namespace) -> int:
        words: list[str] = args.words
        verb = words[0] if words[0] in _VERBS else None
        wanted = {None: 1, "status": 2, "rollback": 3}[verb]
        if len(words) != wanted:
            shape = {None: "CONFIG", "status": "status CONFIG", "rollback": "rollback CONFIG VERSION"}[verb]
            print(f"agl improve: expected agl improve {shape}, got {' '.join(words)!r}", file=sys.stderr)
            return 2
        if args.json and verb != "status":
            print("agl improve: --json applies to agl improve status", file=sys.stderr)
            return 2
        path = words[1] if verb else words[0]
        try:
            config = _load(path, args.overrides)
        except ConfigError as exc:
            print(masked_url(f"agl improve: {exc}"), file=sys.stderr)
            return 2
        if verb == "status":
            return _status(config, args.json)
        if verb == "rollback":
            return _rollback(config, words[2])
        return _run(config)


IMPROVE_COMMAND = _ImproveCommand()
