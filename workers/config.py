"""Engine arguments: one validated pydantic model, the same names as the CLI's --kebab-case."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Everything that shapes one engine: model, memory pools, batching limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("tiny", description="'tiny' (built in) or an HF-format checkpoint folder")
    dtype: DType = Field("float32", description="weights and activations")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if present")
    seed: int = Field(0, description="default sampling seed for requests without their own")
    max_model_len: int | None = Field(
        None, ge=2, description="longest prompt + output; default: the model's, at most 8192"
    )
    max_num_seqs: int = Field(64, ge=1, description="requests running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step (the budget)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV pool size in bytes (alternative to num_kv_blocks)"
    )
    num_mamba_slots: int | None = Field(
        None, ge=1, description="Mamba state slots; default max_num_seqs"
    )
    mamba_ssm_dtype: DType = Field("float32", description="dtype of the SSM state")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine replica")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("set num_kv_blocks or kv_cache_memory_bytes, not both")
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported yet: layers are TP-aware but the "
                "multi-process engine is not built; run one replica per GPU instead"
            )
        return self
