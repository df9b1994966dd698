"""The gateway's front doors beside OpenAI's chat completions: the Responses API (``responses``) and
Anthropic's Messages API (``anthropic``), each translated to and from the one generation request."""
