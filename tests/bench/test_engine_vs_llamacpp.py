"""The llama.cpp comparison: skips cleanly when llama.cpp is not available, and prepares a
checkpoint its converter reads as the dense NemotronH it is, or as the Qwen3.5 it is. (The
comparison itself builds llama.cpp, minutes on this machine: run by hand, figures in the README.)"""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from hybridserve.bench import llamacpp
from hybridserve.bench.common import build_checkpoint


def test_without_llama_cpp_the_benchmark_says_why_and_exits_0(run_bench, monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", "/nonexistent/llama-server")
    result = run_bench("engine_vs_llamacpp.py", "--quick")
    assert result["skipped"] == "LLAMA_SERVER=/nonexistent/llama-server is not an executable file"
    assert "throughput" not in result


def test_the_converter_gets_a_string_pattern_no_moe_keys_and_a_full_vocabulary(tmp_path):
    build_checkpoint(tmp_path / "hf", quick=True)
    prepared = llamacpp.prepare_checkpoint(tmp_path / "hf", tmp_path / "prepared")
    config = json.loads((prepared / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M-M*-M-M*-M-"
    assert config["num_hidden_layers"] == 12 and "layers_block_type" not in config
    assert not set(llamacpp.MOE_KEYS) & set(config)
    tokenizer = AutoTokenizer.from_pretrained(prepared)
    assert len(tokenizer) == config["vocab_size"] == 4096
    assert sorted(tokenizer.get_vocab().values()) == list(range(4096))
    text = "hybrid models, byte by byte: ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_qwen3_5_checkpoint_goes_to_the_converter_as_written_with_a_tokenizer(tmp_path):
    build_checkpoint(tmp_path / "hf", quick=True, family="qwen3_5")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    prepared = llamacpp.prepare_checkpoint(tmp_path / "hf", tmp_path / "prepared")
    assert json.loads((prepared / "config.json").read_text()) == written
    assert written["model_type"] == "qwen3_5_text"
    assert len(AutoTokenizer.from_pretrained(prepared)) == written["vocab_size"] == 4096
