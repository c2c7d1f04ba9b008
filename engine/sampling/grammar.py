"""Grammar-constrained decoding: compiled grammars, per-sequence matchers, token masks.

Backed by xgrammar (the grammar engine vLLM and SGLang use; its CPU path needs nothing
but the wheel). A ``GrammarSpec`` (wire/params.py) is plain data; each process compiles
it against its tokenizer and keeps the result by ``spec.key``.

Who calls what, when:
- one ``GrammarCache`` per process (``ModelRunner.grammars``; the frontend has its own to
  validate requests). Nothing is loaded until the first grammar arrives.
- ``prepare(spec)`` as a constrained request arrives: compilation starts on the cache's
  thread. xgrammar releases the GIL while it compiles, so the worker's steps go on.
- ``ready(spec)``: is it compiled? Raises ``GrammarError`` if compilation failed.
  Schedulers do not sample a constrained request before it is ready.
- ``state(spec, output_ids)``: a fresh matcher that has accepted ``output_ids`` (a request
  resumed after a worker death, or handed from prefill to decode). Waits if the compile
  is still running.
- per step (engine/sampling/grammar_mask.py): ``fill_bitmask`` writes each row's allowed-token bitmask (``GrammarState.fill``,
  the rows of a batch on several threads), then
  ``apply_bitmask`` puts -inf on the rest; ``GrammarState.accept`` advances the matcher by
  the sampled token (``Sequence.append_token`` calls it).
- ``compile_now(spec)``: compile synchronously (the frontend validates off its loop).
  A grammar whose language is empty is a ``GrammarError`` (engine/sampling/grammar_check.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.sampling.grammar_check import emptiness
from engine.sampling.grammar_vocab import tokenizer_info
from engine.sampling.json_bounds import whole_integer_bounds
from wire.params import GrammarKind, GrammarSpec

if TYPE_CHECKING:  # not at import: xgrammar brings torch with it, when a grammar first needs it
    import torch

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


class GrammarError(EngineError, ValueError):
    """A grammar spec that does not compile; the message says what is wrong with it."""


def choice_ebnf(choices: Sequence[str]) -> str:
    """The grammar whose language is exactly ``choices``."""
    # JSON string literals are valid EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(e: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line) for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__


# JSON schemas compile strict, in compact whitespace: an unconstrained model may
# otherwise pad JSON forever. (The same for the compile and for the recursion check.)
_ANY_WHITESPACE, _STRICT = False, True


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled by an ``xgrammar.GrammarCompiler``; ``GrammarError`` if it cannot."""
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return compiler.compile_json_schema(
                whole_integer_bounds(spec.text), any_whitespace=_ANY_WHITESPACE, strict_mode=_STRICT
            )
        if spec.kind is GrammarKind.JSON_OBJECT:
            return compiler.compile_builtin_json_grammar()
        if spec.kind is GrammarKind.REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind is GrammarKind.CHOICE:
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.text)))
        return compiler.compile_grammar(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"invalid {spec.kind.value}: {_clean(e)}") from e


def source_grammar(spec: GrammarSpec) -> Any:
    """``spec`` as an ``xgrammar.Grammar`` before compiling (its rules, no automata), for
    the recursion check; None for the kinds whose rules always end (JSON, choices)."""
    import xgrammar as xgr

    if spec.kind is GrammarKind.JSON_SCHEMA:
        return xgr.Grammar.from_json_schema(
            whole_integer_bounds(spec.text), any_whitespace=_ANY_WHITESPACE, strict_mode=_STRICT
        )
    if spec.kind is GrammarKind.REGEX:
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind is GrammarKind.EBNF:
        return xgr.Grammar.from_ebnf(spec.text)
    return None


