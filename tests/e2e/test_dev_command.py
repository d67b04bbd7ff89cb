"""`sluice dev` as a user runs it: it prints a working curl, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but its exit status.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (the stack's children all carry its Redis URL)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_dev_prints_a_working_curl_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    workdir = tmp_path / "dev"
    stderr_path = tmp_path / "dev.stderr"
    with stderr_path.open("w") as stderr, subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "dev", "--port", "0", "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    ) as proc:  # fmt: skip
        pids, redis_url = run_then_interrupt(proc, workdir, stderr_path)
        code = proc.wait(timeout=60)
    assert code == 0, stderr_path.read_text()
    survivors = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert survivors == {}
    assert processes_with_env("SLUICE_REDIS_URL", redis_url) == [], "a worker started by the scaler survived"


def run_then_interrupt(
    proc: subprocess.Popen[str], workdir: Path, stderr_path: Path
) -> tuple[dict[str, int], str]:
    """Wait for the stack, run the printed curl, then press Ctrl-C; return the stack's pids and Redis URL."""
    try:
        deadline = time.monotonic() + 90
        while not (workdir / "pids").exists():
            assert proc.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "dev stack did not come up"
            time.sleep(0.2)
        pids = {line.split()[0]: int(line.split()[1]) for line in (workdir / "pids").read_text().splitlines()}
        assert {"broker", "redis", "ingress", "dispatcher-sim", "scaler"} <= set(pids)
        env = dict(line.split("=", 1) for line in (workdir / "dev.env").read_text().splitlines())
        assert env["SLUICE_API_KEY"].startswith("sk-sluice-")
        # ingress, the dispatcher, the scaler and the worker it started
        assert len(processes_with_env("SLUICE_REDIS_URL", env["SLUICE_REDIS_URL"])) == 4

        assert proc.stdout is not None
        curl_line = next(line for line in iter(proc.stdout.readline, "") if line.startswith("curl "))
        out = subprocess.run(
            shlex.split(curl_line), capture_output=True, text=True, timeout=30, check=True
        ).stdout
        events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
        assert len(events) > 3
        assert events[-1] == "[DONE]"
        assert '"role":"assistant"' in events[0]
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, also when an assertion above failed
    return pids, env["SLUICE_REDIS_URL"]
