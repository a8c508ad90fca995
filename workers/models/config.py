"""The one internal description of a hybrid model, whatever checkpoint format it came from.

Every supported architecture (the README's support table lists them) is normalised into a
`HybridModelConfig`: a flat list of residual sublayers, each `norm -> op -> residual add` (or
`op -> norm -> residual add`), where `op` is one of six kinds. A Bamba decoder layer
"mamba + MLP" becomes two sublayers; a NemotronH layer is already one. The model code
(`workers/models/hybrid.py`) only ever reads this type; everything that holds or moves recurrent
state reads the kind's state description (`recurrent_state.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hybridserve.workers.models.recurrent_state import (
    RecurrentStateSpec,
    StateSection,
    StateTensor,
)

LayerKind = Literal[
    "mamba2", "mamba1", "gdn", "short_conv", "attention", "shared_block", "mlp", "moe"
]
# Layer kinds that keep per-sequence recurrent state (a slot in the state pools).
RECURRENT_KINDS: tuple[LayerKind, ...] = ("mamba2", "mamba1", "gdn", "short_conv")
# Layer kinds that keep attention keys and values (a layer of the KV pool).
KV_KINDS: tuple[LayerKind, ...] = ("attention", "shared_block")
Activation = Literal["silu", "relu2", "gelu"]
# How a Mamba2 scan output meets its gate z: RMSNorm(y * silu(z)) per group (Mamba2's own),
# RMSNorm(y) * silu(z), or y * silu(z) with no norm (Falcon-H1's options).
MambaGate = Literal["norm_after_gate", "norm_before_gate", "no_norm"]
Architecture = Literal[
    "nemotron_h",
    "bamba",
    "granitemoehybrid",
    "qwen3_next",
    "qwen3_5",
    "olmo_hybrid",
    "lfm2",
    "falcon_h1",
    "jamba",
    "zamba2",
    "kimi_linear",
]


class CheckpointError(ValueError):
    """A checkpoint is unusable; the message names the file and the field or weight."""

    kind = "entry"

    def __init__(self, file: str, field: str, message: str) -> None:
        super().__init__(f"{file}: {self.kind} '{field}': {message}")
        self.file = file
        self.field = field


class ConfigError(CheckpointError):
    kind = "field"


class WeightError(CheckpointError):
    kind = "weight"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MambaSpec(_Frozen):
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    activation: Activation
    norm_eps: float
    # dt is clamped to this range after bias + softplus, in prefill and decode alike.
    dt_min: float = 0.0
    dt_max: float = math.inf
    gate: MambaGate = "norm_after_gate"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_state_size(self) -> int:
        return self.n_groups * self.state_size

    @property
    def conv_dim(self) -> int:
        # conv rows are three sections: x (intermediate) | B (groups * state) | C (groups * state)
        return self.intermediate_size + 2 * self.group_state_size

    def state(self) -> RecurrentStateSpec:
        groups = StateSection(self.group_state_size, self.n_groups)
        return RecurrentStateSpec(
            "mamba2",
            (
                StateTensor(
                    "conv",
                    "conv",
                    (StateSection(self.intermediate_size, self.num_heads), groups, groups),
                    (self.conv_kernel - 1,),
                ),
                StateTensor(
                    "ssm",
                    "recurrent",
                    (StateSection(self.num_heads, self.num_heads),),
                    (self.head_dim, self.state_size),
                ),
            ),
        )


class Mamba1Spec(_Frozen):
    """A Mamba1 mixer (Jamba): in_proj gives x | z over `intermediate_size` channels; x goes
    through a causal conv, then x_proj gives dt (`dt_rank`) | B | C (`state_size` each), each
    RMS-normalised, and dt_proj widens dt to the channels. The state of a channel is a row of
    `state_size` values, decayed per column by exp(dt * A[channel, column])."""

    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float

    def state(self) -> RecurrentStateSpec:
        channels = StateSection(self.intermediate_size, self.intermediate_size)
        return RecurrentStateSpec(
            "mamba1",
            (
                StateTensor("conv", "conv", (channels,), (self.conv_kernel - 1,)),
                StateTensor("ssm", "recurrent", (channels,), (self.state_size,)),
            ),
        )


class GatedDeltaNetSpec(_Frozen):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): q and k in `num_key_heads` heads, v, the gate z and
    the per-head b, a in `num_value_heads`; each key head serves a run of
    num_value_heads / num_key_heads consecutive value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    norm_eps: float
    chunk_size: int = 64
    # beta = beta_scale * sigmoid(b): 2 lets the state transition's eigenvalues go negative
    # (OLMo-Hybrid's `linear_allow_neg_eigval`).
    beta_scale: float = 1.0
    # Kimi Delta Attention: the decay per key channel, g = -exp(A_log) * softplus(f(x) +
    # dt_bias) with f low-rank (rank key_head_dim) and a dt bias per channel; the output gate
    # low-rank too, through a sigmoid (Gated DeltaNet: z from in_proj, through silu).
    per_channel_decay: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        # conv rows are three sections: q (key_dim) | k (key_dim) | v (value_dim)
        return 2 * self.key_dim + self.value_dim

    def state(self) -> RecurrentStateSpec:
        keys = StateSection(self.key_dim, self.num_key_heads)
        return RecurrentStateSpec(
            "gdn",
            (
                StateTensor(
                    "conv",
                    "conv",
                    (keys, keys, StateSection(self.value_dim, self.num_value_heads)),
                    (self.conv_kernel - 1,),
                ),
                StateTensor(
                    "recurrent",
                    "recurrent",
                    (StateSection(self.num_value_heads, self.num_value_heads),),
                    (self.key_head_dim, self.value_head_dim),
                ),
            ),
        )


class ShortConvSpec(_Frozen):
    """A gated short convolution (LFM2): in_proj gives B | C | x over `channels` (the hidden
    size), y = C * conv(B * x), a depthwise causal conv without activation, then out_proj.
    Its state is the conv window alone."""

    channels: int
    conv_kernel: int
    bias: bool

    def state(self) -> RecurrentStateSpec:
        channels = StateSection(self.channels, self.channels)  # every channel on its own
        return RecurrentStateSpec(
            "short_conv", (StateTensor("conv", "conv", (channels,), (self.conv_kernel - 1,)),)
        )


class RopeSpec(_Frozen):
    theta: float
    rotary_dim: int


class LatentKVSpec(_Frozen):
    """Multi-head latent attention (Kimi Linear, after DeepSeek-V2): each token's keys and
    values are one shared latent, kv_a(x) = c (`kv_lora_rank`, RMS-normed) | k_rope
    (`qk_rope_head_dim`), and that latent is what the KV cache holds (one "head" of their
    width, one plane: V is K). Per head, kv_b expands c into k_nope (`qk_nope_head_dim`) and v
    (`v_head_dim`); queries (from q_proj, or q_a -> norm -> q_b with `q_lora_rank`) are
    k_nope's width plus the rope part."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    norm_eps: float = 1e-6


