"""The API surface: OpenAI's completions, chat completions and Responses API, Anthropic's
Messages API, and vLLM's native ``/generate``, ``/tokenize`` and ``/detokenize``.

``protocol`` parses and validates bodies; ``chat_prompt``, ``tools``, ``tool_parsers``,
``structured`` and ``choices`` turn them into engine requests and engine output into
responses; ``serving_*`` are the handlers, called by ``frontend.http.app``. The
chat-shaped APIs share one internal request: ``messages_request`` and
``responses_request`` translate their bodies into a chat completion request,
``chat_run`` starts it and ``answer`` reads its output (reasoning, content, tool calls)
for each API to write in its own shape.
"""
