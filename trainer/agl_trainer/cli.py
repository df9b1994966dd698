"""``agl train``: validate the config before anything starts, then train.

The command reaches ``agl`` through the ``agl.commands`` entry point ``train`` (see
:mod:`agl_core.plugins`); this module imports no torch, so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
from typing import Any

import yaml

from .config import ConfigError, add_override_argument, load_config
from .run.signals import received, stop_on_signals

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
    if config.improve is not None and not print_config:
        print(
            f"agl train: {config_path} has an improve: section; run it with: agl improve {config_path}",
            file=sys.stderr,
        )
        return 2
    if print_config:
        dumped = config.model_dump(mode="json")
        if as_json:
            print(json.dumps(dumped, indent=2))
        else:
            print(yaml.safe_dump(dumped, sort_keys=False, allow_unicode=True), end="")
        return 0
    from .requirements import check_requirements

    try:
        check_requirements(config)
    except ValueError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    taken = _ports_taken(config)
    if taken:
        print(f"agl train: {taken}", file=sys.stderr)
        return 2
    with stop_on_signals():
        return _train_until_stopped(config, config_path, overrides, resume=resume, overwrite=overwrite)


def _ports_taken(config: Any) -> str | None:
    """Why a port the run listens on is taken (``None``: all free), said before the model loads."""
    from agl_core.server import port_problem

    wanted = []
    if config.traces is None or config.validation.before or config.validation.after:
        wanted.append((config.gateway.host, config.gateway.port, "gateway.port"))
    if config.logging.dashboard:
        wanted.append(
            (config.logging.dashboard_host, config.logging.dashboard_port, "logging.dashboard_port")
        )
    for host, port, key in wanted:
        problem = port_problem(host, port)
        if problem is not None:
            return f"{problem} ({key} in the config, or --set {key}=0 for any free port)"
    return None


def _train_until_stopped(
    config: Any, config_path: str, overrides: list[str], *, resume: bool, overwrite: bool
) -> int:
    from agl_core.server import ListenError

    from .learning.checkpoint import CheckpointError
    from .model import ModelNotFoundError
    from .run.loop import NothingTrainedError, train
    from .run.offline import train_from_traces

    try:
        (train if config.traces is None else train_from_traces)(
            config, echo=lambda line: print(line, flush=True), resume=resume, overwrite=overwrite
        )
    except BaseException as exc:
        # A signal's exception can surface wrapped (raised inside a library callback, pydantic's
        # serializers say "Error calling function ..."): what was received decides, not its shape.
        if received or isinstance(exc, KeyboardInterrupt):
            return _interrupted(config, config_path, overrides, terminated=signal.SIGTERM in received)
        if isinstance(exc, (ModelNotFoundError, CheckpointError, ValueError)):
            print(f"agl train: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, ListenError):  # a port taken since the check before the model loaded
            print(f"agl train: {exc} (gateway.port or logging.dashboard_port in the config)", file=sys.stderr)
            return 2
        if isinstance(exc, NothingTrainedError):
            print(f"agl train: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def _interrupted(config: Any, config_path: str, overrides: list[str], *, terminated: bool) -> int:
    """The closing line of a run stopped by Ctrl-C or SIGTERM, run.json marked ``interrupted``; the exit
    status (130, or 143 for SIGTERM)."""
    from .learning.checkpoint import latest_checkpoint
    from .run.run_context import CHECKPOINTS_DIR
    from .run.runfile import RUN_FILE

    run_file = config.output_dir / RUN_FILE
    try:  # the signal may have come where the run file's own handler saw another exception
        data = json.loads(run_file.read_text())
        if data.get("status") != "interrupted":
            data.update(status="interrupted", error=None)
            run_file.write_text(json.dumps(data, indent=2, default=str))
    except (OSError, ValueError):
        pass
    how = "terminated (SIGTERM)" if terminated else "interrupted"
    newest = latest_checkpoint(config.output_dir / CHECKPOINTS_DIR)
    # the same command as the interrupted run's, its --set overrides included (output_dir among them)
    command = shlex.join(["agl", "train", config_path, *(f for o in overrides for f in ("--set", o))])
    if newest is not None:
        then = f"continue from {newest.name} with: {command} --resume"
    else:
        then = f"no checkpoint was written yet; start again with: {command} --overwrite"
    print(f"agl train: {how}; run.json says interrupted; {then}", file=sys.stderr)
    return 143 if terminated else 130


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
