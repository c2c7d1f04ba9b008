"""Choosing the next token.

sampler.py        penalties, temperature, top-k/p, min-p, seeded draws, logprobs
grammar.py        GrammarCache (compile on a thread, cache by spec), GrammarState
                  (a sequence's matcher); torch comes only with xgrammar, on first use
grammar_mask.py   the token bitmask per step (fill, apply to the logits)
grammar_vocab.py  the vocabulary as xgrammar sees it, cached on disk per model
"""
