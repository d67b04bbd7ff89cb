"""`sluice batch submit` refuses what it must not touch, before it connects to anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from queue_schemas.signing import new_signing_key

LINE = (
    '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sluice-sim"}}\n'
)


def submit(tmp_path: Path, *args: str, key: bool = True) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "requests.jsonl"
    source.write_text(LINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    if key:
        pem = tmp_path / "team.pem"
        pem.write_text(new_signing_key()[0])
        env["SLUICE_SIGNING_KEY_FILE"] = str(pem)
    # An address nothing listens on: a refusal must come before any connection is tried.
    env["SLUICE_KAFKA_BOOTSTRAP"] = "127.0.0.1:9"
    argv = [sys.executable, "-m", "infra.cli", "batch", "submit", str(source), "--team", "acme", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_an_output_file_that_is_not_a_batch_output_is_left_alone(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not JSON\n")
    run = submit(tmp_path, "--output", str(notes))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "is not the output of a sluice batch run" in run.stderr
    assert notes.read_text() == "my notes, not JSON\n"


def test_a_batch_without_a_signing_key_is_refused(tmp_path: Path) -> None:
    run = submit(tmp_path, key=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "signing key is required" in run.stderr
