"""One channel-layer subscription per group and server process, fanned out to that process's viewers.

Through Channels' own path each viewer of a group gets the group message on its own channel: one
deserialisation, one queue and several task wake-ups (``await_many_dispatch`` waits on a fresh task
per message) per viewer per message. With hundreds of viewers of one task that is the larger part of
the server's cost of an event (docs/notebook/events.md). Here the group is joined once per
event loop through the ordinary channel-layer API (``new_channel``, ``group_add``, ``receive``),
each message is read once and handed to every member's ``offer(message)``, a plain call that must
not block: members queue the message for their own task and so keep their own pace.

Messages are shared between members: they must not be modified.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from channels.layers import get_channel_layer


class Member(Protocol):
    def offer(self, message: dict) -> None: ...


class _Subscription:
    def __init__(self, layer, group: str, on_message=None) -> None:
        self.layer, self.group, self.on_message = layer, group, on_message
        self.members: dict[Member, None] = {}  # a dict keeps the order members joined in
        self.channel: str | None = None
        self.opened = asyncio.ensure_future(self._open())
        self.reader: asyncio.Task | None = None

    async def _open(self) -> None:
        self.channel = await self.layer.new_channel()
        await self.layer.group_add(self.group, self.channel)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            message = await self.layer.receive(self.channel)
            if self.on_message is not None:
                self.on_message(message)
            for member in tuple(self.members):
                member.offer(message)

    async def close(self) -> None:
        self.opened.cancel()
        if self.reader is not None:
            self.reader.cancel()
        if self.channel is not None:
            await self.layer.group_discard(self.group, self.channel)


class GroupFanout:
    """Process-local members of the groups of one channel layer (``alias``)."""

    def __init__(self, alias: str, on_message=None) -> None:
        """``on_message(message)`` sees each group message once per process (e.g. for metrics)."""
        self.alias, self.on_message = alias, on_message
        self._subscriptions: dict[tuple[asyncio.AbstractEventLoop, str], _Subscription] = {}

    async def join(self, group: str, member: Member) -> None:
        """Return once the group's messages reach ``member`` (so a caller may then read what it
        missed before, without a gap)."""
        key = (asyncio.get_running_loop(), group)
        subscription = self._subscriptions.get(key)
        if subscription is None:
            subscription = self._subscriptions[key] = _Subscription(get_channel_layer(self.alias), group,
                                                                         self.on_message)
        subscription.members[member] = None
        try:
            # Shielded: a joiner that goes away must not cancel the subscription others wait for.
            await asyncio.shield(subscription.opened)
        except BaseException:
            await self.leave(group, member)
            raise

    async def leave(self, group: str, member: Member) -> None:
        key = (asyncio.get_running_loop(), group)
        subscription = self._subscriptions.get(key)
        if subscription is None or member not in subscription.members:
            return
        del subscription.members[member]
        if not subscription.members:
            del self._subscriptions[key]
            await subscription.close()
