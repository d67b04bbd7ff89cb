"""What waits and runs at a worker: which waiting entry a free slot takes, and entries appended twice."""

from __future__ import annotations

from gpu_workers.slots import Slots
from queue_schemas.messages import Priority
from tests.integration.helpers import make_request


def test_a_batch_entry_waits_while_batch_holds_its_slots() -> None:
    slots = Slots(max_running=4, light_slots=0, batch_slots=1)
    first = make_request("sim", "batch-0000000001").model_copy(update={"priority": Priority.BATCH})
    second = make_request("sim", "batch-0000000002").model_copy(update={"priority": Priority.BATCH})
    chat = make_request("sim", "chat-00000000001")
    for n, request in enumerate((first, second, chat)):
        slots.wait(request, f"{n}-0".encode())
    chat_taken = slots.next(running=0)  # interactive first
    assert chat_taken is not None
    assert chat_taken.request.request_id == chat.request_id
    slots.started(chat_taken.request)
    batch_taken = slots.next(running=1)
    assert batch_taken is not None
    assert batch_taken.request.request_id == first.request_id
    slots.started(batch_taken.request)
    assert slots.next(running=2) is None  # the other batch entry waits for batch's one slot
    slots.ended(chat_taken.request.request_id)
    assert slots.next(running=1) is None  # a free slot, but batch still holds its own
    slots.ended(batch_taken.request.request_id)
    again = slots.next(running=0)
    assert again is not None
    assert again.request.request_id == second.request_id


def test_a_request_run_lately_is_known_and_not_run_twice() -> None:
    slots = Slots(max_running=1, light_slots=0, batch_slots=1)
    request = make_request("sim", "chat-00000000002")
    assert not slots.knows(request.request_id)
    slots.wait(request, b"1-0")
    assert slots.knows(request.request_id)
    taken = slots.next(running=0)
    assert taken is not None
    slots.started(taken.request)
    assert slots.next(running=1) is None  # full
    slots.ended(request.request_id)
    assert slots.finished(request.request_id)
    assert not slots.knows(request.request_id)
