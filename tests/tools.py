"""Command-line tools the tests run, installed by the Makefile."""

from __future__ import annotations

import shutil
from pathlib import Path

PROMTOOL = Path(__file__).resolve().parent.parent / ".sluice" / "tools" / "usr" / "bin" / "promtool"


def promtool() -> str:
    """Prometheus's promtool: the one `make promtool` unpacked, else one on the PATH."""
    if PROMTOOL.exists():
        return str(PROMTOOL)
    found = shutil.which("promtool")
    if found is None:
        raise FileNotFoundError("promtool is not installed: `make promtool` unpacks it into .sluice/tools")
    return found
