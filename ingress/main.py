"""Entry point: `sluice ingress`."""

from __future__ import annotations

import uvicorn

from ingress.app import create_app
from ingress.settings import IngressSettings
from queue_schemas.clients import configure_logging


def run(settings: IngressSettings) -> None:
    configure_logging(settings, "ingress")
    app = create_app(settings)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=10
    )
