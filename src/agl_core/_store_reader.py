"""A store the ``agl`` commands read from: a running one (its URL) or a SQLite file an embedded store left
behind (``agl inspect``, ``agl store stats``, ``agl rollouts list``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import semconv, settings
from .records import Rollout, Span

__all__ = ["StoreReader", "add_store_arguments"]


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """``--store`` (or ``--url``) and ``--token``: the store a reading command reads from."""
    parser.add_argument(
        "--store",
        "--url",
        dest="store",
        default=None,
        help=f"store URL or SQLite file (default: $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})",
    )
    parser.add_argument("--token", default=None, help="the store's bearer token (default: $AGL_STORE_TOKEN)")


class StoreReader:
    """A store to read from: a running one (URL), a PostgreSQL DSN or a SQLite file an embedded store left
    behind."""

    def __init__(self, target: str | None, token: str | None) -> None:
        from .store import Store, StoreClient, connect

        self.store: Store | None = None
        self.client: StoreClient | None = None
        backend = connect(target, token, must_exist=True) if target else StoreClient(target, token=token)
        if isinstance(backend, StoreClient):
            self.client, self.where = backend, backend.url
        else:
            self.store, self.where = backend, target or ""

    def spans(self, rollout_id: str) -> list[Span]:
        if self.store is not None:
            return self.store.query_spans(rollout_ids=[rollout_id], limit=1_000_000)
        assert self.client is not None
        return self.client.all_spans([rollout_id])

    def rollout(self, rollout_id: str) -> Rollout | None:
        from .store import NotFoundError

        try:
            if self.store is not None:
                found = self.store.get_rollouts([rollout_id])
            else:
                assert self.client is not None
                found = self.client.get_rollouts([rollout_id])
        except NotFoundError:
            return None
        return found[0] if found else None

    def gateway_records(self, response_ids: Sequence[str], besides: str) -> dict[str, str]:
        """Response id -> the rollout (other than ``besides``) holding the gateway's record of that call:
        an agent run by hand sends its own spans to one rollout while the gateway records the calls it
        served in the session's (or its own trace's) rollout. At most 20 calls are looked up."""
        from .pipeline.spantree import GATEWAY, kind_of
        from .store import RolloutFilter

        found: dict[str, str] = {}
        for response_id in list(dict.fromkeys(response_ids))[:20]:
            if not response_id or len(response_id) > 512:
                continue
            where = RolloutFilter(text=response_id)
            page = (self.store or self.client).list_rollouts(where, limit=5)  # type: ignore[union-attr]
            for rollout in page.rollouts:
                if rollout.rollout_id == besides:
                    continue
                spans = self.spans(rollout.rollout_id)
                if any(
                    kind_of(s) == GATEWAY and s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id
                    for s in spans
                ):
                    found[response_id] = rollout.rollout_id
                    break
        return found

    def stats(self) -> dict[str, int]:
        if self.store is not None:
            return self.store.stats()
        assert self.client is not None
        return self.client.stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.client is not None:
            self.client.close()
