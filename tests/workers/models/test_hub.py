"""Models named by Hugging Face id, served from a Hugging Face cache folder the test fills
(offline: nothing is downloaded). Oracle: the same checkpoint loaded as `tiny`."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.cluster.config import ServiceConfig
from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.models import hub
from hybridserve.workers.models.tiny import write_tiny_checkpoint

REPO_ID = "hybridserve-tests/tiny-hybrid"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo_id: str = REPO_ID) -> Path:
    """The tiny checkpoint laid out as huggingface_hub caches a download of `repo_id`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    write_tiny_checkpoint(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    snapshot = fill_cache(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub._snapshot.cache_clear()
    yield snapshot
    hub._snapshot.cache_clear()


def test_an_id_in_the_cache_loads_offline_as_its_checkpoint(offline_cache):
    assert hub.model_folder(REPO_ID) == offline_cache
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(REPO_ID, num_kv_blocks=32, max_model_len=128) as from_hub:
        (served,) = from_hub.generate("Hello from the cache", params)
    with LLM("tiny", num_kv_blocks=32, max_model_len=128) as built_in:
        (expected,) = built_in.generate("Hello from the cache", params)
    assert served.token_ids == expected.token_ids and served.text == expected.text
    assert ServiceConfig(model=REPO_ID).model_id == REPO_ID  # served under its id, as vLLM


def test_an_id_missing_from_the_cache_is_refused_naming_it(offline_cache):
    with pytest.raises(FileNotFoundError, match="'nobody/nothing' is neither a local folder"):
        LLM("nobody/nothing")


def test_local_folders_are_never_ids(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "org" / "name")
    assert not hub.is_repo_id(str(folder))
    assert hub.model_folder(str(folder)) == Path(folder)
    assert ServiceConfig(model=str(folder)).model_id == "name"