class AttentionSpec(_Frozen):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    scale: float
    rope: RopeSpec | None
    # Gated attention (Qwen3-Next, Qwen3.5): q_proj gives each head its queries then as many
    # gate logits; the output is multiplied by sigmoid(gate) before o_proj.
    output_gate: bool = False
    # RMSNorm over q and k before RoPE, with this epsilon (None: none): per head ("head",
    # weights of head_dim) or over all heads' projection at once ("all_heads", OLMo).
    qk_norm_eps: float | None = None
    qk_norm_scope: Literal["head", "all_heads"] = "head"
    # The width q, k and v project from, where it is not the hidden size (Zamba2's shared
    # blocks attend over [hidden | embeddings], twice the hidden size).
    input_size: int | None = None
    # Latent attention: num_kv_heads is 1 and head_dim the latent's width (the cache's shape).
    latent: LatentKVSpec | None = None


class MLPSpec(_Frozen):
    intermediate_size: int
    activation: Activation
    # gated: act(gate(x)) * up(x); otherwise act(up(x)).
    gated: bool
    bias: bool


class MoESpec(_Frozen):
    num_experts: int
    top_k: int
    intermediate_size: int
    activation: Activation
    gated: bool
    # "sigmoid_grouped": sigmoid scores + correction bias, group-limited top-k (NemotronH,
    # DeepSeek-V3).
    # "softmax_topk": top-k of the logits, softmax over the chosen k (Granite / Mixtral).
    router: Literal["sigmoid_grouped", "softmax_topk"]
    num_expert_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None
    # sigmoid_grouped: whether a learned per-expert bias is added to the scores that choose
    # the experts, and the epsilon of the chosen weights' renormalisation.
    score_bias: bool = True
    topk_norm_eps: float = 1e-20
    shared: MLPSpec | None = None
    # The shared expert's output is scaled by sigmoid(a learned per-token logit).
    shared_gate: bool = False


