"""``agl train``: validate the config before anything starts, then train.

The command reaches ``agl`` through the ``agl.commands`` entry point ``train`` (see
:mod:`agl_core.plugins`); this module imports no torch, so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

import yaml

from .config import ConfigError, add_override_argument, load_config
from .cpu import passive_openmp

__all__ = ["TRAIN_COMMAND", "run_train"]


def run_train(
    config_path: str,
    overrides: list[str],
    *,
    print_config: bool = False,
    as_json: bool = False,
    resume: bool = False,
    overwrite: bool = False,
) -> int:
    """Train as the YAML file at ``config_path`` says, with ``KEY=VALUE`` ``overrides``; the exit status.

    Raises ImportError when the trainer extra (torch ...) is missing; ``agl`` reports it with the install
    hint. ``--print-config`` needs only the config's own requirements.
    """
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    if print_config:
        dumped = config.model_dump(mode="json")
        if as_json:
            print(json.dumps(dumped, indent=2))
        else:
            print(yaml.safe_dump(dumped, sort_keys=False, allow_unicode=True), end="")
        return 0
    passive_openmp()  # before anything imports torch
    from .checkpoint import CheckpointError
    from .requirements import check_requirements

    try:
        check_requirements(config)
    except ValueError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    from .loop import NothingTrainedError, train
    from .model import ModelNotFoundError
    from .offline import train_from_traces

    previous = signal.signal(signal.SIGTERM, _terminated) if _main_thread() else None
    try:
        (train if config.traces is None else train_from_traces)(
            config, echo=lambda line: print(line, flush=True), resume=resume, overwrite=overwrite
        )
    except (ModelNotFoundError, CheckpointError, ValueError) as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    except NothingTrainedError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        from .checkpoint import latest_checkpoint
        from .loop import CHECKPOINTS_DIR

        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        newest = latest_checkpoint(config.output_dir / CHECKPOINTS_DIR)
        if newest is not None:
            then = f"continue from {newest.name} with: agl train {config_path} --resume"
        else:
            then = f"no checkpoint was written yet; start again with: agl train {config_path} --overwrite"
        print(f"agl train: {how}; run.json says interrupted; {then}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so a terminated run ends the same clean way."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclasses.dataclass(frozen=True)
class _TrainCommand:
    """``agl train CONFIG [--set KEY=VALUE ...] [--print-config] [--resume | --overwrite]``."""

    name: str = "train"
    help: str = "train an agent from a YAML config"
    extra: str = "trainer"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", help="path of the trainer's YAML config")
        add_override_argument(parser, "train.steps=2")
        parser.add_argument(
            "--print-config",
            action="store_true",
            help="print the validated config (YAML, every key with its default) and exit",
        )
        parser.add_argument("--json", action="store_true", help="with --print-config: print it as JSON")
        again = parser.add_mutually_exclusive_group()
        again.add_argument(
            "--resume", action="store_true", help="continue the run in output_dir from its newest checkpoint"
        )
        again.add_argument(
            "--overwrite",
            action="store_true",
            help="start over, deleting the checkpoints, metrics and store of a run in output_dir",
        )

    def run(self, args: argparse.Namespace) -> int:
        return run_train(
            args.config,
            args.overrides,
            print_config=args.print_config,
            as_json=args.json,
            resume=args.resume,
            overwrite=args.overwrite,
        )


#: ``agl train``, an :class:`agl_core.plugins.CliCommand` (entry point ``agl.commands: train``).
TRAIN_COMMAND = _TrainCommand()
