"""The web dashboard: training runs, their live curves, the rollouts in the store and what one rollout
did, served by agl itself (``agl dashboard``, or ``logging.dashboard: true`` in a training config).

Everything is read-only. The page is static HTML and JavaScript shipped in this package (no build step,
no network); it fetches JSON from the endpoints below and inserts span content as text, never as markup.

====================================  ===========================================================
``GET /``                             the page (``?token=T`` once sets the session cookie)
``GET /api/runs``                     every run: status, step, ETA, reward
``GET /api/runs/{name}``              one run: config, per-step curves, held-out before/after
``GET /api/rollouts``                 a page of rollouts: ``status`` (repeatable), ``step``,
                                      ``split``, ``agent``, ``task``, ``reward_min``, ``reward_max``,
                                      ``before`` (the cursor), ``limit``
``GET /api/rollouts/{rollout_id}``    one rollout: span timeline, transitions, untrained reason
``GET /api/stats``                    what the store holds
====================================  ===========================================================
"""

from __future__ import annotations

from ._app import DashboardError, create_dashboard_app, start_dashboard
from ._runs import RUN_FILE, find_runs, read_run

__all__ = ["RUN_FILE", "DashboardError", "create_dashboard_app", "find_runs", "read_run", "start_dashboard"]
