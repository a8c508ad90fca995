"""A feed's far end as a Ray actor (cluster/transport/token_feed.py `FeedEndpoint`): its
ticket comes from the actor's `subscribe` method, and whether it lives from a `describe`
call, over Ray."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from hybridserve.cluster.transport.token_feed import ActorDied

LIVENESS_TIMEOUT_S = 10.0  # asking an actor over Ray whether it lives, after its feed broke


class ActorEndpoint:
    def __init__(self, handle: Any) -> None:
        """`handle`: an engine or router actor's handle (both have `subscribe`, `describe`)."""
        self.handle = handle

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        try:
            return await self.handle.subscribe.remote(subscriber)
        except Exception as exc:
            if _actor_died(exc):
                raise ActorDied(repr(exc)) from exc
            raise

    async def alive(self) -> bool:
        try:
            await asyncio.wait_for(self.handle.describe.remote(), LIVENESS_TIMEOUT_S)
        except Exception as exc:
            return not _actor_died(exc)
        return True


def _actor_died(exc: BaseException) -> bool:
    """Whether a Ray call's error says its actor is dead, not just unreachable for now."""
    return isinstance(exc, RayActorError) and not isinstance(exc, ActorUnavailableError)
