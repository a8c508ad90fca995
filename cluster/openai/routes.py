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
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.metrics import REFUSAL_REASONS, ServiceMetrics
from hybridserve.cluster.openai.chat_output import ChatOutputParser, ChatParsing
from hybridserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    check_token_ids,
    derive_cache_salt,
    model_not_found,
    validation_error,
)
from hybridserve.cluster.openai.reply import BatchReply, Reply
from hybridserve.cluster.openai.request_body import parse_json_object, refuse_unsupported
from hybridserve.cluster.openai.response_body import (
    SSE_DONE,
    ResponseMeta,
    Usage,
    models_list,
    sse_error,
    sse_event,
    usage_chunk,
)
from hybridserve.cluster.openai.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    ResponseState,
    ResponseStore,
    input_messages,
    output_items,
    sse_named_event,
)
from hybridserve.cluster.routing.router import RouteRefused
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.structured_output import GrammarCompiler
from hybridserve.workers.core.tokenizer import ChatPrompt, ChatTemplateError
from hybridserve.workers.models.loader import load_tokenizer

logger = logging.getLogger(__name__)

# What the server renders a chat template with itself: not a request's to set.
RENDER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})

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
        if self.tokenizer is not None and config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        self.parsing = self._parsing(self.tokenizer.chat_template if self.tokenizer else None)
        self._grammars: GrammarCompiler | None = None
        self.stored_responses = ResponseStore(config.responses_store_size)
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
        data = await self._json(request)
        endpoints = {ChatCompletionRequest: "chat", ResponsesRequest: "responses"}
        refuse_unsupported(data, endpoints.get(model, "completions"))
        parsed = self._parse(data, model)
        await self._check_model(parsed)
        return parsed

    async def _json(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > self.config.max_request_bytes:
            raise OpenAIError(
                413,
                f"request body is {len(raw)} bytes; the limit is {self.config.max_request_bytes}",
            )
        return parse_json_object(raw)

    @staticmethod
    def _parse(data: dict[str, Any], model: type[Any]) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def _check_model(self, body: Any) -> None:
        model_id = (await self._model())["model_id"]
        if body.model is not None and body.model != model_id:
            raise model_not_found(body.model)

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
        prompts = [ChatPrompt(await self._prompt_ids(p, "prompt")) for p in body.prompt]
        if len(prompts) == 1:
            return await self._serve(body, prompts[0], tenant, chat=False)
        return await self._serve_batch(body, prompts, tenant)

    async def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A prompt's token ids: text tokenized, ids checked against the vocabulary."""
        if isinstance(prompt, list):
            check_token_ids(prompt, (await self._model())["vocab_size"], param)
            return list(prompt)
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: send token ids", param=param)
        return self.tokenizer.encode(prompt)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's POST /tokenize: a prompt, or chat messages through the template (with the
        chat request's tools and template fields), as token ids."""
        self._tenant(request)
        data = await self._json(request)
        if "messages" in data:
            body = self._parse(data, ChatCompletionRequest)
            token_ids = self._render(body)[0].token_ids
        else:
            body = self._parse(data, TokenizeRequest)
            token_ids = await self._prompt_ids(body.prompt, "prompt")
        await self._check_model(body)
        model = await self._model()
        limit = model["max_model_len"]
        return {"count": len(token_ids), "max_model_len": limit, "tokens": token_ids}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's POST /detokenize: token ids as text."""
        self._tenant(request)
        body = self._parse(await self._json(request), DetokenizeRequest)
        await self._check_model(body)
        check_token_ids(body.tokens, (await self._model())["vocab_size"], "tokens")
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses, served as a chat completion (cluster/openai/responses_api.py)."""
        tenant = self._tenant(request)
        body = await self._body(request, ResponsesRequest)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self.stored_responses.get(body.previous_response_id, tenant)[0]
        chat = self._parse(body.chat_request(history), ChatCompletionRequest)
        prompt, parsing = self._render(chat)
        state = ResponseState(body, model=(await self._model())["model_id"])
        meta = ResponseMeta(state.id, state.model, state.created_at, chat=True)
        parsers = [parsing.parser(chat, prompt.text or "")]
        reply, events = await self._start(
            chat, prompt, tenant, chat=True, parsers=parsers, meta=meta
        )
        conversation = [*history, *input_messages(body.input)]
        if body.stream:
            frames = self._response_events(events, reply, state, (tenant, conversation))
            return StreamingResponse(frames, media_type="text/event-stream")
        completion = await self._collect(events, reply)
        (choice,) = completion["choices"]
        state.output = output_items(choice["message"])
        state.finish(choice["finish_reason"], completion["usage"])
        self._keep(state, tenant, conversation)
        return JSONResponse(state.body())

    async def response(self, request: Request, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: a stored response (its tenant's only)."""
        return self.stored_responses.get(response_id, self._tenant(request))[1]

    async def delete_response(self, request: Request, response_id: str) -> dict[str, Any]:
        self.stored_responses.delete(response_id, self._tenant(request))
        return {"id": response_id, "object": "response", "deleted": True}

    def _keep(
        self, state: ResponseState, tenant: str | None, conversation: list[dict[str, Any]]
    ) -> None:
        if state.request.store:
            conversation = [*conversation, state.assistant_message()]
            self.stored_responses.put(state.id, tenant, conversation, state.body())

    async def _response_events(
        self,
        events: AsyncIterator[TokenEvent],
        reply: Reply,
        state: ResponseState,
        stored: tuple[str | None, list[dict[str, Any]]],
    ) -> AsyncIterator[str]:
        """The Responses API's stream: its events from the chat reply's chunks; a failure
        midway is an `error` event, and the response is not stored."""
        stream = ResponseEvents(state)
        try:
            for event in stream.start():
                yield sse_named_event(event)
            finish = None
            async for chunk in self._chunks(events, reply):
                (choice,) = chunk["choices"]
                finish = choice["finish_reason"] or finish
                for event in stream.delta(choice["delta"]):
                    yield sse_named_event(event)
            for event in stream.finish(finish, reply.usage().to_dict()):
                yield sse_named_event(event)
            self._keep(state, *stored)
        except asyncio.CancelledError:
            logger.info("response %s: client disconnected", state.id)
            raise
        except Exception as exc:
            if not isinstance(exc, OpenAIError):
                logger.exception("response %s failed mid-stream", state.id)
                exc = OpenAIError(500, f"the request failed: {exc}", type="server_error")
            error = {"code": exc.code or exc.type, "message": exc.message, "param": exc.param}
            yield sse_named_event(stream.event("error", **error))

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request, ChatCompletionRequest)
        chat, parsing = self._render(body)
        parsers = [parsing.parser(body, chat.text or "") for _ in range(body.n)]
        return await self._serve(body, chat, tenant, chat=True, parsers=parsers)

    def _render(self, body: ChatCompletionRequest) -> tuple[ChatPrompt, ChatParsing]:
        """The request's prompt through its chat template, with its tools and variables, and
        the parsers of its output (read from a request's own template where configured
        "auto"); a 400 for a variable the template never reads, and for tools the parsers
        cannot read back from the output."""
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer or chat template")
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise OpenAIError(
                400,
                "chat_template: this server runs only its own chat template "
                "(trust_request_chat_template is off).",
                param="chat_template",
            )
        try:
            template = self.tokenizer.template(body.chat_template)
        except ChatTemplateError as exc:
            param = "chat_template" if body.chat_template is not None else "messages"
            raise OpenAIError(400, f"{param}: {exc}", param=param) from None
        variables = body.template_variables()
        if body.tool_mode != "auto" and "tools" in variables and not template.reads("tools"):
            del variables["tools"]  # a forced choice's constraint does not need the template
        for name in variables:
            if name in RENDER_VARIABLES:
                raise OpenAIError(
                    400,
                    f"chat_template_kwargs: {name!r} is set by the server.",
                    param="chat_template_kwargs",
                )
            if not template.reads(name):
                param = name if name in ("tools", "reasoning_effort") else "chat_template_kwargs"
                raise OpenAIError(
                    400,
                    f"{param}: the chat template never reads {name!r}, so it would have no effect.",
                    param=param,
                )
        parsing = self.parsing
        if body.chat_template is not None:
            parsing = self._parsing(body.chat_template)
        if body.tool_mode == "auto":
            if parsing.tool_format is None:
                raise OpenAIError(
                    400,
                    "tools: no tool-call parser is set for this model (tool_call_parser), so "
                    "its calls could not be read; use tool_choice 'required' or a named "
                    "function, which need none.",
                    param="tools",
                )
            if not parsing.auto_tool_choice:
                raise OpenAIError(
                    400,
                    "tool_choice: 'auto' is off on this server (enable_auto_tool_choice).",
                    param="tool_choice",
                )
        try:
            chat = self.tokenizer.render_chat(
                body.template_messages(), chat_template=body.chat_template, **variables
            )
        except ValueError as exc:
            raise OpenAIError(400, f"the chat template failed: {exc}", param="messages") from None
        return chat, parsing

    def _parsing(self, template: str | None) -> ChatParsing:
        return ChatParsing.resolve(
            template,
            tool_call_parser=self.config.tool_call_parser,
            reasoning_parser=self.config.reasoning_parser,
            auto_tool_choice=self.config.enable_auto_tool_choice,
        )

    # ---- one request ----------------------------------------------------------------------

    async def _serve(
        self,
        body: Any,
        prompt: ChatPrompt,
        tenant: str | None,
        *,
        chat: bool,
        parsers: Sequence[ChatOutputParser] = (),
    ) -> Response:
        reply, events = await self._start(body, prompt, tenant, chat=chat, parsers=parsers)
        if body.stream:
            return StreamingResponse(self._sse(events, reply), media_type="text/event-stream")
        return JSONResponse(await self._collect(events, reply))

    async def _start(
        self,
        body: Any,
        prompt: ChatPrompt,
        tenant: str | None,
        *,
        chat: bool,
        parsers: Sequence[ChatOutputParser] = (),
        meta: ResponseMeta | None = None,
    ) -> tuple[Reply, AsyncIterator[TokenEvent]]:
        """The request admitted (its first event awaited: a refusal is a 429 or 503 here),
        with the reply that will shape its events."""
        model = await self._model()
        params = body.to_sampling_params(
            model["vocab_size"], model["max_model_len"], len(prompt.token_ids)
        )
        await self._check_structured_output(params, body)
        # One id: the client's response id is the engines' request id (logs, aborts).
        meta = meta or ResponseMeta.new(model["model_id"], chat=chat)
        request = GenerateRequest(
            request_id=meta.id,
            prompt_token_ids=prompt.token_ids,
            sampling=params.model_dump(mode="json"),
            cache_salt=derive_cache_salt(tenant, body.cache_salt),
            stable_prompt_len=prompt.stable_len,
            system_prompt_len=prompt.system_len,
        )
        reply = Reply(self.tokenizer, body, request, meta, parsers)
        events = self.service.events(request)
        if self.config.request_timeout_s is not None:
            events = within_deadline(events, self.config.request_timeout_s, request.request_id)
        try:
            return reply, await _admitted(events)
        except OpenAIError as refused:
            if self.metrics is not None and refused.code in REFUSAL_REASONS:
                self.metrics.observe_refusal(refused.code)
            raise

    async def _serve_batch(
        self, body: CompletionRequest, prompts: list[ChatPrompt], tenant: str | None
    ) -> Response:
        """Several prompts of one /v1/completions request, run side by side as requests of
        their own: choice i * n + j is prompt i's choice j (as in vLLM), usage is summed. If
        one is refused, the others are aborted and the refusal is the answer."""
        model = await self._model()
        meta = ResponseMeta.new(model["model_id"], chat=False)
        # Admitted side by side: each start waits for its prompt's first token.
        outcomes = await asyncio.gather(
            *(
                self._start(
                    body,
                    prompt,
                    tenant,
                    chat=False,
                    meta=dataclasses.replace(meta, id=f"{meta.id}-{i}"),
                )
                for i, prompt in enumerate(prompts)
            ),
            return_exceptions=True,
        )
        started = [o for o in outcomes if not isinstance(o, BaseException)]
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            for _, events in started:
                await events.aclose()  # aborts them on their engines
            raise failed[0]
        batch = BatchReply(meta, [reply for reply, _ in started], body.n)
        if body.stream:
            frames = self._sse_batch(started, batch)
            return StreamingResponse(frames, media_type="text/event-stream")
        # One failing prompt (a deadline, an engine error) cancels the others, which aborts them.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._collect(events, reply)) for reply, events in started]
        return JSONResponse(batch.body([task.result() for task in tasks]))

    async def _sse_batch(
        self, started: list[tuple[Reply, AsyncIterator[TokenEvent]]], batch: BatchReply
    ) -> AsyncIterator[str]:
        """The prompts' chunks as they come, each choice under its batch index."""
        queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, reply: Reply, events: AsyncIterator[TokenEvent]) -> None:
            try:
                async for chunk in self._chunks(events, reply):
                    await queue.put((index, chunk))
            except Exception as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        async def merged() -> AsyncIterator[dict[str, Any]]:
            tasks = [asyncio.ensure_future(pump(i, *part)) for i, part in enumerate(started)]
            try:
                remaining = len(tasks)
                while remaining:
                    index, item = await queue.get()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield batch.chunk(index, item)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        async for frame in _sse_frames(merged(), batch, batch.meta.id):
            yield frame

    def _observe(self, reply: Reply) -> None:
        if self.metrics is not None:
            stats = reply.stats
            self.metrics.observe_request(
                prompt_tokens=len(reply.request.prompt_token_ids),
                generation_tokens=stats.num_tokens,
                cached_tokens=stats.num_cached_tokens,
                finish_reason=stats.finish_reason or "abort",
                e2e_s=time.monotonic() - reply.arrived,
                ttft_s=stats.ttft,
                itl_s=stats.itl,
                queued_s=stats.queued_s,
                max_generation_tokens=max(choice.num_tokens for choice in reply.streams),
            )

    async def _collect(self, events: AsyncIterator[TokenEvent], reply: Reply) -> dict[str, Any]:
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
            self._observe(reply)
        return reply.body()

    async def _chunks(
        self, events: AsyncIterator[TokenEvent], reply: Reply
    ) -> AsyncIterator[dict[str, Any]]:
        """The request's stream chunks; its events are closed (and it is counted) at the end."""
        try:
            async for delta in reply.deltas(events):
                chunk = reply.chunk(delta)
                if chunk is not None:
                    yield chunk
        finally:
            await events.aclose()
            self._observe(reply)

    def _sse(self, events: AsyncIterator[TokenEvent], reply: Reply) -> AsyncIterator[str]:
        return _sse_frames(self._chunks(events, reply), reply, reply.request.request_id)


