"""The process tree under a process, read from /proc (Linux): what a supervisor stops with it."""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a child between fork and exec loads nothing


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM when the thread that started it ends, which is when its
    process dies if that was the main thread or a pool thread (Linux)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, children before their own children."""
    found: list[int] = []
    layer = child_pids(pid)
    while layer:
        found += layer
        layer = [grandchild for child in layer for grandchild in child_pids(child)]
    return found
