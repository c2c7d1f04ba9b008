"""Benchmarks: each compares against a baseline in the same run; see README.md."""
