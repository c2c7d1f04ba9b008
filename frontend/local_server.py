"""``python -m frontend.local_server``: the HTTP API over one in-process engine.

No prefill/decode split, no worker processes: ``LocalEngineClient`` runs the engine and
the detokenizer in this process. It is the co-located baseline that disaggregated serving
(``launch``) is benchmarked against, and a quick way to try the API on a laptop.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn
from transformers import AutoTokenizer

from engine.config import EngineConfig, ModelConfig
from frontend.app import build_app
from frontend.local_client import LocalEngineClient
from frontend.settings import FrontendSettings
from pdserve.default_model import resolve_model

API_KEY_ENV = "PDSERVE_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m frontend.local_server", description=__doc__)
    a = p.add_argument
    a("--model", default=None, help="checkpoint directory or .gguf (default: the embedded model)")
    a("--served-model-name", default=None)
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--device", default="cpu", choices=("cpu", "cuda"))
    a("--dtype", default="auto")
    a("--max-model-len", type=int, default=None)
    a("--kv-cache-tokens", type=int, default=65536)
    a("--max-num-seqs", type=int, default=256)
    a("--api-key", default=os.environ.get(API_KEY_ENV), help=f"or set {API_KEY_ENV}")
    a("--chat-template", default=None, help="Jinja template file or text")
    a("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    model = resolve_model(Path(args.model) if args.model else None)
    config = EngineConfig(model=str(model), dtype=args.dtype, device=args.device,
                          kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs)  # fmt: skip
    model_config = ModelConfig.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = FrontendSettings(
        model_name=args.served_model_name or model.name,
        max_model_len=config.resolve_max_model_len(model_config),
        vocab_size=model_config.vocab_size,
        api_key=args.api_key,
        chat_template=args.chat_template,
        host=args.host,
        port=args.port,
    )
    client = LocalEngineClient(config, tokenizer)
    app = build_app(client, tokenizer, settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
