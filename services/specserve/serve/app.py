"""The Ray Serve application: OpenAI-compatible HTTP and the `Generator` gRPC service.

    serve run specserve.serve:build_app            # or `specserve serve`
    import_path: specserve.serve:build_app         # Serve YAML / KubeRay serveConfigV2

One ingress deployment validates and tokenizes requests (both front ends
share `protocol.prepare`), then streams one session from the coordinator,
which talks to the draft and target workers over gRPC: a Ray actor of its
own, or, with a colocated draft (the worker runs whole sessions; the
coordinator only relays its stream), an object in this replica
(`coordinator.hosting`). The ingress starts them when its replica starts,
so they live and die with it.
A Serve handle is only used by Serve itself to reach this ingress; the
per-round traffic never passes through Serve.
"""

# No `from __future__ import annotations`: FastAPI must see the real body types through Serve's ingress.
import asyncio
import contextlib
import json
import logging
import pathlib
import secrets
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import ray
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.coordinator import Chunk, Overloaded, SessionRequest, start_coordinator
from specserve.coordinator.links import WorkerLost
from specserve.engine.prompts import PromptCodec, PromptError
from specserve.models import load_tokenizer
from specserve.serve import auth, limits
from specserve.rpc.convert import logprobs_to_wire
from specserve.serve.config import AppConfig
from specserve.serve.grpc_api import UNDECODABLE
from specserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationInput,
    choices,
    openai_error,
    openai_logprobs,
    prepare,
    round_view,
    stats_summary,
    usage,
)
from specserve.v1 import generator_pb2
from specserve.workers.launch import adopt_target, release_workers, start_workers
from specserve.workers.quiet import data_plane_priority

RETRY_AFTER_S = "5"  # what a 503 tells clients to wait (a restarting worker, a full server)
PLAYGROUND_HTML = (pathlib.Path(__file__).parent / "playground.html").read_text(encoding="utf-8")
HEALTH_TIMEOUT_S = 5.0  # a worker or coordinator that does not answer /health within this is reported down

log = logging.getLogger("ray.serve")

api = FastAPI(title="specserve", description="Lossless speculative decoding, OpenAI-compatible.")
api.add_middleware(limits.BodyLimit)


