"""OpenAI's APIs: ``completions`` (POST /v1/completions), ``chat_completions``
(POST /v1/chat/completions) and the Responses API (``responses_request`` translates a
body onto the internal chat request, ``responses`` answers POST /v1/responses)."""
