"""The front door's ASGI application: each request handed to its endpoint by method and
path, as a Starlette Request, and the endpoint's Response sent.

Not Starlette's application and router: their stack (two middlewares, the router, and an
exception handler wrapped around every `send`) took about a fifth of the front door's
CPU per request, and every endpoint already answers its own errors (`Api.endpoint`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import Receive, Scope, Send

from modelpool.supervisor.httpapi.replies import error_body

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    path: str  # segments in braces are parameters: "/v1/jobs/{key}"
    method: str
    handler: Handler

    @cached_property
    def pattern(self) -> re.Pattern[str]:
        return compile_path(self.path)[0]

    def params(self, path: str) -> dict[str, str] | None:
        """The path's parameters if it matches this route's path, else None."""
        match = self.pattern.match(path)
        return match.groupdict() if match else None


class Routes:
    def __init__(self, routes: list[Route], on_shutdown: Callable[[], Awaitable[None]]) -> None:
        self.exact = {(r.method, r.path): r.handler for r in routes if "{" not in r.path}
        self.templated = [r for r in routes if "{" in r.path]
        self.routes = routes
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served; uvicorn refuses the upgrade
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        handler = self.exact.get((method, scope["path"]))
        if handler is None:
            handler = self._templated(scope, method)
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    def _templated(self, scope: Scope, method: str) -> Handler:
        """The handler of a path with parameters (set in the scope), or an endpoint that
        answers 404 or 405."""
        allowed = [r.method for r in self.routes if r.path == scope["path"]]
        for route in self.templated:
            params = route.params(scope["path"])
            if params is None:
                continue
            if route.method == method:
                scope["path_params"] = params
                return route.handler
            allowed.append(route.method)
        return _not_found if not allowed else _not_allowed(allowed)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _not_found(request: Request) -> Response:
    return Response(error_body(404, f"no endpoint at {request.url.path}", "not_found"), 404,
                    media_type="application/json")


def _not_allowed(allowed: list[str]) -> Handler:
    async def answer(request: Request) -> Response:
        return Response(error_body(405, f"{request.method} is not allowed here; "
                                   f"{', '.join(allowed)} is", "method_not_allowed"), 405,
                        {"Allow": ", ".join(allowed)}, media_type="application/json")
    return answer
