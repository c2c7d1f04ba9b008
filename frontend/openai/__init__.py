"""The API surface: OpenAI's completions and chat completions, and vLLM's native
``/generate``, ``/tokenize`` and ``/detokenize``, shaped alike.

``protocol`` parses and validates bodies; ``chat_prompt``, ``tools``, ``tool_parsers``,
``structured`` and ``choices`` turn them into engine requests and engine output into
responses; ``serving_*`` are the handlers, called by ``frontend.http.app``.
"""
