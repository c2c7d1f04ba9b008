"""Benchmarks, in rooms: ``harness`` (what every benchmark imports), then ``engine``,
``transport``, ``cluster``, ``serving`` and ``peers`` (pdserve against vLLM and llama.cpp)
by subject. Each compares against a baseline in the same run; see README.md."""
