"""Moving bytes on one host: rings against ZeroMQ, the KV handoff against a memcpy, and
where a tier-3 read's time goes."""
