"""agl's trainer service: YAML config, training loop, LightningRL updates, model serving on CPU."""

from .api import FitResult, Trainer
from .config import ConfigError, TrainerConfig, load_config
from .reporting.results import DevResult, DevRollout

__all__ = [
    "ConfigError",
    "DevResult",
    "DevRollout",
    "FitResult",
    "Trainer",
    "TrainerConfig",
    "load_config",
    "train",
]


def train(config: TrainerConfig, **kwargs):  # type: ignore[no-untyped-def]
    """Run a training job (see :func:`agl_trainer.run.loop.train`); imports torch on first use."""
    from .run.loop import train as _train

    return _train(config, **kwargs)