@api.exception_handler(auth.Unauthenticated)
async def _unauthenticated(request: Request, exc: auth.Unauthenticated):
    return JSONResponse(openai_error(auth.UNAUTHENTICATED_MESSAGE, None, "invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes (404), wrong methods (405) and the like, in OpenAI's error shape too."""
    return JSONResponse(openai_error(str(exc.detail), None), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return JSONResponse(openai_error(f"{param}: {first['msg']}" if param else first["msg"], param), status_code=400)


@dataclass
class Event:
    """A coordinator chunk as the front ends send it: with its text, and the finish reason the text decided."""

    text: str  # new text safe to show
    chunk: Chunk
    finish_reason: str | None  # the chunk's, or "stop" where a stop string ended the text
    completion_tokens: int  # the session's so far

    @property
    def token_ids(self) -> list[int]:
        return self.chunk.tokens

    @property
    def logprobs(self) -> list | None:  # per token of token_ids, when the request asked
        return self.chunk.logprobs

    @property
    def stats(self) -> dict[str, Any] | None:
        return self.chunk.stats


class _WorkerError(Exception):
    """A session failed after validation: a short message for the client (no traceback, address or actor id;
    the details go to the replica's log with the request id) and the status for each front end."""

    def __init__(self, message: str, http_status: int, grpc_code: grpc.StatusCode):
        super().__init__(message)
        self.http_status = http_status
        self.grpc_code = grpc_code

    def __reduce__(self):  # Serve's gRPC proxy unpickles what a stream raises ("Failed to deserialize exception")
        return _WorkerError, (str(self), self.http_status, self.grpc_code)

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.bad_input else "server_error"
        headers = {"Retry-After": RETRY_AFTER_S} if self.http_status == 503 else None
        return JSONResponse(openai_error(str(self), None, kind=kind), status_code=self.http_status, headers=headers)

    @property
    def bad_input(self) -> bool:
        return self.http_status == 400

    @classmethod
    def from_cause(cls, cause: BaseException, request_id: str) -> "_WorkerError":
        if isinstance(cause, Overloaded):
            return cls(str(cause), 503, grpc.StatusCode.RESOURCE_EXHAUSTED)
        if isinstance(cause, ValueError):
            return cls(str(cause), 400, grpc.StatusCode.INVALID_ARGUMENT)
        if isinstance(cause, WorkerLost):
            log.warning("request %s: %s", request_id, cause)
            return cls(f"{cause}; retry later (request {request_id})", 503, grpc.StatusCode.UNAVAILABLE)
        if isinstance(cause, grpc.RpcError):
            code = cause.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # our own validation message, naming the field
                return cls(f"worker: {cause.details()}", 400, grpc.StatusCode.INVALID_ARGUMENT)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the target's KV pool is full
                return cls(f"worker: {cause.details()}", 503, grpc.StatusCode.RESOURCE_EXHAUSTED)
            log.error("request %s: worker call failed: %s: %s", request_id, code.name, cause.details())
            return cls(f"a model worker failed (request {request_id})", 502, grpc.StatusCode.UNAVAILABLE)
        if isinstance(cause, ray.exceptions.RayActorError):
            log.error("request %s: the coordinator is gone: %s", request_id, cause)
            return cls(f"the coordinator is unavailable; retry later (request {request_id})", 503,
                       grpc.StatusCode.UNAVAILABLE)
        log.error("request %s failed: %s", request_id, "".join(traceback.format_exception(cause)))
        return cls(f"internal error (request {request_id})", 500, grpc.StatusCode.INTERNAL)


# Helpers the ingress uses are defined above it: Serve serializes the class where it is decorated.
async def _merged(streams: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from several choices' event streams as they come. Closing this closes them all (their
    sessions end); the first failure of one is raised here and ends the others."""
    if len(streams) == 1:  # the usual n=1: no tasks in between
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Event]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        except Exception as exc:  # noqa: BLE001 - handed over
            await queue.put((index, exc))
        finally:
            await stream.aclose()
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _all_or_none(calls: list) -> list:
    """Await every call; if one fails, cancel the others (their sessions end) and raise its error."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class SpecServe:
    def __init__(self, config: "dict[str, Any] | None" = None):
        data_plane_priority()  # on the request path (`workers.quiet`)
        self.config = AppConfig(**(config or {}))
        cfg = self.config
        auth.configure(cfg.api_key)
        limits.configure(cfg.max_body_bytes)
        # first: a prestarted worker is loading meanwhile (and transformers' imports are not safe on two threads)
        tokenizer = load_tokenizer(cfg.target)
        adopted = adopt_target(cfg.prestarted_target) if cfg.prestarted_target else None
        if adopted is not None:  # started by `specserve serve` while Serve started (`workers.launch.prestart_target`)
            (self.target, token), self.draft = adopted, None
        else:
            token = secrets.token_urlsafe(24)  # the internal worker services answer only the coordinator (rpc.auth)
            self.target, self.draft = start_workers(cfg, gamma_max=cfg.gamma_max, token=token)
        self.coordinator = start_coordinator(
            cfg, self.target, self.draft, gamma=cfg.gamma, gamma_max=cfg.gamma_max, pipelined=cfg.pipelining(),
            max_sessions=cfg.max_sessions, draft_lookup=cfg.draft_lookup, worker_token=token,
        )
        info = ray.get(self.target.info.remote())
        self.info = info
        self.model_name = cfg.model_name or info["name"]
        self.codec = PromptCodec(tokenizer, info["vocab"], info["max_positions"],
                                 cfg.special_tokens_in_messages)
        self.created = int(time.time())

    def __del__(self):
        """Serve's graceful replica shutdown: give back the workers' placement (the actors end with this one)."""
        if getattr(self, "target", None) is not None:
            release_workers(self.target)

    # -- the shared session path ----------------------------------------------
    def _prepare(self, inp: GenerationInput, field_prefix: str = "") -> SessionRequest:
        # seeded: a session resumed after a coordinator restart draws what the lost one would have
        return prepare(inp, self.codec, self.model_name, self.config, field_prefix).seeded()

    async def _events(self, request: SessionRequest) -> AsyncIterator[Event]:
        """One Event per round; ends the coordinator session when the consumer stops early (disconnect, stop string).
        If a coordinator actor's process dies, Ray restarts it and the request goes on there from the tokens
        already delivered: the client sees no error (and, seed and position-keyed randomness fixed, the same
        tokens)."""
        text = self.codec.stream(request.params.stop)
        committed: list[int] = []
        part, ended = request, False  # ended: the coordinator's session finished on its own
        deadline, last_pid = None, None  # since the coordinator was lost; the process that answered after a loss
        try:
            while True:
                try:
                    async with contextlib.aclosing(self.coordinator.chunks(part)) as chunks:
                        async for chunk in chunks:
                            committed.extend(chunk.tokens)
                            deadline = None  # the coordinator answers: a later loss gets a restart timeout of its own
                            ended = chunk.finish_reason is not None
                            delta = text.push(chunk.tokens, ended)
                            reason = "stop" if text.stopped else chunk.finish_reason
                            yield Event(delta, chunk, reason, len(committed))
                            if reason is not None:
                                return
                    return
                except ray.exceptions.RayActorError as exc:  # the coordinator actor died (or is restarting)
                    if not self.coordinator.restartable or self.config.max_restarts == 0:
                        raise _WorkerError.from_cause(exc, request.request_id) from None
                    log.warning("request %s: the coordinator was lost after %d tokens; resuming on its replacement",
                                request.request_id, len(committed))
                    deadline = deadline or time.monotonic() + self.config.restart_timeout_s
                    pid = await self._coordinator_back(deadline)
                    if pid is None:
                        raise _WorkerError.from_cause(exc, request.request_id) from None
                    if pid != last_pid:  # a replacement came back in time: a later loss gets a timeout of its own
                        deadline, last_pid = None, pid  # (several kills in a row may leave no time for a chunk)
                    await asyncio.sleep(0.2)
                    # a new id: should the old coordinator still be running it after all, the two cannot collide
                    part = replace(request.resumed(committed), request_id=uuid.uuid4().hex)
                except Exception as exc:  # noqa: BLE001 - a session's failure: a short message and a status
                    raise _WorkerError.from_cause(exc, request.request_id) from None
        finally:
            if not ended:  # a disconnect, or a stop string: the session would otherwise run on to max_tokens
                self.coordinator.cancel(part.request_id, "stop" if text.stopped else "cancelled")

    async def _coordinator_back(self, deadline: float) -> int | None:
        """The coordinator actor's process id once it answers again (Ray restarted it), None past `deadline`
        (time.monotonic())."""
        while time.monotonic() < deadline:
            try:
                return await asyncio.wait_for(self.coordinator.pid(),
                                              timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):  # not restarted yet (or its death unseen)
                await asyncio.sleep(0.2)
        return None

    async def _started(self, request: SessionRequest) -> AsyncIterator[Event]:
        """The session's events, the first already here: a failure before the first token (overload, a full KV
        pool, input a worker refused) raises _WorkerError now, to become the response's status (HTTP 503 with
        Retry-After, gRPC RESOURCE_EXHAUSTED), not an error inside a stream that already said 200."""
        events = self._events(request)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None

        async def chained():
            try:
                if first is not None:
                    yield first
                async for event in events:
                    yield event
            finally:
                await events.aclose()  # a disconnect ends the session (see _events)

        return chained()

    async def _started_all(self, sessions: list[SessionRequest]) -> AsyncIterator[tuple[int, Event]]:
        """Every session started (`_started`; a failure raises here, after closing those already started), their
        events merged as (index, event)."""
        streams = []
        try:
            for session in sessions:
                streams.append(await self._started(session))
        except BaseException:
            for started in streams:
                await started.aclose()
            raise
        return _merged(streams)

    async def _collect(self, request: SessionRequest) -> Event:
        text, rounds, last = [], [], None
        async for event in self._events(request):
            text.append(event.text)
            rounds.extend(event.chunk.rounds)
            last = event
        return Event("".join(text), Chunk(rounds, last.chunk.finish_reason, last.stats), last.finish_reason,
                     last.completion_tokens)

    def _token_text(self, token: int) -> str:
        return self.codec.tokenizer.decode([token]) if self.codec.tokenizer is not None else str(token)

    def _logprobs(self, event: Event, chat: bool, offset: int = 0) -> dict[str, Any] | None:
        """The event's tokens' `logprobs` object (None when the request did not ask)."""
        if event.logprobs is None:
            return None
        return openai_logprobs(event.logprobs, self._token_text, chat, offset)

    # -- HTTP -------------------------------------------------------------------
    @api.get("/", response_class=HTMLResponse)
    async def playground(self):
        """The playground page: a chat that colours each token by how speculation produced it (no build step,
        nothing fetched from elsewhere; it calls this app's own API)."""
        return HTMLResponse(PLAYGROUND_HTML)

    @api.get("/health")
    async def health(self):
        """200 when the coordinator and every worker answer; 503 "degraded" while one is down or restarting
        (Kubernetes probes and load balancers then route elsewhere)."""
        refs = {"coordinator": self.coordinator.describe(), "target": self.target.info.remote()}
        if self.draft is not None:
            refs["draft"] = self.draft.is_free.remote()
        answers, down = {}, []
        for role, ref in refs.items():
            try:
                answers[role] = await asyncio.wait_for(ref, HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead, restarting or stuck actor: report it, do not crash the probe
                down.append(role)
        down += [role for role in answers.get("coordinator", {}).get("workers_down", []) if role not in down]
        if down:
            return JSONResponse({"status": "degraded", "down": down}, status_code=503)
        return {"status": "ok", "model": self.model_name, "target": answers["target"], **answers["coordinator"]}

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specserve"}

    @api.get("/v1/models", dependencies=[Depends(auth.require_key)])
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model_id:path}", dependencies=[Depends(auth.require_key)])
    async def model(self, model_id: str):
        if model_id != self.model_name:
            return JSONResponse(openai_error(f"The model {model_id!r} does not exist; this server serves "
                                             f"{self.model_name!r}", "model", "model_not_found"), status_code=404)
        return self._model_card()

    @api.post("/v1/completions", dependencies=[Depends(auth.require_key)])
    async def completions(self, body: CompletionRequest):
        return await self._openai(body, chat=False)

    @api.post("/v1/chat/completions", dependencies=[Depends(auth.require_key)])
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._openai(body, chat=True)

    async def _openai(self, body, chat: bool):
        try:
            request = self._prepare(body.to_input())
            request.stream = body.stream or bool(request.params.stop)  # stop strings are checked as text arrives
            sessions = choices(request, body.n)  # n > 1: sessions of their own, seeds of their own
        except PromptError as exc:
            code = "model_not_found" if exc.field == "model" else None
            return JSONResponse(openai_error(str(exc), exc.field, code), status_code=400)
        rid = ("chatcmpl-" if chat else "cmpl-") + request.request_id
        prompt_tokens = len(request.prompt_ids)
        try:
            if body.stream:
                sse = self._sse(await self._started_all(sessions), rid, chat, prompt_tokens, body.include_usage,
                                body.speculation_detail)
                return StreamingResponse(sse, media_type="text/event-stream")
            events = await _all_or_none([self._collect(session) for session in sessions])
        except _WorkerError as exc:
            return exc.response()
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": event.text},
                 "logprobs": self._logprobs(event, chat), "finish_reason": event.finish_reason}
                if chat else {"index": i, "text": event.text, "logprobs": self._logprobs(event, chat),
                              "finish_reason": event.finish_reason}
                for i, event in enumerate(events)
            ],
            "usage": usage(prompt_tokens, sum(event.completion_tokens for event in events),
                           (events[0].stats or {}).get("cached_tokens", 0)),
            "specserve": stats_summary(events[0].stats),  # the first choice's
        }

    async def _sse(self, events: AsyncIterator[tuple[int, Event]], rid: str, chat: bool, prompt_tokens: int,
                   include_usage: bool = False, detail: bool = False):
        """OpenAI's stream: a chunk per round and choice; with include_usage, `usage: null` on each and a last
        chunk with empty choices and the usage (as OpenAI sends it); with detail (`speculation_detail`), each
        chunk's rounds as `specserve_rounds`."""
        created, started = int(time.time()), set()
        completion_tokens: dict[int, int] = {}
        cached_tokens = 0  # the first choice's (usage counts the prompt once)
        offsets: dict[int, int] = {}  # completions' text_offset: the text each choice streamed so far
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            async for index, event in events:
                if chat:
                    delta = {"content": event.text}
                    if index not in started:
                        delta["role"] = "assistant"
                    choice = {"index": index, "delta": delta, "logprobs": self._logprobs(event, chat),
                              "finish_reason": event.finish_reason}
                else:
                    choice = {"index": index, "text": event.text,
                              "logprobs": self._logprobs(event, chat, offsets.get(index, 0)),
                              "finish_reason": event.finish_reason}
                    offsets[index] = offsets.get(index, 0) + len(event.text)
                started.add(index)
                completion_tokens[index] = event.completion_tokens
                payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
                if include_usage:
                    payload["usage"] = None
                if detail:  # extension, asked for with speculation_detail
                    payload["specserve_rounds"] = [round_view(r, self._token_text) for r in event.chunk.rounds]
                if event.finish_reason is not None:
                    payload["specserve"] = stats_summary(event.stats)  # extension: this choice's statistics
                    if index == 0:
                        cached_tokens = (event.stats or {}).get("cached_tokens", 0)
                yield f"data: {json.dumps(payload)}\n\n"
            if include_usage:
                payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                           "usage": usage(prompt_tokens, sum(completion_tokens.values()), cached_tokens)}
                yield f"data: {json.dumps(payload)}\n\n"
        except _WorkerError as exc:
            yield f"data: {json.dumps(openai_error(str(exc), None))}\n\n"
        yield "data: [DONE]\n\n"

    # -- gRPC (method names = rpc names of specserve.v1.Generator) ----------------
    def _grpc_request(self, message: generator_pb2.GenerateRequest) -> SessionRequest:
        if message.model == UNDECODABLE:
            raise PromptError("request", "is not a valid specserve.v1.GenerateRequest message")
        kind = message.WhichOneof("input")
        if kind == "prompt":
            prompt, field_name = message.prompt, "prompt"
        elif kind == "messages":
            prompt = [{"role": m.role, "content": m.content} for m in message.messages.messages]
            field_name = "messages"
            if not prompt:
                raise PromptError("messages", "must not be empty")
        else:
            raise PromptError("prompt", "set either prompt or messages")
        s = message.sampling
        sampling: dict[str, Any] = {"top_k": s.top_k, "stop": list(s.stop), "ignore_eos": s.ignore_eos}
        for name in ("temperature", "top_p", "seed", "logprobs"):
            if s.HasField(name):
                sampling[name] = getattr(s, name)
        max_tokens = None if message.max_tokens == 0 else message.max_tokens
        inp = GenerationInput(prompt, field_name, message.model or None, max_tokens, sampling, message.gamma or None)
        return self._prepare(inp, field_prefix="sampling.")

    @staticmethod
    def _grpc_fail(context, code: grpc.StatusCode, details: str) -> None:
        context.set_code(code)
        context.set_details(details)

    def _grpc_response(self, event: Event, request: SessionRequest, index: int = 0) -> generator_pb2.GenerateResponse:
        response = generator_pb2.GenerateResponse(
            index=index,
            text=event.text, token_ids=event.token_ids, finish_reason=event.finish_reason or "",
            prompt_tokens=len(request.prompt_ids), completion_tokens=event.completion_tokens,
            logprobs=logprobs_to_wire(event.logprobs),
        )
        if event.finish_reason is not None:
            stats = stats_summary(event.stats)
            stats.pop("controller", None)
            stats.pop("worker_verify_time_s", None)
            response.stats.CopyFrom(generator_pb2.SpeculationStats(**stats))
        return response

    def _grpc_authenticate(self, grpc_context) -> None:
        """Raise auth.Unauthenticated (status set) unless the call's metadata carries the API key."""
        metadata = dict(grpc_context.invocation_metadata() or ()) if grpc_context is not None else {}
        if not auth.key_matches(metadata.get("authorization")):
            self._grpc_fail(grpc_context, grpc.StatusCode.UNAUTHENTICATED, auth.UNAUTHENTICATED_MESSAGE)
            raise auth.Unauthenticated()

    async def Generate(self, request: generator_pb2.GenerateRequest, grpc_context=None):
        try:
            self._grpc_authenticate(grpc_context)
        except auth.Unauthenticated:
            return generator_pb2.GenerateResponse()
        try:
            session = self._grpc_request(request)
            session.stream = bool(session.params.stop)
            events = await _all_or_none([self._collect(one) for one in choices(session, request.n or 1)])
        except PromptError as exc:
            self._grpc_fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return generator_pb2.GenerateResponse()
        except _WorkerError as exc:
            self._grpc_fail(grpc_context, exc.grpc_code, str(exc))
            return generator_pb2.GenerateResponse()
        response = self._grpc_response(events[0], session)
        if len(events) > 1:  # n > 1: every sample in `choices`, sample 0's fields at the top as well
            for i, event in enumerate(events):
                response.choices.append(self._grpc_response(event, session, i))
        return response

    async def GenerateStream(self, request: generator_pb2.GenerateRequest, grpc_context=None):
        # A stream carries its status only with a message or an exception: set the code, then raise
        # (Serve's proxy keeps a code the deployment set before raising).
        self._grpc_authenticate(grpc_context)
        try:
            session = self._grpc_request(request)
            sessions = choices(session, request.n or 1)
        except PromptError as exc:
            self._grpc_fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        try:  # a failed session's stream, and every other, is closed by the merge itself
            async for index, event in await self._started_all(sessions):
                yield self._grpc_response(event, session, index)
        except _WorkerError as exc:
            self._grpc_fail(grpc_context, exc.grpc_code, str(exc))
            raise

    # -- introspection (tests, bench) ----------------------------------------------
    async def process_ids(self, timeout_s: float = 120.0) -> dict[str, int]:
        """The PIDs of this application's processes, by role, once all of them are up (fault-injection tests kill
        them; a restarting actor refuses calls until its __init__ is done). A coordinator in this replica (a
        colocated draft) reports the replica's own."""
        calls = {"coordinator": self.coordinator.pid, "target": self.target.pid.remote,
                 "draft": self.draft.pid.remote if self.draft is not None else None,
                 "target-ranks": self.target.rank_pids.remote}  # a tensor-parallel target's ranks 1..
        deadline = time.monotonic() + timeout_s
        pids = {}
        for role, call in calls.items():
            while call is not None and role not in pids:
                try:
                    pids[role] = await call()
                except ray.exceptions.RayActorError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        for rank, pid in enumerate(pids.pop("target-ranks"), 1):
            pids[f"target-rank-{rank}"] = pid
        return pids

    async def worker_sessions(self) -> dict[str, int]:
        counts = {"target": await self.target.active_sessions.remote(),
                  "coordinator": await self.coordinator.active_sessions()}
        if self.draft is not None:
            counts["draft"] = await self.draft.active_sessions.remote()
        return counts


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (`import_path: specserve.serve:build_app`); args are `AppConfig` fields."""
    config = AppConfig(**(args or {}))  # validate before Serve starts a replica
    # Serve holds requests past max_ongoing_requests in its own unbounded queue: let ours (max_queued, with its
    # timeout and 503) see them all, with room for /health and the like beside them
    ongoing = config.max_sessions + config.max_queued + 64
    # each replica starts workers of its own (target, draft, coordinator): N replicas hold the models N times
    replicas = {"autoscaling_config": config.autoscaling_config} if config.autoscaling_config is not None \
        else {"num_replicas": config.num_replicas}
    return SpecServe.options(max_ongoing_requests=ongoing, **replicas).bind(config.model_dump())

