"""Tokenizers: the Hugging Face one (without torch where that is exact) and the one a GGUF
file carries (``gguf_tokenizer``)."""
