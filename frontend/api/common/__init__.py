"""What every API handler shares: ``context`` (what a handler is given; the model checked
once), ``call`` (one engine call's lifecycle), ``choices`` (``n`` and ``best_of``),
``protocol`` (OpenAI-shaped bodies parsed and turned into engine parameters), ``limits``
(what one body may cost), ``structured`` (constraint fields into one grammar), ``sse``
(stream framing), ``usage`` (token counts) and ``lora_registry`` (the adapters served)."""
