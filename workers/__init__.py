"""One engine: requests, scheduler, cache managers, model runner, models, sampler."""

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.engine import Engine
from hybridserve.workers.core.llm import LLM
from hybridserve.workers.core.outputs import RequestOutput
from hybridserve.workers.core.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
