"""The HTTP edge and the frontend process.

``server`` is the process's ``main`` (``python -m frontend.http.server``, started by the
launcher). ``acceptor`` (with its C thread, ``_acceptor.c``) owns the listening socket
and answers health probes off the event loop; ``connections`` holds slow clients to
deadlines and caps connections; ``guard`` decides who may call; ``app`` routes requests to
the API handlers and shapes every failure as a JSON error.
"""
