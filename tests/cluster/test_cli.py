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
