"""Small NVFP4 checkpoints written from scratch, in either producer's format.

Used by ``scripts/make_sample.py`` (the built-in sample) and by the tests, which need fresh random
checkpoints of odd shapes. Weights are quantized from real-valued matrices the way ModelOpt does
(per-tensor amax / (6 * 448), per-block amax / 6, round to nearest E2M1), so dequantized weights are
close to the originals and a model built from them computes something meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..nvfp4 import BLOCK_SIZE, E2M1_VALUES, NVFP4Weight, pack_codes

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def quantize_nvfp4(weight: torch.Tensor, amax: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a real ``[N, K]`` matrix to NVFP4 (codes, e4m3 block scales, float32 multiplier).

    ``amax`` (default: the matrix's own) sets the multiplier: give the partitions of one fused module (q/k/v,
    gate/up) their largest, and they share one global scale, as llm-compressor and ModelOpt write them.
    """
    w = weight.to(torch.float32)
    n, k = w.shape
    amax = w.abs().max() if amax is None else amax.to(torch.float32)
    multiplier = (amax.clamp(min=1e-12) / (E2M1_MAX * E4M3_MAX)).reshape(1)
    blocks = w.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_scales = (blocks.abs().amax(-1) / E2M1_MAX / multiplier).to(torch.float8_e4m3fn)
    denom = block_scales.to(torch.float32).unsqueeze(-1) * multiplier
    scaled = torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks)).reshape(n, k)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1).to(torch.uint8)
    codes = codes | ((scaled < 0).to(torch.uint8) << 3)
    return NVFP4Weight(pack_codes(codes), block_scales, multiplier.to(torch.float32))


def random_nvfp4(
    n: int, k: int, generator: torch.Generator | None = None, *, allow_zero_scales: bool = False
) -> NVFP4Weight:
    """Random codes (all 256 byte values), random finite e4m3 scales (positive, or also zero), a random multiplier."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    lowest = 0 if allow_zero_scales else 1
    scale_bits = torch.randint(lowest, 0x7F, (n, k // BLOCK_SIZE), dtype=torch.uint8, generator=generator)
    multiplier = torch.rand(1, generator=generator) * 1e-2 + 1e-4
    return NVFP4Weight(codes, scale_bits.view(torch.float8_e4m3fn), multiplier.to(torch.float32))


def input_scale(weight: NVFP4Weight) -> torch.Tensor:
    """A W4A4 layer's activation dequant scale (ModelOpt's ``input_scale``, the reciprocal of compressed-tensors'
    ``input_global_scale``): float32 ``[]``, drawn from the layer's own random block scales so that the layers, and
    the q/k/v and gate/up of one block (which share a multiplier), differ: vLLM's fused modules keep one of them."""
    return (weight.block_scales.to(torch.float32).mean() * 1e-3 + 2e-3).to(torch.float32)


def layer_tensors(prefix: str, weight: NVFP4Weight, fmt: str, w4a4: bool) -> dict[str, torch.Tensor]:
    """The tensors a producer stores for one quantized linear."""
    if fmt == "modelopt":
        out = {
            f"{prefix}.weight": weight.codes,
            f"{prefix}.weight_scale": weight.block_scales,
            f"{prefix}.weight_scale_2": weight.multiplier.reshape(()),
        }
        if w4a4:
            out[f"{prefix}.input_scale"] = input_scale(weight)
        return out
    out = {
        f"{prefix}.weight_packed": weight.codes,
        f"{prefix}.weight_scale": weight.block_scales,
        f"{prefix}.weight_global_scale": torch.reciprocal(weight.multiplier).reshape(1),
    }
    if w4a4:
        out[f"{prefix}.input_global_scale"] = torch.reciprocal(input_scale(weight)).reshape(1)
    return out


def quantization_config(fmt: str, w4a4: bool, ignore: list[str]) -> tuple[dict, dict | None]:
    """``config.json``'s quantization_config and, for ModelOpt, hf_quant_config.json."""
    if fmt == "modelopt":
        algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
        hf = {
            "producer": {"name": "modelopt", "version": "synthetic"},
            "quantization": {"quant_algo": algo, "group_size": BLOCK_SIZE, "exclude_modules": ignore},
        }
        return {"quant_method": "modelopt", "quant_algo": algo, "ignore": ignore}, hf
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK_SIZE, "symmetric": True}
    group = {"targets": ["Linear"], "weights": scheme, "input_activations": dict(scheme, dynamic="local") if w4a4 else None}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": dict(group, format="nvfp4-pack-quantized")},
        "ignore": ignore,
    }
    return qc, None


