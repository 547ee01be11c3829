"""The run manifest: everything peers must agree on before they exchange a single tensor.

A run is identified by the hash of its canonical manifest, so two peers with the same `run_id`
compute the same function. An optional field left at its default (`context_parallel` off) is
left out of the canonical JSON, so adding such a field does not change existing runs' ids. The
manifest also records the SHA-256 of `T_fixed` and of `U` version 0, which every peer recomputes
from the seed and checks before it starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from swarm.context_parallel import ContextParallelSpec
from swarm.modes import DEFAULT, MODES, CompressionMode
from swarm.subspace import T_FIXED_STD
from swarm.subspace_update import SubspaceDriver, SubspaceDriverName, subspace_driver
from swarm.wire_dtype import WireDType, WireDTypeName, wire_dtype

MANIFEST_FORMAT = 1
# optional fields left out of the canonical JSON at these values, so manifests written before the field
# existed keep their run ids (and, for `t_fixed_std`, their T_fixed bytes and hash)
_OMITTED_AT = {"context_parallel": None, "t_fixed_std": T_FIXED_STD, "stage_embedding_rank": 0}


class ManifestError(ValueError):
    """A manifest broke a rule; the message names the field and the rule."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelShape(_Strict):
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    d_ff: int = Field(gt=0)
    vocab_size: int = Field(ge=2, le=1 << 20)
    max_seq_len: int = Field(gt=1)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model.d_model / model.n_heads must be even (RoPE rotates pairs)")
        return self


class StageSpec(_Strict):
    """Layers `[first_layer, end_layer)` of the decoder."""

    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)


