"""Several hosts, stood in for by network namespaces joined by a veth (``netns_pair``):
NIXL's READ rate, the KV handoff between hosts, serving across them, and a partition."""
