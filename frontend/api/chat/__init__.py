"""The one internal chat request behind every chat-shaped API: ``prompt`` (messages
through the chat template), ``tools`` and ``tool_parsers`` (what tools render and
constrain, and how output becomes tool calls), ``run`` (starts the request) and
``answer`` (its output read once: reasoning, content, tool calls)."""
