"""The OpenAI-compatible HTTP routes (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics.

Per request: authenticate, parse and validate (OpenAI error bodies), tokenize once (chat:
render the template and find the stable boundaries), derive the cache salt from the tenant,
then answer from the service's token events, detokenized incrementally and cut at stop
strings, as JSON or SSE. A client that goes away closes the events, which aborts the request
on every engine that holds it.

No Ray here: `OpenAIServer` reaches the engines through a `Service` (cluster/control/
service_client.py). The routes take the server that answers them from `current_server`, which
the Serve deployment (cluster/control/app.py) binds to its replica's server.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the route signatures of a
# Serve ingress class at runtime and would not see `Request` behind a string annotation.
import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.metrics import ServiceMetrics
from hybridserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    derive_cache_salt,
    model_not_found,
    validation_error,
)
from hybridserve.cluster.openai.reply import Reply
from hybridserve.cluster.openai.request_body import parse_json_object, refuse_unsupported
from hybridserve.cluster.openai.response_body import (
    SSE_DONE,
    ResponseMeta,
    models_list,
    sse_error,
    sse_event,
    usage_chunk,
)
from hybridserve.cluster.routing.router import RouteRefused
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.structured_output import GrammarCompiler
from hybridserve.workers.core.tokenizer import ChatPrompt
from hybridserve.workers.models.loader import load_tokenizer

logger = logging.getLogger(__name__)

api = FastAPI(title="hybridserve", docs_url=None, redoc_url=None)


class Service(Protocol):
    """The running service as the routes see it."""

    async def model(self) -> dict[str, Any]:
        """The served model: `model_id`, `vocab_size`, `max_model_len`, `eos_token_ids`."""

    async def healthy(self) -> bool: ...

    async def stats(self) -> dict[str, Any]:
        """`engines`: each engine's stats; `router`: the prefix index's sizes."""

    def events(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """The request's token events (cluster/orchestrator.py), ending with a finish reason;
        RouteRefused before the first one when no engine takes it now. Closing the iterator
        early aborts the request everywhere."""


@api.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything unforeseen (a failed actor call, no engine left to route to) still answers
    with an OpenAI error body, never a bare 500."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    error = OpenAIError(500, f"the server failed: {exc}", type="server_error")
    return JSONResponse(error.body(), status_code=500)


class OpenAIServer:
    def __init__(self, config: ServiceConfig, service: Service) -> None:
        self.config = config
        self.service = service
        self.keys = config.accepted_keys()
        self.tokenizer = load_tokenizer(config.model)  # not the weights
        self._grammars: GrammarCompiler | None = None
        self.metrics: ServiceMetrics | None = None

    async def _model(self) -> dict[str, Any]:
        model = await self.service.model()
        if self.metrics is None:
            self.metrics = ServiceMetrics(model["model_id"], model["max_model_len"])
        return model

    async def _grammar_compiler(self) -> GrammarCompiler | None:
        """Checks structured-output specs against the model's vocabulary (built lazily)."""
        if self._grammars is None and self.tokenizer is not None:
            model = await self._model()
            self._grammars = GrammarCompiler(
                self.tokenizer, model["vocab_size"], model["eos_token_ids"]
            )
        return self._grammars

    # ---- auth and parsing -----------------------------------------------------------------

    def _tenant(self, request: Request) -> str | None:
        """The caller's tenant (None without keys configured); 401 on a bad key."""
        if not self.keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'")
        for key in self.keys:
            if hmac.compare_digest(token.encode(), key.encode()):
                return self.config.tenants.get(key, key)
        raise OpenAIError(401, "invalid API key", code="invalid_api_key")

    async def _body(self, request: Request, model: type[Any]) -> Any:
        raw = await request.body()
        if len(raw) > self.config.max_request_bytes:
            raise OpenAIError(
                413,
                f"request body is {len(raw)} bytes; the limit is {self.config.max_request_bytes}",
            )
        data = parse_json_object(raw)
        refuse_unsupported(data, chat=model is ChatCompletionRequest)
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        model_id = (await self._model())["model_id"]
        if parsed.model is not None and parsed.model != model_id:
            raise model_not_found(parsed.model)
        return parsed

    async def _check_structured_output(self, params: SamplingParams, body: Any) -> None:
        """Compile the output constraint here too: a bad schema is the client's 400, before
        any engine sees it."""
        spec = params.structured_output
        if spec is None:
            return
        grammars = await self._grammar_compiler()
        if grammars is None:
            raise OpenAIError(400, "structured output needs the model's tokenizer")
        try:
            grammars.compile(spec)
        except ValueError as exc:
            param, _ = body.output_constraint()
            raise OpenAIError(400, f"{param}: {exc}", param=param) from None

    # ---- what the routes answer ---------------------------------------------------------

    async def health(self) -> Response:
        return Response(status_code=200 if await self.service.healthy() else 503)

    async def models(self, request: Request) -> dict[str, Any]:
        self._tenant(request)
        return models_list([(await self._model())["model_id"]])

    async def scrape(self, request: Request) -> Response:
        """The Prometheus page: this replica's request metrics, the engines' and the index's
        (behind the API key only with metrics_require_api_key)."""
        if self.config.metrics_require_api_key:
            self._tenant(request)
        await self._model()
        assert self.metrics is not None
        stats = await self.service.stats()
        self.metrics.update_engines(stats["engines"])
        router = stats["router"]
        self.metrics.set_prefix_index(router["num_blocks"], router["num_snapshots"])
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OpenAIError(
                    400, "this model has no tokenizer: send token ids", param="prompt"
                )
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        return await self._serve(body, ChatPrompt(prompt_ids), tenant, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request, ChatCompletionRequest)
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer or chat template")
        try:
            chat = self.tokenizer.render_chat(body.template_messages())
        except ValueError as exc:
            raise OpenAIError(400, f"the chat template failed: {exc}", param="messages") from None
        return await self._serve(body, chat, tenant, chat=True)

    # ---- one request ----------------------------------------------------------------------

    async def _serve(
        self,
        body: Any,
        prompt: ChatPrompt,
        tenant: str | None,
        *,
        chat: bool,
    ) -> Response:
        model = await self._model()
        params = body.to_sampling_params(
            model["vocab_size"], model["max_model_len"], len(prompt.token_ids)
        )
        await self._check_structured_output(params, body)
        # One id: the client's response id is the engines' request id (logs, aborts).
        meta = ResponseMeta.new(model["model_id"], chat=chat)
        request = GenerateRequest(
            request_id=meta.id,
            prompt_token_ids=prompt.token_ids,
            sampling=params.model_dump(mode="json"),
            cache_salt=derive_cache_salt(tenant, body.cache_salt),
            stable_prompt_len=prompt.stable_len,
            system_prompt_len=prompt.system_len,
        )
        reply = Reply(self.tokenizer, body, request, meta)
        events = self.service.events(request)
        if self.config.request_timeout_s is not None:
            events = within_deadline(events, self.config.request_timeout_s, request.request_id)
        events = await _admitted(events)
        if body.stream:
            return StreamingResponse(self._sse(events, reply), media_type="text/event-stream")
        return JSONResponse(await self._collect(events, reply))

    def _observe(self, reply: Reply, start: float) -> None:
        if self.metrics is not None:
            stats = reply.stats
            self.metrics.observe_request(
                prompt_tokens=len(reply.request.prompt_token_ids),
                generation_tokens=stats.num_tokens,
                cached_tokens=stats.num_cached_tokens,
                finish_reason=stats.finish_reason or "abort",
                e2e_s=time.monotonic() - start,
                ttft_s=stats.ttft,
                itl_s=stats.itl,
            )

    async def _collect(self, events: AsyncIterator[TokenEvent], reply: Reply) -> dict[str, Any]:
        start = time.monotonic()
        try:
            async for delta in reply.deltas(events):
                reply.add(delta)
        except OpenAIError:
            raise
        except Exception as exc:  # anything else still answers with an OpenAI error body
            logger.exception("request %s failed", reply.request.request_id)
            raise OpenAIError(500, f"the request failed: {exc}", type="server_error") from None
        finally:
            await events.aclose()
            self._observe(reply, start)
        return reply.body()

    async def _sse(self, events: AsyncIterator[TokenEvent], reply: Reply) -> AsyncIterator[str]:
        start = time.monotonic()
        try:
            async for delta in reply.deltas(events):
                chunk = reply.chunk(delta)
                if chunk is not None:
                    yield sse_event(chunk)
            if reply.body_request.include_usage:
                yield sse_event(usage_chunk(reply.meta, reply.usage()))
            yield SSE_DONE
        except OpenAIError as exc:
            yield sse_error(exc)  # mid-stream failure: an error event and no [DONE]
        except asyncio.CancelledError:
            logger.info("request %s: client disconnected", reply.request.request_id)
            raise
        except Exception as exc:
            logger.exception("request %s failed mid-stream", reply.request.request_id)
            yield sse_error(OpenAIError(500, f"the request failed: {exc}", type="server_error"))
        finally:
            await events.aclose()
            self._observe(reply, start)


