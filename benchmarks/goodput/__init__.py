"""Goodput: the highest request rate at which 90 % of requests meet both latency targets.

``python -m benchmarks.goodput`` sends Poisson arrivals at a sweep of rates to each server
configuration in turn and measures, per request, TTFT (send -> first content chunk) and
TPOT (mean time per output token after the first). A request *attains* the SLO when it
finished and met both ``--slo-ttft-ms`` and ``--slo-tpot-ms``; a configuration's goodput
is the rate at which attainment falls to 90 %, interpolated linearly between the last
swept rate that met it and the first that did not (as DistServe reports it).

Traces (``traces``): ``chat`` (prompts 100-400 tokens, outputs 100-300), ``doc`` (prompts
1.5k-3k tokens, outputs 20-80) and ``phased``, which moves from chat to doc to an even
mix every ``--phase-s`` seconds. Prompts are exactly their drawn length in the model's
tokens; outputs are forced to length with ``ignore_eos``.

Modules: ``traces`` (request shapes, arrival schedules), ``slo`` (attainment and goodput
arithmetic), ``configs`` (which servers to launch), ``drive`` (sending one sweep point),
``report`` (the markdown page and the plot), ``__main__`` (the command line).
"""
