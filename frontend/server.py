"""The frontend process: ``python -m frontend.server`` (started by the launcher).

Builds the tokenizer, the ring engine client and the FastAPI app, then serves HTTP with
uvicorn on the configured host and port.
"""

from __future__ import annotations

import logging

import uvicorn
from transformers import AutoTokenizer

from frontend.app import build_app
from frontend.client_rings import RingEngineClient
from frontend.settings import FrontendSettings
from pdserve.process import bootstrap
from router.policy import RouterConfig

logger = logging.getLogger(__name__)


def main() -> None:
    spec, _ = bootstrap()
    s = spec.settings
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    settings = FrontendSettings(
        model_name=s["served_model_name"],
        max_model_len=s["max_model_len"],
        vocab_size=s["vocab_size"],
        api_key=s.get("api_key"),
        chat_template=s.get("chat_template"),
        host=s["host"],
        port=s["port"],
    )
    router_config = RouterConfig(
        max_waiting_requests=s["max_waiting_requests"],
        max_queued_prefill_tokens=s["max_queued_prefill_tokens"],
    )
    client = RingEngineClient(spec, s["router_policy"], router_config)
    app = build_app(client, tokenizer, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=s.get("log_level", "info").lower(),
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
