"""Anthropic's Messages API: ``messages_request`` translates a body onto the internal
chat request, ``messages`` answers POST /v1/messages and /v1/messages/count_tokens in
Anthropic's shapes, errors included."""
