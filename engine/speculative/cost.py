"""The speculator's cost-aware gate: how many drafts each request verifies this step.

A step that verifies X drafts over a batch of B requests costs t(B, X) seconds and emits
B tokens plus the accepted drafts; a plain decode step costs t(B, 0) and emits B. The
gate picks the X (0: no speculation) with the most expected tokens per second:

    tokens(X) = B + the X largest gains g[i][j],   g[i][j] = a_i[0] * ... * a_i[j - 1]

where a_i[p] is request i's measured probability that draft p + 1 is accepted given
that draft p was (per-position EWMAs; ``Acceptance``). A position the request has not
tried takes the worker's rate there, and a position no request has tried yet takes the
rate of the one before it: drafts that follow an earlier run of the text hold about as
well further along as they did so far, and a fixed guess there (below what verifying one
more row costs) would keep every request from ever trying past the positions it tried
first. The gains of one request fall
with j, so the X largest are a prefix of each request's drafts: request i verifies as
many drafts as it has among them. t(B, X) is the engine's own step times, measured
(``StepTimes``): verification rows may cost more than decode rows (other attention, on
CPU a dense K/V copy to rebuild when the batch changed, the GEMM where a decode would take
the packed kernel), and only the clock knows by how much on this machine, model and
context.

Acceptance is measured for free while a request does not speculate ("shadow" drafts,
for proposers whose drafts cost nothing, like the n-gram one): its proposal is kept and
checked against the tokens it then decodes, so a request whose text turns to copying
starts speculating again, and one whose drafts stop matching stops within a few steps,
without a rejected verification to learn it from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_TIME_WEIGHT = 0.25  # weight of the newest step in a (B, X) cell's time
_OUTLIER = 3.0  # a step slower than this many times its cell's estimate counts as this
_ACC_WEIGHT = 0.4  # weight of the newest observation in a request's acceptance: backs off fast
_PRIOR_WEIGHT = 0.05  # the worker-wide prior a new request starts from
_PRIOR_ACCEPT = 0.5
# Until measured: a verification costs a decode step, plus this, plus this per draft row
# per request. Optimistic enough that a request with good acceptance tries it once.
_PRIOR_FIXED, _PRIOR_ROW = 0.25, 0.1
_MARGIN = 1.04  # speculate only for an expected >= 4 % more tokens per second
_REPROBE = 32  # plain steps in a row after which measured verification costs are re-tried


# The worker-wide per-position acceptance new requests start from; None: no request has
# tried that position yet.
Prior = list[float | None]


class StepTimes:
    """Measured seconds of a decode worker's steps by (batch size B, drafted rows X).

    A decode step right after a verification may pay to rebuild the dense decode K/V
    (engine/model/attention.py: DenseDecodeKV; when the verified batch was not the one it
    held); that excess over a plain decode step is charged to the verification, not to
    decoding.
    """

    def __init__(self) -> None:
        self._t: dict[tuple[int, int], float] = {}
        self._pending: tuple[int, int, float] | None = None  # the last verification
        self._plain_steps = 0  # plain decode steps since the last verification

    def observe(self, b: int, x: int, seconds: float) -> None:
        pending, self._pending = self._pending, None
        self._plain_steps = 0 if x > 0 else self._plain_steps + 1
        if x > 0:
            if pending is not None:
                self._update(*pending)
            self._pending = (b, x, seconds)
            return
        t0 = self._t.get((b, 0))
        if pending is not None and pending[0] == b and t0 is not None:
            pb, px, pt = pending
            self._update(pb, px, pt + max(0.0, seconds - t0))
            return
        if pending is not None:
            self._update(*pending)
        self._update(b, 0, seconds)

    def _update(self, b: int, x: int, seconds: float) -> None:
        old = self._t.get((b, x))
        if old is None:
            self._t[(b, x)] = seconds
        else:
            seconds = min(seconds, _OUTLIER * old)  # a descheduled step is not the kernel's
            self._t[(b, x)] = (1 - _TIME_WEIGHT) * old + _TIME_WEIGHT * seconds

    def estimate(self, b: int, x: int) -> float | None:
        """Seconds of a step of ``b`` requests verifying ``x`` drafts; None: no plain
        decode step of ``b`` measured yet (nothing to compare a verification with).

        Every ``_REPROBE`` plain steps in a row, the prior stands in for the measured
        verification cells for a step: one slow measurement (another process took the
        core) must not keep a worker from speculating for good.
        """
        t0 = self._t.get((b, 0))
        if t0 is None or x == 0:
            return t0
        slope = _PRIOR_ROW * t0 / b
        if self._plain_steps and self._plain_steps % _REPROBE == 0:
            return t0 * (1 + _PRIOR_FIXED) + slope * x
        if (b, x) in self._t:
            return self._t[(b, x)]
        pts = [(xx, t) for (bb, xx), t in self._t.items() if bb == b and xx > 0]
        if not pts:
            return t0 * (1 + _PRIOR_FIXED) + slope * x
        if len({xx for xx, _ in pts}) >= 2:  # least squares through the measured cells
            mx = sum(xx for xx, _ in pts) / len(pts)
            mt = sum(t for _, t in pts) / len(pts)
            var = sum((xx - mx) ** 2 for xx, _ in pts)
            slope = max(0.0, sum((xx - mx) * (t - mt) for xx, t in pts) / var)
            return mt + slope * (x - mx)
        (x1, t1), *_ = pts
        return t1 + slope * (x - x1)


@dataclass
class Acceptance:
    """Per-position acceptance of one request: ``rates[p]`` ~ P(draft p + 1 accepted | p
    accepted), or None where it has not been observed (the worker's prior stands in)."""

    rates: list[float | None]
    shadow: list[int] = field(default_factory=list)  # drafts proposed, not verified
    shadow_base: int = 0  # len(output_ids) when they were proposed

    def observe(self, tried: int, accepted: int, prior: Prior) -> None:
        """``tried`` drafts were checked, the first ``accepted`` held (the next did not,
        if ``accepted < tried``). A position's first observation moves its rate from the
        one ``gains`` used, as every later one does: one lucky draft does not make it 1."""
        rates = self._rates(min(tried, accepted + 1), prior)
        for p, rate in enumerate(rates):
            hit = 1.0 if p < accepted else 0.0
            self.rates[p] = (1 - _ACC_WEIGHT) * rate + _ACC_WEIGHT * hit
            was = prior[p]
            prior[p] = (1 - _PRIOR_WEIGHT) * (_PRIOR_ACCEPT if was is None else was) + (
                _PRIOR_WEIGHT * hit
            )

    def gains(self, n: int, prior: Prior) -> list[float]:
        """Expected tokens each of the first ``n`` drafts adds: g[j] = P(drafts 1..j+1 held)."""
        out, g = [], 1.0
        for rate in self._rates(n, prior):
            g *= rate
            out.append(g)
        return out

    def _rates(self, n: int, prior: Prior) -> list[float]:
        """The acceptance rates of the first ``n`` positions: the request's own, else the
        worker's, else the position before's (the first: ``_PRIOR_ACCEPT``)."""
        out, rate = [], _PRIOR_ACCEPT
        for p in range(min(n, len(self.rates))):
            own, worker = self.rates[p], prior[p]
            rate = own if own is not None else worker if worker is not None else rate
            out.append(rate)
        return out

    def check_shadow(self, output_ids: list[int], prior: Prior, final: bool) -> None:
        """Score the shadow drafts against the tokens decoded since they were proposed.
        Resolved once one differs or all matched; ``final``: the request is about to
        verify real drafts, so what matched so far counts and the rest is dropped."""
        if not self.shadow:
            return
        new = output_ids[self.shadow_base : self.shadow_base + len(self.shadow)]
        m = 0
        while m < len(new) and new[m] == self.shadow[m]:
            m += 1
        if m < len(new) or m == len(self.shadow):  # a miss, or every draft matched
            self.observe(len(self.shadow), m, prior)
            self.shadow = []
        elif final:  # all decoded so far matched; the rest unknown
            self.observe(m, m, prior)
            self.shadow = []


def allocate(gains: list[list[float]], b: int, times: StepTimes) -> list[int]:
    """How many drafts each of ``b`` requests verifies (``gains[i]``: its drafts' expected
    tokens, falling): the X with the most expected tokens per second, or all 0."""
    base = times.estimate(b, 0)
    flat = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), key=lambda t: -t[0])
    if base is None or not flat:
        return [0] * len(gains)
    best_x, best_rate, tokens = 0, b / base * _MARGIN, float(b)
    for x, (g, _) in enumerate(flat, start=1):
        tokens += g
        t = times.estimate(b, x)
        if t is not None and t > 0 and tokens / t > best_rate:
            best_x, best_rate = x, tokens / t
    ks = [0] * len(gains)
    for _, i in flat[:best_x]:
        ks[i] += 1
    return ks
