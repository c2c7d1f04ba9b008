"""Speculative decoding: proposers, exact verification, adaptive k and gating."""
