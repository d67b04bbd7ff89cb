"""The one input boundary: what an untrusted body may hold so that every service can carry it.

Every body from outside (an HTTP JSON body, a Kafka batch record, a line of an uploaded file, a Responses
input) passes `load_untrusted` or `check_untrusted` before any model sees it. They refuse, naming the
field, what a later step could not encode or store: lone surrogates (valid JSON escapes that UTF-8 cannot
carry), non-finite numbers, nesting past `max_depth`, integers outside int64, and strings past
`max_string_chars`. A value that passed encodes as JSON, as UTF-8, and through the pydantic models.

Pure: no I/O. The walk is iterative, so a hostile depth costs no recursion.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_DEPTH = 32  # objects and arrays inside each other; JSON schemas for structured output need ~10
MAX_STRING_CHARS = 4 * 1024 * 1024
PATH_PART_CHARS = 64  # a key named in a refusal is cut to this
PATH_CHARS = 512  # and the whole path to this, so a refusal stays small whatever the body held


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_depth: int = MAX_DEPTH
    max_string_chars: int = MAX_STRING_CHARS


DEFAULT_LIMITS = InputLimits()


class InputRefused(ValueError):
    """A body the services cannot carry: `message` says why (never echoing the value), `param` where."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most] + "..."


def _where(path: tuple[str | int, ...]) -> str | None:
    """The field's path as `a.b.0.c`, each part and the whole bounded."""
    return _cut(".".join(_cut(str(p), PATH_PART_CHARS) for p in path), PATH_CHARS) or None


def _refuse(what: str, path: tuple[str | int, ...]) -> InputRefused:
    where = _where(path)
    return InputRefused(f"{where or 'The body'}: {what}." if where else f"The body {what}.", where)


def _string_problem(text: str, limits: InputLimits) -> str | None:
    if len(text) > limits.max_string_chars:
        return f"is a string longer than {limits.max_string_chars} characters"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "holds a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry"
    return None


def _scalar_problem(value: object, limits: InputLimits) -> str | None:
    kind = type(value)
    if kind is str:
        return _string_problem(value, limits)  # type: ignore[arg-type]
    if kind is int:
        if not INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
            return "is an integer outside the 64-bit range"
        return None
    if kind is float:
        return None if math.isfinite(value) else "is not a finite number"  # type: ignore[arg-type]
    if kind is bool or value is None:
        return None
    return f"holds a value of type {kind.__name__}, which JSON does not have"


def check_untrusted(value: Any, limits: InputLimits = DEFAULT_LIMITS) -> None:
    """Raise InputRefused for the first thing in `value` (parsed JSON) the services cannot carry."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        kind = type(node)
        if kind is dict:
            if len(path) >= limits.max_depth:
                raise _refuse(f"nests deeper than {limits.max_depth} levels", path)
            for key, child in node.items():
                problem = _string_problem(key, limits) if type(key) is str else "has a non-string key"
                if problem is not None:
                    raise _refuse(f"has a key that {problem.removeprefix('is ')}", path)
                if type(child) in (dict, list):
                    stack.append((child, (*path, key)))
                else:
                    problem = _scalar_problem(child, limits)
                    if problem is not None:
                        raise _refuse(problem, (*path, key))
        elif kind is list:
            if len(path) >= limits.max_depth:
                raise _refuse(f"nests deeper than {limits.max_depth} levels", path)
            for index, child in enumerate(node):
                if type(child) in (dict, list):
                    stack.append((child, (*path, index)))
                else:
                    problem = _scalar_problem(child, limits)
                    if problem is not None:
                        raise _refuse(problem, (*path, index))
        else:
            problem = _scalar_problem(node, limits)
            if problem is not None:
                raise _refuse(problem, path)


def _no_constant(name: str) -> None:
    raise InputRefused(f"The body holds {name}, which is not a finite number.")


def load_untrusted(data: bytes | str, limits: InputLimits = DEFAULT_LIMITS) -> Any:
    """Parse untrusted JSON and check it: the value, or InputRefused saying what is wrong and where."""
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except InputRefused:
        raise
    except RecursionError:
        raise InputRefused(f"The body nests deeper than {limits.max_depth} levels.") from None
    except ValueError as exc:  # bad UTF-8, bad JSON, or an integer too long to convert
        raise InputRefused(f"The body is not valid JSON: {_short(exc)}") from None
    check_untrusted(value, limits)
    return value


def _short(exc: ValueError) -> str:
    """The parser's reason without any of the input it quotes."""
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."
