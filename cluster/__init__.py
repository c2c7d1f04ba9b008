"""A node's part in a cluster of hosts: its gateway process (docs/multi_host.md)."""