class _Streamed(Protocol):
    """What a stream's end needs of its reply (`Reply`, `BatchReply`)."""

    meta: ResponseMeta

    @property
    def include_usage(self) -> bool: ...

    def usage(self) -> Usage: ...


async def _sse_frames(
    chunks: AsyncIterator[dict[str, Any]], reply: _Streamed, request_id: str
) -> AsyncIterator[str]:
    """Server-sent events: the chunks, the usage chunk when asked for, then [DONE]; a failure
    midway is one error event and no [DONE]."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
        if reply.include_usage:
            yield sse_event(usage_chunk(reply.meta, reply.usage()))
        yield SSE_DONE
    except OpenAIError as exc:
        yield sse_error(exc)
    except asyncio.CancelledError:
        logger.info("request %s: client disconnected", request_id)
        raise
    except Exception as exc:
        logger.exception("request %s failed mid-stream", request_id)
        yield sse_error(OpenAIError(500, f"the request failed: {exc}", type="server_error"))
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


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


@api.post("/tokenize")
async def tokenize(request: Request, server: Server) -> Any:
    return await server.tokenize(request)


@api.post("/detokenize")
async def detokenize(request: Request, server: Server) -> Any:
    return await server.detokenize(request)


@api.post("/v1/responses")
async def responses(request: Request, server: Server) -> Response:
    return await server.responses(request)


@api.get("/v1/responses/{response_id}")
async def response(request: Request, response_id: str, server: Server) -> Any:
    return await server.response(request, response_id)


@api.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str, server: Server) -> Any:
    return await server.delete_response(request, response_id)


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
