"""Moved to :mod:`agl_core.instrumentation` (the adapters' public contract); kept as an alias."""

from __future__ import annotations

from .instrumentation import HookErrors

__all__ = ["HookErrors"]
