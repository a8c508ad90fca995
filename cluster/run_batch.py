"""`hybridserve run-batch`: an OpenAI batch file run through the OpenAI API, as vLLM's
`run-batch` runs one.

    hybridserve run-batch -i requests.jsonl -o results.jsonl --model tiny     (offline)
    hybridserve run-batch -i requests.jsonl -o results.jsonl --url http://host:8000

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with the url one of
/v1/chat/completions, /v1/completions, /v1/responses; each output line, in input order, is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the error
`{"code", "message"}` of a request that failed (its body the API's error body). Offline, the
requests run through the server's own routes in this process (one colocated engine, no Ray,
no port), so every parameter behaves as it does against the service; against a service they
are POSTed to it. A line that is not a request is an error line of its own; the rest run.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from hybridserve.cluster.config import ServiceConfig

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
REQUEST_TIMEOUT_S = 3600.0


class BatchLine:
    """One line of the input: a request to send, or why it cannot be sent."""

    def __init__(self, number: int, text: str) -> None:
        self.number = number
        self.custom_id: str | None = None
        self.url = ""
        self.body: dict[str, Any] = {}
        self.problem: str | None = None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            self.problem = f"line {number} is not JSON: {exc}"
            return
        if not isinstance(data, dict):
            self.problem = f"line {number} is not a JSON object"
            return
        custom_id = data.get("custom_id")
        self.custom_id = custom_id if isinstance(custom_id, str) else None
        if self.custom_id is None:
            self.problem = f"line {number} has no custom_id (a string)"
        elif data.get("method") != "POST":
            self.problem = f"line {number}: method must be POST, got {data.get('method')!r}"
        elif data.get("url") not in URLS:
            self.problem = f"line {number}: url {data.get('url')!r} is not one of {URLS}"
        elif not isinstance(data.get("body"), dict):
            self.problem = f"line {number}: body must be a JSON object"
        elif data["body"].get("stream"):
            self.problem = f"line {number}: a batch request cannot stream"
        else:
            self.url, self.body = data["url"], data["body"]


def read_batch(path: Path) -> list[BatchLine]:
    lines = [text for text in path.read_text().splitlines() if text.strip()]
    batch = [BatchLine(number, text) for number, text in enumerate(lines, start=1)]
    seen: set[str] = set()
    for line in batch:
        if line.problem is not None:
            continue
        if line.custom_id in seen:
            line.problem = f"line {line.number}: custom_id {line.custom_id!r} is not unique"
        seen.add(line.custom_id or "")
    return batch


def result(
    line: BatchLine, status: int | None, body: dict[str, Any] | None, problem: str | None
) -> dict[str, Any]:
    """One output line, OpenAI's shape."""
    error = None
    if problem is not None:
        error = {"code": "invalid_batch_line", "message": problem}
    elif status != 200:
        detail = (body or {}).get("error") or {}
        error = {"code": detail.get("code") or str(status), "message": detail.get("message")}
    response = None
    if status is not None:
        request_id = (body or {}).get("id") if status == 200 else None
        response = {"status_code": status, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }


async def run_lines(
    client: httpx.AsyncClient, batch: list[BatchLine], max_concurrency: int, progress: bool
) -> list[dict[str, Any]]:
    """Every line's output, in input order; up to `max_concurrency` requests at once."""
    limit = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(batch), desc="requests", unit="req", disable=not progress)

    async def one(line: BatchLine) -> dict[str, Any]:
        try:
            if line.problem is not None:
                return result(line, None, None, line.problem)
            async with limit:
                try:
                    reply = await client.post(line.url, json=line.body)
                except httpx.HTTPError as exc:
                    return result(line, None, None, f"the request failed: {exc!r}")
            try:
                body = reply.json()
            except ValueError:
                body = {"error": {"message": reply.text, "code": str(reply.status_code)}}
            return result(line, reply.status_code, body, None)
        finally:
            bar.update(1)

    try:
        return await asyncio.gather(*(one(line) for line in batch))
    finally:
        bar.close()


@contextmanager
def in_process_client(config: ServiceConfig) -> Iterator[httpx.AsyncClient]:
    """A client of the server's routes served in this process (no port) over one engine."""
    from hybridserve.cluster.engine_host.in_process import InProcessService
    from hybridserve.cluster.openai.routes import OpenAIServer, api, current_server

    service = InProcessService(config)
    server = OpenAIServer(config, service)
    api.dependency_overrides[current_server] = lambda: server
    transport = httpx.ASGITransport(app=api)
    try:
        yield httpx.AsyncClient(transport=transport, base_url="http://in-process")
    finally:
        api.dependency_overrides.pop(current_server, None)
        service.shutdown()


def run_batch(
    input_path: Path,
    output_path: Path,
    *,
    config: ServiceConfig | None = None,
    url: str | None = None,
    api_key: str | None = None,
    max_concurrency: int = 64,
    progress: bool = True,
) -> dict[str, int]:
    """Run a batch file, offline with `config` or against the service at `url`; writes
    `output_path` and returns {"completed", "failed"}."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    batch = read_batch(input_path)

    async def run(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        async with client:
            return await run_lines(client, batch, max_concurrency, progress)

    if url is not None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.AsyncClient(
            base_url=url.rstrip("/").removesuffix("/v1"),
            headers=headers,
            timeout=REQUEST_TIMEOUT_S,
        )
        results = asyncio.run(run(client))
    else:
        with in_process_client(config or ServiceConfig(num_prefill=0)) as client:
            results = asyncio.run(run(client))
    output_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    failed = sum(r["error"] is not None for r in results)
    return {"completed": len(results) - failed, "failed": failed}
