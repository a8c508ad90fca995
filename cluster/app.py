"""The OpenAI-compatible ingress (Ray Serve + FastAPI) and `build_app`.

    import_path: hybridserve.cluster.app:build_app      args: a ServiceConfig dict

Per request: authenticate, parse and validate (OpenAI error bodies), tokenize once (chat:
render the template and find the stable boundaries), derive the cache salt from the tenant,
ask the router where to run, then stream TokenEvents from the decode engine, detokenize
incrementally, apply stop strings, and answer as JSON or SSE. A client that goes away
aborts the request on every engine that holds it.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the route signatures of a
# Serve ingress class at runtime and would not see `Request` behind a string annotation.
import asyncio
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.coordinator import Coordinator
from hybridserve.cluster.handles import RemoteEngine, RemoteRouter
from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.metrics import ServiceMetrics
from hybridserve.cluster.openai_body import parse_json_object, refuse_unsupported
from hybridserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    derive_cache_salt,
    model_not_found,
    validation_error,
)
from hybridserve.cluster.openai_reply import Reply
from hybridserve.cluster.openai_responses import (
    SSE_DONE,
    ResponseMeta,
    models_list,
    sse_error,
    sse_event,
    usage_chunk,
)
from hybridserve.cluster.orchestrator import Orchestrator, StaleTopology
from hybridserve.cluster.router import RouteRefused
from hybridserve.cluster.token_feed import EngineFeed
from hybridserve.workers.models.loader import load_tokenizer
from hybridserve.workers.sampling_params import SamplingParams
from hybridserve.workers.structured_output import GrammarCompiler
from hybridserve.workers.tokenizer import ChatPrompt

logger = logging.getLogger(__name__)

api = FastAPI(title="hybridserve", docs_url=None, redoc_url=None)


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


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, config: dict[str, Any], coordinator: Any) -> None:
        self.config = ServiceConfig(**config)
        self.coordinator = coordinator
        self.keys = self.config.accepted_keys()
        self.tokenizer = load_tokenizer(self.config.model)  # not the weights
        self._grammars: GrammarCompiler | None = None
        self._topology: dict[str, Any] | None = None
        self._feeds: dict[tuple[str, str, int], EngineFeed] = {}  # (epoch, name, incarnation)
        self.metrics: ServiceMetrics | None = None

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Checks structured-output specs against the model's vocabulary (built lazily)."""
        if self._grammars is None and self.tokenizer is not None and self._topology is not None:
            model = self._topology["model"]
            self._grammars = GrammarCompiler(
                self.tokenizer, model["vocab_size"], model["eos_token_ids"]
            )
        return self._grammars

    async def _topo(self) -> dict[str, Any]:
        if self._topology is None:
            self._topology = await self.coordinator.topology.remote()
            model = self._topology["model"]
            if self.metrics is None:
                self.metrics = ServiceMetrics(model["model_id"], model["max_model_len"])
        return self._topology

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
        topology = await self._topo()
        model_id = topology["model"]["model_id"]
        if parsed.model is not None and parsed.model != model_id:
            raise model_not_found(parsed.model)
        return parsed

    def _check_structured_output(self, params: SamplingParams, body: Any) -> None:
        """Compile the output constraint here too: a bad schema is the client's 400, before
        any engine sees it."""
        spec = params.structured_output
        if spec is None:
            return
        if self.grammars is None:
            raise OpenAIError(400, "structured output needs the model's tokenizer")
        try:
            self.grammars.compile(spec)
        except ValueError as exc:
            param, _ = body.output_constraint()
            raise OpenAIError(400, f"{param}: {exc}", param=param) from None

    # ---- routes ---------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> Response:
        healthy = await self.coordinator.healthy.remote()
        return Response(status_code=200 if healthy else 503)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._tenant(request)
        topology = await self._topo()
        return models_list([topology["model"]["model_id"]])

    @api.get("/metrics")
    async def metrics_route(self, request: Request) -> Response:
        self._tenant(request)
        await self._topo()
        assert self.metrics is not None
        stats = await self.coordinator.stats.remote()
        self.metrics.update_engines(stats["engines"])
        router = stats["router"]
        self.metrics.set_prefix_index(router["num_blocks"], router["num_snapshots"])
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    @api.post("/v1/completions")
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

    @api.post("/v1/chat/completions")
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
        topology = await self._topo()
        model = topology["model"]
        params = body.to_sampling_params(
            model["vocab_size"], model["max_model_len"], len(prompt.token_ids)
        )
        self._check_structured_output(params, body)
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
        try:
            events = await self._admitted(self._events(request, topology))
        except StaleTopology:  # an engine was restarted since this replica last looked
            self._topology = None
            events = await self._admitted(self._events(request, await self._topo()))
        if body.stream:
            return StreamingResponse(self._sse(events, reply), media_type="text/event-stream")
        return JSONResponse(await self._collect(events, reply))

    def _events(
        self, request: GenerateRequest, topology: dict[str, Any]
    ) -> AsyncIterator[TokenEvent]:
        events = self._run(request, topology)
        if self.config.request_timeout_s is not None:
            events = _within(events, self.config.request_timeout_s, request.request_id)
        return events

    async def _run(
        self, request: GenerateRequest, topology: dict[str, Any]
    ) -> AsyncIterator[TokenEvent]:
        """TokenEvents of one request (cluster/orchestrator.py has the steps)."""
        epoch, incarnations = topology["epoch"], topology["incarnations"]
        addresses = topology["addresses"]
        engines = {
            name: RemoteEngine(
                name,
                self._feed(epoch, name, incarnations[name], handle),
                (str(addresses[name][0]), int(addresses[name][1])) if addresses[name] else None,
            )
            for name, handle in topology["engines"].items()
        }

        async def engine_died(name: str) -> None:
            await self._engine_died(epoch, name, incarnations.get(name))

        orchestrator = Orchestrator(
            RemoteRouter(self._feed(epoch, "router", 0, topology["router"], engine=False)),
            engines,
            engine_died,
            incarnations,
        )
        async for event in orchestrator.run(request):
            yield event

    async def _engine_died(self, epoch: str, name: str, incarnation: int | None) -> None:
        """Report `name` dead to the Coordinator, which takes it out of routing and restarts
        it. Whoever sees it first reports (the feed, or a request on it; the Coordinator
        acts on the first report). The topology's epoch and the engine's incarnation make a
        report about an engine that has been restarted since, or that an earlier
        Coordinator started, stale: it cannot take the new one down."""
        try:
            await self.coordinator.mark_dead.remote(name, incarnation, epoch)
        finally:
            self._topology = None  # routed afresh from now on

    def _feed(
        self, epoch: str, name: str, incarnation: int, handle: Any, *, engine: bool = True
    ) -> EngineFeed:
        """This replica's connection to that engine incarnation, or to the router (one for
        all requests). An engine's feed reports the engine's death, even with no request
        open on it."""
        key = (epoch, name, incarnation)
        feed = self._feeds.get(key)
        if feed is None or feed.dead:
            for old in [k for k, f in self._feeds.items() if k[1] == name and f is not feed]:
                del self._feeds[old]  # earlier incarnations, or a Coordinator's before
            on_death = (
                functools.partial(self._engine_died, epoch, name, incarnation) if engine else None
            )
            feed = self._feeds[key] = EngineFeed(name, handle, on_death)
        return feed

    @staticmethod
    async def _admitted(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        """The request's events once it is admitted: its first event is awaited before the
        response starts, so that a refusal is the response's status (429, or 503 with no
        decode engine), not an event inside a 200 stream."""
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


async def _within(
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


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for `args` (a ServiceConfig dict; validated here, so a typo
    fails the deploy with the field named)."""
    config = ServiceConfig(**args)
    dumped = config.model_dump()
    return OpenAIIngress.bind(dumped, Coordinator.bind(dumped))
