"""A transformers-backed ``EngineClient``: the reference the HTTP tests run against.

Real generation: a Hugging Face model's forward pass with its KV cache, real tokenizer
decode, stop strings, EOS and stop_token_ids, logprobs of the raw distribution. It
implements greedy and temperature sampling with an optional seed; any other sampling
option raises ``EngineUnavailable`` (which the app must answer with a 500), so nothing is
silently ignored. ``max_running`` bounds concurrent requests (beyond it: ``Overloaded``)
and ``step_delay_s`` slows each step, to hold requests in flight while a test acts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from frontend.engine_link.engine_client import (
    EngineClient,
    EngineRequest,
    EngineUnavailable,
    Overloaded,
    WorkerHealth,
    WorkerReport,
)
from transport.worker_load import WorkerLoad
from wire.records import Finish, TextDelta, TokenLogprob

_UNSUPPORTED = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class ReferenceEngineClient(EngineClient):
    def __init__(
        self, tokenizer: Any, model: Any, *, max_running: int = 8, step_delay_s: float = 0.0
    ) -> None:
        self.tokenizer, self.model = tokenizer, model
        eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.max_running, self.step_delay_s = max_running, step_delay_s
        self.running: set[int] = set()
        self.aborted: dict[int, float] = {}  # rid -> time.monotonic() of abort()
        self._lock = asyncio.Lock()

    @staticmethod
    def load(model_dir: Path) -> tuple[Any, Any]:
        """(tokenizer, model) to share between clients: loading takes seconds."""
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return tokenizer, model

    def check_admission(self) -> None:
        if len(self.running) >= self.max_running:
            raise Overloaded(retry_after_s=2.0)

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        defaults = type(req.sampling)()
        for name in _UNSUPPORTED:
            if getattr(req.sampling, name) != getattr(defaults, name):
                raise EngineUnavailable(f"the reference client does not implement {name}")
        self.check_admission()
        self.running.add(req.rid)
        try:
            async for delta in self._run(req):
                yield delta
        finally:
            self.running.discard(req.rid)

    async def _run(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        sp, dp = req.sampling, req.detok
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        past: Any = None
        sent, pending = "", 0  # text already emitted; tokens not yet covered by a delta
        inputs = torch.tensor([req.prompt_ids])
        while True:
            async with self._lock:
                logits, past = await asyncio.to_thread(self._forward, inputs, past)
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            if req.rid in self.aborted:
                return
            token, lp = self._sample(logits, sp.temperature, gen, sp.logprobs)
            ids.append(token)
            lps.extend([lp] if lp is not None else [])
            pending += 1
            inputs = torch.tensor([[token]])
            finish, reason = self._finish(token, len(ids), req)
            text = self.tokenizer.decode(ids, skip_special_tokens=dp.skip_special_tokens)
            stop_at = _find_stop(text, dp.stop)
            if stop_at is not None:
                idx, stop = stop_at
                text = text[: idx + (len(stop) if dp.include_stop_str_in_output else 0)]
                finish, reason = Finish.STOP, stop
            hold = 0 if finish else max((len(s) - 1 for s in dp.stop), default=0)
            emit = text[: max(len(sent), len(text) - hold)]
            if not finish and (emit.endswith("\ufffd") or emit == sent):
                continue  # incomplete character or held-back stop prefix: wait for more
            new_ids = ids[len(ids) - pending :]
            yield TextDelta(
                rid=req.rid,
                text=emit[len(sent) :],
                token_ids=new_ids,
                finish=int(finish),
                stop_reason=reason,
                num_output_tokens=len(ids),
                logprobs=lps[-pending:] if sp.logprobs is not None else None,
            )
            sent, pending = emit, 0
            if finish:
                return

    def _forward(self, inputs: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values  # (vocab,)

    def _sample(
        self, logits: torch.Tensor, temperature: float, gen: torch.Generator | None, n: int | None
    ) -> tuple[int, TokenLogprob | None]:
        if temperature == 0.0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        if n is None:
            return token, None
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, n) if n else None
        pairs = (
            [(self.tokenizer.decode([int(i)]), float(v)) for v, i in zip(top.values, top.indices)]
            if top
            else []
        )
        return token, TokenLogprob(self.tokenizer.decode([token]), float(logp[token]), pairs)

    def _finish(self, token: int, n: int, req: EngineRequest) -> tuple[Finish, str | int | None]:
        sp = req.sampling
        if token in sp.stop_token_ids:
            return Finish.STOP, token
        if token in self.eos_ids and not sp.ignore_eos:
            return Finish.STOP, None
        if n >= sp.max_tokens:
            return Finish.LENGTH, None
        return Finish.NONE, None

    async def abort(self, rid: int) -> None:
        self.aborted.setdefault(rid, time.monotonic())

    def health(self) -> list[WorkerHealth]:
        return [
            WorkerHealth(
                "reference", 0, os.getpid(), True, {"running": len(self.running)}, node="here"
            )
        ]

    def metrics_snapshot(self) -> list[WorkerReport]:
        return [
            WorkerReport(
                "reference", 0, WorkerLoad(running_requests=len(self.running)), node="here"
            )
        ]


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
