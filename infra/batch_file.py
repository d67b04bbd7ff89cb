"""OpenAI batch files for `sluice batch`: input lines to submissions, answers to output lines, and the state
that lets an interrupted run resume. Pure, apart from reading and writing the files named.

A run's state (`<output>.state.json`) holds the batch id (a digest of the input), the reply topic, and how
many input lines were submitted; the output file holds one line per answered custom_id. Resuming submits
only the lines after that count and skips answers already written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from queue_schemas.batch import ENDPOINTS, BatchAnswer, BatchSubmission
from queue_schemas.config import SluiceConfig


@dataclass(frozen=True, slots=True)
class Line:
    """One input line: where it goes and what to send, or why it cannot be sent."""

    number: int
    custom_id: str
    pool: str | None = None
    submission: BatchSubmission | None = None
    problem: str | None = None


@dataclass
class RunState:
    batch_id: str
    input: str
    reply_topic: str
    team: str
    total: int
    submitted: int = 0  # input lines [0, submitted) were sent (or answered locally)


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    answered: set[str] = field(default_factory=set)  # custom ids with a line in the output


def batch_id_of(data: bytes) -> str:
    return "batch_" + hashlib.sha256(data).hexdigest()[:16]


def request_id_for(batch_id: str, number: int) -> str:
    return f"{batch_id}-{number}"


def read_lines(
    data: bytes, batch_id: str, team: str, reply_topic: str, config: SluiceConfig, window_s: float | None
) -> list[Line]:
    """Every input line, checked as far as the client can: JSON, custom_id (unique), method, url, model."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, text in enumerate(data.decode(errors="replace").splitlines()):
        if not text.strip():
            continue
        lines.append(_read_line(text, number, batch_id, team, reply_topic, config, window_s, seen))
    return lines


def _read_line(
    text: str,
    number: int,
    batch_id: str,
    team: str,
    reply_topic: str,
    config: SluiceConfig,
    window_s: float | None,
    seen: set[str],
) -> Line:
    fallback = f"line-{number + 1}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(number, fallback, problem=f"line {number + 1} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return Line(number, fallback, problem=f"line {number + 1} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, fallback, problem=f"line {number + 1} has no custom_id")
    if custom_id in seen:
        return Line(number, custom_id, problem=f"custom_id {custom_id!r} appears more than once")
    seen.add(custom_id)
    if obj.get("method", "POST") != "POST":
        return Line(number, custom_id, problem="method must be POST")
    if obj.get("url") not in ENDPOINTS:
        return Line(number, custom_id, problem=f"url must be one of {', '.join(ENDPOINTS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return Line(number, custom_id, problem="body must be a JSON object")
    pool = config.pool_for_model(str(body.get("model")))
    if pool is None:
        return Line(number, custom_id, problem=f"no pool serves the model {body.get('model')!r}")
    submission = BatchSubmission(
        request_id=request_id_for(batch_id, number), custom_id=custom_id, team=team, reply_topic=reply_topic,
        url=obj["url"], body=body, completion_window_s=window_s,
    )  # fmt: skip
    return Line(number, custom_id, pool.name, submission)


def local_error_line(batch_id: str, line: Line) -> dict[str, Any]:
    """The output line for an input line that could not be submitted."""
    request_id = request_id_for(batch_id, line.number)
    error = {"code": "invalid_line", "message": line.problem or ""}
    return {"id": f"batch_req_{request_id}", "custom_id": line.custom_id, "response": None, "error": error}


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.json")


def load_state(output: Path) -> RunState | None:
    path = state_path(output)
    if not path.exists():
        return None
    return RunState(**json.loads(path.read_text()))


def save_state(output: Path, state: RunState) -> None:
    path = state_path(output)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def load_tally(output: Path) -> Tally:
    """What the output file already holds (a last line cut by a crash is dropped)."""
    tally = Tally()
    if not output.exists():
        return tally
    good: list[str] = []
    for text in output.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        good.append(text)
        count(tally, line)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(t + "\n" for t in good))
    os.replace(tmp, output)  # a crash leaves the old file or the new one, never half of one
    return tally


def count(tally: Tally, line: dict[str, Any]) -> None:
    tally.answered.add(str(line["custom_id"]))
    response = line.get("response")
    if response is not None and response.get("status_code") == 200:
        tally.completed += 1
    else:
        tally.failed += 1


def accept(tally: Tally, answer: BatchAnswer, batch_id: str) -> dict[str, Any] | None:
    """The output line for an answer of this batch not yet written, else None."""
    rid = answer.request_id
    if rid is None or not rid.startswith(batch_id + "-") or answer.custom_id in tally.answered:
        return None
    line = answer.output_line()
    count(tally, line)
    return line
