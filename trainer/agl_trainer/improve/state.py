"""What ``agl improve`` knows and must not forget: the versions it made (their lineage), the rollouts
each round trained on, the round in progress and its phase, and each gateway's last answer.

The state lives in ``OUTPUT_DIR/improve.json``, written whole to a temporary file, flushed to disk and
renamed over the old one at every change, so a process killed at any moment leaves either the state
before a change or the state after it. The same document (less the list of consumed rollout ids) is the
lineage kept in the store as the resource ``agl.improve.<name>``, one resource version per change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = [
    "STATE_FILE",
    "GateRecord",
    "ImproveState",
    "RoundInProgress",
    "StateError",
    "TargetStatus",
    "Version",
    "lineage_resource",
]

STATE_FILE = "improve.json"
#: Events kept in the state (older ones are dropped; the store's resource versions keep them all).
_MAX_EVENTS = 200


def lineage_resource(name: str) -> str:
    """The store resource holding the lineage of the service called ``name``."""
    return f"agl.improve.{name}"


class StateError(ValueError):
    """The state file cannot be read, or belongs to another service; the message says what to do."""


@dataclasses.dataclass
class GateRecord:
    """A held-out gate's numbers: both versions scored on the same tasks, and what was decided."""

    decision: str  # "promoted" | "refused"
    reason: str
    candidate: float | None = None
    serving: float | None = None
    #: Mean paired change (candidate - serving) and its standard error, over ``tasks`` tasks.
    change: float | None = None
    se: float | None = None
    tasks: int = 0
    seconds: float = 0.0
    #: The smallest change this gate tells from none with 80% power at 5% (one-sided): 2.49 SE.
    detectable: float | None = None


@dataclasses.dataclass
class Version:
    """A policy version: version 0 is the base model (or ``model.init_adapter``); every round makes one."""

    version: int
    #: ``serving`` (the one the gateways should serve), ``retired`` (served, then replaced),
    #: ``refused`` (the gate said no), ``rolled_back`` (served, then replaced by rollback), ``base``.
    status: str
    parent: int | None = None
    round: int | None = None
    #: The LoRA adapter directory (``None``: the base model, with no adapter yet saved).
    adapter: str | None = None
    algorithm: str | None = None
    #: The rollouts its round trained on.
    trained_on: list[str] = dataclasses.field(default_factory=list)
    created_at: float = dataclasses.field(default_factory=time.time)
    gate: GateRecord | None = None
    #: Gateway -> when it first answered that it serves this version (Unix seconds).
    published: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Why its status last changed (a rollback's numbers, a refusal's).
    note: str | None = None


@dataclasses.dataclass
class RoundInProgress:
    """A round between its start and its decision: restarted at ``phase`` after a crash."""

    round: int
    version: int
    parent: int
    rollouts: list[str]
    #: ``training`` (its directory is trained again from the start) or ``gating`` (``candidate`` is there).
    phase: str
    started_at: float = dataclasses.field(default_factory=time.time)
    candidate: str | None = None


@dataclasses.dataclass
class TargetStatus:
    """A gateway's last answer: ``ok`` (serves ``serving``), ``down`` (unreachable; retried every look),
    ``refused`` (it answered no to version ``version``: not retried for that version)."""

    state: str
    message: str = ""
    serving: int | None = None
    version: int | None = None
    since: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass
class ImproveState:
    name: str
    versions: list[Version]
    serving: int = 0
    rounds: int = 0
    consumed: list[str] = dataclasses.field(default_factory=list)
    pending: RoundInProgress | None = None
    targets: dict[str, TargetStatus] = dataclasses.field(default_factory=dict)
    #: Why no round is running now (shown by ``agl improve status``).
    waiting: str = "starting"
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    updated_at: float = dataclasses.field(default_factory=time.time)
    #: When the service last stopped cleanly, and why (``None`` while it runs; a service killed or crashed
    #: leaves it ``None``, which its next start reports).
    stopped_at: float | None = None
    stop_reason: str = ""
    #: Version (as a string, as JSON keys are) -> its live reward: ``mean``, ``se``, ``sessions`` (the
    #: rated sessions it served alone) and ``left_out`` (rewards not finite or outside the range).
    live: dict[str, dict[str, float | None]] = dataclasses.field(default_factory=dict)

    # -- reading and writing ---------------------------------------------------------------------------

    @classmethod
    def new(cls, name: str, base_adapter: str | None) -> ImproveState:
        return cls(name, [Version(0, "serving", adapter=base_adapter, note="the starting policy")])

    @classmethod
    def load(cls, path: Path, name: str) -> ImproveState | None:
        """The state at ``path``, or ``None`` when there is none yet."""
        if not path.exists():
            return None
        if not path.is_file():
            raise StateError(f"{path} is not a file; move it away (the lineage in the store is kept)")
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"a JSON object was expected, got {type(data).__name__}")
            state = cls.from_json(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise StateError(
                f"{path} is not a readable agl improve state ({exc}); move it away to start over (the"
                " lineage in the store is kept)"
            ) from None
        if state.name != name:
            raise StateError(
                f"{path} belongs to the improve service {state.name!r}, and this config names {name!r};"
                " use another output_dir, or the same improve.name"
            )
        return state

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImproveState:
        versions = []
        for v in data["versions"]:
            gate = GateRecord(**v["gate"]) if v.get("gate") else None
            versions.append(Version(**{**v, "gate": gate}))
        pending = RoundInProgress(**data["pending"]) if data.get("pending") else None
        targets = {k: TargetStatus(**t) for k, t in data.get("targets", {}).items()}
        if not versions or not all(type(v.version) is int and isinstance(v.status, str) for v in versions):
            raise ValueError("'versions' must list at least one version, each with an integer 'version'")
        if not isinstance(data["name"], str):
            raise ValueError("'name' must be a string")
        if int(data["serving"]) not in {v.version for v in versions}:
            raise ValueError(f"'serving' names v{data['serving']}, which 'versions' does not hold")
        return cls(
            data["name"],
            versions,
            int(data["serving"]),
            int(data["rounds"]),
            list(data.get("consumed", [])),
            pending,
            targets,
            str(data.get("waiting", "")),
            list(data.get("events", [])),
            float(data.get("updated_at", time.time())),
            None if data.get("stopped_at") is None else float(data["stopped_at"]),
            str(data.get("stop_reason", "")),
            {str(k): dict(v) for k, v in dict(data.get("live") or {}).items()},
        )

    def to_json(self, *, with_consumed: bool = True) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not with_consumed:
            data.pop("consumed")
            data["consumed_count"] = len(self.consumed)
        return data

    def save(self, path: Path) -> None:
        """Write the state whole (temporary file, fsync, rename): a crash leaves the old or the new one."""
        self.updated_at = time.time()
        text = json.dumps(self.to_json(), indent=1, default=str)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    # -- questions -------------------------------------------------------------------------------------

    def version(self, number: int) -> Version:
        for v in self.versions:
            if v.version == number:
                return v
        known = ", ".join(str(v.version) for v in self.versions)
        raise KeyError(f"no version {number} in this service's lineage (versions: {known})")

    @property
    def next_version(self) -> int:
        return max(v.version for v in self.versions) + 1

    def event(self, kind: str, message: str, **fields: Any) -> None:
        self.events.append({"time": time.time(), "kind": kind, "message": message, **fields})
        del self.events[:-_MAX_EVENTS]
