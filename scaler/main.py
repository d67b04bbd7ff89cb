"""Entry point: `sluice scaler`."""

from __future__ import annotations

import uvicorn

from queue_schemas.clients import configure_logging
from scaler.app import create_app
from scaler.settings import ScalerSettings


def run(settings: ScalerSettings) -> None:
    configure_logging(settings, "scaler")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
