"""vLLM's and SGLang's native endpoints: ``generate`` (POST /generate), ``tokenize``
(/tokenize, /detokenize, /version) and the LoRA adapter endpoints (``lora``, over the
registry in ``common.lora_registry``)."""
