"""The dashboard's ASGI app and how it is started (foreground for ``agl dashboard``, background for the
trainer)."""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from .. import settings
from ..plugins import RolloutExplainer
from ..records import RolloutStatus
from ..store.base import MAX_PAGE, NotFoundError, RolloutFilter, StoreError, StoreUnavailableError
from ._rollout import installed_explainer, rollout_detail, rollout_row
from ._runs import find_runs, read_info, read_run, run_summary

__all__ = ["DashboardError", "create_dashboard_app", "start_dashboard"]

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
COOKIE = "agl_dashboard_token"
_ASSETS = {"app.js": "text/javascript", "app.css": "text/css", "icon.svg": "image/svg+xml"}
_STATUSES = {s.value for s in RolloutStatus}
_IMPROVE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEADERS = {
    # the page runs only its own script and style; span content can never become markup or script
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
        " base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_Handler = Callable[[Request], Awaitable[Response]]


class DashboardError(ValueError):
    """The dashboard cannot start as asked (the message says how to fix it)."""


class _BadRequest(Exception):
    pass


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers=_HEADERS)


def _error(status: int, message: str) -> JSONResponse:
    return _json({"error": {"message": message}}, status)


def _number(params: Mapping[str, str], name: str, parse: Callable[[str], Any], kind: str) -> Any:
    """``parse(params[name])``, ``None`` when absent or empty; a 400 naming ``kind`` when it fails."""
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return parse(raw)
    except ValueError:
        raise _BadRequest(f"{name} must be {kind}, not {raw[:40]!r}") from None


def _int(params: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    value: int | None = _number(params, name, int, "a whole number")
    if value is not None and not low <= value <= high:
        raise _BadRequest(f"{name} must be between {low} and {high}, not {value}")
    return value


def _float(params: Mapping[str, str], name: str) -> float | None:
    value: float | None = _number(params, name, float, "a number")
    if value is not None and not math.isfinite(value):
        raise _BadRequest(f"{name} must be a finite number")
    return value


def _text(params: Mapping[str, str], name: str, limit: int = 256) -> str | None:
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    if len(raw) > limit or "\x00" in raw:
        raise _BadRequest(f"{name} must be at most {limit} characters, without NUL")
    return raw


def _rollout_filter(request: Request) -> tuple[RolloutFilter, int | None, int]:
    params = request.query_params
    statuses = tuple(s for s in params.getlist("status") if s)
    unknown = [s for s in statuses if s not in _STATUSES]
    if unknown:
        raise _BadRequest(f"unknown status {unknown[0][:40]!r}; use one of {', '.join(sorted(_STATUSES))}")
    try:
        where = RolloutFilter(
            statuses=statuses,
            task_id=_text(params, "task"),
            step=_int(params, "step", 0, 2**62),
            split=_text(params, "split", 64),
            run=_text(params, "run"),
            agent=_text(params, "agent"),
            text=_text(params, "search", 256),
            reward_min=_float(params, "reward_min"),
            reward_max=_float(params, "reward_max"),
        )
    except ValueError as exc:  # fields that do not fit together
        raise _BadRequest(str(exc)) from None
    before = _int(params, "before", 0, 2**63 - 1)
    limit = _int(params, "limit", 1, MAX_PAGE) or 50
    return where, before, limit


class _DashboardAPI:
    """The dashboard's page, assets and data endpoints (see :func:`create_dashboard_app`)."""

    def __init__(
        self,
        store: Any,
        runs: Sequence[Path],
        *,
        token: str | None,
        config: Mapping[str, Any] | None,
        tokenizer: Any,
        explainer: RolloutExplainer | None,
    ) -> None:
        self.store, self.run_paths, self.token = store, list(runs), token
        self.config, self.tokenizer, self.explainer = config, tokenizer, explainer
        self.lock = threading.Lock()
        self.state: dict[str, Any] = {}

    def runs_now(self) -> dict[str, Path]:
        return find_runs(self.run_paths)

    def default_config(self) -> Mapping[str, Any] | None:
        if self.config is not None:
            return self.config
        for path in self.runs_now().values():
            found = read_info(path).get("config")
            if isinstance(found, dict):
                return found
        return None

    def default_tokenizer(self) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        with self.lock:
            if "tokenizer" not in self.state:
                try:
                    self.state["tokenizer"] = (self.explainer or installed_explainer()).tokenizer(
                        self.default_config()
                    )
                except Exception as exc:  # a damaged model directory: show ids instead
                    logger.info("agl dashboard: no tokenizer (%s); showing token ids", exc)
                    self.state["tokenizer"] = None
            return self.state["tokenizer"]

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        header = request.headers.get("authorization", "")
        cookie = request.cookies.get(COOKIE, "")
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode()) or hmac.compare_digest(
            cookie.encode(), self.token.encode()
        )

    def api(self, handler: _Handler) -> _Handler:
        async def endpoint(request: Request) -> Response:
            if not self.authorized(request):
                return _error(
                    401, "this dashboard needs its token: open the URL printed at start (?token=...)"
                )
            try:
                return await handler(request)
            except _BadRequest as exc:
                return _error(400, str(exc))
            except NotFoundError as exc:
                return _error(404, str(exc))
            except StoreUnavailableError as exc:
                return _error(503, f"the store is unavailable: {exc}")
            except StoreError as exc:
                return _error(502, f"the store refused: {exc}")

        return endpoint

    def need_store(self) -> Any:
        if self.store is None:
            raise _BadRequest("this dashboard has no store; start it with --store URL|FILE")
        return self.store

    async def page(self, request: Request) -> Response:
        given = request.query_params.get("token")
        if given is not None and self.token is not None:
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return Response("wrong token", status_code=401, headers=_HEADERS, media_type="text/plain")
            response = RedirectResponse("/", status_code=303, headers=_HEADERS)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return response
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            return _error(404, f"no asset {name[:40]!r}")
        return FileResponse(STATIC / name, media_type=_ASSETS[name], headers=_HEADERS)

    async def icon(self, request: Request) -> Response:
        """What a browser asks for by itself (the page also names the icon): the same SVG, not a 404."""
        return FileResponse(STATIC / "icon.svg", media_type="image/svg+xml", headers=_HEADERS)

    async def list_runs(self, request: Request) -> Response:
        found = await run_in_threadpool(lambda: [run_summary(n, p) for n, p in self.runs_now().items()])
        return _json({"runs": found, "store": self.store is not None})

    async def one_run(self, request: Request) -> Response:
        name = request.path_params["name"]
        found = self.runs_now()
        if name not in found:
            raise NotFoundError(f"no run named {name[:100]!r}")
        return _json(await run_in_threadpool(read_run, name, found[name]))

    async def rollouts(self, request: Request) -> Response:
        where, before, limit = _rollout_filter(request)
        target = self.need_store()
        page = await run_in_threadpool(lambda: target.list_rollouts(where, before=before, limit=limit))
        rows = [
            rollout_row(r, seq, page.span_counts.get(r.rollout_id, 0))
            for r, seq in zip(page.rollouts, page.seqs, strict=True)
        ]
        return _json(
            {"rollouts": rows, "before": page.before, "total": page.total, "total_capped": page.total_capped}
        )

    async def one_rollout(self, request: Request) -> Response:
        rollout_id = request.path_params["rollout_id"]
        if len(rollout_id) > 512 or "\x00" in rollout_id:
            raise _BadRequest("a rollout id is at most 512 characters, without NUL")
        target = self.need_store()
        detail = await run_in_threadpool(
            lambda: rollout_detail(
                target,
                rollout_id,
                config=self.default_config(),
                tokenizer=self.default_tokenizer(),
                explainer=self.explainer,
            )
        )
        return _json(json.loads(json.dumps(detail, default=str)))

    async def improve(self, request: Request) -> Response:
        """The lineage an ``agl improve`` service keeps in the store (resource ``agl.improve.<name>``)."""
        name = request.path_params["name"]
        if not _IMPROVE_NAME.fullmatch(name):
            raise _BadRequest(
                "a service name is 1-64 letters, digits, '_', '.' or '-', starting with one of the first two"
            )
        target = self.need_store()
        found = await run_in_threadpool(target.get_resource, f"agl.improve.{name}")
        if found is None:
            raise NotFoundError(
                f"no agl improve service named {name!r} has written to this store (improve.name in its"
                " config)"
            )
        return _json({"name": name, "resource_version": found.version, "lineage": found.value})

    async def stats(self, request: Request) -> Response:
        target = self.need_store()
        return _json(await run_in_threadpool(target.stats))

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/static/{name}", self.asset, methods=["GET"]),
            Route("/favicon.ico", self.icon, methods=["GET"]),
            Route("/api/runs", self.api(self.list_runs), methods=["GET"]),
            Route("/api/runs/{name:path}", self.api(self.one_run), methods=["GET"]),
            Route("/api/rollouts", self.api(self.rollouts), methods=["GET"]),
            Route("/api/rollouts/{rollout_id:path}", self.api(self.one_rollout), methods=["GET"]),
            Route("/api/stats", self.api(self.stats), methods=["GET"]),
            Route("/api/improve/{name}", self.api(self.improve), methods=["GET"]),
        ]


