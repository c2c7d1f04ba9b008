"""How a model's weights are stored: dense or packed, chosen at load.

``plan`` decides (quantization, activation dtype) from the flags and the checkpoint;
``engine.checkpoint.loader`` fills a model accordingly; ``linear`` holds the layer kinds the model calls;
``quant`` the group-quantized representations and where they come from; ``lora`` the
LoRA adapters' low-rank updates beside any of them, and ``lora_spec`` a PEFT directory read
and checked without torch (the frontend's check too).
"""