def write_checkpoint(
    root: Path,
    quantized: dict[str, NVFP4Weight],
    plain: dict[str, torch.Tensor],
    *,
    fmt: str,
    w4a4: bool = False,
    config: dict | None = None,
    shards: int = 1,
    ignore: list[str] | None = None,
) -> Path:
    """Write a Hugging Face-style NVFP4 checkpoint folder (optionally split into ``shards`` files + index)."""
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, weight in quantized.items():
        tensors.update(layer_tensors(prefix, weight, fmt, w4a4))
    tensors.update(plain)
    qc, hf = quantization_config(fmt, w4a4, ignore or [])
    (root / "config.json").write_text(json.dumps(dict(config or {}, quantization_config=qc), indent=2))
    if hf is not None:
        (root / "hf_quant_config.json").write_text(json.dumps(hf, indent=2))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, root / "model.safetensors", metadata={"format": "pt"})
        return root
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, root / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


def llama_layers(
    hidden: int, heads: int, kv_heads: int, intermediate: int, generator: torch.Generator, *, layers: int = 1,
    head_dim: int = 16, shared_scales: bool = True,
) -> dict[str, NVFP4Weight]:
    """Random NVFP4 q/k/v/o and gate/up/down of a Llama decoder; ``shared_scales``: every partition of a
    fused module gets one multiplier, as llm-compressor and ModelOpt write them."""
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    out = {}
    for i in range(layers):
        shared = {}
        for name, (n, k) in shapes.items():
            weight = random_nvfp4(n, k, generator)
            group = name.split(".")[0] + ("" if name.endswith(("o_proj", "down_proj")) else "-fused")
            if shared_scales:
                weight = NVFP4Weight(weight.codes, weight.block_scales, shared.setdefault(group, weight.multiplier).clone())
            out[f"model.layers.{i}.{name}"] = weight
    return out


def write_llama(
    root: Path, fmt: str, *, hidden: int, heads: int, kv_heads: int, intermediate: int, generator: torch.Generator,
    layers: int = 1, head_dim: int = 16, vocab: int = 64, w4a4: bool = False,
    quantized: dict[str, NVFP4Weight] | None = None, max_positions: int = 128, plain_std: float = 1.0,
) -> Path:
    """A Llama checkpoint that vLLM can build (config.json, embeddings and bf16 lm_head of standard deviation
    ``plain_std``, norms); tiny by default."""
    quantized = quantized or llama_layers(hidden, heads, kv_heads, intermediate, generator, layers=layers,
                                          head_dim=head_dim)
    plain = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=generator) * plain_std).bfloat16(),
             "lm_head.weight": (torch.randn(vocab, hidden, generator=generator) * plain_std).bfloat16(),
             "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plain[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": layers, "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    }
    return write_checkpoint(root, quantized, plain, fmt=fmt, w4a4=w4a4, config=config, ignore=["lm_head"])


