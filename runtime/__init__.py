"""What every server process shares: its spec and bootstrap, worker ring I/O, and the
skeleton of an engine worker (``runtime.worker.Worker``)."""
