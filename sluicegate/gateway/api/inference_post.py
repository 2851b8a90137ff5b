"""``inference_post``: Litestar's ``@post`` for the inference endpoints, whose guards get the
route handler itself.

Litestar hands every guard a ``copy`` of the route handler, so that a guard cannot change it.
The inference guard (``sluicegate.gateway.services.authenticate``) never looks at the handler, and copying
a handler (41 slots, through ``copy``'s generic reduce protocol) costs about 18 µs on every
request: a tenth of what the whole gateway adds to an instant upstream.
"""

from __future__ import annotations

from litestar import post
from litestar.connection import ASGIConnection


class inference_post(post):
    async def authorize_connection(self, connection: ASGIConnection) -> None:
        for guard in self.resolve_guards():
            await guard(connection, self)  # type: ignore[misc]
