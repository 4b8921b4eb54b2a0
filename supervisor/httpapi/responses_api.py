"""OpenAI's Responses API: POST /v1/responses answers the chat its body describes, whole,
streamed, or in the background as a job; a response is kept (unless `store` is false)
for `previous_response_id` to continue and GET /v1/responses/{id} to show (a background
one streamed again with ?stream=true, after ?starting_after=N); DELETE removes one,
GET /v1/responses/{id}/input_items lists its input items, and
POST /v1/responses/{id}/cancel cancels a background one's job.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from modelpool.protocol.client import AsyncClient
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi import choices
from modelpool.supervisor.httpapi.bodies import PoolCall, bad
from modelpool.supervisor.httpapi.jobs_api import refuse_in_a_job
from modelpool.supervisor.httpapi.plumbing import (
    EventStream,
    client_identity,
    model_name,
    unless_disconnected,
    with_header_options,
)
from modelpool.supervisor.httpapi.replies import HttpError, json_response
from modelpool.supervisor.httpapi.response_store import Kept
from modelpool.supervisor.httpapi.response_store_pg import MemoryKept, PgKept
from modelpool.supervisor.httpapi.responses_in import (
    InputItem,
    ResponsesBody,
    continued,
    conversation,
    response_tools,
    responses_call,
)
from modelpool.supervisor.httpapi.responses_items import (
    include_images,
    kept_items,
    listed,
    page,
    page_options,
)
from modelpool.supervisor.httpapi.responses_out import (
    RESPONSE_ID,
    ResponseShape,
    background,
    background_shape,
    events,
    item_response_id,
)
from modelpool.supervisor.httpapi.tools import ToolCalls

if TYPE_CHECKING:
    from modelpool.supervisor.httpapi.app import Api

RESPONSE_OPS = ("generate", "describe")  # what a Responses body asks of the pool
FINISHED = ("completed", "incomplete")
NOT_KEPT = "never made, deleted, made with store false, or dropped for newer ones"
log = logging.getLogger("modelpool.http")


class ResponsesApi:
    def __init__(self, api: Api) -> None:
        self.api = api
        settings = api.settings
        self.kept: MemoryKept | PgKept = (
            PgKept(settings.kept_responses_postgres, settings.kept_responses_bytes)
            if settings.kept_responses_postgres else MemoryKept(settings.kept_responses_bytes))

    async def create(self, request: Request) -> Response:
        """POST /v1/responses: the chat its body describes (after the conversation of the
        response it continues), answered as a response."""
        body = await self._referenced(request, await self.api.body(request, ResponsesBody))
        before = await self._before(request, body.previous_response_id)
        call = responses_call(body, conversation(body, continued(before)))
        model = model_name(body.model, self.api.settings, call.op)
        items = [*before, *kept_items(body.input)]
        stored = body.store is not False and self.kept.fits(items)
        if body.background:
            return await self._background(request, body, call, model, items if stored else None)
        client = await self.api.client(request)
        stream = getattr(client, call.op)(
            *call.args, **with_header_options(request, call.kwargs, self.api.settings))
        firsts = await unless_disconnected(request.scope, choices.firsts([stream]))
        shape = ResponseShape(body, model, call.made, stored=stored)
        finished: list[dict[str, Any]] = []
        if stored:
            shape.on_finished = finished.append
        keep = self._keeper(shape.id, _owner(request), items, body, finished)
        if body.stream:
            return EventStream(_kept_when_sent(events(shape, choices.chunks(firsts, [stream])),
                                               keep))
        (text,) = await unless_disconnected(request.scope,
                                            choices.gather_all(firsts, [stream], shape.model))
        response = shape.whole(text)
        await keep()
        return json_response(response)

    def _keeper(self, response_id: str, owner: str, items: list[dict[str, Any]],
                body: ResponsesBody, finished: list[dict[str, Any]]
                ) -> Callable[[], Awaitable[None]]:
        """What keeps the response once it has finished (before it is sent, so that a
        client continuing it at once finds it). A store that cannot be reached costs the
        answer nothing: it is sent, not kept, and the log says so."""
        async def keep() -> None:
            while finished:
                await self._keep(response_id, owner, items, body, finished.pop())
        return keep

    async def _keep(self, response_id: str, owner: str, items: list[dict[str, Any]],
                    body: ResponsesBody, response: dict[str, Any] | None = None) -> None:
        try:
            await self.kept.keep(response_id, owner, items, body, response)
        except PoolError as exc:
            log.warning("response %s not kept: %s", response_id, exc.message)

    async def _background(self, request: Request, body: ResponsesBody, call: PoolCall,
                          model: str, items: list[dict[str, Any]] | None) -> Response:
        """Run as a job: answered queued at once, its id the job's, shown by GET
        /v1/responses/{id} (the SDK's responses.retrieve) whatever connection asks;
        with `stream`, its events as it runs (the job goes on if the client leaves)."""
        refuse_in_a_job(body, schema_field="text.format", streams=True)
        key = await self.api.jobs.submit_call(request, call, stream=bool(body.stream))
        owner = _owner(request)
        if items is not None:  # if not kept (a store out of reach): shown as its job stands
            await self._keep(f"{RESPONSE_ID}{key}", owner, items, body)
        if not body.stream:
            shape = ResponseShape(body, model, call.made, key, stored=items is not None)
            return json_response(shape.response("queued", []))
        client = await self.api.client(request)
        shape = background_shape(await client.job(key), body, call.made, items is not None)
        finished: list[dict[str, Any]] = []
        if items is not None:
            shape.on_finished = finished.append
        keep = self._keeper(shape.id, owner, items or [], body, finished)
        return EventStream(_kept_when_sent(
            events(shape, _followed(client, key), queued=True), keep))

    async def _before(self, request: Request,
                      response_id: str | None) -> list[dict[str, Any]]:
        """The input items a continued response had, then its output items."""
        if response_id is None:
            return []
        kept = await self.kept.get(response_id)
        if kept is None:
            raise HttpError(400, f"previous_response_id: no response {response_id!r} is kept "
                            f"({NOT_KEPT})", "previous_response_not_found",
                            "previous_response_id")
        response = await self._kept_response(request, response_id, kept)
        if response["status"] not in FINISHED:
            raise bad("previous_response_id", f"{response_id} is {response['status']}: only "
                      "a finished response can be continued")
        return [*kept.items, *response["output"]]

    async def _referenced(self, request: Request, body: ResponsesBody) -> ResponsesBody:
        """Its `item_reference`s replaced by the items of kept responses they name: an
        output item, or an input item of the client's own (what a client that sends the
        whole conversation each turn may send instead of an item it was given)."""
        if isinstance(body.input, str) or all(i.type != "item_reference" for i in body.input):
            return body
        # Referenced items count against the body's bound: one large item named again and
        # again would otherwise make a request of any size from a small body.
        limit = left = self.api.settings.max_body_bytes
        items = list(body.input)
        for index, item in enumerate(items):
            if item.type == "item_reference":
                found = await self._kept_item(request, item.id or "", f"input[{index}]")
                left -= len(msgspec.json.encode(found))
                if left < 0:
                    raise HttpError(413, f"input: the items referenced make a request over "
                                    f"{limit} bytes", "request_too_large", "input")
                items[index] = msgspec.convert(found, InputItem)
        return msgspec.structs.replace(body, input=items)

    async def _kept_item(self, request: Request, item_id: str, field: str) -> dict[str, Any]:
        response_id = item_response_id(item_id)
        if response_id is not None and (kept := await self.kept.get(response_id)) is not None:
            response = await self._kept_response(request, response_id, kept)
            for item in response["output"]:
                if item.get("id") == item_id:
                    return item
        found = await self.kept.input_item(item_id, _owner(request))
        if found is not None:
            return found
        raise bad(field, "item_reference: no finished response kept has this item (an "
                  f"output item's id, or an input item's of a response kept for you; a "
                  f"response is not kept if {NOT_KEPT})")

    async def show(self, request: Request) -> Response:
        """GET /v1/responses/{id}: a kept response; a background one as its job stands,
        or with ?stream=true its events from the start (after ?starting_after=N)."""
        response_id = request.path_params["id"]
        kept = await self.kept.get(response_id)
        after = _starting_after(request)
        if after is not None:
            return await self._stream_again(request, response_id, kept, after)
        return json_response(await self._kept_response(request, response_id, kept))

    async def _stream_again(self, request: Request, response_id: str, kept: Kept | None,
                            after: int) -> Response:
        """A background response's events as its stream sent them (the daemon keeps a
        streamed job's chunks), live while it runs: a client whose stream broke takes it
        up after the last event it had."""
        if kept is not None and kept.response is not None and not kept.response["background"]:
            raise bad("stream", "only a background response streams again; this one was "
                      "answered as it was asked")
        key = _job_key(response_id)
        client = await self.api.client(request)
        info = await _response_job(client, key)
        body = kept.body if kept is not None else None
        calls = response_tools(body) if body is not None else ToolCalls(None, auto=True)
        shape = background_shape(info, body, calls, body is not None)
        return EventStream(events(shape, _followed(client, key), queued=True,
                                  starting_after=after))

    async def input_items(self, request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: a page of a kept response's input items (a
        continued one's: the whole conversation before its answer)."""
        response_id = request.path_params["id"]
        query = request.query_params
        images = include_images([*query.getlist("include"), *query.getlist("include[]")])
        after, limit, order = page_options(query)
        kept = await self.kept.get(response_id)
        if kept is None:
            raise PoolError(ErrorCode.RESULT_NOT_FOUND,
                            f"no response {response_id!r} is kept ({NOT_KEPT})")
        listing = page(kept.items, after, limit, order)  # only a page's items converted
        listing["data"] = [listed(item, images) for item in listing["data"]]
        return json_response(listing)

    async def cancel(self, request: Request) -> Response:
        """POST /v1/responses/{id}/cancel: its job cancelled (an ended one is left)."""
        response_id = request.path_params["id"]
        kept = await self.kept.get(response_id)
        if kept is not None and kept.response is not None:
            if not kept.response["background"]:
                raise bad("id", "only a background response can be cancelled")
            return json_response(kept.response)  # it has ended: left as it is
        key = _job_key(response_id)
        client = await self.api.client(request)
        if (await _response_job(client, key))["state"] in ("queued", "running"):
            await client.cancel(key)
        return json_response(await self._as_job_stands(request, response_id, kept))

    async def delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{id}: no longer kept; a background one's job cancelled if
        it runs, and its result removed."""
        response_id = request.path_params["id"]
        kept = await self.kept.get(response_id)
        await self.kept.forget(response_id)
        if kept is None or kept.response is None or kept.response["background"]:
            try:
                key = _job_key(response_id)
                client = await self.api.client(request)
                await _response_job(client, key)
                await client.forget(key)
            except PoolError as exc:  # a kept one's job may be gone already
                if kept is None or exc.code is not ErrorCode.RESULT_NOT_FOUND:
                    raise
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _kept_response(self, request: Request, response_id: str,
                             kept: Kept | None) -> dict[str, Any]:
        """The response as answered if kept so, else as its job stands."""
        if kept is not None and kept.response is not None:
            return kept.response
        return await self._as_job_stands(request, response_id, kept)

    async def _as_job_stands(self, request: Request, response_id: str,
                             kept: Kept | None) -> dict[str, Any]:
        """A background response as its job stands; once it has finished, kept as
        answered (its job's result is removed an hour after it ended, by default)."""
        client = await self.api.client(request)
        response = await _job_response(client, _job_key(response_id),
                                        kept.body if kept else None)
        if kept is not None and response["status"] in FINISHED and kept.body is not None:
            await self.kept.keep(response_id, kept.owner, kept.items, kept.body, response)
        return response


def _owner(request: Request) -> str:
    """Whose a kept response is: its client's identity (its API key, else its address),
    hashed, so that no key is kept, in memory or in a cluster's database."""
    return hashlib.sha256(client_identity(request).encode()).hexdigest()


def _starting_after(request: Request) -> int | None:
    """None: the response itself; else its events after this one (-1: all of them)."""
    query = request.query_params
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad("stream", "true or false")
    after = query.get("starting_after")
    if stream == "false":
        if after is not None:
            raise bad("starting_after", "only with stream=true")
        return None
    if after is None:
        return -1
    if not after.isdigit() or len(after) > 12:
        raise bad("starting_after", "an event's sequence_number: 0 or more")
    return int(after)


def _job_key(response_id: str) -> str:
    if not response_id.startswith(RESPONSE_ID):
        raise PoolError(ErrorCode.RESULT_NOT_FOUND, f"no response {response_id!r}")
    return response_id.removeprefix(RESPONSE_ID)


async def _response_job(client: AsyncClient, key: str) -> dict[str, Any]:
    """A background response's job (not one of /v1/jobs, whose result is no response)."""
    info = await client.job(key)
    if info["op"] not in RESPONSE_OPS:
        raise PoolError(ErrorCode.RESULT_NOT_FOUND, f"no response {RESPONSE_ID}{key}")
    return info


async def _job_response(client: AsyncClient, key: str,
                        body: ResponsesBody | None) -> dict[str, Any]:
    info = await _response_job(client, key)
    done = info["state"] == "done"
    return background(info, await client.retrieve(key, timeout_s=1.0) if done else None, body)


async def _followed(client: AsyncClient, key: str) -> AsyncIterator[tuple[int, Any]]:
    """A background response's job's chunks, as one choice's; leaving them leaves the
    job running."""
    async with contextlib.aclosing(client.follow(key)) as chunks:  # type: ignore[type-var]
        async for chunk in chunks:
            yield 0, chunk


async def _kept_when_sent(events: AsyncIterator[bytes],
                          keep: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """Each event once the response it finishes, if it does, is kept."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            await keep()
            yield event
