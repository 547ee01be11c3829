"""A run's model as a Hugging Face `LlamaForCausalLM` checkpoint, where that is the same function.

T_fixed + T_S fold into one embedding table and the layers map one to one (RoPE rows reordered); a boundary
projection, stage-local embeddings of a multi-stage run or context-parallel attention have no LLaMA equivalent,
so `llama_blockers` says why a run cannot be written this way and the caller refuses.

Pure logic: a bundle (`swarm/export.py`) in, a config and tensors out, written by hand as safetensors so neither
`safetensors` nor `transformers` is needed here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from swarm.export import ExportError, one_line
from swarm.manifest import Manifest


def llama_blockers(manifest: Manifest, projects_boundary: Iterable[bool]) -> list[str]:
    """Why the run's function is not a plain LLaMA (empty when it is). `projects_boundary`: per stage, whether
    it ends with the boundary projection (`PipelineStage.projects_boundary`)."""
    reasons = []
    if any(projects_boundary):
        reasons.append(f"compression {manifest.compression!r} projects every stage boundary onto T_fixed + span(U)")
    if manifest.stage_embedding_rank and manifest.num_stages > 1:
        reasons.append("every stage adds and removes its own token embedding (stage_embedding_rank)")
    if manifest.context_parallel is not None:
        reasons.append("context-parallel attention passes K/V between chunks through their subspace")
    return reasons


def _rope_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from this model's RoPE on interleaved pairs (2i, 2i+1) to Hugging Face's on halves (i, i+hd/2):
    the same rotation once each head's rows are reordered evens first, odds after (q·k is unchanged)."""
    rows, cols = weight.shape
    head_dim = rows // heads
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.view(heads, head_dim, cols)[:, order, :].reshape(rows, cols)


def to_llama(manifest: Manifest, bundle: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """A `LlamaForCausalLM` config and state dict computing the bundle's float32 chain (no wire rounding).
    The caller checks `llama_blockers` first: this does not re-check."""
    shape, sd = manifest.model, bundle["state_dict"]
    last = manifest.num_stages - 1
    embed = bundle["t_fixed"].float() + sd["stages.0.t_s"].float()
    if manifest.stage_embedding_rank:  # one stage (else blocked): its table is added at the input, never removed
        table = sd["stages.0.stage_embedding.table"].float()
        up = sd.get("stages.0.stage_embedding.up")
        embed = embed + (table if up is None else table @ up.float())
    out = {"model.embed_tokens.weight": embed}
    for stage in range(manifest.num_stages):
        for local, layer in enumerate(manifest.layers_of(stage)):
            src, dst = f"stages.{stage}.layers.{local}.", f"model.layers.{layer}."
            out[dst + "self_attn.q_proj.weight"] = _rope_halves(sd[src + "attn.wq.weight"], shape.n_heads)
            out[dst + "self_attn.k_proj.weight"] = _rope_halves(sd[src + "attn.wk.weight"], shape.n_kv_heads)
            out[dst + "self_attn.v_proj.weight"] = sd[src + "attn.wv.weight"]
            out[dst + "self_attn.o_proj.weight"] = sd[src + "attn.wo.weight"]
            out[dst + "mlp.gate_proj.weight"] = sd[src + "mlp.w1.weight"]
            out[dst + "mlp.up_proj.weight"] = sd[src + "mlp.w3.weight"]
            out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.w2.weight"]
            out[dst + "input_layernorm.weight"] = sd[src + "attn_norm.weight"]
            out[dst + "post_attention_layernorm.weight"] = sd[src + "mlp_norm.weight"]
    out["model.norm.weight"] = sd[f"stages.{last}.final_norm.weight"]
    out["lm_head.weight"] = sd[f"stages.{last}.lm_head.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.d_model // shape.n_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_seq_len,
        "rope_theta": shape.rope_theta,  # transformers 4's name; 5 reads rope_parameters
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rms_norm_eps": shape.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "protocol_swarm": {"run_id": manifest.run_id, "tokenizer": manifest.tokenizer},
    }
    return config, {name: tensor.contiguous() for name, tensor in out.items()}


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The safetensors format by hand (8-byte header length, JSON header, raw little-endian bytes), so writing a
    Hugging Face checkpoint needs neither `safetensors` nor `transformers` installed here."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(f"{name}: dtype {tensor.dtype} has no safetensors name here")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for tensor in tensors.values():
            handle.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def write_llama(manifest: Manifest, bundle: dict, folder: Path) -> None:
    """`config.json` and `model.safetensors` in `folder`: `LlamaForCausalLM.from_pretrained(folder)` loads them."""
    config, tensors = to_llama(manifest, bundle)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, folder / "model.safetensors")
    except OSError as exc:
        raise ExportError(f"cannot write the LLaMA checkpoint to {folder}: {one_line(exc)}") from None