class GrammarState:
    """One sequence's position in its grammar (an xgrammar ``GrammarMatcher``)."""

    def __init__(self, compiled: Any, output_ids: Sequence[int], rid: int) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.rid = rid
        self.failed = False
        for token in output_ids:
            if not self.accept(token):
                break

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and ``failed``) if the grammar forbids it."""
        if self.failed or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token):
            # NOTE: only a mask that allowed nothing (the sampler then picks any token)
            # or a replayed output that disagrees gets here. The request ends with an
            # error where its token is emitted (runtime/step_output.py), never unconstrained.
            logger.warning("rid %d: token %d is outside the grammar", self.rid, token)
            self.failed = True
            return False
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed next tokens into ``bitmask[row]``.

        A failed or complete grammar leaves the row as it is (the request ends at
        once: the row is not sampled under a grammar again).
        """
        if self.failed or self._matcher.is_terminated():
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows from here; state unchanged."""
        if self.failed:
            return 0
        n = 0
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def fill_along(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Fill ``bitmask[first_row + j]`` as the matcher stands after ``drafts[:j]``, for j
        in 0..len(drafts) (speculative verification); state unchanged. Every draft must be
        allowed (``valid_prefix``)."""
        self.fill(bitmask, first_row)
        for j, token in enumerate(drafts, 1):
            ok = self._matcher.accept_token(token)
            assert ok, f"rid {self.rid}: draft {token} is outside the grammar"
            self.fill(bitmask, first_row + j)
        if drafts:
            self._matcher.rollback(len(drafts))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class GrammarCache:
    """This process's compiled grammars by spec key, compiled on one background thread.

    ``load_tokenizer`` returns the Hugging Face tokenizer; it is called at most once, on
    the thread, when the first grammar arrives and the vocabulary is not cached on disk
    for ``model_dir`` (engine/sampling/grammar_vocab.py). ``vocab_size`` is the logits' width (the
    padded embedding size); ``stop_token_ids`` end a grammar that is complete.
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        model_dir: str | None = None,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self._model_dir = model_dir
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids) if stop_token_ids else None
        self._max_cached = max_cached
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._entries: OrderedDict[str, Future[Any]] = OrderedDict()  # LRU first
        self.compiled = 0  # compilations run (cache misses), for tests and logs

    def prepare(self, spec: GrammarSpec) -> Future[Any]:
        """Start compiling ``spec`` unless it is cached or under way; its future."""
        fut = self._entries.get(spec.key)
        if fut is not None:
            self._entries.move_to_end(spec.key)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        fut = self._pool.submit(self.compile_now, spec)
        self._entries[spec.key] = fut
        while len(self._entries) > self._max_cached:
            self._entries.popitem(last=False)  # matchers keep what they use alive
        return fut

    def warm(self) -> None:
        """Import the grammar library now, on the cache's thread.

        xgrammar imports torch: seconds of CPU, in stretches that hold the GIL. A process
        that serves HTTP calls this once it is up, so its first constrained request does
        not pay that in the middle of traffic.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pool.submit(importlib.import_module, "xgrammar")

    def ready(self, spec: GrammarSpec) -> bool:
        """Compiled (True) or still compiling (False); ``GrammarError`` if it failed."""
        fut = self.prepare(spec)
        if not fut.done():
            return False
        fut.result()  # raises the compile error, if any
        return True

    def state(self, spec: GrammarSpec, output_ids: Sequence[int], rid: int) -> GrammarState:
        """A matcher for a sequence that has produced ``output_ids`` (waits for compile)."""
        return GrammarState(self.prepare(spec).result(), output_ids, rid)

    def compile_now(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` in the calling thread (no caching); ``GrammarError`` if bad."""
        self.compiled += 1
        try:
            compiled = compile_spec(self._get_compiler(), spec)
            why = emptiness(source_grammar(spec), compiled, self.vocab_size)
        except GrammarError:
            raise
        except Exception as e:  # the library's own failure: the request fails, not the worker
            logger.exception("the grammar engine failed on a %s", spec.kind.value)
            raise GrammarError(f"the grammar engine failed: {_clean(e)}") from e
        if why is not None:  # sampling under it would have no token to pick
            what = "schema" if spec.kind is GrammarKind.JSON_SCHEMA else spec.kind.value
            raise GrammarError(f"{what} admits no output: {why}")
        return compiled

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(
                    self._load_tokenizer, self.vocab_size, self._stop_ids, self._model_dir
                )
                # xgrammar's own cache is off: ours bounds memory and is keyed the same
                # way in every process.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler
