"""``agl train``: validate the config before anything starts, then train."""

from __future__ import annotations

import json
import sys

from .config import ConfigError, load_config


def run_train(
    config_path: str,
    overrides: list[str],
    *,
    print_config: bool = False,
    resume: bool = False,
    overwrite: bool = False,
) -> int:
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    if print_config:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    from .checkpoint import CheckpointError
    from .requirements import check_requirements

    try:
        check_requirements(config)
    except ValueError as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    from .loop import train
    from .model import ModelNotFoundError

    try:
        train(config, echo=lambda line: print(line, flush=True), resume=resume, overwrite=overwrite)
    except (ModelNotFoundError, CheckpointError, ValueError) as exc:
        print(f"agl train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agl train: interrupted; continue with --resume from the newest checkpoint", file=sys.stderr)
        return 130
    return 0
