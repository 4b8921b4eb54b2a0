"""Jobs over HTTP: POST /v1/jobs runs one of the endpoints' bodies as a job that
outlives the connection; GET /v1/jobs/{id} shows it (and its result once done, waiting up
to ?wait=S seconds for it); DELETE /v1/jobs/{id} cancels it.

The daemon keeps jobs per user, and every HTTP client reaches it as the daemon's own
user: a job's id (random, 128 bits) is what protects it, as a bearer token would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from modelpool.protocol.client import AsyncClient
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi import bodies, replies
from modelpool.supervisor.httpapi.chat import chat_call
from modelpool.supervisor.httpapi.completions import completion_call
from modelpool.supervisor.httpapi.plumbing import unless_disconnected, with_header_options
from modelpool.supervisor.httpapi.replies import HttpError, json_response

if TYPE_CHECKING:
    from modelpool.supervisor.httpapi.app import Api

MAX_WAIT_S = 600.0

# Each operation's body and the call it makes.
OPERATIONS: dict[str, tuple[type[Any], Callable[[Any], bodies.PoolCall]]] = {
    "embeddings": (bodies.EmbeddingsBody, bodies.embeddings_call),
    "image_embeddings": (bodies.ImageEmbeddingsBody, bodies.image_embeddings_call),
    "chat.completions": (bodies.ChatBody, chat_call),
    "completions": (bodies.CompletionBody, completion_call),
    "images.generations": (bodies.ImagesBody, bodies.images_call),
    "rerank": (bodies.RerankBody, bodies.rerank_call),
}


class JobsApi:
    def __init__(self, api: Api) -> None:
        self.api = api

    async def submit(self, request: Request) -> Response:
        job = await self.api.body(request, bodies.JobBody)
        kind, make_call = OPERATIONS[job.operation]
        try:
            body = msgspec.convert(job.body, type=kind, str_keys=True)  # JSON keys
        except msgspec.ValidationError as exc:
            raise HttpError(400, f"body: {exc}", "invalid_request", "body") from None
        refuse_in_a_job(body, "body.")
        call = make_call(body)
        key = await self.submit_call(request, call, bodies.options(job))
        return json_response({"id": key, "object": "job", "operation": call.op,
                              "status": "queued"}, 202)

    async def submit_call(self, request: Request, call: bodies.PoolCall,
                          options: dict[str, Any] | None = None, stream: bool = False) -> str:
        """The call submitted as a job (`options`: the job body's own; `stream`: its
        chunks kept for a client to follow); its key."""
        kwargs = with_header_options(request, {**(options or {}), **call.kwargs},
                                     self.api.settings)
        client = await self.api.client(request)
        return str(await client.submit(call.op, *call.args, stream=stream, **kwargs))

    async def show(self, request: Request) -> Response:
        key = request.path_params["key"]
        wait = _wait(request)
        client = await self.api.client(request)
        info, result = await client.job(key), None
        if info["state"] in ("queued", "running") and wait > 0:
            info, result = await unless_disconnected(request.scope, _after(client, key, wait))
        out = _job(info)
        if info["state"] == "done":
            if result is None:
                result = await client.retrieve(key, timeout_s=1.0)
            out["result"] = replies.job_result(info["op"], result)
        return json_response(out)

    async def cancel(self, request: Request) -> Response:
        key = request.path_params["key"]
        client = await self.api.client(request)
        await client.cancel(key)
        return json_response(_job(await client.job(key)))


def refuse_in_a_job(body: Any, field: str = "", schema_field: str = "response_format",
                    streams: bool = False) -> None:
    """What a body run as a job cannot have (`field`: where the body is in the request):
    a stream (unless its job `streams`), several choices, a forced tool call (its result
    is text; `schema_field` holds it to the call's schema)."""
    if getattr(body, "stream", False) and not streams:
        raise bodies.bad(f"{field}stream", "a job's result is fetched whole, not streamed")
    if getattr(body, "n", 1) != 1:
        raise bodies.bad(f"{field}n", "a job has one result: submit a job for each choice")
    if getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        raise bodies.bad(f"{field}tool_choice", "a job's result is text, not tool calls: "
                                                f"hold it to the call's schema with "
                                                f"{schema_field} instead")


async def _after(client: AsyncClient, key: str,
                 wait_s: float) -> tuple[dict[str, Any], Any]:
    """The job once it has ended (with its result if it succeeded), or as it is after
    wait_s."""
    result = None
    try:
        result = await client.retrieve(key, timeout_s=wait_s)
    except PoolError as exc:
        if exc.code is ErrorCode.RESULT_NOT_FOUND:
            raise
    return await client.job(key), result


def _wait(request: Request) -> float:
    raw = request.query_params.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        raise bodies.bad("wait", "seconds, a number") from None
    if not 0 <= wait <= MAX_WAIT_S:
        raise bodies.bad("wait", f"0 to {MAX_WAIT_S:g} seconds")
    return wait


def _job(info: dict[str, Any]) -> dict[str, Any]:
    out = {"id": info["key"], "object": "job", "operation": info["op"],
           "model": info["model"], "status": info["state"],
           "created_at": info["submitted_at"], "started_at": info.get("started_at"),
           "finished_at": info.get("finished_at")}
    if info.get("error_code"):
        out["error"] = {"code": info["error_code"].lower(),
                        "message": info.get("error_message") or ""}
    return out
