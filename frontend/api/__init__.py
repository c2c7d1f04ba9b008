"""The API surface, in rooms; bottom up, each imports only the rooms below it
(``tools/check_layers.py`` enforces the order):

    common     what every handler shares: context (the model checked once), call, choices,
               protocol, limits, structured, sse, usage, lora_registry
    chat       the one internal chat request: prompt, tools, tool_parsers, run, answer
    openai     /v1/completions, /v1/chat/completions, /v1/responses
    anthropic  /v1/messages, /v1/messages/count_tokens
    native     /generate, /tokenize, /detokenize, /version, the LoRA adapter endpoints

``frontend.http.app`` routes every request to a handler here, from one table. The
chat-shaped APIs share one internal request: ``openai.responses_request`` and
``anthropic.messages_request`` translate their bodies into a chat completion request,
``chat.run`` starts it and ``chat.answer`` reads its output for each API to write in its
own shape.
"""
