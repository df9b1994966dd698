"""AutoGen AgentChat adapter. Not implemented in this version."""

__all__: list[str] = []