def current_server() -> OpenAIServer:
    """The server that answers a request; the deployment binds it
    (`api.dependency_overrides[current_server]`)."""
    raise RuntimeError("no OpenAIServer is bound to these routes")


Server = Annotated[OpenAIServer, Depends(current_server)]


@api.get("/health")
async def health(server: Server) -> Response:
    return await server.health()


@api.get("/v1/models")
async def models(request: Request, server: Server) -> Any:
    return await server.models(request)


@api.get("/metrics")
async def metrics(request: Request, server: Server) -> Response:
    return await server.scrape(request)


@api.post("/v1/completions")
async def completions(request: Request, server: Server) -> Response:
    return await server.completions(request)


@api.post("/v1/chat/completions")
async def chat_completions(request: Request, server: Server) -> Response:
    return await server.chat_completions(request)


async def _admitted(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    """The request's events once it is admitted: its first event is awaited before the
    response starts, so that a refusal is the response's status (429, or 503 with no decode
    engine), not an event inside a 200 stream."""
    try:
        first = await anext(events)
    except RouteRefused as refused:
        await events.aclose()
        raise OpenAIError(
            refused.status,
            refused.message,
            code="overloaded" if refused.status == 429 else "no_engine",
            retry_after_s=1 if refused.status == 429 else 5,
        ) from None

    async def resumed() -> AsyncIterator[TokenEvent]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return resumed()


async def within_deadline(
    events: AsyncIterator[TokenEvent], timeout_s: float, request_id: str
) -> AsyncIterator[TokenEvent]:
    """`events` until `timeout_s` after now; past it the request ends with a 504, and closing
    `events` aborts it on every engine that holds it."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                remaining = max(0.0, deadline - time.monotonic())
                event = await asyncio.wait_for(anext(events), remaining)
            except StopAsyncIteration:
                return
            except TimeoutError:
                logger.warning("request %s: past its %g s deadline; aborted", request_id, timeout_s)
                raise OpenAIError(
                    504,
                    f"the request did not finish within request_timeout_s={timeout_s:g} s",
                    code="request_timeout",
                ) from None
            yield event
    finally:
        await events.aclose()
