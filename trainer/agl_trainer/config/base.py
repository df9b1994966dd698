"""The base of every config section: unknown keys are errors, and the error type the loader raises."""

from __future__ import annotations

from typing import Annotated

import pydantic


class ConfigError(ValueError):
    """The configuration is invalid; the message names the file and every bad key."""


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


#: A float that must be finite (no inf or NaN in a config).
_FiniteFloat = Annotated[float, pydantic.Field(allow_inf_nan=False)]
