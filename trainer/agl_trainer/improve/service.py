"""``agl improve``: a service that keeps a production agent improving from its own traffic.

Each look (every ``improve.poll_s``):

1. read what the store gained since the last look (spans, late rewards, rollout records); a store that
   cannot be reached is waited for, and the status says so;
2. finish a round a crash interrupted (at its phase);
3. make every gateway serve the serving version (publish where one serves another: a gateway that was
   down, or restarted on the base model, gets it when it answers);
4. roll back the last promoted version when its live reward fell below its predecessor's;
5. start a round when enough new rewarded rollouts arrived: train a candidate from the serving version on
   them, gate it on the held-out tasks against the serving version, promote it (then publish) or refuse it.

Every change is written to ``OUTPUT_DIR/improve.json`` before the next step starts (see
:mod:`~agl_trainer.improve.state`) and mirrored to the store as the lineage resource. So a service killed
anywhere resumes where it was: a round killed while training trains again from the same parent on the
same rollouts (its version is made once, and each rollout trains one version), a decided round is not
decided again, and a gateway already serving a version is not sent it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from agl_core.settings import masked_url

from ..config import GateConfig, GatewayTargetConfig, ImproveConfig, TrainerConfig
from .gate import compare_live, gate_decision
from .publish import PublishResult, publish_version
from .rounds import RoundWork, TrainerRoundWork, copy_adapter
from .state import STATE_FILE, ImproveState, RoundInProgress, StateError, Version, lineage_resource
from .watch import StoreWatcher

__all__ = [
    "ALIVE_FILE",
    "LOCK_FILE",
    "ROLLBACK_FILE",
    "ImproveError",
    "ImproveService",
    "apply_rollback",
    "liveness",
    "read_lineage",
    "service_lock",
    "status_lines",
]

LOCK_FILE = "improve.lock"
#: The running service's heartbeat: rewritten every ``improve.poll_s`` by a thread of its own, through rounds
#: too, so ``agl improve status`` can tell a service that is busy from one that was killed.
ALIVE_FILE = "improve.alive"
#: A rollback asked for while the service runs: the service applies it at its next look.
ROLLBACK_FILE = "improve.rollback.json"
#: At most this often is a changed "waiting" line mirrored to the store (every other change at once).
_MIRROR_WAITING_S = 30.0
#: A running service writes its lineage at least this often, changed or not (a sign of life).
_MIRROR_ALIVE_S = 60.0
#: Versions of the lineage resource the store keeps (each change writes one; older ones are deleted).
LINEAGE_VERSIONS = 200


class ImproveError(ValueError):
    """``agl improve`` cannot do what was asked; the message says why and what to do."""


@contextlib.contextmanager
def service_lock(out: Path, *, wait: bool = False) -> Iterator[IO[str] | None]:
    """Hold ``OUTPUT_DIR/improve.lock`` (one service per output folder); yields ``None`` when another
    process holds it and ``wait`` is false."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / LOCK_FILE, "a+")  # noqa: SIM115  # held until the service stops
    except OSError as exc:
        raise ImproveError(
            f"cannot open the lock file {out / LOCK_FILE} ({exc.strerror or exc}); it must be a file this"
            " user can write (move away what is there)"
        ) from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield handle
    finally:
        handle.close()


class _Outcome:
    """How a :class:`_Job` ended: its value, or the exception it raised; and how long it took."""

    def __init__(self, result: Any, error: BaseException | None, seconds: float) -> None:
        self.result, self.error, self.seconds = result, error, seconds

    def value(self) -> Any:
        """The job's value; the exception it raised is raised here, in the service's thread."""
        if self.error is not None:
            raise self.error
        return self.result


class _Job(threading.Thread):
    """A round's training or gate on a thread of its own (daemon: a service stopped mid-round leaves it
    with the process; the round resumes at its phase when the service starts again)."""

    def __init__(self, label: str, work: Callable[[], Any]) -> None:
        super().__init__(name=f"agl-improve {label}", daemon=True)
        self.label, self.work = label, work
        self.outcome: _Outcome | None = None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.outcome = _Outcome(self.work(), None, time.monotonic() - t0)
        except BaseException as exc:  # handed to the service's thread, which decides
            self.outcome = _Outcome(None, exc, time.monotonic() - t0)


