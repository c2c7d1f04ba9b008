"""Request placement: the shared-memory load table and the routing policies."""