class OptimizerSpec(_Strict):
    lr: float = Field(default=1e-3, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _moments_bounded(self) -> OptimizerSpec:
        # Adam's first moment is bounded by its second only when β1² < β2: a peer checks a served optimizer
        # state against that bound (swarm/optimizer_state.py)
        if self.beta1**2 >= self.beta2:
            raise ValueError(f"optimizer.beta1² ({self.beta1**2:g}) must be below optimizer.beta2 ({self.beta2:g})")
        return self


class BatchSpec(_Strict):
    microbatch_size: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    target_batch_size: int = Field(gt=0, description="sequences per optimizer step, summed over a stage's peers")


class Manifest(_Strict):
    format: int = MANIFEST_FORMAT
    name: str = Field(min_length=1, max_length=64)
    model: ModelShape
    stages: tuple[StageSpec, ...]
    k: int
    compression: str = DEFAULT  # a name in swarm.modes.MODES
    wire_dtype: WireDTypeName = "bf16"
    seed: int = Field(ge=0, lt=1 << 63)
    tokenizer: str = "bytes"
    dataset: str = "builtin:stdlib"
    optimizer: OptimizerSpec = OptimizerSpec()
    batch: BatchSpec
    subspace_update_interval: int = Field(default=0, ge=0, description="optimizer epochs between U updates; 0 = never")
    subspace_driver: SubspaceDriverName = "gradient"
    subspace_step: float = Field(default=0.05, gt=0, le=1, description="Grassmann step size (radians, roughly)")
    # the frozen embedding's per-element standard deviation: what carries token identity past a rank-k
    # boundary, so it must not be small next to what the layers write (DESIGN §2.10)
    t_fixed_std: float = Field(default=T_FIXED_STD, gt=0, le=100)
    # a stage-local learned token embedding, added at every stage's input and removed before its output
    # (nothing new on the wire): 0 = none; d_model = a V×d table per stage; 0 < r < d_model = V×r · r×d
    stage_embedding_rank: int = Field(default=0, ge=0)
    t_fixed_sha256: str = ""
    u_sha256: str = ""
    # chunks of a sequence on different peers, K/V compressed between them (swarm/context_parallel.py)
    context_parallel: ContextParallelSpec | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_options(self, handler) -> dict:
        """An optional field at its old default is absent (context parallelism off is absent, not null): the
        run ids of manifests written without it stay as they were."""
        data = handler(self)
        for key, default in _OMITTED_AT.items():
            if key in data and data[key] == default:
                del data[key]
        return data

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: int) -> int:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"format must be {MANIFEST_FORMAT} (the manifest format this software reads), got {value}")
        return value

    @field_validator("compression")
    @classmethod
    def _known_mode(cls, name: str) -> str:
        if name not in MODES:
            raise ValueError(f"compression must be one of {', '.join(map(repr, MODES))}, got {name!r}")
        return name

    @field_validator("k")
    @classmethod
    def _k_positive(cls, k: int) -> int:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        return k

    @field_validator("tokenizer")
    @classmethod
    def _known_tokenizer(cls, tokenizer: str) -> str:
        if tokenizer != "bytes" and not tokenizer.startswith("hf:"):
            raise ValueError(f"tokenizer must be 'bytes' or 'hf:<name>', got {tokenizer!r}")
        return tokenizer

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        shape = self.model
        if self.k >= shape.d_model:
            raise ValueError(f"k ({self.k}) must be smaller than model.d_model ({shape.d_model})")
        if self.tokenizer == "bytes" and shape.vocab_size < 256:
            raise ValueError(f"model.vocab_size ({shape.vocab_size}) must be >= 256 for the byte tokenizer")
        if self.batch.seq_len > shape.max_seq_len:
            raise ValueError(
                f"batch.seq_len ({self.batch.seq_len}) must not exceed model.max_seq_len ({shape.max_seq_len})"
            )
        if not self.stages:
            raise ValueError("stages must list at least one stage")
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.first_layer != expected:
                raise ValueError(
                    f"stages[{i}].first_layer is {stage.first_layer} but must be {expected}: "
                    "stages must cover the layers exactly, in order, without gaps or overlaps"
                )
            if stage.end_layer <= stage.first_layer:
                raise ValueError(f"stages[{i}] must hold at least one layer (end_layer > first_layer)")
            expected = stage.end_layer
        if expected != shape.n_layers:
            raise ValueError(
                f"stages end at layer {expected} but model.n_layers is {shape.n_layers}: "
                "stages must cover the layers exactly"
            )
        if self.stage_embedding_rank > shape.d_model:
            raise ValueError(
                f"stage_embedding_rank ({self.stage_embedding_rank}) must be at most model.d_model ({shape.d_model}): "
                "d_model means a full table per stage"
            )
        if self.context_parallel is not None:
            self.context_parallel.validate(shape, self.batch.seq_len)
        for field in ("t_fixed_sha256", "u_sha256"):
            value = getattr(self, field)
            if value and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
                raise ValueError(f"{field} must be 64 lowercase hex digits")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        """Short hash of the canonical manifest: names every DHT key of the run."""
        digest = hashlib.sha256(self.canonical_json().encode()).hexdigest()
        return f"{self.name}-{digest[:12]}"

    @property
    def mode(self) -> CompressionMode:
        """The compression mode's answers (`swarm/modes/`): what is constrained, what crosses a boundary."""
        return MODES[self.compression]

    @property
    def wire(self) -> WireDType:
        """The wire dtype's answers (`swarm/wire_dtype.py`): bytes per token, encoding and decoding."""
        return wire_dtype(self.wire_dtype)

    @property
    def u_driver(self) -> SubspaceDriver:
        """What moves U (`swarm/subspace_update.py`): which terms accumulate, which stages contribute."""
        return subspace_driver(self.subspace_driver)

    @property
    def lanes(self) -> int:
        """P: the lanes (chunks of every sequence) each stage has; 1 when the run has no context parallelism."""
        return self.context_parallel.size if self.context_parallel is not None else 1

    @property
    def updates_u(self) -> bool:
        """Whether U moves during this run: an update interval is set and the mode has a U to move."""
        return self.subspace_update_interval > 0 and self.mode.moves_u

    def optimizer_run_id(self, stage: int) -> str:
        """The run id of a stage's hivemind optimizer (its averagers' and progress records' keys start with it);
        hivemind matchmaking refuses '.' in a run id."""
        return f"{self.run_id.replace('.', '_')}_stage{stage}"

    def layers_of(self, stage: int) -> range:
        spec = self.stages[stage]
        return range(spec.first_layer, spec.end_layer)

    def dense_bytes_per_token(self) -> int:
        """What the dense baseline sends per token across one boundary in one direction."""
        return self.wire.payload_bytes(1, self.model.d_model)

    def compressed_bytes_per_token(self) -> int:
        """Payload per token, forward, in compressed modes: k coefficients (int8: plus their scale) and the
        token id; the backward message is the same without the id."""
        if not self.mode.compressed:
            return self.dense_bytes_per_token()
        return self.wire.payload_bytes(1, self.k) + token_id_itemsize(self.model.vocab_size)


def token_id_itemsize(vocab_size: int) -> int:
    if vocab_size <= 1 << 8:
        return 1
    if vocab_size <= 1 << 16:
        return 2
    return 4


def even_stages(n_layers: int, n_stages: int) -> tuple[StageSpec, ...]:
    """Split layers into contiguous stages; earlier stages take the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise ManifestError(f"stages must be between 1 and model.n_layers ({n_layers}), got {n_stages}")
    base, extra = divmod(n_layers, n_stages)
    specs, first = [], 0
    for i in range(n_stages):
        end = first + base + (1 if i < extra else 0)
        specs.append(StageSpec(first_layer=first, end_layer=end))
        first = end
    return tuple(specs)


def parse_manifest(data: dict) -> Manifest:
    """Validate a manifest dict; every broken rule becomes one ManifestError naming its field."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "manifest"
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message}")
        raise ManifestError("invalid manifest: " + "; ".join(problems)) from None


def load_manifest(path: str | Path) -> Manifest:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ManifestError(f"manifest file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest file {path} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, binary bytes
        raise ManifestError(f"manifest file {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"manifest file {path} must hold a JSON object")
    return parse_manifest(data)


def save_manifest(manifest: Manifest, path: str | Path) -> None:
    Path(path).write_text(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
