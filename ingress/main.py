"""Entry point: `sluice ingress`."""

from __future__ import annotations

from ingress.app import create_app
from ingress.settings import IngressSettings
from plumbing.clients import configure_logging
from plumbing.serving import bind_listener, serve
from queue_schemas.config import ConfigError


def run(settings: IngressSettings) -> None:
    configure_logging(settings, "ingress")
    sock = bind_listener("ingress", settings.host, settings.port)
    try:
        app = create_app(settings)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"sluice ingress: bad configuration: {exc}") from None
    serve(app, sock, timeout_graceful_shutdown=10)
