"""OpenAI Agents SDK adapter (trace processor). Not implemented in this version."""

__all__: list[str] = []
