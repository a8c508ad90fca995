"""Where a model's files are: a local checkpoint folder, or a Hugging Face id resolved through
the Hugging Face cache, as vLLM resolves `vllm serve MODEL`.

An id is downloaded into the cache when the Hub is reachable (only the files an engine reads:
config, weights, tokenizer, chat template) and served from the cache when it is not, or when
`HF_HUB_OFFLINE` is set. `HF_HUB_CACHE` (or `HF_HOME`) chooses the cache, read when a model is
resolved, so a process may point it anywhere before it loads a model. Each process (every
engine, every rank) resolves the id itself, in its own node's cache.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# What each reader of a checkpoint needs: configuration checks read config.json, the ingress
# the tokenizer and chat template, an engine everything (weights too). An id is downloaded
# only as far as its reader needs: a CPU ingress never fetches the weights.
FILES = {
    "config": ["*.json"],
    "tokenizer": ["*.json", "*.jinja", "tokenizer.model", "*.txt"],
    "all": ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"],
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "true", "yes", "on"}


def is_repo_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face id ("org/name") rather than a local folder."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def model_folder(model: str, files: str = "all") -> Path:
    """The folder holding `model`'s files: the folder itself, or the cached snapshot of a
    Hugging Face id with at least `files` ("config", "tokenizer" or "all"; downloaded first
    when the Hub answers). FileNotFoundError names what was looked for and where."""
    folder = Path(model).expanduser()
    if folder.is_dir() or not is_repo_id(model):
        return folder
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
    return _snapshot(model, cache, offline, files)


@functools.cache
def _snapshot(repo_id: str, cache: str | None, offline: bool, files: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id,
                cache_dir=cache,
                allow_patterns=FILES[files],
                local_files_only=offline,
            )
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        where = cache or "the default Hugging Face cache"
        how = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor in {where}, and {how} "
            f"({type(exc).__name__}); download it first (huggingface-cli download {repo_id}) "
            "or pass a checkpoint folder"
        ) from None
