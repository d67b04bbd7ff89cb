"""Entry point: `sluice scaler`."""

from __future__ import annotations

import sys

from plumbing.clients import configure_logging
from plumbing.serving import bind_listener, serve
from queue_schemas.config import ConfigError
from scaler.app import create_app
from scaler.settings import ScalerSettings


def run(settings: ScalerSettings) -> None:
    configure_logging(settings, "scaler")
    sock = bind_listener("scaler", settings.host, settings.port)
    try:
        app = create_app(settings)
    except (ValueError, ConfigError) as exc:
        # A bad pool file is an operator's mistake to fix, not something to restart into.
        print(f"sluice scaler: bad configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    serve(app, sock)
