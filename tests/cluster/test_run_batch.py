"""`hybridserve run-batch` on OpenAI's batch file format, offline (the server's routes in
process) and against the running service. Oracle: the same requests sent one by one through
the `openai` client; the format of OpenAI's batch output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridserve.cluster.cli import main
from tests.service import API_KEY, ENGINE, Service, assert_at_baseline, client

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
LINES: list[Any] = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": CHAT | {"temperature": 0.0}},
    {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 3, "temperature": 0.0}},
    {"custom_id": "response", "method": "POST", "url": "/v1/responses",
     "body": {"model": "tiny", "input": "hey", "max_output_tokens": 4, "temperature": 0.0}},
    {"custom_id": "bad-param", "method": "POST", "url": "/v1/chat/completions",
     "body": CHAT | {"use_beam_search": True}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
    "not json at all",
]  # fmt: skip


def write_batch(folder: Path) -> Path:
    path = folder / "requests.jsonl"
    text = [line if isinstance(line, str) else json.dumps(line) for line in LINES]
    path.write_text("\n".join(text) + "\n")
    return path


def check_results(path: Path, expected_chat: str, expected_completion: list[str]) -> None:
    results = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [
        "chat", "completion", "response", "bad-param", "bad-url", None,
    ]  # fmt: skip
    assert all(r["id"].startswith("batch_req_") for r in results)
    chat, completion, response, bad_param, bad_url, not_json = results
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == expected_chat
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    texts = [c["text"] for c in completion["response"]["body"]["choices"]]
    assert texts == expected_completion
    assert response["response"]["body"]["object"] == "response"
    assert bad_param["response"]["status_code"] == 400
    assert "use_beam_search" in bad_param["error"]["message"]
    assert bad_url["response"] is None and "/v1/embeddings" in bad_url["error"]["message"]
    assert not_json["error"]["code"] == "invalid_batch_line"


@pytest.mark.slow
def test_run_batch_offline_and_against_the_service(service: Service, tmp_path, capsys):
    requests = write_batch(tmp_path)
    openai = client(service)
    expected_chat = openai.chat.completions.create(**CHAT, temperature=0.0)
    expected_chat_text = expected_chat.choices[0].message.content
    expected_completion = [
        openai.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0.0)
        .choices[0]
        .text
        for p in ("one", "two")
    ]

    offline = tmp_path / "offline.jsonl"
    argv = ["run-batch", "-i", str(requests), "-o", str(offline), "--model", "tiny"]
    argv += ["--max-model-len", str(ENGINE["max_model_len"]), "--num-kv-blocks", "64"]
    assert main(argv) == 0
    assert "3 completed, 3 failed" in capsys.readouterr().out
    check_results(offline, expected_chat_text, expected_completion)

    remote = tmp_path / "remote.jsonl"
    argv = ["run-batch", "-i", str(requests), "-o", str(remote)]
    argv += ["--url", service.base_url, "--api-key", API_KEY]
    assert main(argv) == 0
    check_results(remote, expected_chat_text, expected_completion)
    assert_at_baseline(service)