class SharedBlockSpec(_Frozen):
    """Zamba2's shared transformer blocks: `num_blocks` blocks of weights (attention over
    [hidden | the token embeddings], then a gated MLP, each pre-norm and without a residual),
    invoked at several depths in turn: invocation j runs block j % num_blocks with its own
    low-rank adapters (rank `adapter_rank`) on the MLP's gate | up projection, and on q, k and
    v where `attention_adapters`, its own KV cache layer and its own output linear. The
    invocation's output is added to the next sublayer's input, not to the residual."""

    num_blocks: int
    adapter_rank: int
    attention_adapters: bool
    mlp: MLPSpec


class HybridModelConfig(_Frozen):
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[LayerKind, ...]
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Zero-centred RMSNorms (Qwen3-Next, Qwen3.5): the checkpoint stores w, the norm scales by
    # 1 + w (the residual norms, the final norm and attention's q/k norms).
    zero_centred_norms: bool = False
    # Sublayers whose norm applies to the op's output, x + norm(op(x)) (OLMo's attention
    # layers), where the others compute x + op(norm(x)).
    post_norm_layer_ids: tuple[int, ...] = ()
    # Sublayers that read the input of the sublayer before them rather than its output, so
    # both add to one residual: x + a(norm(x)) + b(norm'(x)) (Falcon-H1's attention beside
    # its Mamba2 mixer).
    parallel_layer_ids: tuple[int, ...] = ()
    # Scalars of the checkpoint format that its adapter folds into the weights at load
    # (Falcon-H1's muP multipliers); the model never reads them.
    weight_multipliers: Mapping[str, float] = {}
    mamba2: MambaSpec | None = None
    mamba1: Mamba1Spec | None = None
    gdn: GatedDeltaNetSpec | None = None
    short_conv: ShortConvSpec | None = None
    attention: AttentionSpec | None = None
    shared_block: SharedBlockSpec | None = None
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    # Multi-token prediction layers the checkpoint ships (`mtp.*`, models/mtp.py): the
    # sublayers of one prediction step, and how many steps have layers of their own (later
    # steps reuse them in turn); none: () and 0.
    mtp_layer_kinds: tuple[LayerKind, ...] = ()
    num_mtp_steps: int = 0

    def model_post_init(self, context: Any, /) -> None:
        for kind in set(self.layer_kinds) | set(self.mtp_layer_kinds):
            if getattr(self, kind) is None:
                raise ValueError(f"layer kind '{kind}' is used but has no spec")
        if set(self.mtp_layer_kinds) & set(RECURRENT_KINDS):
            raise ValueError("multi-token-prediction layers hold no recurrent state")
        if bool(self.mtp_layer_kinds) != bool(self.num_mtp_steps):
            raise ValueError("mtp_layer_kinds and num_mtp_steps go together")
        if any(not 0 < i < len(self.layer_kinds) for i in self.parallel_layer_ids):
            raise ValueError("a parallel sublayer needs a sublayer before it")
        kinds = self.layer_kinds
        feeding = [i for i, kind in enumerate(kinds) if kind == "shared_block"]
        if any(i + 1 == len(kinds) or kinds[i + 1] == "shared_block" for i in feeding):
            raise ValueError("a shared block feeds the sublayer after it, which must exist")
        if self.shared_block is not None and self.attention is None:
            raise ValueError("a shared block attends: it needs the attention spec")
        recurrent = {kind for kind in self.layer_kinds if kind in RECURRENT_KINDS}
        if len(recurrent) > 1:
            # NOTE: the state pools hold one state description; a model mixing recurrent kinds
            # would need a pool set per kind.
            raise ValueError(f"one recurrent layer kind per model, got {sorted(recurrent)}")

    @cached_property
    def recurrent_kind(self) -> LayerKind | None:
        return next((kind for kind in self.layer_kinds if kind in RECURRENT_KINDS), None)

    @cached_property
    def recurrent_state(self) -> RecurrentStateSpec | None:
        """What each recurrent layer keeps per sequence; None without recurrent layers."""
        kind = self.recurrent_kind
        return None if kind is None else getattr(self, kind).state()

    @cached_property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in RECURRENT_KINDS)

    @cached_property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The sublayers that hold a layer of the KV pool (attention, shared-block
        invocations)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in KV_KINDS)

    @property
    def num_recurrent_layers(self) -> int:
        return len(self.recurrent_layer_ids)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    @property
    def kv_planes(self) -> int:
        """Planes of the KV pool: K and V, or the latent alone."""
        return 1 if self.attention is not None and self.attention.latent is not None else 2

    @property
    def num_mtp_attention_layers(self) -> int:
        """The KV layers the multi-token-prediction layers add to the pool when they run."""
        return self.mtp_layer_kinds.count("attention") * self.num_mtp_steps


