"""Redaction at ingest: applied to every span before anything is written.

Rules, as given to ``agl store serve --redact RULE`` (repeatable):

=================  ===========================================================================
``key:GLOB``       drop span, event and resource attributes whose key matches GLOB
                   (``key:gen_ai.input.messages``, ``key:http.request.header.*``)
``regex:PATTERN``  replace every match of PATTERN in string values with ``[REDACTED]``
``email``          mask e-mail addresses
``api-key``        mask common API key and token shapes (``sk-...``, ``Bearer ...``, AWS, GitHub)
=================  ===========================================================================

Masking reaches string values nested in arrays and key-value lists, span status messages and event
attributes. Token ids and numbers are never touched.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MASK", "Redactor", "parse_rules"]

MASK = "[REDACTED]"
_PRESETS = {
    "email": [r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"],
    "api-key": [
        r"\bsk-[A-Za-z0-9_-]{16,}",
        r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=-]{16,}",
        r"\bAKIA[0-9A-Z]{16}\b",
        r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
        r"\bxox[abprs]-[A-Za-z0-9-]{10,}",
    ],
}


class Redactor:
    """Drops attributes by key and masks patterns in string values of OTLP protobuf messages, in place."""

    def __init__(self, drop_keys: Sequence[str] = (), patterns: Sequence[str] = ()) -> None:
        self.drop_keys = tuple(drop_keys)
        self._exact = {k for k in self.drop_keys if not any(c in k for c in "*?[")}
        self._globs = [k for k in self.drop_keys if k not in self._exact]
        # Applied one after another: each pattern keeps its own flags.
        self._patterns = [re.compile(p) for p in patterns]

    def __bool__(self) -> bool:
        return bool(self.drop_keys or self._patterns)

    def _dropped(self, key: str) -> bool:
        return key in self._exact or any(fnmatch.fnmatchcase(key, g) for g in self._globs)

    def mask(self, text: str) -> str:
        for pattern in self._patterns:
            text = pattern.sub(MASK, text)
        return text

    def _clean(self, key_values: Any) -> None:
        if self.drop_keys:
            keep = [kv for kv in key_values if not self._dropped(kv.key)]
            if len(keep) != len(key_values):
                copies = [type(kv)() for kv in keep]
                for copy, kv in zip(copies, keep, strict=True):  # one fresh copy per kept pair
                    copy.CopyFrom(kv)
                del key_values[:]
                key_values.extend(copies)
        if self._patterns:
            for kv in key_values:
                self._mask_value(kv.value)

    def _mask_value(self, value: Any, depth: int = 0) -> None:
        if depth > 16:
            return
        kind = value.WhichOneof("value")
        if kind == "string_value":
            masked = self.mask(value.string_value)
            if masked != value.string_value:
                value.string_value = masked
        elif kind == "array_value":
            for item in value.array_value.values:
                self._mask_value(item, depth + 1)
        elif kind == "kvlist_value":
            for kv in value.kvlist_value.values:
                self._mask_value(kv.value, depth + 1)

    def __call__(self, message: Any) -> None:
        """Redact a ``Resource`` or ``Span`` protobuf message in place."""
        self._clean(message.attributes)
        events = getattr(message, "events", None)
        if events is not None:
            for event in events:
                self._clean(event.attributes)
            if self._patterns and message.status.message:
                message.status.message = self.mask(message.status.message)


def parse_rules(rules: Iterable[str]) -> Redactor:
    """Build a :class:`Redactor` from rule strings; raises ``ValueError`` naming a bad rule."""
    drop: list[str] = []
    patterns: list[str] = []
    for rule in rules:
        kind, sep, arg = rule.partition(":")
        if not sep and rule in _PRESETS:
            patterns.extend(_PRESETS[rule])
        elif sep and kind == "key" and arg:
            drop.append(arg)
        elif sep and kind == "regex" and arg:
            try:
                re.compile(arg)
            except re.error as exc:
                raise ValueError(f"redaction rule {rule!r}: invalid regular expression: {exc}") from None
            patterns.append(arg)
        else:
            raise ValueError(
                f"redaction rule {rule!r} is not one of key:GLOB, regex:PATTERN, "
                f"{', '.join(sorted(_PRESETS))}"
            )
    return Redactor(drop, patterns)
