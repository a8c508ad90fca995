"""Engine arguments: one validated pydantic model, the same names as the CLI's --kebab-case."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridserve.workers.runner.paths import ForwardPathName
from hybridserve.workers.speculative.config import SpeculativeConfig

DType = Literal["float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Everything that shapes one engine: model, memory pools, batching limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        "tiny",
        description="'tiny' (built in), an HF-format checkpoint folder, or a Hugging Face id "
        "(from the Hugging Face cache, downloaded when the Hub is reachable)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto: the checkpoint's safetensors; dummy (vLLM's): random weights in "
        "dtype, uniform in [-1e-3, 1e-3], made where they live, and only config.json read "
        "(benchmarks of a model's shape without its download)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and activations; auto: the checkpoint's torch_dtype on CUDA, "
        "float32 on the CPU (its fast kernels are float32)",
    )
    fp8_weights: Literal["keep", "dequantize"] = Field(
        "keep",
        description="an FP8 checkpoint's linear weights: keep them FP8 in memory (each GEMM "
        "dequantises them as it reads them: a byte a weight, and on the CPU 3x float32's "
        "decode at one request, docs/benchmarks.md) or dequantise them into dtype at load",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if present")
    seed: int = Field(0, description="default sampling seed for requests without their own")
    forward_paths: tuple[ForwardPathName, ...] = Field(
        ("native", "cuda_graphs", "eager"),
        description="how a step's forward pass may run, tried in order for each step (the "
        "first that accepts it runs it; eager accepts any, so it ends the list). native: on "
        "the CPU, up to eight decode rows as one C call (fp32, tensor_parallel_size 1, no "
        "MoE). cuda_graphs: on CUDA, decode-only steps replayed as graphs captured at start "
        "per batch size up to max_num_seqs (tensor_parallel_size 1, no MoE). compiled: "
        "decode-only steps through torch.compile, compiled at start (about a minute the "
        "first time on a small CPU; tensor_parallel_size 1). A path that cannot serve the "
        "model or device logs why at start and is skipped",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="speculative decoding (vLLM's speculative_config; a JSON object on the "
        "command line): each decode step verifies the proposer's guesses of a request's next "
        "tokens and keeps those the model agrees with (docs/speculative-decoding.md); None: "
        "one token per request per step",
    )
    async_scheduling: bool = Field(
        False,
        description="vLLM's async scheduling: schedule step N+1 while step N runs, its "
        "requests' new tokens taken on the rank from step N's samples, and learn those tokens "
        "(stop checks, outputs) one step late; the same tokens as without it. A request that "
        "needs its tokens to build the next step (a grammar, penalties, n > 1 forking, a "
        "prefill engine's hand-off) makes that step wait (docs/step-plan.md). "
        "tensor_parallel_size 1, no speculative decoding",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="longest prompt + output; default: the model's, at most 8192"
    )
    max_num_seqs: int = Field(64, ge=1, description="requests running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step (the budget)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    max_logprobs: int = Field(
        20,
        ge=-1,
        description="most logprobs / prompt_logprobs a request may ask for (-1: the whole "
        "vocabulary)",
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV pool size in bytes (alternative to num_kv_blocks)"
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="on a GPU without num_kv_blocks or kv_cache_memory_bytes: the share of the "
        "GPU's memory this engine may hold in all (weights and what is already taken count); "
        "the KV pool gets the rest of that share, as in vLLM",
    )
    num_state_slots: int | None = Field(
        None,
        ge=1,
        description="recurrent state slots (Mamba2, Gated DeltaNet): live + checkpoints + "
        "snapshots; default max_num_seqs live, as many checkpoints with speculative decoding, "
        "and max(2 * max_num_seqs, 64) snapshot slots with prefix caching",
    )
    recurrent_state_dtype: DType = Field(
        "float32",
        description="dtype of the recurrent state (Mamba2's SSM state, Gated DeltaNet's "
        "key x value state)",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="dtype of the attention layers' KV cache: auto = dtype; fp8 = e4m3 (a "
        "byte a value: 2-4x the blocks in the same memory), keys and values scaled by the "
        "layer's k_scale and v_scale (1.0: as stored) and saturated at e4m3's largest value",
    )
    conv_state_dtype: DType | None = Field(
        None, description="dtype of the recurrent layers' conv windows; default: dtype"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse cached prompt prefixes (KV blocks + recurrent state snapshots)"
    )
    snapshot_interval: int = Field(
        512, ge=0, description="snapshot the recurrent state every N prompt tokens (0 = off)"
    )
    save_last_snapshot: bool = Field(
        True, description="snapshot at the prompt end (and a chat prompt's stable boundaries)"
    )
    snapshot_turn_end: bool = Field(
        False,
        description="when a request finishes, cache its prompt + output and a snapshot of the "
        "state after them (the next turn of a conversation resumes there); it replaces a "
        "prompt-end snapshot in the same block; the service turns it on for decode engines",
    )
    snapshot_offsets_from_start: tuple[int, ...] = Field(
        (), description="extra snapshot positions counted from the prompt start"
    )
    snapshot_offsets_from_end: tuple[int, ...] = Field(
        (), description="extra snapshot positions counted back from the prompt end"
    )
    enable_partial_reuse: bool = Field(
        True, description="allow reuse up to a position inside a block"
    )
    host_cache_bytes: int = Field(
        0, ge=0, description="host memory for evicted blocks and snapshots (0 = no host tier)"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks (GPUs, or CPU processes) one engine spans; each holds a shard"
    )
    enable_expert_parallel: bool = Field(
        False,
        description="MoE: partition the experts over the tensor-parallel ranks instead of "
        "splitting every expert",
    )
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None,
        description="how ranks run: uni (in this process), mp (one process per rank), ray "
        "(rank actors, inside the service); default uni at TP 1, mp above",
    )
    distributed_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="a rank that died or has not finished a step after this long ends every "
        "running request with an error and stops the engine",
    )
    role: Literal["colocated", "prefill", "decode"] = Field(
        "colocated",
        description="prefill: stop after the first token and hand the request off; "
        "decode: continue requests received from a prefill engine",
    )
    transfer_backend: Literal["tcp", "nixl"] = Field(
        "tcp", description="how KV blocks and recurrent state move between engines"
    )
    transfer_streams: int = Field(
        2,
        ge=1,
        le=16,
        description="nixl: threads that post one transfer's regions in parallel, each on its "
        "own UCX worker (the tcp backend has one stream)",
    )
    transfer_links_per_peer: int = Field(
        8,
        ge=1,
        le=16,
        description="prefill: links (a connection and a sender thread each) to each decode "
        "engine, each carrying one transfer at a time: a transfer waits for the decode "
        "engine's steps (to reserve its pages, to admit the request), and several links let "
        "those waits overlap",
    )
    transfer_lease_seconds: float = Field(
        60.0,
        gt=0,
        description="prefill frees a handed-off request's blocks after this long "
        "without an ack or abort",
    )
    transfer_secret: str | None = Field(
        None,
        repr=False,
        description="hex; a disaggregated engine's transfer and shard links admit only peers "
        "that prove they hold it (the service's Coordinator makes one per deployment)",
    )
    transfer_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="after a failed transfer, decode recomputes the prompt or "
        "ends the request with an error",
    )

    @field_validator("forward_paths")
    @classmethod
    def _check_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(paths)) != len(paths):
            raise ValueError(f"forward_paths {list(paths)} names a path twice")
        if not paths or paths[-1] != "eager":
            raise ValueError(
                f"forward_paths {list(paths)} must end with 'eager', the path that runs any "
                "step (prompt chunks, mixed steps, and whatever the others do not take)"
            )
        return paths

    @field_validator("transfer_secret")
    @classmethod
    def _check_secret(cls, secret: str | None) -> str | None:
        if secret is None:
            return None
        try:
            key = bytes.fromhex(secret)
        except ValueError:
            raise ValueError(
                "transfer_secret must be hex (secrets.token_hex(32) makes one)"
            ) from None
        if len(key) < 16:
            raise ValueError(f"transfer_secret has {len(key)} bytes; at least 16 are needed")
        return secret

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("set num_kv_blocks or kv_cache_memory_bytes, not both")
        if self.enable_prefix_caching:
            if self.max_num_batched_tokens < self.block_size:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                    f"block_size ({self.block_size}): with prefix caching, chunks cut by the "
                    "budget are rounded down to whole blocks and could never progress; raise "
                    "max_num_batched_tokens or disable enable_prefix_caching"
                )
            if not (
                self.snapshot_interval
                or self.save_last_snapshot
                or self.snapshot_offsets_from_start
                or self.snapshot_offsets_from_end
            ):
                raise ValueError(
                    "prefix caching with no snapshot points would never reuse anything: "
                    "set snapshot_interval > 0 or save_last_snapshot=True"
                )
        needed = self.num_live_slots + self.num_checkpoint_slots
        if self.num_state_slots is not None and self.num_state_slots < needed:
            why = (
                "every running request needs a live slot, and with speculative decoding a "
                "checkpoint slot too"
                if self.num_checkpoint_slots
                else "every running request needs a live slot"
            )
            raise ValueError(
                f"num_state_slots ({self.num_state_slots}) is smaller than {needed}: {why}; "
                "raise num_state_slots or lower max_num_seqs"
            )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                f"async_scheduling with tensor_parallel_size={self.tensor_parallel_size}: a "
                "step that runs ahead takes its tokens from the last step's samples, which only "
                "rank 0 draws; use tensor_parallel_size 1 or turn async_scheduling off"
            )
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "async_scheduling with speculative_config: a verify step needs the tokens the "
                "last one accepted before it can be built; turn one of them off"
            )
        self._check_parallelism()
        return self

    def _check_parallelism(self) -> None:
        tp = self.tensor_parallel_size
        if tp > 1 and self.executor_backend == "uni":
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                f"{tp}: use 'mp' (one process per rank) or 'ray'"
            )
        if tp > 1 and self.role != "colocated" and self.executor_backend != "ray":
            raise ValueError(
                f"role={self.role!r} with tensor_parallel_size={tp}: each rank of a "
                "disaggregated engine moves its own shards, which the service's rank actors "
                "do (distributed_executor_backend='ray'); an engine in this process runs "
                "role='colocated'"
            )
        if tp > 1 or self.enable_expert_parallel:
            # NOTE: reads only config.json, so a shape the ranks cannot split is refused before
            # any process starts.
            from hybridserve.workers.executors.parallel import check_tensor_parallel
            from hybridserve.workers.models.loader import read_model_config

            check_tensor_parallel(read_model_config(self.model), tp, self.enable_expert_parallel)

    @property
    def executor_backend(self) -> Literal["uni", "mp", "ray"]:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def num_live_slots(self) -> int:
        return self.max_num_seqs

    @property
    def runs_mtp_layers(self) -> bool:
        """Whether the checkpoint's multi-token-prediction layers load and run (their KV
        layers join the pool; a prefill engine runs them too, to hand over their KV and first
        guesses)."""
        return self.speculative_config is not None and self.speculative_config.method == "mtp"

    @property
    def num_checkpoint_slots(self) -> int:
        """Speculative decoding: a slot per running request for its state before a verify
        step, copied back when a draft is rejected (a prefill engine never verifies)."""
        speculates = self.speculative_config is not None and self.role != "prefill"
        return self.max_num_seqs if speculates else 0

    @property
    def num_snapshot_slots(self) -> int:
        if self.num_state_slots is not None:
            return self.num_state_slots - self.num_live_slots - self.num_checkpoint_slots
        return max(2 * self.max_num_seqs, 64) if self.enable_prefix_caching else 0
