"""The OpenAI-compatible ingress (Ray Serve + FastAPI) and `build_app`.

    import_path: hybridserve.cluster.app:build_app      args: a ServiceConfig dict

Per request: authenticate, parse and validate (OpenAI error bodies), tokenize once (chat:
render the template and find the stable boundary), derive the cache salt from the tenant,
ask the router where to run, then stream TokenEvents from the decode engine, detokenize
incrementally, apply stop strings, and answer as JSON or SSE. A client that goes away
aborts the request on every engine that holds it.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the route signatures of a
# Serve ingress class at runtime and would not see `Request` behind a string annotation.
import asyncio
import hmac
import json
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
from hybridserve.cluster.detokenizer import Detokenizer
from hybridserve.cluster.handles import RayEngine, RayRouter
from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.metrics import ServiceMetrics
from hybridserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    derive_cache_salt,
    model_not_found,
    validation_error,
)
from hybridserve.cluster.openai_responses import (
    SSE_DONE,
    ResponseMeta,
    Usage,
    models_list,
    response_body,
    sse_error,
    sse_event,
    stream_chunk,
    usage_chunk,
)
from hybridserve.cluster.orchestrator import Orchestrator
from hybridserve.cluster.stop_strings import StopStringMatcher
from hybridserve.workers.models.loader import load_tokenizer

logger = logging.getLogger(__name__)

api = FastAPI(title="hybridserve", docs_url=None, redoc_url=None)


@api.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, config: dict[str, Any], coordinator: Any) -> None:
        self.config = ServiceConfig(**config)
        self.coordinator = coordinator
        self.keys = self.config.accepted_keys()
        self.tokenizer = load_tokenizer(self.config.model)  # not the weights
        self._topology: dict[str, Any] | None = None
        self.metrics: ServiceMetrics | None = None

    async def _topo(self) -> dict[str, Any]:
        if self._topology is None:
            self._topology = await self.coordinator.topology.remote()
            model = self._topology["model"]
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
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        topology = await self._topo()
        model_id = topology["model"]["model_id"]
        if parsed.model is not None and parsed.model != model_id:
            raise model_not_found(parsed.model)
        return parsed

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
        return await self._serve(body, prompt_ids, None, tenant, chat=False)

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
        return await self._serve(body, chat.token_ids, chat.stable_len, tenant, chat=True)

    # ---- one request ----------------------------------------------------------------------

    async def _serve(
        self,
        body: Any,
        prompt_ids: list[int],
        stable_len: int | None,
        tenant: str | None,
        *,
        chat: bool,
    ) -> Response:
        topology = await self._topo()
        model = topology["model"]
        params = body.to_sampling_params(
            model["vocab_size"], model["max_model_len"], len(prompt_ids)
        )
        # One id: the client's response id is the engines' request id (logs, aborts).
        meta = ResponseMeta.new(model["model_id"], chat=chat)
        request = GenerateRequest(
            request_id=meta.id,
            prompt_token_ids=prompt_ids,
            sampling=params.model_dump(),
            cache_salt=derive_cache_salt(tenant, body.cache_salt),
            stable_prompt_len=stable_len,
        )
        events = self._run(request, topology)
        if body.stream:
            return StreamingResponse(
                self._sse(events, request, body, meta), media_type="text/event-stream"
            )
        return JSONResponse(await self._collect(events, request, body, meta))

    async def _run(
        self, request: GenerateRequest, topology: dict[str, Any]
    ) -> AsyncIterator[TokenEvent]:
        """TokenEvents of one request (cluster/orchestrator.py has the steps)."""
        engines = {name: RayEngine(name, h) for name, h in topology["engines"].items()}
        orchestrator = Orchestrator(RayRouter(topology["router"]), engines, self._engine_died)
        async for event in orchestrator.run(request):
            yield event

    async def _engine_died(self, name: str) -> None:
        await self.coordinator.mark_dead.remote(name)
        self._topology = None  # routed afresh from now on

    async def _texts(
        self, events: AsyncIterator[TokenEvent], body: Any, stats: dict[str, Any]
    ) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """(text delta, token ids, finish reason) per event, with stop strings applied.
        Raises OpenAIError(500) for an engine-side error."""
        detokenizer = Detokenizer(self.tokenizer)
        matcher = StopStringMatcher(body.stop or [])
        start = time.monotonic()
        last = start
        async for event in events:
            now = time.monotonic()
            if event.token_ids:
                if stats["ttft"] is None:
                    stats["ttft"] = now - start
                else:
                    stats["itl"].append(now - last)
                last = now
            stats["cached"] = event.num_cached_tokens
            if event.finish_reason == "error":
                stats["finish_reason"] = "error"
                raise OpenAIError(500, event.error or "the request failed", type="server_error")
            if event.finish_reason == "abort":
                stats["finish_reason"] = "abort"
                raise OpenAIError(503, "the request was aborted by the engine")
            stats["tokens"] += len(event.token_ids)
            text = detokenizer.feed(event.token_ids, event.finished)
            match = matcher.feed(text)
            reason = event.finish_reason
            if match.stopped:
                stats["finish_reason"] = "stop"
                yield match.text, event.token_ids, "stop"
                return  # leaving the loop aborts the request (`_run`'s finally)
            if reason is not None:
                stats["finish_reason"] = reason
                yield match.text + matcher.flush(), event.token_ids, reason
                return
            yield match.text, event.token_ids, None

    def _observe(self, request: GenerateRequest, stats: dict[str, Any], start: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(
                prompt_tokens=len(request.prompt_token_ids),
                generation_tokens=stats["tokens"],
                cached_tokens=stats["cached"],
                finish_reason=stats["finish_reason"] or "abort",
                e2e_s=time.monotonic() - start,
                ttft_s=stats["ttft"],
                itl_s=stats["itl"],
            )

    @staticmethod
    def _new_stats() -> dict[str, Any]:
        return {"ttft": None, "itl": [], "tokens": 0, "cached": 0, "finish_reason": None}

    async def _collect(
        self, events: AsyncIterator[TokenEvent], request: GenerateRequest, body: Any, meta: Any
    ) -> dict[str, Any]:
        stats, start = self._new_stats(), time.monotonic()
        texts: list[str] = []
        token_ids: list[int] = []
        finish_reason = None
        try:
            async for text, ids, reason in self._texts(events, body, stats):
                texts.append(text)
                token_ids.extend(ids)
                finish_reason = reason
        finally:
            await events.aclose()
            self._observe(request, stats, start)
        usage = Usage(len(request.prompt_token_ids), stats["tokens"], stats["cached"])
        return response_body(
            meta,
            "".join(texts),
            finish_reason,
            usage,
            token_ids=token_ids if body.return_token_ids else None,
            prompt_token_ids=request.prompt_token_ids if body.return_token_ids else None,
        )

    async def _sse(
        self, events: AsyncIterator[TokenEvent], request: GenerateRequest, body: Any, meta: Any
    ) -> AsyncIterator[str]:
        stats, start = self._new_stats(), time.monotonic()
        first = True
        # Tokens whose text is held back (an incomplete UTF-8 sequence) ride with the next
        # chunk that has text: a chunk is never sent empty, and no token id is ever dropped.
        pending: list[int] = []
        try:
            async for text, ids, reason in self._texts(events, body, stats):
                pending.extend(ids)
                if text or reason is not None or first:
                    ids, pending = pending, []
                    yield sse_event(
                        stream_chunk(
                            meta,
                            text,
                            reason,
                            first=first,
                            token_ids=ids if body.return_token_ids else None,
                            prompt_token_ids=(
                                request.prompt_token_ids
                                if body.return_token_ids and first
                                else None
                            ),
                        )
                    )
                    first = False
            if body.include_usage:
                usage = Usage(len(request.prompt_token_ids), stats["tokens"], stats["cached"])
                yield sse_event(usage_chunk(meta, usage))
            yield SSE_DONE
        except OpenAIError as exc:
            yield sse_error(exc)  # mid-stream failure: an error event and no [DONE]
        except asyncio.CancelledError:
            logger.info("request %s: client disconnected", request.request_id)
            raise
        finally:
            await events.aclose()
            self._observe(request, stats, start)


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for `args` (a ServiceConfig dict; validated here, so a typo
    fails the deploy with the field named)."""
    config = ServiceConfig(**args)
    dumped = config.model_dump()
    return OpenAIIngress.bind(dumped, Coordinator.bind(dumped))
