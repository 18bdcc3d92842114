"""`Item`: one submitted request on its way through the front, from `RemoteEngine.submit` to
its last output, and `Group`: the items of one client request, which go to one worker.

Synopsis::

    prepared = [GroupedRequest(**fields, group=group) for ...]   # `RemoteEngine.prepare`
    item = Item(rid, request, sender, group=group_of(request))

The engine (`engine.RemoteEngine`) owns the items it has in flight and delivers their
outputs; the forwarding path (`forward.Forwarder`) tries workers for one item at a time and
records on it which worker holds it now (what an abort tells) and whether that worker had
the whole request.
"""

from __future__ import annotations

import dataclasses

import trio

from ..request import GenerateRequest
from ..stream import OutputSender, RequestStream
from .attempt import Together
from .wire import SendTracker
from .worker import Worker

__all__ = ["Group", "GroupedRequest", "Item", "group_of"]


@dataclasses.dataclass(eq=False)
class Item:
    rid: str
    request: GenerateRequest
    sender: OutputSender
    stream: RequestStream | None = None
    scope: trio.CancelScope | None = None  # the forwarding task's
    attempt: trio.CancelScope | None = None  # the current try's
    started: bool = False  # an output has been delivered
    worker: Worker | None = None  # the one holding it now
    ended: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: Trio clock when the item's first token reached the front (its `Done` carries it).
    first_token_at: float | None = None
    #: The items of its client request (a batch, n > 1): one worker for all (`Group`).
    group: Group | None = None
    #: Whether the current try's worker has the whole request (`SendTracker`).
    tracker: SendTracker | None = None


class Group(Together):
    """The items of one client request (a batch, n > 1), as `prepare` received them: they go
    to one worker, as SGLang's gateway sends a batch body to one worker whole, so a poison
    batch reaches one worker, never one per item."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedRequest(GenerateRequest):
    """A request `prepare` saw with the other items of its client request."""

    group: Group = dataclasses.field(repr=False, compare=False)


def group_of(request: GenerateRequest) -> Group:
    return request.group if isinstance(request, GroupedRequest) else Group()
