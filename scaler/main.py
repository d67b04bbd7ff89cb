"""Entry point: `sluice scaler`."""

from __future__ import annotations

import sys

import uvicorn

from plumbing.clients import configure_logging
from queue_schemas.config import ConfigError
from scaler.app import create_app
from scaler.settings import ScalerSettings


def run(settings: ScalerSettings) -> None:
    configure_logging(settings, "scaler")
    try:
        app = create_app(settings)
    except (ValueError, ConfigError) as exc:
        # A bad pool file is an operator's mistake to fix, not something to restart into.
        print(f"sluice scaler: bad configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
