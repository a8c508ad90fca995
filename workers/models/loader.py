"""Open an HF-format checkpoint (or the built-in `tiny` model) and load it into our model.

A checkpoint is a folder with `config.json`, `*.safetensors` and usually `tokenizer.json` +
`tokenizer_config.json`. Weights are read tensor by tensor, assembled into full parameters
(stacking per-expert tensors, fusing gate/up projections), then sliced for this TP rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from hybridserve.workers.core.tokenizer import Tokenizer
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.attention import Attention
from hybridserve.workers.layers.linear import fp8_parameters, hold_fp8, shard_tensor
from hybridserve.workers.models.adapter import ArchitectureAdapter, WeightSource
from hybridserve.workers.models.config import (
    ConfigError,
    ConfigReader,
    HybridModelConfig,
    WeightError,
)
from hybridserve.workers.models.hub import model_folder
from hybridserve.workers.models.hybrid import HybridForCausalLM
from hybridserve.workers.models.quantization import (
    Fp8Tensor,
    WeightFormat,
    load_weight,
    weight_format,
)
from hybridserve.workers.models.registry import get_adapter


class TensorSource(Protocol):
    """Named tensors of a checkpoint, wherever they are stored."""

    description: str

    def keys(self) -> Iterable[str]: ...

    def file_of(self, key: str) -> str: ...

    def get(self, key: str) -> torch.Tensor: ...


class SafetensorsSource:
    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise WeightError(str(folder), "*.safetensors", "no weight files in the checkpoint")
        self.description = ", ".join(f.name for f in files)
        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    self._file_of[key] = file

    def keys(self) -> Iterable[str]:
        return self._file_of.keys()

    def file_of(self, key: str) -> str:
        return self._file_of[key].name

    def get(self, key: str) -> torch.Tensor:
        # NOTE: opened for each tensor: a handle kept open keeps every page read through its
        # mapping resident, so loading would hold the whole checkpoint beside the model; a
        # tensor read is a copy, and the header parse costs ~1 ms.
        with safe_open(str(self._file_of[key]), framework="pt") as handle:
            return handle.get_tensor(key)


@dataclass
class MemorySource:
    tensors: dict[str, torch.Tensor]
    description: str = "model.safetensors"

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def file_of(self, key: str) -> str:
        return self.description

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]


@dataclass
class Checkpoint:
    name: str
    raw_config: dict[str, Any]
    config_file: str
    tensors: TensorSource
    tokenizer: Tokenizer | None
    # Extra stop ids from generation_config.json (HF generate stops on these too).
    generation_eos_ids: tuple[int, ...] = ()
    # load_format "dummy": `load_model` makes random weights instead of reading `tensors`.
    random_weights: bool = False
    adapter: ArchitectureAdapter = field(init=False)
    config: HybridModelConfig = field(init=False)
    # How its quantized weights become float (None: a float checkpoint).
    weight_format: WeightFormat | None = field(init=False)

    def __post_init__(self) -> None:
        parsed = _parse_config(self.raw_config, self.config_file)
        self.adapter, self.config, self.weight_format = parsed

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.config.eos_token_ids + self.generation_eos_ids))


def load_tokenizer(model: str) -> Tokenizer | None:
    """Only the tokenizer of `model` ("tiny", a checkpoint folder or a Hugging Face id): None
    if it has none."""
    if model == "tiny":
        from hybridserve.workers.models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    folder = model_folder(model, "tokenizer")
    return Tokenizer.from_pretrained(folder) if (folder / "tokenizer.json").is_file() else None


def open_checkpoint(model: str, load_format: str = "auto") -> Checkpoint:
    """`model` is "tiny" (built in), an HF-format checkpoint folder or a Hugging Face id
    (models/hub.py). `load_format` "dummy": its config.json only; `load_model` makes random
    weights."""
    if load_format == "dummy":
        raw, config_file = _raw_config(model)
        return Checkpoint(
            name=model,
            raw_config=raw,
            config_file=config_file,
            tensors=MemorySource({}, "no weights (load_format='dummy')"),
            tokenizer=load_tokenizer(model),
            random_weights=True,
        )
    if model == "tiny":
        from hybridserve.workers.models.tiny import tiny_checkpoint

        return tiny_checkpoint()
    folder = model_folder(model)
    raw, config_file = _raw_config(model)
    generation_eos: tuple[int, ...] = ()
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        value = json.loads(generation_file.read_text()).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        generation_eos = tuple(v for v in values if isinstance(v, int))
    return Checkpoint(
        name=str(folder),
        raw_config=raw,
        config_file=config_file,
        tensors=SafetensorsSource(folder),
        tokenizer=load_tokenizer(model),
        generation_eos_ids=generation_eos,
    )


def read_model_config(model: str) -> HybridModelConfig:
    """Only the model description of `model` ("tiny" or a checkpoint folder): no weights, no
    tokenizer (cheap enough for config validation)."""
    raw, config_file = _raw_config(model)
    return _parse_config(raw, config_file)[1]


def _parse_config(
    raw: dict[str, Any], config_file: str
) -> tuple[ArchitectureAdapter, HybridModelConfig, WeightFormat | None]:
    """The adapter of the checkpoint's format, the model it describes and its quantized
    weight format; a quantization method that does not load is refused first: its weights
    would load as the wrong numbers."""
    fmt = weight_format(raw, config_file)
    adapter = get_adapter(raw.get("model_type"), config_file)
    return adapter, adapter.parse_config(ConfigReader(raw, config_file)), fmt


def _raw_config(model: str) -> tuple[dict[str, Any], str]:
    if model == "tiny":
        from hybridserve.workers.models.tiny import TINY_CONFIG

        return dict(TINY_CONFIG), "tiny/config.json"
    config_file = model_folder(model, "config") / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"model {model!r}: no config.json there (expected 'tiny', an HF-format "
            "checkpoint folder or a Hugging Face id)"
        )
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(str(config_file), "(file)", f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(str(config_file), "(file)", "expected a JSON object")
    return raw, str(config_file)


def load_model(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    parallel: ParallelContext | None = None,
    keep_fp8: bool = False,
    mtp: bool = False,
) -> HybridForCausalLM:
    """The model of `checkpoint` on `device`, this rank's shard. `keep_fp8`: an FP8
    checkpoint's linear weights stay FP8 with their scales (the layers' GEMMs dequantise
    them); otherwise they are dequantised into `dtype` as they load. `mtp`: with the
    checkpoint's multi-token-prediction layers (otherwise their tensors are skipped)."""
    parallel = parallel or ParallelContext()
    with torch.device("meta"):
        shapes = HybridForCausalLM(checkpoint.config, ParallelContext(), dtype, mtp=mtp)
    model = HybridForCausalLM(checkpoint.config, parallel, dtype, device, mtp=mtp)
    if checkpoint.random_weights:
        _randomize(model)
        return model
    full_shapes = {name: tuple(p.shape) for name, p in shapes.named_parameters()}
    source = checkpoint.tensors
    available = set(source.keys())
    used: set[str] = set()
    for name, param in list(model.named_parameters()):
        alternatives = checkpoint.adapter.weight_sources(checkpoint.config, name)
        chosen = next((alt for alt in alternatives if all(s.key in available for s in alt)), None)
        if chosen is None:
            expected = alternatives[0][0].key
            raise WeightError(
                source.description,
                expected,
                f"missing (needed for {name}; the checkpoint does not contain it)",
            )
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        parts = [load_weight(part.key, source, checkpoint.weight_format, used) for part in chosen]
        held = None
        if keep_fp8 and attribute in fp8_parameters(module):
            fp8 = _fp8_parts(parts, chosen)
            if fp8 is not None:
                held = _shard_fp8(_assemble_fp8(source, chosen, fp8, full_shapes[name]), param)
        if held is not None:
            data, scale = (_own(t.to(device)) for t in (held.data, held.scale))
            hold_fp8(module, attribute, data, scale, held.group)
        else:
            floats = [
                part.dequantize(param.dtype) if isinstance(part, Fp8Tensor) else part
                for part in parts
            ]
            full = _assemble(source, chosen, floats, full_shapes[name], param.dtype)
            with torch.no_grad():
                param.copy_(shard_tensor(full, param))
        used.update(s.key for s in chosen)
    _load_kv_scales(model, checkpoint, available, used)
    ignored = checkpoint.adapter.ignored_keys
    unused = sorted(k for k in available - used if ignored is None or not ignored.search(k))
    if unused:
        # NOTE: a tensor the model does not read means a layout it does not know (scales of
        # a quantized checkpoint, another architecture's layers): loading on would answer
        # with wrong tokens. Names a family knowingly skips (its `ignored_keys`) are fine.
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise WeightError(
            source.file_of(unused[0]),
            unused[0],
            f"the model does not use {len(unused)} of the checkpoint's tensors ({shown}): "
            "a layout this model does not know (a quantized checkpoint, another "
            "architecture) would load as wrong weights",
        )
    return model


