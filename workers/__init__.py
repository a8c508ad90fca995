"""One engine: requests, scheduler, cache managers, model runner, models, sampler."""

from hybridserve.workers.config import EngineConfig
from hybridserve.workers.engine import Engine
from hybridserve.workers.llm import LLM
from hybridserve.workers.outputs import RequestOutput
from hybridserve.workers.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
