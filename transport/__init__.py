"""Everything that moves between processes on one host: message rings and KV handoff."""
