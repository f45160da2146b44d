"""The OpenAI-compatible HTTP gateway: `/v1/completions`, `/v1/chat/completions` (streamed
as server-sent events or whole), `/v1/models`, `/health`, `/metrics`, over the pipeline's
`mc.req.submitted` entry and each request's reply subject. `workers/gateway.py` serves it."""

from mooncake.gateway.app import GatewayOptions, create_app
from mooncake.gateway.backend import Backend, NatsBackend

__all__ = ["Backend", "GatewayOptions", "NatsBackend", "create_app"]
