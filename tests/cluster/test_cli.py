"""The `hybridserve` command line, driven through `main(argv)`."""

from __future__ import annotations

import json

import pytest

from hybridserve.cluster.cli import main
from hybridserve.workers import LLM, SamplingParams


def test_generate_prints_text(capsys):
    """The text of the offline engine's output for the same prompt and parameters (sampled
    with the engine's default seed: the same request id draws the same tokens)."""
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "16"]) == 0
    (expected,) = LLM("tiny").generate(["hello"], SamplingParams(max_tokens=16))
    assert expected.text.strip()
    assert capsys.readouterr().out == expected.text + "\n"


def test_generate_json_and_config_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max-tokens: 5\ntemperature: 0\nmax_num_seqs: 4\n")
    argv = ["generate", "--prompt", "a", "--prompt", "bc", "--json", "--config", str(config)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(line["token_ids"]) for line in lines] == [5, 5]
    assert [line["prompt_token_ids"] for line in lines] == [[97], [98, 99]]
    assert {line["finish_reason"] for line in lines} == {"length"}
    # Command-line flags win over the file.
    assert main([*argv, "--max-tokens", "2"]) == 0
    assert [len(json.loads(x)["token_ids"]) for x in capsys.readouterr().out.splitlines()] == [2, 2]


def test_speculative_config_is_a_json_object_and_keeps_the_tokens(capsys):
    argv = ["generate", "--prompt", "abcabcabc", "--max-tokens", "12", "--temperature", "0"]
    assert main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    assert main([*argv, "--json", "--speculative-config", spec]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    with pytest.raises(SystemExit):
        main([*argv, "--speculative-config", "[3]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_generate_across_two_rank_processes_gives_the_tokens_of_one(capsys):
    argv = ["generate", "--prompt", "tensor parallel", "--max-tokens", "8", "--json"]
    argv += ["--temperature", "0", "--max-model-len", "64", "--num-kv-blocks", "16"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == one


def test_unknown_config_key_is_rejected(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max-tokenz: 5\n")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "a", "--config", str(config)])
    assert "unknown option 'max-tokenz'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-tokens", "0", "max_tokens: Input should be greater than or equal to 1"),
        ("--temperature", "-1", "temperature: Input should be greater than or equal to 0"),
        ("--model", "/does/not/exist", "no config.json there"),
        ("--speculative-config", '{"method": "eagle"}', "Input should be 'ngram'"),
    ],
)
def test_bad_arguments_exit_2_with_a_named_error(flag, value, message, capsys):
    assert main(["generate", "--prompt", "a", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("hybridserve ")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "--max-num-batched-tokens" in help_text and "(default: 2048)" in help_text
    for flag in ("--tensor-parallel-size", "--enable-expert-parallel"):
        assert flag in help_text
    assert "--distributed-executor-backend {uni,mp,ray}" in help_text


def test_export_tiny_writes_a_loadable_checkpoint(tmp_path, capsys):
    folder = tmp_path / "tiny"
    assert main(["export-tiny", str(folder)]) == 0
    assert {p.name for p in folder.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert (
        main(
            [
                "generate",
                "--model",
                str(folder),
                "--prompt",
                "hi",
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "--json",
            ]
        )
        == 0
    )
    from_folder = json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]
    assert (
        main(["generate", "--prompt", "hi", "--max-tokens", "3", "--temperature", "0", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["token_ids"] == from_folder


def test_serve_flags_become_the_service_config():
    from pydantic import ValidationError

    from hybridserve.cluster.cli import build_parser, service_config

    argv = ["serve", "--num-prefill", "0", "--torch-threads", "2", "--stream-interval", "4"]
    argv += ["--cpu-wait-policy", "brief", "--cpu-binding", "off"]
    config = service_config(build_parser().parse_args(argv))
    assert (config["num_prefill"], config["torch_threads"], config["stream_interval"]) == (0, 2, 4)
    assert (config["cpu_wait_policy"], config["cpu_binding"]) == ("brief", "off")
    defaults = service_config(build_parser().parse_args(["serve"]))
    assert (defaults["stream_interval"], defaults["cpu_wait_policy"]) == (1, "auto")
    assert defaults["cpu_binding"] == "auto"
    with pytest.raises(ValidationError, match="stream_interval"):
        service_config(build_parser().parse_args(["serve", "--stream-interval", "0"]))


def test_serve_takes_vllm_s_positional_model_and_flags(tmp_path):
    from hybridserve.cluster.cli import build_parser, service_config

    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    argv = ["serve", "org/model", "--api-key", "k1", "k2", "--api-key", "k3"]
    argv += ["--chat-template", str(template), "--tool-call-parser", "qwen3_coder"]
    argv += ["--reasoning-parser", "none", "--gpu-memory-utilization", "0.5"]
    args = build_parser().parse_args(argv)
    config = service_config(args)
    assert config["model"] == "org/model" and config["api_keys"] == ["k1", "k2", "k3"]
    assert config["chat_template"] == "{{ messages[0]['content'] }}"
    assert (config["tool_call_parser"], config["reasoning_parser"]) == ("qwen3_coder", "none")
    assert config["engine"]["gpu_memory_utilization"] == 0.5
    assert args.host == "0.0.0.0"  # every interface, as vLLM's
    with pytest.raises(ValueError, match="the model is given twice"):
        service_config(build_parser().parse_args(["serve", "a/b", "--model", "c/d"]))
    with pytest.raises(ValueError, match="tool_call_parser 'xml'"):
        service_config(build_parser().parse_args(["serve", "--tool-call-parser", "xml"]))


@pytest.mark.slow
def test_serve_a_hugging_face_id_from_the_cache_offline(tmp_path):
    """`hybridserve serve ORG/NAME` as a user runs it: its own Ray, the model from a filled
    Hugging Face cache with HF_HUB_OFFLINE, answers under the id, and Ctrl-C exits 0."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import openai

    from hybridserve.cluster.control.local import free_port
    from tests.workers.models.test_hub import REPO_ID, fill_cache

    fill_cache(tmp_path / "hub")
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    command = [str(Path(sys.executable).parent / "hybridserve"), "serve", REPO_ID]
    command += ["--port", str(port), "--num-prefill", "0", "--torch-threads", "1"]
    command += ["--max-model-len", "256", "--num-kv-blocks", "32"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        deadline = time.monotonic() + 180
        while True:
            # Nothing listens at first; then Serve's proxy answers 404 until the application
            # is routed.
            try:
                models = client.models.list()
                break
            except (openai.APIConnectionError, openai.NotFoundError):
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "the service did not start"
                time.sleep(1)
        assert [m.id for m in models.data] == [REPO_ID]
        reply = client.completions.create(model=REPO_ID, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens == 4
    finally:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=120)
    assert server.returncode == 0, output
    assert "Traceback" not in output, output