class ImproveService:
    """The service for one config (``improve`` and ``traces`` sections set). :meth:`run` loops until
    ``improve.rounds`` rounds are decided, ``improve.idle_exit_s`` passes without one, or ``stop`` is set.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        echo: Callable[[str], None] = print,
        work: RoundWork | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        if config.improve is None or config.traces is None:
            raise ImproveError("agl improve needs a config with improve: and traces: sections")
        self.config = config
        self.improve: ImproveConfig = config.improve
        self.out = config.output_dir
        self.echo = echo
        self.work: RoundWork = work or TrainerRoundWork(config, echo)
        self.stop = stop or threading.Event()
        self.watcher = StoreWatcher(
            config.traces,
            timed_out_too=config.algorithm.rewards.timeout_episode_reward is not None,
            owner=config.improve.name,
        )
        if isinstance(self.work, TrainerRoundWork) and isinstance(self.improve.gate, GateConfig):
            try:
                self.work.check_held_out()
            except ValueError as exc:
                raise ImproveError(f"the held-out gate cannot run: {exc}") from None
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_path = self.out / STATE_FILE
        loaded = ImproveState.load(self.state_path, self.improve.name)
        self.state = loaded or ImproveState.new(self.improve.name, self._initial_adapter())
        self._mirrored_at = 0.0
        self._written_at = time.time()
        self._mirrored_text = ""
        self._mirror_failed = False
        self._mirror_due = loaded is None
        self._last_round_at = time.time()
        self._last_progress = time.monotonic()
        if loaded is None:
            self.state.event("start", f"new service {self.improve.name!r}: version 0 serves")
            self._save(changed=True)
        self._resumed = loaded is not None
        #: The round phase running on its own thread, if any.
        self._job: _Job | None = None
        #: The live rewards of the last look, with the (spans, records) the watcher held then.
        self._live: tuple[tuple[int, int], dict[int, list[float]]] | None = None

    def _initial_adapter(self) -> str | None:
        init = self.config.model.init_adapter
        if init is None:
            return None
        from ..saved import find_checkpoint

        adapter = find_checkpoint(init).adapter
        if adapter is None:
            raise ImproveError(f"model.init_adapter {init} holds no single LoRA adapter")
        return str(adapter.resolve())

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self) -> ImproveState:
        """Look, act, sleep ``poll_s``, until done (see the class); the final state. However it ends (done,
        ``stop``, a signal, an error), the state and the lineage say that it stopped, when and why."""
        with service_lock(self.out) as held:
            if held is None:
                raise ImproveError(
                    f"another agl improve runs on {self.out} (it holds {self.out / LOCK_FILE}); stop it, or"
                    " use another output_dir"
                )
            self._started()
            beating = threading.Event()
            heart = threading.Thread(target=self._heartbeat, args=(beating,), name="agl-improve-alive")
            heart.daemon = True
            heart.start()
            ended = "stopped: asked to stop"
            try:
                while not self.stop.is_set():
                    self.tick()
                    if self._finished():
                        ended = self.state.waiting
                        break
                    self.stop.wait(self.improve.poll_s)
            except KeyboardInterrupt:
                ended = "stopped by a signal (Ctrl-C or SIGTERM)"
                raise
            except Exception as exc:
                ended = f"stopped by an error: {type(exc).__name__}: {exc}"
                raise
            finally:
                beating.set()
                heart.join(timeout=5.0)
                self._stopped(ended)
                self.watcher.close()
        return self.state

    def _started(self) -> None:
        """Say how the service starts: new, resumed after a clean stop, or after one that never said it
        stopped (killed, or the machine went down)."""
        state = self.state
        if self._resumed:
            pending = state.pending
            self.echo(
                f"resuming: v{state.serving} serves, {state.rounds} rounds so far"
                + (f", round {pending.round} resumes at {pending.phase}" if pending else "")
            )
            if state.stopped_at is None:
                last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.updated_at))
                why = f"restarted; the last run never said it stopped (killed, or crashed after {last})"
                state.event("restart", why)
            else:
                state.event("restart", f"restarted after a stop ({state.stop_reason})")
        state.stopped_at, state.stop_reason = None, ""
        self._save(changed=True)

    def _stopped(self, reason: str) -> None:
        """Record that the service stopped and why; never raises (the reason it stopped is what matters)."""
        state = self.state
        reason = masked_url(reason)[:500]
        pending = state.pending
        if pending is not None:
            reason += f"; round {pending.round} resumes at {pending.phase} when the service starts again"
        state.stopped_at, state.stop_reason = time.time(), reason
        state.waiting = f"not running: {reason}"
        state.event("stop", reason)
        with contextlib.suppress(Exception):
            self._save(changed=True)
        with contextlib.suppress(OSError):
            (self.out / ALIVE_FILE).unlink(missing_ok=True)

    def _heartbeat(self, done: threading.Event) -> None:
        """Rewrite :data:`ALIVE_FILE` every ``poll_s`` (at least every 5 s) until ``done``."""
        path = self.out / ALIVE_FILE
        every = min(self.improve.poll_s, 5.0)
        while True:
            with contextlib.suppress(OSError):
                tmp = path.with_name(path.name + ".tmp")
                beat = {
                    "time": time.time(),
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "every_s": every,
                }
                tmp.write_text(json.dumps(beat))
                os.replace(tmp, path)
            if done.wait(every):
                return

    def _finished(self) -> bool:
        wanted = self.improve.rounds
        if wanted is not None and self.state.rounds >= wanted and self.state.pending is None:
            if all(t.state != "down" for t in self.state.targets.values()):
                self.echo(f"done: {self.state.rounds} rounds; v{self.state.serving} serves")
                self.state.waiting = f"stopped after {self.state.rounds} rounds (improve.rounds)"
                self._save(changed=True)
                return True
        idle = self.improve.idle_exit_s
        if idle is not None and time.monotonic() - self._last_progress > idle:
            self.echo(f"stopping: no round for {idle:g}s ({self.state.waiting})")
            self.state.waiting = (
                f"stopped: no round for {idle:g}s (improve.idle_exit_s); {self.state.waiting}"
            )
            self._save(changed=True)
            return True
        return False

    def tick(self) -> None:
        """One look (see the module docstring)."""
        if not self._refresh():
            return
        # the gateways, rollbacks and live rewards are looked after at every look, rounds or not
        self._apply_rollback_request()
        self._reconcile()
        self._check_live()
        serving = self.state.serving
        if self.state.pending is not None:
            self._continue_round(self.state.pending)
        if self._job is not None and self.state.pending is None and not self._job.is_alive():
            self._job = None  # the phase of a round closed early (its parent rolled back) has ended
        if self.state.pending is None and self._job is None and self._round_due():
            self._continue_round(self._start_round())
        if self.state.serving != serving:
            self._reconcile()  # a round promoted a version: it goes out now
        self._save()

    # -- the store -------------------------------------------------------------------------------------

    def _refresh(self) -> bool:
        try:
            self.watcher.refresh()
        except Exception as exc:  # the store is down or refusing: wait, say so, lose nothing
            store = self.config.traces.store if self.config.traces else ""
            # a PostgreSQL URL's password never reaches the state, the lineage or the log
            why = masked_url(f"waiting for the store {store}: {exc}")
            if self.state.waiting != why:
                self.echo(why)
                self.state.event("store_down", masked_url(str(exc)))
            self.state.waiting = why
            self._save()
            return False
        return True

    def _save(self, *, changed: bool = False) -> None:
        self.state.save(self.state_path)
        self._mirror_due = self._mirror_due or changed
        now = time.time()
        if self._mirror_due or now - self._mirrored_at > _MIRROR_WAITING_S:
            self._mirror()

    def _mirror(self) -> None:
        """The lineage in the store (a new version of the resource, the latest :data:`LINEAGE_VERSIONS`
        kept), written when it changed, and at least every :data:`_MIRROR_ALIVE_S` while the service runs
        (its ``updated_at`` is then the dashboard's sign of life); retried at the next save if the store
        cannot take it now."""
        document = self.state.to_json(with_consumed=False)
        compared = json.dumps(
            {k: v for k, v in document.items() if k != "updated_at"}, sort_keys=True, default=str
        )
        alive = self.state.stopped_at is None and time.time() - self._written_at > _MIRROR_ALIVE_S
        if compared == self._mirrored_text and not alive:
            self._mirror_due = False
            self._mirrored_at = time.time()
            return
        try:
            backend = self.watcher.backend()
            backend.put_resource(lineage_resource(self.improve.name), document, keep=LINEAGE_VERSIONS)
        except Exception as exc:
            if not self._mirror_failed:
                self.echo(masked_url(f"lineage not written to the store yet ({exc}); retrying at each look"))
            self._mirror_failed = True
            return
        self._mirror_failed = False
        self._mirror_due = False
        self._mirrored_at = self._written_at = time.time()
        self._mirrored_text = compared

    # -- rounds ----------------------------------------------------------------------------------------

    def _new_rollouts(self) -> tuple[list[str], str]:
        chosen = self.watcher.selection(exclude=self.state.consumed)
        return [r.rollout_id for r in chosen.rollouts], chosen.describe()

    def _round_due(self) -> bool:
        wanted = self.improve.rounds
        if wanted is not None and self.state.rounds >= wanted:
            return False
        new, described = self._new_rollouts()
        enough = len(new) >= self.improve.min_new_rollouts
        every = self.improve.every_s
        scheduled = every is not None and bool(new) and time.time() - self._last_round_at >= every
        if enough or scheduled:
            return True
        if not new and not self.watcher.selection().rollouts:
            waiting = f"the filter matches no rewarded rollout yet ({described}); waiting"
        else:
            waiting = (
                f"waiting for data: {len(new)} of {self.improve.min_new_rollouts} new rewarded rollouts"
                f" ({described})"
            )
        if waiting != self.state.waiting:
            self.state.waiting = waiting
        return False

    def _start_round(self) -> RoundInProgress:
        new, _ = self._new_rollouts()
        if self.improve.data == "all":
            rollouts = [r.rollout_id for r in self.watcher.selection().rollouts]
        else:
            rollouts = new
        state = self.state
        state.rounds += 1
        pending = RoundInProgress(state.rounds, state.next_version, state.serving, rollouts, "training")
        state.pending = pending
        state.waiting = f"round {pending.round}: training v{pending.version} on {len(rollouts)} rollouts"
        state.event("round_start", state.waiting, round=pending.round, version=pending.version)
        self.echo(
            f"round {pending.round}: training v{pending.version} from v{pending.parent} on"
            f" {len(rollouts)} rollouts ({len(new)} new)"
        )
        self._save(changed=True)
        return pending

    def _continue_round(self, pending: RoundInProgress) -> None:
        """Take the round one phase further: its training and its gate's scoring run on a thread of their
        own (:class:`_Job`), so every look meanwhile still reconciles the gateways and applies rollbacks;
        a phase's outcome is taken at the first look after it ended."""
        from ..run.traces import NothingSelectedError

        if self.state.version(pending.parent).status == "rolled_back":
            self._close_round(
                pending,
                None,
                f"its parent v{pending.parent} was rolled back while it ran; its rollouts train in the next"
                " round, from the version serving now",
                consume=False,
            )
            return
        round_dir = self.out / "rounds" / f"round-{pending.round}"
        if pending.phase == "training":

            def training() -> Callable[[], Path]:
                # chosen here, in the service's thread (the watcher is not read from two threads)
                parent = self._adapter_of(pending.parent, create=False)
                chosen = self.watcher.selection().only(pending.rollouts, "chosen for this round")
                return lambda: self.work.train(round_dir, chosen, parent)

            outcome = self._run_job(f"round {pending.round} training", training)
            if outcome is None:
                return  # still training
            if isinstance(outcome.error, NothingSelectedError):
                self._close_round(pending, None, f"nothing to train on: {outcome.error}")
                return
            trained = outcome.value()
            candidate = copy_adapter(trained, self.out / "versions" / f"v{pending.version}")
            pending.candidate, pending.phase = str(candidate), "gating"
            self.state.event(
                "trained",
                f"round {pending.round}: v{pending.version} trained in {outcome.seconds:.0f}s",
                round=pending.round,
            )
            self._save(changed=True)
        assert pending.candidate is not None
        self._gate(pending, Path(pending.candidate))

    def _run_job(self, label: str, prepare: Callable[[], Callable[[], Any]]) -> _Outcome | None:
        """The outcome of the job ``label`` once it has ended, ``None`` while it runs; started here (with
        the work ``prepare()`` gives, in this thread) when it is not running yet."""
        job = self._job
        if job is None or job.label != label:
            self._job = job = _Job(label, prepare())
            job.start()
        if job.is_alive():
            return None
        self._job = None
        return job.outcome

    def _gate(self, pending: RoundInProgress, candidate: Path) -> None:
        gate = self.improve.gate
        version = Version(
            pending.version,
            "refused",
            parent=pending.parent,
            round=pending.round,
            adapter=str(candidate),
            algorithm=self.config.algorithm.name,
            trained_on=list(pending.rollouts),
        )
        if gate == "none" or gate is None:  # None: refused by the config; kept for the type checker
            from .state import GateRecord

            version.gate = GateRecord("promoted", "gate: none (promoted unchecked)")
        else:
            waiting = f"round {pending.round}: gating v{pending.version} against v{pending.parent}"
            if self.state.waiting != waiting:
                self.state.waiting = waiting
                self._save()

            def scoring() -> Callable[[], tuple[dict[str, float], dict[str, float]]]:
                parent = self._adapter_of(pending.parent, create=False)
                return lambda: self.work.score(candidate, parent)

            outcome = self._run_job(f"round {pending.round} gate", scoring)
            if outcome is None:
                return  # still scoring
            serving_scores, candidate_scores = outcome.value()
            version.gate = gate_decision(gate, serving_scores, candidate_scores, outcome.seconds)
        self._close_round(pending, version, version.gate.reason)

    def _close_round(
        self, pending: RoundInProgress, version: Version | None, reason: str, *, consume: bool = True
    ) -> None:
        state = self.state
        if consume:
            already = set(state.consumed)  # once: a set built per rollout made a round quadratic
            state.consumed.extend(r for r in dict.fromkeys(pending.rollouts) if r not in already)
        state.pending = None
        self._last_round_at = time.time()
        self._last_progress = time.monotonic()
        if version is None:
            state.event("round_skipped", f"round {pending.round}: {reason}", round=pending.round)
            self.echo(f"round {pending.round}: skipped, {reason}")
        elif version.gate is not None and version.gate.decision == "promoted":
            previous = state.version(state.serving)
            previous.status = "retired"
            version.status = "serving"
            state.versions.append(version)
            state.serving = version.version
            state.event(
                "promoted",
                f"round {pending.round}: v{version.version} promoted: {reason}",
                round=pending.round,
                version=version.version,
            )
            self.echo(f"round {pending.round}: v{version.version} promoted ({reason})")
        else:
            version.note = reason
            state.versions.append(version)
            state.event(
                "refused",
                f"round {pending.round}: v{version.version} refused: {reason}",
                round=pending.round,
                version=version.version,
            )
            self.echo(
                f"round {pending.round}: v{version.version} refused ({reason}); v{state.serving} still serves"
            )
        state.waiting = "round decided"
        self._save(changed=True)

    # -- versions and gateways -------------------------------------------------------------------------

    def _adapter_of(self, number: int, *, create: bool) -> Path | None:
        """The adapter directory of version ``number``; for a base version without one, ``None`` or
        (``create``) a freshly saved adapter that changes nothing."""
        version = self.state.version(number)
        if version.adapter is not None:
            return Path(version.adapter)
        if not create:
            return None
        path = self.out / "versions" / f"v{number}"
        if not (path / "adapter_config.json").is_file():
            self.work.base_adapter(path)
        version.adapter = str(path.resolve())
        self._save(changed=True)
        return path

    def _reconcile(self) -> None:
        """Make every gateway serve ``state.serving``."""
        serving = self.state.serving
        for target in self.improve.gateways:
            known = self.state.targets.get(target.label)
            if known is not None and known.state == "refused" and known.version == serving:
                continue  # it said no to this version; told again only for another one
            result = self._publish(target, serving)
            self._record_target(target, serving, result)

    def _publish(self, target: GatewayTargetConfig, version: int) -> PublishResult:
        from .publish import served_version, settled

        now = served_version(target)
        name = self.improve.name
        done = settled(target, now, version, name)
        if done is not None:
            return done  # no adapter is saved for a version that need not be sent
        adapter = self._adapter_of(version, create=True)
        assert adapter is not None
        self.echo(f"publishing v{version} to {target.label} (it serves v{now.serving})")
        return publish_version(target, version, adapter, owner=name, now=now)

    def _record_target(self, target: GatewayTargetConfig, version: int, result: PublishResult) -> None:
        from .state import TargetStatus

        label = target.label
        old = self.state.targets.get(label)
        status = TargetStatus(result.state, result.message, result.serving, version)
        changed = old is None or (old.state, old.serving, old.version) != (
            status.state,
            status.serving,
            version,
        )
        if not changed:
            return
        self.state.targets[label] = status
        if result.state == "ok" and result.serving == version:
            published = self.state.version(version).published
            published.setdefault(label, time.time())
            self.state.event("published", f"{label} serves v{version}", target=label, version=version)
            self.echo(f"{label} serves v{version}")
        elif result.state == "down":
            self.state.event("gateway_down", f"{label}: {result.message}", target=label)
            self.echo(f"{label} is down ({result.message}); v{version} is published when it answers")
        else:
            self.state.event("publish_refused", f"{label}: {result.message}", target=label, version=version)
            self.echo(f"{label} refused v{version}: {result.message}")
        self._save(changed=True)

    # -- rollback --------------------------------------------------------------------------------------

    def _check_live(self) -> None:
        rollback = self.improve.rollback
        live = self._live_rewards()
        current = self.state.version(self.state.serving)
        if not rollback.auto or current.parent is None or current.round is None:
            return
        if current.status != "serving" or (current.note or "").startswith("serving again"):
            return  # only a version a round promoted, never one a rollback brought back
        worse, comparison = compare_live(
            live.get(current.version, []),
            live.get(current.parent, []),
            min_sessions=rollback.min_sessions,
            k_se=rollback.k_se,
        )
        if worse:
            ignored = sum(self.watcher.ignored_rewards.get(v, 0) for v in (current.version, current.parent))
            why = f"automatic rollback: {comparison.describe()}, below -{rollback.k_se:g} SE" + (
                f" ({ignored} rewards left out: not finite, or outside rollback.reward_range)"
                if ignored
                else ""
            )
            self.roll_back(current.parent, why)

    def _live_rewards(self) -> dict[int, list[float]]:
        """Each version's live rewards (:meth:`StoreWatcher.live_rewards`), computed again only when the
        watcher holds spans or records it did not at the last look; their summary goes into the state
        (and so the lineage, the status and the dashboard)."""
        from ..stats import mean_se

        held = (len(self.watcher.spans), len(self.watcher.records))
        if self._live is not None and self._live[0] == held:
            return self._live[1]
        live = self.watcher.live_rewards(self.improve.rollback.reward_range)
        self._live = (held, live)
        ignored = self.watcher.ignored_rewards
        summary: dict[str, dict[str, float | None]] = {}
        for version in sorted(set(live) | set(ignored)):
            rewards = live.get(version, [])
            mean, se = mean_se(rewards) if rewards else (math.nan, math.nan)
            summary[str(version)] = {
                "mean": round(mean, 6) if rewards else None,
                "se": round(se, 6) if rewards else None,
                "sessions": len(rewards),
                "left_out": ignored.get(version, 0),
            }
        self.state.live = summary
        return live

    def roll_back(self, number: int, why: str, *, replaces: int | None = None) -> None:
        """Serve version ``number`` again (published at once); the version it replaces is marked.
        ``replaces``: the version the rollback was asked against; refused when another serves by now (a
        round promoted it after the rollback was asked for)."""
        state = self.state
        target = state.version(number)  # KeyError names the known versions
        if replaces is not None and replaces != state.serving:
            raise ImproveError(
                f"the rollback to v{number} was asked to replace v{replaces}, and v{state.serving} serves now"
                f" (promoted since); nothing changed: ask again if v{state.serving} should go"
            )
        if target.status == "refused":
            raise ImproveError(
                f"v{number} was refused by the gate ({target.note}); roll back to a version that served:"
                f" {', '.join(f'v{v.version}' for v in state.versions if v.status != 'refused')}"
            )
        if number == state.serving:
            raise ImproveError(f"v{number} is already serving")
        replaced = state.version(state.serving)
        replaced.status, replaced.note = "rolled_back", why
        target.status = "serving"
        target.note = f"serving again after a rollback from v{replaced.version}"
        state.serving = number
        state.event("rollback", f"v{replaced.version} -> v{number}: {why}", version=number)
        self.echo(f"rolled back from v{replaced.version} to v{number}: {why}")
        self._save(changed=True)
        self._reconcile()

    def _apply_rollback_request(self) -> None:
        request = self.out / ROLLBACK_FILE
        if not request.is_file():
            return
        try:
            asked = json.loads(request.read_text())
            version = asked.get("version") if isinstance(asked, dict) else None
            replaces = asked.get("replaces") if isinstance(asked, dict) else None
            if (
                isinstance(version, bool)
                or not isinstance(version, int)
                or isinstance(replaces, bool)
                or not isinstance(replaces, int | None)
            ):
                raise ValueError(
                    f"{request.name} must be a JSON object with an integer version and the integer version"
                    f' it replaces ({{"version": 2, "replaces": 3}}), got {str(asked)[:80]}'
                )
            why = str(asked.get("why") or "rolled back by hand")[:500]
            self.roll_back(version, why, replaces=replaces)
        except (KeyError, ValueError, TypeError, OSError, RecursionError, ImproveError) as exc:
            message = exc.args[0] if exc.args else str(exc)
            self.state.event("rollback_refused", f"rollback request refused: {message}")
            self.echo(f"rollback request refused: {message}")
            self._save(changed=True)
        finally:
            request.unlink(missing_ok=True)


def apply_rollback(
    config: TrainerConfig, version: int, *, echo: Callable[[str], None] = print, timeout_s: float = 120.0
) -> ImproveState:
    """``agl improve rollback``: serve ``version`` again. When the service runs, it is asked (through
    ``OUTPUT_DIR/improve.rollback.json``) and this waits until it did; otherwise it is done here."""
    if config.improve is None:
        raise ImproveError("the config has no improve: section")
    out = config.output_dir
    state = ImproveState.load(out / STATE_FILE, config.improve.name)
    if state is None:
        raise ImproveError(f"no agl improve state in {out} ({STATE_FILE}); has the service run there?")
    try:
        state.version(version)
    except KeyError as exc:
        raise ImproveError(exc.args[0]) from None
    with service_lock(out) as held:
        if held is not None:
            service = ImproveService(config, echo=echo)
            try:
                service.roll_back(
                    version, "rolled back by hand (agl improve rollback)", replaces=state.serving
                )
            except KeyError as exc:
                raise ImproveError(exc.args[0]) from None
            finally:
                service.watcher.close()
            return service.state
    request = out / ROLLBACK_FILE
    why = f"rolled back by hand from v{state.serving} (agl improve rollback)"
    request.write_text(json.dumps({"version": version, "replaces": state.serving, "why": why}))
    echo(
        f"the service running on {out} was asked to roll back from v{state.serving} to v{version}; waiting"
        " for it"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if request.exists():
            continue
        try:
            now = ImproveState.load(out / STATE_FILE, config.improve.name)
        except StateError:
            continue
        if now is not None and now.serving == version:
            return now
        if now is not None and now.events and now.events[-1]["kind"] == "rollback_refused":
            raise ImproveError(now.events[-1]["message"])
    raise ImproveError(
        f"the service did not apply the rollback within {timeout_s:g}s (it may be inside a round);"
        f" {request} stays and it applies it at its next look"
    )


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else pattern.format(value)


def liveness(out: Path, state: ImproveState, now: float | None = None) -> str:
    """Whether the service of ``out`` runs, from its state and its heartbeat (:data:`ALIVE_FILE`): running
    (heard from lately), stopped (it said so, and why), or silent (killed, or its machine went down)."""
    now = time.time() if now is None else now
    if state.stopped_at is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.stopped_at))
        return f"not running: stopped at {stamp} ({state.stop_reason})"
    try:
        beat = json.loads((out / ALIVE_FILE).read_text())
        heard, every, pid = float(beat["time"]), float(beat["every_s"]), int(beat["pid"])
        host = str(beat.get("host", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"not known to run: it never said it stopped, and it leaves no heartbeat ({ALIVE_FILE}); if it"
            " was killed, the same command resumes it"
        )
    age = max(0.0, now - heard)
    if host == socket.gethostname() and not _process_exists(pid):
        return (
            f"NOT RUNNING: its process (pid {pid}) is gone and it never said it stopped: killed; the same"
            " command resumes it"
        )
    if age <= 3 * every + 10:
        return f"running (pid {pid}, heard from {age:.0f}s ago)"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(heard))
    return (
        f"NOT RUNNING: not heard from since {stamp} ({age:.0f}s ago) and it never said it stopped: killed,"
        " or its machine went down; the same command resumes it"
    )


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def status_lines(
    state: ImproveState,
    live: dict[int, list[float]] | None = None,
    ignored: dict[int, int] | None = None,
    alive: str | None = None,
) -> list[str]:
    """``agl improve status``: the serving version, whether the service runs (``alive``:
    :func:`liveness`), what it waits for, each version's lineage and gate numbers (``live``: its live
    rewards; ``ignored``: how many were left out), each gateway, the latest events."""
    from ..stats import mean_se

    lines = [
        f"service {state.name!r}: v{state.serving} serves; {state.rounds} rounds;"
        f" {len(state.consumed)} rollouts trained on",
        *([f"service: {alive}"] if alive else []),
        f"now: {state.waiting}",
    ]
    if state.pending is not None:
        p = state.pending
        lines.append(
            f"round {p.round} in progress: v{p.version} from v{p.parent}, {len(p.rollouts)} rollouts,"
            f" phase {p.phase}"
        )
    lines.append("versions:")
    for v in state.versions:
        gate = v.gate
        numbers = ""
        if gate is not None and gate.change is not None:
            numbers = (
                f" held-out {_fmt(gate.serving)} -> {_fmt(gate.candidate)},"
                f" change {gate.change:+.3f} ± {_fmt(gate.se)} (n={gate.tasks}"
                + (f", tells {gate.detectable:.3f} apart" if gate.detectable is not None else "")
                + ")"
            )
        rewards = (live or {}).get(v.version, [])
        live_text = ""
        if rewards:
            mean, se = mean_se(rewards)
            live_text = f"; live {mean:.3f} ± {se:.3f} over {len(rewards)} sessions"
        left_out = (ignored or {}).get(v.version, 0)
        if left_out:
            live_text += f" ({left_out} rewards left out: not finite, or outside rollback.reward_range)"
        where = ", ".join(sorted(v.published)) or "-"
        parts = [
            f"v{v.version} {v.status}"
            + (f" from v{v.parent}, round {v.round}, {len(v.trained_on)} rollouts" if v.round else ""),
            numbers.strip(),
            live_text.removeprefix("; "),
            f"published to {where}",
            v.note if v.note and v.status in ("refused", "rolled_back") else "",
        ]
        lines.append("  " + "; ".join(part for part in parts if part))
    if state.targets:
        lines.append("gateways:")
        for label, t in sorted(state.targets.items()):
            lines.append(
                f"  {label}: {t.state}"
                + (f", serves v{t.serving}" if t.serving is not None else "")
                + (f" ({t.message})" if t.message and t.state != "ok" else "")
            )
    lines.append("recent events:")
    for e in state.events[-8:]:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
        lines.append(f"  {stamp} {e['kind']}: {e['message']}")
    return lines


def read_lineage(store: str, name: str) -> dict[str, Any] | None:
    """The lineage the service ``name`` wrote to ``store`` (its latest resource version), or ``None``."""
    from agl_core import settings
    from agl_core.store import connect

    backend: Any = connect(store, settings.store_token())
    try:
        found = backend.get_resource(lineage_resource(name))
    finally:
        backend.close()
    return None if found is None else dict(found.value)
