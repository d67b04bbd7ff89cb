"""Moving a started request off a lost worker. Pure decisions, no I/O.

The replay log (plumbing.replay) says what the client has been sent. The request goes to another
worker with its prompt followed by those output tokens, max_tokens reduced by them and the same sampling
settings; that worker's chunks continue the sequence numbers, so the client sees one stream. A greedy
request continues exactly as an uninterrupted run would; a sampled one continues validly, but a seed
cannot replay the rest of the random stream on another engine.

Some requests cannot go on exactly from a prompt, and end with worker_lost instead:
- structured output (JSON mode, a schema, a forced tool call): the engine's grammar would start again
  at the beginning of the continuation;
- presence or frequency penalties: engines apply them to output tokens only, and the delivered tokens
  would count as prompt;
- stop sequences: the engine holds back text that may begin a stop sequence, so the delivered text can
  trail the delivered tokens, and a stop that spans the move would be missed;
- requests that already moved `limit` times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, Resume, StreamEvent
from queue_schemas.prefix import block_hashes


@dataclass(frozen=True, slots=True)
class Progress:
    """What a request's log shows was sent: its output tokens and text, and the next sequence number."""

    next_seq: int
    token_ids: tuple[int, ...]
    text: str
    ended: bool  # a final or error chunk went out: nothing is left to move


def progress_of(events: Sequence[StreamEvent]) -> Progress:
    """Progress from a log's chunks, in order from seq 0 (plumbing.replay.in_order)."""
    tokens: list[int] = []
    parts: list[str] = []
    ended = False
    for event in events:
        if isinstance(event, ErrorChunk):
            ended = True
            break
        tokens.extend(event.token_ids)
        parts.append(event.text)
        if isinstance(event, FinalChunk):
            ended = True
            break
    return Progress(len(events), tuple(tokens), "".join(parts), ended)


def refusal(request: InferenceRequest, done: Progress, limit: int) -> str | None:
    """Why the request cannot move and go on exactly, or None if it can."""
    sampling = request.sampling
    moved = 0 if request.resume is None else request.resume.migrations
    if moved >= limit:
        return f"the request already moved {moved} times (the pool's limit)"
    if sampling.structured is not None:
        return "structured output cannot resume in the middle of an answer"
    if sampling.presence_penalty or sampling.frequency_penalty:
        return "penalties apply to output tokens only, so they cannot resume exactly"
    if sampling.stop:
        return "stop sequences cannot resume exactly across a move"
    client_max = sampling.max_tokens if request.resume is None else request.resume.max_tokens
    if len(done.token_ids) >= client_max:
        return "the request had no tokens left to generate"
    if done.text and not done.token_ids:
        return "the log holds text without its tokens"
    return None


def continuation(request: InferenceRequest, done: Progress, block_size: int) -> InferenceRequest:
    """The request as another worker runs it: the client's prompt, then every token already sent.

    `done` must show at least one output token, and `refusal` must have found nothing in the way.
    """
    assert done.token_ids, "a request with no output restarts; it does not need a continuation"
    previous = request.resume
    client_prompt = request.prompt_token_ids[: request.client_prompt_tokens]
    client_max = request.sampling.max_tokens if previous is None else previous.max_tokens
    prompt = client_prompt + done.token_ids
    resume = Resume(
        prompt_tokens=len(client_prompt),
        delivered_tokens=len(done.token_ids),
        next_seq=done.next_seq,
        text=done.text,
        migrations=(0 if previous is None else previous.migrations) + 1,
        max_tokens=client_max,
    )
    sampling = request.sampling.model_copy(update={"max_tokens": client_max - len(done.token_ids)})
    hashes = tuple(block_hashes(prompt, block_size, salt=request.cache_salt))
    fields = request.model_dump()
    # It started long ago: only its deadline applies now, not the start-by time of a queued request.
    fields.update(
        prompt_token_ids=prompt, sampling=sampling, resume=resume, block_hashes=hashes, start_by=None
    )
    return InferenceRequest.model_validate(fields)


@dataclass(frozen=True, slots=True)
class Move:
    """What becomes of a request taken over from a lost worker, given its replay log."""

    outcome: Literal["ended", "restarted", "moved", "refused"]
    request: InferenceRequest  # what to place (the request itself, or its continuation)
    logged: int  # chunks the log holds in order: the seq the request goes on from
    reason: str = ""  # why it cannot move (refused)
    used_tokens: int = 0  # what the client was sent, charged to a refused request


def decide_move(lost: InferenceRequest, log: Sequence[StreamEvent], limit: int, block_size: int) -> Move:
    """Ended (its last chunk was out), restarted whole (nothing was delivered), moved as its
    continuation, or refused (it cannot go on exactly; the client gets worker_lost after what it has)."""
    done = progress_of(log)
    if done.ended:
        return Move("ended", lost, done.next_seq)
    if done.next_seq == 0:
        return Move("restarted", lost, 0)
    why = refusal(lost, done, limit) if done.token_ids else "the log holds no tokens"
    if why is not None:
        used = lost.client_prompt_tokens + len(done.token_ids)
        return Move("refused", lost, done.next_seq, why, used)
    return Move("moved", continuation(lost, done, block_size), done.next_seq)
