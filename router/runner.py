"""Serving the gateway app: an `AppRunner` whose two OpenAI POST routes skip aiohttp's app layer.

Owns `GatewayRunner`, which `kvgate router` and `kvgate up` (`router.router_cmd.start_app`)
serve a `router.app.build_app` app with. Every request is parsed and answered by
aiohttp as usual; only the choice of handler differs: `POST /v1/completions` and
`POST /v1/chat/completions` go straight to `router.app.serve` wrapped in the same
`error_middleware` the app installs, everything else through the app (routes,
sub-app, middleware) unchanged.

Why: per request, the app layer resolves the route, freezes a match info, builds the
middleware chain and runs two middleware frames around the handler, a few percent
of the router's CPU per request for two fixed paths.

Invariants: the answers are the ones the app would give. A request the direct path
cannot answer exactly as the app does goes through the app: any other method or path
(404, 405 and the admin API stay the app's), and an `Expect` header (the app answers
`100 Continue` first). The direct path gives the handler the gateway itself, so it
never needs `request.app` / `request.match_info` (unset on that path).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from router.app import OPENAI_ROUTES, serve
from router.errors import error_middleware
from router.gateway import GATEWAY, Gateway

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class _OpenAIRoute:
    """`serve` bound to one gateway and one request kind: a handler for `error_middleware`."""

    __slots__ = ("gateway", "kind")

    def __init__(self, gateway: Gateway, kind: str) -> None:
        self.gateway = gateway
        self.kind = kind

    def __call__(self, request: web.Request) -> Awaitable[web.StreamResponse]:
        return serve(request, self.gateway, self.kind)


class _Dispatcher:
    """The server's request handler: the OpenAI POST routes directly, the rest through the app."""

    __slots__ = ("_routes", "_app_handler")

    def __init__(self, gateway: Gateway, app_handler: Handler) -> None:
        self._routes = {path: _OpenAIRoute(gateway, kind) for kind, path in OPENAI_ROUTES.items()}
        self._app_handler = app_handler

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        route = self._routes.get(request.path) if request.method == hdrs.METH_POST else None
        if route is None or hdrs.EXPECT in request.headers:
            return await self._app_handler(request)
        return await error_middleware(request, route)


class GatewayRunner(web.AppRunner):
    """An `AppRunner` for a `build_app` app (see the module docstring)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts the app: its gateway exists from here
        server.request_handler = _Dispatcher(self.app[GATEWAY], server.request_handler)
        return server
