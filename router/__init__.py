"""Request placement: the routing policies over the load table (``transport.load_table``)
and a ledger of what the router has assigned to each worker."""