def write_qwen_moe(
    root: Path, fmt: str, *, hidden: int, experts: int, intermediate: int, generator: torch.Generator,
    layers: int = 1, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None, vocab: int = 64, top_k: int = 2,
    shared_scales: bool = True, shared_expert: int = 0, dense_layers: tuple[int, ...] = (), shards: int = 1,
    w4a4: bool = True, shared_input_scales: bool = False,
) -> Path:
    """A tiny W4A4 (``w4a4`` False: weight-only, ModelOpt ``W4A16_NVFP4`` / compressed-tensors ``NVFP4A16``) Qwen3-MoE
    checkpoint vLLM can build (Qwen2-MoE with ``shared_expert``, the intermediate size of
    its dense shared expert): NVFP4 attention and routed experts, every layer's input scale random (so that the
    largest, which vLLM's MoE kernels share among experts, is some expert's), bf16 routers, norms and embeddings.
    ``shared_scales``: each expert's gate and up share one multiplier, as the producers write them (else vLLM keeps
    gate's and warns). ``dense_layers``: layers with a dense NVFP4 MLP instead (config ``mlp_only_layers``).
    ``shared_input_scales``: each expert's up takes its gate's input scale, as the producers calibrate them (one
    input; SGLang loads one of the two into both halves of ModelOpt's w13). ``head_dim``: Qwen3-MoE's 16 by default;
    Qwen2-MoE has none of its own (vLLM and SGLang derive ``hidden // heads``), so it is that."""
    if shared_expert and head_dim not in (None, hidden // heads):
        raise ValueError(f"Qwen2-MoE's head_dim is hidden // heads = {hidden // heads}, not {head_dim}")
    head_dim = head_dim or (hidden // heads if shared_expert else 16)
    dense = llama_layers(hidden, heads, kv_heads, intermediate, generator, layers=layers, head_dim=head_dim)
    quantized = {p: w for p, w in dense.items() if ".self_attn." in p or int(p.split(".")[2]) in dense_layers}
    mlps = {f"model.layers.{i}.mlp.experts.{e}": intermediate for i in range(layers) if i not in dense_layers
            for e in range(experts)}
    mlps.update({f"model.layers.{i}.mlp.shared_expert": shared_expert for i in range(layers)
                 if shared_expert and i not in dense_layers})
    for owner, size in mlps.items():
        gate, up = random_nvfp4(size, hidden, generator), random_nvfp4(size, hidden, generator)
        quantized[f"{owner}.gate_proj"] = gate
        quantized[f"{owner}.up_proj"] = NVFP4Weight(up.codes, up.block_scales,
                                                    gate.multiplier.clone() if shared_scales else up.multiplier)
        quantized[f"{owner}.down_proj"] = random_nvfp4(hidden, size, generator)
    plain = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator).to(torch.bfloat16),
             "lm_head.weight": torch.randn(vocab, hidden, generator=generator).to(torch.bfloat16),
             "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    qk_norm = () if shared_expert else (("self_attn.q_norm", head_dim), ("self_attn.k_norm", head_dim))
    for i in range(layers):
        for norm, size in (("input_layernorm", hidden), ("post_attention_layernorm", hidden), *qk_norm):
            plain[f"model.layers.{i}.{norm}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        routers = {"mlp.gate": experts, **({"mlp.shared_expert_gate": 1} if shared_expert else {})}
        for router, rows in routers.items():
            if i not in dense_layers:
                weight = torch.randn(rows, hidden, generator=generator)
                plain[f"model.layers.{i}.{router}.weight"] = weight.to(torch.bfloat16)
        for proj, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)) if shared_expert else ():
            bias = torch.randn(rows * head_dim, generator=generator) * 0.1  # Qwen2's attention has q/k/v biases
            plain[f"model.layers.{i}.self_attn.{proj}.bias"] = bias.to(torch.bfloat16)
    drawn: dict[str, torch.Tensor] = {}
    for prefix in quantized if w4a4 else ():  # random activation scales in the producer's convention
        scale = drawn[prefix] = torch.rand((), generator=generator) * 1e-2 + 1e-3
        if shared_input_scales and prefix.endswith(".up_proj"):
            scale = drawn[prefix.removesuffix("up_proj") + "gate_proj"].clone()
        if fmt == "modelopt":
            plain[f"{prefix}.input_scale"] = scale.to(torch.float32)
        else:
            plain[f"{prefix}.input_global_scale"] = (1.0 / scale).to(torch.float32).reshape(1)
    model = ("Qwen2MoeForCausalLM", "qwen2_moe") if shared_expert else ("Qwen3MoeForCausalLM", "qwen3_moe")
    config = {
        "architectures": [model[0]], "model_type": model[1], "hidden_size": hidden,
        "intermediate_size": intermediate, "moe_intermediate_size": intermediate, "num_experts": experts,
        "num_experts_per_tok": top_k, "decoder_sparse_step": 1, "mlp_only_layers": list(dense_layers),
        "norm_topk_prob": True, "shared_expert_intermediate_size": shared_expert,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    }
    ignore = (["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"] if fmt != "modelopt"
              else ["lm_head", "*.mlp.gate", "*.shared_expert_gate"])
    return write_checkpoint(root, quantized, plain, fmt=fmt, w4a4=w4a4, config=config, ignore=ignore, shards=shards)
