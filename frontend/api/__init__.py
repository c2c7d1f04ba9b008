"""The API surface: OpenAI's completions, chat completions and Responses API, Anthropic's
Messages API, vLLM's native ``/generate``, ``/tokenize`` and ``/detokenize``, and its
LoRA adapter endpoints. ``frontend.http.app`` routes every POST to a handler here, from
one table.

    handlers   completions, chat, messages (Anthropic), responses, generate, tokenize, lora
    shared     context (what every handler gets; ``check_model``), call (one engine call's
               lifecycle), sse (stream framing), usage (token counts), protocol (bodies
               parsed and validated), limits (what one body may cost)
    building   chat_prompt, tools, tool_parsers, structured, choices: bodies into engine
               requests, engine output into responses

The chat-shaped APIs share one internal request: ``messages_request`` and
``responses_request`` translate their bodies into a chat completion request,
``chat_run`` starts it and ``answer`` reads its output (reasoning, content, tool calls)
for each API to write in its own shape.
"""