_MISSING: Any = object()


class ConfigReader:
    """Reads typed fields out of a raw `config.json` dict with aliases and named errors."""

    def __init__(self, raw: dict[str, Any], file: str) -> None:
        self.raw = raw
        self.file = file

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(self.file, field, message)

    def has(self, *names: str) -> bool:
        return any(self.raw.get(name) is not None for name in names)

    def _lookup(self, name: str, aliases: tuple[str, ...]) -> tuple[str, Any]:
        for key in (name, *aliases):
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return name, _MISSING

    def int(
        self, name: str, default: Any = _MISSING, *, aliases: tuple[str, ...] = (), minimum: int = 1
    ) -> int:
        key, value = self._lookup(name, aliases)
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(name, "required but missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def float(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        aliases: tuple[str, ...] = (),
        positive: bool = False,
    ) -> float:
        key, value = self._lookup(name, aliases)
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(name, "required but missing")
            return default
        number = parse_float(value)
        if number is None:
            raise self.error(key, f"expected a number, got {value!r}")
        if positive and not number > 0:
            raise self.error(key, f"must be > 0, got {value!r}")
        return number

    def bool(self, name: str, default: Any = _MISSING, *, aliases: tuple[str, ...] = ()) -> bool:
        key, value = self._lookup(name, aliases)
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(name, "required but missing")
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def activation(self, name: str, default: Any = _MISSING) -> Activation:
        key, value = self._lookup(name, ())
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(name, "required but missing")
            value = default
        aliases = {"silu": "silu", "swish": "silu", "relu2": "relu2", "gelu": "gelu"}
        if value not in aliases:
            raise self.error(
                key, f"unsupported activation {value!r} (supported: silu, relu2, gelu)"
            )
        return aliases[value]  # type: ignore[return-value]

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self.raw.get(name)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.error(name, f"expected a token id or a list of token ids, got {value!r}")
        return tuple(values)

    def dt_limit(self, name: str, *, aliases: tuple[str, ...] = ()) -> tuple[float, float]:
        name, value = self._lookup(name, aliases)
        if value is _MISSING:
            return (0.0, math.inf)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self.error(name, f"expected [min, max], got {value!r}")
        low, high = parse_float(value[0]), parse_float(value[1])
        if low is None or high is None or not 0 <= low < high:
            raise self.error(name, f"expected 0 <= min < max, got {value!r}")
        return (low, high)


def parse_float(value: Any) -> float | None:
    """A JSON number, or the encodings transformers uses for non-finite floats."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, str) and value in ("Infinity", "-Infinity", "inf", "-inf", "NaN"):
        return float(value.replace("Infinity", "inf"))
    return None


_LAYER_NAMES: dict[str, LayerKind] = {
    "mamba": "mamba2",
    "mamba2": "mamba2",
    "linear_attention": "mamba2",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def parse_layer_names(
    reader: ConfigReader,
    field: str,
    allowed: set[LayerKind],
    names: Mapping[str, LayerKind] = _LAYER_NAMES,
    *,
    counted: bool = False,
) -> list[LayerKind]:
    """A list of per-layer type names (current and legacy spellings; `names` maps them, the
    Mamba2 families' by default) -> our layer kinds; `counted`: it must list as many layers
    as `num_hidden_layers` says, where the config gives that."""
    value = reader.raw[field]
    if not isinstance(value, list) or not value:
        raise reader.error(field, f"expected a non-empty list of layer types, got {value!r}")
    kinds: list[LayerKind] = []
    for index, name in enumerate(value):
        kind = names.get(name) if isinstance(name, str) else None
        if kind is None or kind not in allowed:
            known = sorted(n for n, k in names.items() if k in allowed)
            raise reader.error(
                field, f"unknown layer type {name!r} at index {index} (known: {', '.join(known)})"
            )
        kinds.append(kind)
    if counted and reader.has("num_hidden_layers"):
        layers = reader.int("num_hidden_layers")
        if layers != len(kinds):
            raise reader.error(
                field, f"lists {len(kinds)} layers but num_hidden_layers is {layers}"
            )
    return kinds
