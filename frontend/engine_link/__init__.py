"""The engine as the frontend sees it: submit, stream, abort, recover, observe.

``engine_client`` is the interface the API handlers use; ``client_rings`` implements it
over the launcher's shared-memory rings; ``recovery`` resumes requests whose workers
died; ``worker_status`` reads the load table for ``/health`` and ``/metrics``. Nothing
here knows HTTP.
"""
