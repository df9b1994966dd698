"""``agl improve``: a trainer service that keeps a production agent improving from its own traffic,
every change gated on held-out tasks, published to gateways, recorded and reversible (docs/improve.md)."""

from .service import ImproveError, ImproveService, apply_rollback
from .state import ImproveState, Version

__all__ = ["ImproveError", "ImproveService", "ImproveState", "Version", "apply_rollback"]
