"""What the chosen backends need installed, checked before a training job starts anything."""

from __future__ import annotations

import shutil

from .config import TrainerConfig

__all__ = ["check_requirements"]


def check_requirements(config: TrainerConfig) -> None:
    """Raise ``ValueError`` naming what is missing and the command that installs it.

    * ``update.backend: verl``: verl and ray importable, and the ``verl:`` section made of keys verl's
      defaults know (see :func:`~agl_trainer.learning.verl_backend.merge_verl_config`);
    * ``serving.backend: vllm`` launching its server: the launch command (``vllm``) on ``PATH``;
    * ``update.device: cuda...``: a GPU that torch sees.
    """
    if config.update.backend == "verl":
        from .learning.verl_backend import merge_verl_config, verl_defaults, verl_overrides

        defaults, source = verl_defaults()
        merge_verl_config(defaults, verl_overrides(config), source=source)
    elif config.update.device not in ("auto", "cpu"):
        from .model import torch_device

        torch_device(config.update.device)
    vllm = config.serving.vllm
    if config.serving.backend == "vllm" and vllm.url is None and shutil.which(vllm.launch.command[0]) is None:
        raise ValueError(
            f"serving.vllm.launch runs {' '.join(vllm.launch.command)!r}, and there is no"
            f" {vllm.launch.command[0]!r} command on PATH: pip install 'agl[gpu]' (on the GPU machine), or"
            " set serving.vllm.url to a running vLLM server"
        )
