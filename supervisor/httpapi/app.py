"""The HTTP front door: OpenAI's endpoints, our extensions, jobs, health and metrics, as an
ASGI application whose every answer comes from the pool over the daemon's socket.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from modelpool.protocol.client import AsyncClient
from modelpool.protocol.client_core import ImageChunk
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi import bodies, choices, replies, tokenizing
from modelpool.supervisor.httpapi.chat import chat_call
from modelpool.supervisor.httpapi.completions import completion_calls, echoed
from modelpool.supervisor.httpapi.exposition import HttpCounters, exposition
from modelpool.supervisor.httpapi.jobs_api import JobsApi
from modelpool.supervisor.httpapi.link import DaemonLink
from modelpool.supervisor.httpapi.openapi import openapi_document
from modelpool.supervisor.httpapi.plumbing import (
    ClientGone,
    EventStream,
    check_key,
    client_identity,
    decode,
    model_name,
    read_body,
    unless_disconnected,
    with_header_options,
)
from modelpool.supervisor.httpapi.ratelimits import RateLimits
from modelpool.supervisor.httpapi.replies import HttpError, json_response
from modelpool.supervisor.httpapi.responses_api import ResponsesApi
from modelpool.supervisor.httpapi.routes import Handler, Route, Routes
from modelpool.supervisor.httpapi.settings import HttpSettings

log = logging.getLogger("modelpool.http")
CLIENT_CLOSED = 499  # nginx's status for a client that left: logged and counted only


class Api:
    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.link = DaemonLink(settings.socket_path, settings.connections)
        self.counters = HttpCounters()
        self.limits = RateLimits()
        self.jobs = JobsApi(self)
        self.responses = ResponsesApi(self)
        self.counters.watch(self.responses.kept)

    # ---- the frame around every endpoint ----------------------------------------------

    def endpoint(self, handler: Handler, path: str, open_: bool = False) -> Handler:
        async def answer(request: Request) -> Response:
            limited: dict[str, str] = {}
            try:
                if not open_:
                    check_key(request, self.settings.api_keys)
                    limited, refusal = self.rate_limited(request)
                    if refusal:
                        raise HttpError(429, refusal, "rate_limit_exceeded")
                response = await handler(request)
            except HttpError as exc:
                # A body cut short (too slow, too large): what is left of it is no next
                # request, and the connection is not kept for its sender.
                close = {"Connection": "close"} if exc.status in (408, 413) else None
                response = Response(replies.error_body(exc.status, exc.message, exc.code,
                                                       exc.param), exc.status, close,
                                    media_type="application/json")
            except PoolError as exc:
                status, body, headers = replies.pool_error(exc)
                response = Response(body, status, headers, "application/json")
            except (ClientGone, ClientDisconnect):
                response = Response(b"", CLIENT_CLOSED)
            except Exception as exc:  # a bug here: the client still gets JSON, and a log
                log.exception("HTTP %s failed", path)
                response = Response(replies.error_body(500, f"{type(exc).__name__}: {exc}",
                                                       "internal"), 500,
                                    media_type="application/json")
            response.headers.update(limited)
            self.counters.requests.labels(path, str(response.status_code)).inc()
            return response

        return answer

    def rate_limited(self, request: Request) -> tuple[dict[str, str], str]:
        """The client's rate-limit headers, and why it is refused ("": it is not)."""
        limit = self.settings.requests_per_minute
        if not limit:
            return {}, ""
        taken = self.limits.take(client_identity(request), limit, time.monotonic())
        refusal = "" if taken.allowed else (f"rate limit of {limit} requests a minute "
                                            f"reached: try again in {taken.retry_after_s:.1f} s")
        return taken.headers(limit), refusal

    async def close(self) -> None:
        await self.link.close()
        await self.responses.kept.close()

    async def client(self, request: Request) -> AsyncClient:
        return await self.link.client(client_identity(request))

    async def call(self, request: Request, call: bodies.PoolCall,
                   whole: bool = False) -> tuple[Any, str]:
        """A call whose answer comes whole (with `whole`, the daemon's reply message
        itself), and the model that answered; cancelled if the HTTP client leaves."""
        kwargs = with_header_options(request, call.kwargs, self.settings)
        client = await self.client(request)
        answer = (client.reply(call.op, *call.args, **kwargs) if whole
                  else getattr(client, call.op)(*call.args, **kwargs))
        model = model_name(kwargs.get("model") or "", self.settings, call.op)
        return await unless_disconnected(request.scope, answer), model

    async def body(self, request: Request, kind: type[Any]) -> Any:
        return decode(await read_body(request, self.settings), kind)

    # ---- OpenAI's endpoints --------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        body = await self.body(request, bodies.EmbeddingsBody)
        reply, model = await self.call(request, bodies.embeddings_call(body), whole=True)
        return json_response(replies.embeddings(replies.rows(reply), model,
                                                body.encoding_format, reply.tokens))

    async def image_embeddings(self, request: Request) -> Response:
        body = await self.body(request, bodies.ImageEmbeddingsBody)
        rows, model = await self.call(request, bodies.image_embeddings_call(body))
        return json_response(replies.embeddings(rows, model, body.encoding_format))

    async def rerank(self, request: Request) -> Response:
        body = await self.body(request, bodies.RerankBody)
        scores, model = await self.call(request, bodies.rerank_call(body))
        return json_response(replies.rerank(scores, body.documents, model, body.top_n,
                                            body.return_documents))

    async def tokenize(self, request: Request) -> Response:
        body = await self.body(request, tokenizing.TokenizeBody)
        reply, _ = await self.call(request, tokenizing.tokenize_call(body))
        return json_response(tokenizing.tokenize_answer(reply))

    async def detokenize(self, request: Request) -> Response:
        body = await self.body(request, tokenizing.DetokenizeBody)
        reply, _ = await self.call(request, tokenizing.detokenize_call(body))
        return json_response(tokenizing.detokenize_answer(reply))

    async def chat(self, request: Request) -> Response:
        body = await self.body(request, bodies.ChatBody)
        return await self._text(request, body, [chat_call(body)], chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self.body(request, bodies.CompletionBody)
        return await self._text(request, body, completion_calls(body), chat=False,
                                echo=echoed(body))

    async def _text(self, request: Request, body: bodies.Sampling,
                    calls: list[bodies.PoolCall], chat: bool,
                    echo: list[str | list[int]] | None = None) -> Response:
        """Each call's `n` choices, in order: choice i is call i // n's; `echo`: the
        prompts a completion puts before its texts."""
        client = await self.client(request)
        streams = [getattr(client, call.op)(*call.args, **choice) for call in calls
                   for choice in bodies.choice_kwargs(
                       with_header_options(request, call.kwargs, self.settings), body.n)]
        # The first chunks before the answer's status: an unknown model is a 404, not an
        # error event inside a 200 stream.
        firsts = await unless_disconnected(request.scope, choices.firsts(streams))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = replies.StreamShape(chat, model_name(body.model, self.settings, calls[0].op),
                                    include_usage, len(streams), body.n, calls[0].made, echo)
        if body.stream:
            return EventStream(_events(shape, choices.chunks(firsts, streams)))
        texts = await unless_disconnected(request.scope,
                                          choices.gather_all(firsts, streams, shape.model))
        return json_response(replies.completion(texts, chat, shape.model,
                                                echo, body.n, calls[0].made))

    async def images(self, request: Request) -> Response:
        body = await self.body(request, bodies.ImagesBody)
        call = bodies.images_call(body)
        kwargs = with_header_options(request, call.kwargs, self.settings)
        client = await self.client(request)
        last = await unless_disconnected(request.scope, _last_image(
            client.generate_image(*call.args, **kwargs)))
        return json_response(replies.image(last))

    async def models(self, request: Request) -> Response:
        client = await self.client(request)
        models = await client.models()
        return json_response({"object": "list", "data": [_card(m) for m in models]})

    async def model(self, request: Request) -> Response:
        """One model, by its key or an alias (either case), as requests name it."""
        name = request.path_params["model"]
        models = await (await self.client(request)).models()
        named = [m for m in models
                 if name.lower() in (n.lower() for n in [m["key"], *m["aliases"]])]
        if not named:
            raise PoolError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; see GET /v1/models")
        return json_response(_card(named[0]))

    # ---- for operators -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Alive: this process answers (its loop runs) and so does the daemon's."""
        try:
            await (await self.link.any_client()).status()
        except PoolError as exc:
            raise HttpError(503, exc.message, "unavailable") from None
        return json_response({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if not await self.link.ready():
            raise HttpError(503, "the daemon does not accept work", "not_ready")
        return json_response({"status": "ready"})

    async def metrics(self, request: Request) -> Response:
        if self.settings.metrics_need_key:
            check_key(request, self.settings.api_keys)
        status = await (await self.link.any_client()).status()
        return Response(exposition(status, self.counters),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return Response(openapi_document(), media_type="application/json")


async def _events(shape: replies.StreamShape,
                  chunks: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        try:
            async for index, chunk in chunks:
                yield shape.event(chunk, index)
        except PoolError as exc:  # mid-stream: the status is sent; say it in the stream
            status, body, _ = replies.pool_error(exc)
            yield b"data: " + body + b"\n\n"
            log.info("stream ended by %s (%d)", exc.code.value, status)
        yield replies.SSE_DONE


def _card(model: dict[str, Any]) -> dict[str, Any]:
    return {"id": model["key"], "object": "model", "created": 0, "owned_by": "modelpool",
            "capability": model["capability"], "state": model["state"],
            "max_model_len": model.get("context")}


async def _last_image(stream: AsyncIterator[ImageChunk]) -> ImageChunk:
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for chunk in stream:
            if chunk.png is not None:
                return chunk
    raise PoolError(replies.ErrorCode.INTERNAL, "the image stream ended without an image")


def build_app(api: Api) -> Routes:
    table: list[tuple[str, Handler, str, bool]] = [
        ("/v1/embeddings", api.embeddings, "POST", False),
        ("/v1/chat/completions", api.chat, "POST", False),
        ("/v1/completions", api.completions, "POST", False),
        ("/v1/responses", api.responses.create, "POST", False),
        ("/v1/responses/{id}", api.responses.show, "GET", False),
        ("/v1/responses/{id}", api.responses.delete, "DELETE", False),
        ("/v1/responses/{id}/cancel", api.responses.cancel, "POST", False),
        ("/v1/responses/{id}/input_items", api.responses.input_items, "GET", False),
        ("/v1/images/generations", api.images, "POST", False),
        ("/v1/models", api.models, "GET", False),
        ("/v1/models/{model:path}", api.model, "GET", False),  # keys hold slashes
        ("/v1/image_embeddings", api.image_embeddings, "POST", False),
        ("/v1/rerank", api.rerank, "POST", False),
        ("/tokenize", api.tokenize, "POST", False),  # vLLM's paths
        ("/detokenize", api.detokenize, "POST", False),
        ("/v1/jobs", api.jobs.submit, "POST", False),
        ("/v1/jobs/{key}", api.jobs.show, "GET", False),
        ("/v1/jobs/{key}", api.jobs.cancel, "DELETE", False),
        ("/health", api.health, "GET", True),
        ("/ready", api.ready, "GET", True),
        ("/metrics", api.metrics, "GET", True),  # its own key check, when asked for
        ("/openapi.json", api.openapi, "GET", True),
    ]
    return Routes([Route(path, method, api.endpoint(handler, path, open_))
                   for path, handler, method, open_ in table], api.close)
