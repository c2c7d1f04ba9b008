"""Plain English words the load generators build prompts from.

Every one is a token or two of the Qwen2 and SmolLM2 vocabularies, so a prompt of n words
is about n to 2n tokens whatever the model; each benchmark adds a few words of its own.
"""

PLAIN_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while")
