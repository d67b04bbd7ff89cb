"""A team's uploads in progress in one ingress are bounded, and their checks run on threads of their own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ingress.upload_slots import UploadSlots
from openai_api.errors import RateLimited


def test_a_team_past_its_uploads_is_refused_and_others_are_not() -> None:
    slots = UploadSlots(per_team=2, threads=1)
    with slots.slot("mallory"), slots.slot("mallory"):
        with pytest.raises(RateLimited) as refused, slots.slot("mallory"):
            pass
        assert refused.value.status == 429
        with slots.slot("acme"):
            pass
    with slots.slot("mallory"), slots.slot("mallory"):  # places come back when uploads end
        pass


def test_checks_run_on_the_upload_threads() -> None:
    slots = UploadSlots(threads=1)

    async def run() -> str:
        return await slots.run(lambda: threading.current_thread().name)

    try:
        assert asyncio.run(run()).startswith("upload-scan")
    finally:
        slots.close()
