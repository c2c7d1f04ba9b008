"""Checkpoints pdserve builds offline: the tiny random-weight fixtures the tests use and
the embedded default model."""