def create_dashboard_app(
    store: Any,
    runs: Sequence[Path] = (),
    *,
    token: str | None = None,
    config: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    explainer: RolloutExplainer | None = None,
) -> Starlette:
    """The dashboard over ``store`` (a :class:`~agl_core.store.base.Store` or a ``StoreClient``; ``None``
    shows runs only) and the run directories ``runs`` (each a run, or a folder of runs).

    ``config`` is the training config used to explain rollouts (credit, advantages); by default the first
    run's. ``explainer`` builds the calls' transitions (default: the installed trainer's, see
    :func:`agl_core.plugins.load_rollout_explainer`). ``tokenizer`` decodes token ids; by default the
    explainer's for the config's model, when it is on this machine. With ``token``, every data request
    needs it (``Authorization: Bearer``, or the cookie that opening ``/?token=...`` sets).
    """
    api = _DashboardAPI(store, runs, token=token, config=config, tokenizer=tokenizer, explainer=explainer)
    return Starlette(routes=api.routes())


def check_listen(host: str, token: str | None) -> None:
    """Refuse to serve beyond this machine without a token (span content is what the dashboard shows)."""
    if token is not None and not token.strip():
        raise DashboardError(
            'the dashboard token is empty; pass a secret, e.g. --token "$(openssl rand -hex 16)"'
        )
    if token is None and not settings.is_loopback(host):
        raise DashboardError(
            f"--host {host} is reachable from other machines, and the dashboard shows every span: pass"
            " --token TOKEN (or set AGL_DASHBOARD_TOKEN)"
        )


def dashboard_url(base: str, token: str | None) -> str:
    """The address to open: with the token, once, so the page can set its cookie."""
    return base + "/" + (f"?token={quote(token)}" if token else "")


def start_dashboard(
    stack: ExitStack,
    store: Any,
    runs: Sequence[Path],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
) -> str:
    """Serve the dashboard in the background until ``stack`` closes; returns the URL to open."""
    from ..server import BackgroundServer

    check_listen(host, token)
    app = create_dashboard_app(store, runs, token=token)
    server = BackgroundServer(app, host, port).start()
    stack.callback(server.stop)
    return dashboard_url(server.url, token)
