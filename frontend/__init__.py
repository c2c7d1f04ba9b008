"""The HTTP frontend process, in rooms; bottom up, each imports only the rooms below it
(``tools/check_layers.py`` enforces the order):

- ``settings``, ``errors``: the frontend's configuration records (built by ``launch``)
  and the OpenAI-shaped HTTP errors every room raises.
- ``engine_link/``: the engine as the frontend sees it: the ``EngineClient`` interface,
  its shared-memory ring implementation, recovery of requests whose workers died, and
  the ``/health`` and ``/metrics`` views of the workers.
- ``telemetry/``: Prometheus metrics and the periodic stats line.
- ``api/``: the API surface, in rooms of its own: what every handler shares
  (``common/``), the one internal chat request (``chat/``), then one room per API family:
  ``openai/`` (completions, chat completions, Responses), ``anthropic/`` (Messages) and
  ``native/`` (``/generate``, ``/tokenize``, LoRA adapters).
- ``http/``: the edge and the process: the C accept thread, connection deadlines and
  caps, the guard (key, Host, Content-Type), the FastAPI app and ``server`` (the
  process's ``main``, started by the launcher).
"""