def _randomize(model: torch.nn.Module) -> None:
    """vLLM's dummy weights: every parameter uniform in [-1e-3, 1e-3], drawn where it lives
    (a GPU's 16 GB model in seconds), seeded so two runs hold the same model."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            generator = generators.get(param.device)
            if generator is None:
                generator = torch.Generator(param.device).manual_seed(0)
                generators[param.device] = generator
            param.uniform_(-1e-3, 1e-3, generator=generator)


def _load_kv_scales(
    model: HybridForCausalLM, checkpoint: Checkpoint, available: set[str], used: set[str]
) -> None:
    """Each attention layer's KV cache scales, where the checkpoint has them (a
    compressed-tensors kv_cache_scheme: `self_attn.k_scale`; ModelOpt: `k_proj.k_scale`)."""
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        query = checkpoint.adapter.weight_sources(checkpoint.config, f"{name}.q_proj.weight")
        prefix = query[0][0].key.removesuffix("q_proj.weight")
        for scale in ("k_scale", "v_scale"):
            key = next(
                (k for k in (prefix + scale, f"{prefix}{scale[0]}_proj.{scale}") if k in available),
                None,
            )
            if key is None:
                continue
            value = checkpoint.tensors.get(key).float()
            if value.numel() != 1 or not value.item() > 0:
                raise WeightError(
                    checkpoint.tensors.file_of(key), key,
                    f"a KV cache scale must be one positive number, not {value.tolist()}",
                )  # fmt: skip
            setattr(module, scale, value.item())
            used.add(key)


def _assemble(
    source: TensorSource,
    sources: list[WeightSource],
    tensors: list[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """One full parameter from its checkpoint tensors (each part's transform applied),
    shape-checked."""
    tensors = [
        tensor if part.transform is None else part.transform(tensor)
        for part, tensor in zip(sources, tensors, strict=True)
    ]
    if len(sources) == 1 and sources[0].index is None:
        _check_shape(source, sources[0].key, tuple(tensors[0].shape), shape)
        return tensors[0].to(dtype)
    full = torch.empty(shape, dtype=dtype)
    for part, tensor in zip(sources, tensors, strict=True):
        assert part.index is not None
        _check_shape(source, part.key, tuple(tensor.shape), tuple(full[part.index].shape))
        full[part.index] = tensor.to(dtype)
    return full


def _fp8_parts(
    parts: list[torch.Tensor | Fp8Tensor], sources: list[WeightSource]
) -> list[Fp8Tensor] | None:
    """`parts` if they can make one FP8 parameter: all FP8 with one group size and no
    transform; None otherwise (the parameter is dequantised)."""
    fp8 = [part for part in parts if isinstance(part, Fp8Tensor)]
    if len(fp8) != len(parts) or any(source.transform for source in sources):
        return None
    return fp8 if len({part.group for part in fp8}) == 1 else None


def _assemble_fp8(
    source: TensorSource, sources: list[WeightSource], parts: list[Fp8Tensor],
    shape: tuple[int, ...],
) -> Fp8Tensor:  # fmt: skip
    """`_assemble` for FP8 parts: bytes and scales placed alike (the parts' indices address
    leading dims only, rows at most)."""
    group = parts[0].group
    # Placed as bytes: torch's indexed assignment does not take float8.
    data = _assemble(source, sources, [p.data.view(torch.uint8) for p in parts], shape, torch.uint8)
    scale_shape = (*shape[:-1], -(-shape[-1] // group))
    scale = _assemble(source, sources, [p.scale for p in parts], scale_shape, torch.float32)
    return Fp8Tensor(data.view(torch.float8_e4m3fn), scale, group)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous in storage of its own (a shard may be a view of the full tensor,
    which would stay alive behind it)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _shard_fp8(full: Fp8Tensor, param: torch.nn.Parameter) -> Fp8Tensor | None:
    """This rank's part of an FP8 parameter; None where a column shard would split a group
    of columns that share a scale (the parameter is then dequantised)."""
    dim = getattr(param, "shard_dim", None)
    data = shard_tensor(full.data.view(torch.uint8), param).view(torch.float8_e4m3fn)
    if dim is None or dim < full.data.dim() - 1:
        return Fp8Tensor(data, shard_tensor(full.scale, param), full.group)
    if full.scale.shape[-1] == 1:  # one group of all columns: any columns keep its scale
        return Fp8Tensor(data, full.scale, data.shape[-1])
    columns, group = full.data.shape[-1], full.group
    pieces = []
    for offset, length in param.shard_ranges:  # type: ignore[attr-defined]
        if offset % group or (length % group and offset + length != columns):
            return None
        pieces.append(full.scale.narrow(-1, offset // group, -(-length // group)))
    return Fp8Tensor(data, torch.cat(pieces, dim=-1), group)


def _check_shape(
    source: TensorSource, key: str, actual: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    if actual != expected:
        raise WeightError(
            source.file_of(key),
            key,
            f"shape {list(actual)} does not match the {list(expected)} that config.json implies",
        )
