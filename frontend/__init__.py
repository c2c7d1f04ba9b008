"""The HTTP frontend process, in rooms; bottom up, each imports only the rooms below it
(``tools/check_layers.py`` enforces the order):

- ``settings``, ``errors``: the frontend's configuration records (built by ``launch``)
  and the OpenAI-shaped HTTP errors every room raises.
- ``engine_link/``: the engine as the frontend sees it: the ``EngineClient`` interface,
  its shared-memory ring implementation, recovery of requests whose workers died, and
  the ``/health`` and ``/metrics`` views of the workers.
- ``telemetry/``: Prometheus metrics and the periodic stats line.
- ``openai/``: the API surface: request shapes, chat prompts, tools, structured output,
  ``n`` choices and the handlers of every endpoint (OpenAI's, Anthropic's Messages API
  and vLLM's native ones).
- ``http/``: the edge and the process: the C accept thread, connection deadlines and
  caps, the guard (key, Host, Content-Type), the FastAPI app and ``server`` (the
  process's ``main``, started by the launcher).
"""
