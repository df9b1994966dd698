"""Commands and gateway backends that other packages add to ``agl``, found through entry points.

Three entry-point groups, read from the installed distributions' metadata at each ``agl`` start:

``agl.commands``
    ``NAME = "module:OBJECT [extra]"``: an object satisfying :class:`CliCommand` becomes ``agl NAME``.
``agl.gateway_backends``
    ``NAME = "module:FACTORY [extra]"``: a :class:`GatewayBackendFactory` becomes
    ``agl gateway serve --backend NAME``.
``agl.rollout_explainers``
    ``NAME = "module:OBJECT [extra]"``: a :class:`RolloutExplainer` the dashboard uses to show a rollout's
    calls as a trainer sees them (credit, advantages, decoded tokens); the first by name that loads wins.

The ``[extra]`` of the entry point names the pip extra its module needs; ``agl`` puts it in the install
hint (``pip install 'DIST[extra]'``) when the module cannot be imported. Built-in names win over
plugins of the same name. Nothing here imports a plugin's module until :func:`command_plugins` (every
command, to build ``agl --help``) or :func:`load_gateway_backend` (the chosen backend only) asks for it;
a plugin that fails to load is reported, never raised, so one broken plugin breaks no other command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from importlib.metadata import EntryPoint, distributions
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .gateway.backend import Backend
    from .gateway.render import TemplateRenderer

logger = logging.getLogger(__name__)

__all__ = [
    "COMMANDS_GROUP",
    "GATEWAY_BACKENDS_GROUP",
    "ROLLOUT_EXPLAINERS_GROUP",
    "RolloutExplainer",
    "CliCommand",
    "GatewayBackendFactory",
    "PluginError",
    "ServedBackend",
    "UnavailableCommand",
    "command_plugins",
    "gateway_backend_names",
    "install_hint",
    "load_gateway_backend",
    "load_rollout_explainer",
    "missing_requirement",
]

COMMANDS_GROUP = "agl.commands"
GATEWAY_BACKENDS_GROUP = "agl.gateway_backends"
ROLLOUT_EXPLAINERS_GROUP = "agl.rollout_explainers"


class CliCommand(Protocol):
    """A subcommand of ``agl`` provided by another package (entry-point group ``agl.commands``).

    The module holding it is imported whenever ``agl`` starts, so it must import cheaply: heavy
    requirements (torch, transformers) are imported inside :meth:`run`. An :class:`ImportError` escaping
    :meth:`run` is reported as a missing requirement of :attr:`extra` (one line, exit status 2).
    """

    @property
    def name(self) -> str:
        """The subcommand, ``agl NAME``; equal to the entry point's name."""
        ...

    @property
    def help(self) -> str:
        """One line for ``agl --help``."""
        ...

    @property
    def extra(self) -> str:
        """The pip extra of the providing distribution that installs its requirements, e.g. ``"trainer"``."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Define the command's arguments on its own subparser."""
        ...

    def run(self, args: argparse.Namespace) -> int:
        """Run with the parsed arguments; returns the process exit status."""
        ...


@dataclasses.dataclass(frozen=True)
class ServedBackend:
    """What a :class:`GatewayBackendFactory` builds for ``agl gateway serve``.

    ``description`` completes the start-up line ("serving NAME (DESCRIPTION)"). ``renderer``, when not
    None, turns on the gateway's drift check of the backend's prompt token ids; a backend that renders
    prompts with the same tokenizer itself leaves it None. The gateway calls ``backend.close()`` (when the
    backend has one) after serving.
    """

    backend: Backend
    description: str
    renderer: TemplateRenderer | None = None


class GatewayBackendFactory(Protocol):
    """Builds a backend from the parsed ``agl gateway serve`` arguments (group ``agl.gateway_backends``).

    ``args`` holds every option of ``agl gateway serve`` (``--model``, ``--served-name``, ``--max-batch``,
    ``--max-tokens``, ``--threads`` ...; see ``agl gateway serve --help``). Raise :class:`ImportError` when
    a requirement is missing (reported with the install hint), :class:`ValueError`, :class:`OSError` or
    :class:`RuntimeError` when the backend cannot start (reported as such); either way exit status 2.
    """

    def __call__(self, args: argparse.Namespace) -> ServedBackend: ...


class PluginError(Exception):
    """A plugin cannot be used; the message is one line saying why and what to install."""


@dataclasses.dataclass(frozen=True)
class UnavailableCommand:
    """Stands in for a command plugin that failed to load: still listed, running it explains why."""

    name: str
    help: str
    extra: str
    #: One line: what failed and what to install.
    reason: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No arguments: whatever follows the command is accepted, since running it only reports."""

    def run(self, args: argparse.Namespace) -> int:
        raise PluginError(self.reason)


#: What to install first for agl's extras that pull torch: a bare ``torch`` requirement resolves to the CUDA
#: build on Linux (gigabytes), so a CPU machine takes torch's CPU wheel before the extra.
TORCH_CPU_FIRST = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def install_hint(extra: str, dist: str = "agl") -> str:
    """``pip install 'DIST[EXTRA]'`` (or ``'DIST'`` when ``extra`` is empty); for agl's ``trainer`` extra,
    with torch's CPU build installed first on a machine without a GPU."""
    hint = f"pip install '{dist}[{extra}]'" if extra else f"pip install '{dist}'"
    if dist == "agl" and extra == "trainer":
        return f"{hint} (on a machine without a GPU, first: {TORCH_CPU_FIRST}, or the CUDA build comes)"
    return hint


