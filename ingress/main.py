"""Entry point: `sluice ingress`."""

from __future__ import annotations

import uvicorn

from ingress.app import create_app
from ingress.settings import IngressSettings
from plumbing.clients import configure_logging
from queue_schemas.config import ConfigError


def run(settings: IngressSettings) -> None:
    configure_logging(settings, "ingress")
    try:
        app = create_app(settings)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"sluice ingress: bad configuration: {exc}") from None
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=10
    )