def _entry_points(group: str) -> list[EntryPoint]:
    # Every distribution's metadata, not importlib's ``entry_points()``: that keeps only the first copy of
    # each distribution name on sys.path, and a stale ``agl.egg-info`` left in the current directory by a
    # build would then hide the installed entry points. The first copy naming an entry point wins.
    found: dict[str, EntryPoint] = {}
    for dist in distributions():
        for ep in dist.entry_points.select(group=group):
            found.setdefault(ep.name, ep)
    return [found[name] for name in sorted(found)]


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else "agl"


def _extra(ep: EntryPoint) -> str:
    return ep.extras[0] if ep.extras else ""


def _target(ep: EntryPoint) -> str:
    """``module:attr`` without the extras."""
    return f"{ep.module}:{ep.attr}" if ep.attr else ep.module


def _load_failure(what: str, ep: EntryPoint, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return missing_requirement(what, exc, _extra(ep), _dist_name(ep))
    hint = install_hint(_extra(ep), _dist_name(ep))
    return f"{what} is unavailable: {_target(ep)} cannot be loaded ({type(exc).__name__}: {exc}); try: {hint}"


def _unavailable(ep: EntryPoint, reason: str) -> UnavailableCommand:
    return UnavailableCommand(ep.name, f"(unavailable; 'agl {ep.name}' says why)", _extra(ep), reason)


def command_plugins(reserved: frozenset[str] = frozenset()) -> list[CliCommand]:
    """Every command of group ``agl.commands`` not named in ``reserved``, sorted by name.

    A command whose entry point cannot be loaded, or does not name a :class:`CliCommand`, comes back as an
    :class:`UnavailableCommand` carrying the reason.
    """
    commands: list[CliCommand] = []
    for ep in _entry_points(COMMANDS_GROUP):
        if ep.name in reserved:
            continue
        try:
            command = ep.load()
        except Exception as exc:  # a broken plugin must not break the other commands
            commands.append(_unavailable(ep, _load_failure(f"agl {ep.name}", ep, exc)))
            continue
        missing = [a for a in ("name", "help", "extra", "add_arguments", "run") if not hasattr(command, a)]
        if missing or getattr(command, "name", None) != ep.name:
            problem = f"lacks {', '.join(missing)}" if missing else f"is named {command.name!r}"
            reason = f"agl {ep.name} is unavailable: {_target(ep)} is not a usable command ({problem})"
            commands.append(_unavailable(ep, reason))
            continue
        commands.append(command)
    return commands


def gateway_backend_names() -> list[str]:
    """Names of the backends in group ``agl.gateway_backends``, sorted; nothing is imported."""
    return [ep.name for ep in _entry_points(GATEWAY_BACKENDS_GROUP)]


def load_gateway_backend(name: str) -> GatewayBackendFactory:
    """The factory of backend ``name``; :class:`PluginError` with the install hint when it cannot load."""
    for ep in _entry_points(GATEWAY_BACKENDS_GROUP):
        if ep.name == name:
            try:
                factory = ep.load()
            except Exception as exc:
                raise PluginError(_load_failure(f"--backend {name}", ep, exc)) from None
            if not callable(factory):
                raise PluginError(f"--backend {name} is unavailable: {_target(ep)} is not callable")
            return _ReportMissing(name, factory, _extra(ep), _dist_name(ep))
    raise PluginError(f"no gateway backend named {name!r} is installed")


@dataclasses.dataclass(frozen=True)
class _ReportMissing:
    """A factory whose ImportError becomes a :class:`PluginError` with the install hint."""

    name: str
    factory: GatewayBackendFactory
    extra: str
    dist: str

    def __call__(self, args: argparse.Namespace) -> ServedBackend:
        try:
            return self.factory(args)
        except ImportError as exc:
            raise PluginError(
                missing_requirement(f"--backend {self.name}", exc, self.extra, self.dist)
            ) from None


class RolloutExplainer(Protocol):
    """How a trainer would train on a group of rollouts (group ``agl.rollout_explainers``)."""

    def explain(
        self, rollouts: Sequence[Any], spans: Sequence[Any], config: Mapping[str, Any] | None
    ) -> tuple[Sequence[Any], dict[tuple[str, int], float], dict[str, str]]:
        """``(rollouts of a group, their spans, the run's config as JSON)`` -> the credited transitions,
        the advantage of each trained call by ``(rollout id, call index)``, and why each rollout with no
        trained call did not train."""
        ...

    def tokenizer(self, config: Mapping[str, Any] | None) -> Any:
        """The run's tokenizer when it is on this machine (never downloaded), else ``None``."""
        ...


def load_rollout_explainer() -> RolloutExplainer | None:
    """The first explainer of group ``agl.rollout_explainers`` that loads, or ``None``."""
    for ep in _entry_points(ROLLOUT_EXPLAINERS_GROUP):
        try:
            found = ep.load()
        except Exception as exc:  # the trainer extra missing: the dashboard explains less
            logger.info("%s", _load_failure(f"rollout explainer {ep.name}", ep, exc))
            continue
        if callable(getattr(found, "explain", None)) and callable(getattr(found, "tokenizer", None)):
            return found  # type: ignore[no-any-return]
        logger.warning("rollout explainer %s (%s) lacks explain() or tokenizer()", ep.name, _target(ep))
    return None


def missing_requirement(what: str, exc: ImportError, extra: str, dist: str = "agl") -> str:
    """One line: ``WHAT needs the EXTRA extra (EXC); install it with: pip install 'DIST[EXTRA]'``."""
    needs = f"the {extra} extra" if extra else "a package that is not installed"
    detail = " ".join(str(exc).split())
    return f"{what} needs {needs} ({detail}); install it with: {install_hint(extra, dist)}"
