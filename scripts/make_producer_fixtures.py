#!/usr/bin/env python3
"""Make small NVFP4 checkpoints with the REAL producers (run once by hand, not in CI).

Builds a tiny randomly initialised Llama (fixed seed) and quantizes it to NVFP4 on CPU with

* llm-compressor (compressed-tensors, ``nvfp4-pack-quantized``): presets NVFP4A16 and NVFP4, and the same after
  ``QuIPModifier`` / ``SpinQuantModifier`` rotations (online-transform checkpoints, ``TRANSFORM_FIXTURES``);
* nvidia-modelopt (``quant_method: modelopt``): NVFP4_DEFAULT_CFG (W4A4) and W4A16_NVFP4_CFG;

plus sharded variants written by the producers' own ``max_shard_size``, and the unquantized
bf16 base model (same seed, same weights) for reference.

Outputs go to ``tests/data/producers/<name>/``. Install the producers in a separate venv, with
torch pinned (an unpinned torch pulls a multi-GB CUDA build)::

    python3 -m venv /tmp/venv-producers
    /tmp/venv-producers/bin/pip install torch==2.13.0
    /tmp/venv-producers/bin/pip install torch==2.13.0 llmcompressor nvidia-modelopt transformers
    python3 -m venv /tmp/venv-modelopt
    /tmp/venv-modelopt/bin/pip install torch==2.13.0
    /tmp/venv-modelopt/bin/pip install torch==2.13.0 nvidia-modelopt==0.47.0 "transformers<5.15" \
        accelerate safetensors requests
    /tmp/venv-producers/bin/python scripts/make_producer_fixtures.py \
        --modelopt-python /tmp/venv-modelopt/bin/python

Two venvs because llmcompressor 0.14.0.1 requires transformers>=5.15,<=5.17 while
nvidia-modelopt 0.47.0 (its [hf] extra, and an import-time warning) wants transformers<5.15.

Each producer runs in its own subprocess (``--only NAME``) so that the two packages' module
patches never meet in one interpreter. The script ends by printing a summary of every fixture
(tensor names, dtypes, shapes, quantization_config) and writing ``summary.md`` next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "producers"

SEED = 0
# hidden 64 -> K=64 (4 groups of 16); intermediate 176 = 11*16, a multiple of 16 but not of 64,
# so down_proj has K=176 -> 11 scale groups and gate/up have N=176.
MODEL_CFG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 16
    num_key_value_heads=2,  # k/v_proj: N=32
    max_position_embeddings=128,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
SHARD_SIZE = "40KB"

# Online-transform checkpoints (llm-compressor's QuIPModifier / SpinQuantModifier before NVFP4). Block sizes must
# divide every targeted K (input side) or N (output side): K is 64 or 176 and N 32, 64 or 176 here, so blocks 32 and
# 64 leave out the layers they do not divide (down_proj for K; gate/up, and k/v for 64, for N).
TRANSFORM_FIXTURES = [
    "ct_quip_v_had16_nvfp4a16",
    "ct_quip_vu_rhad16_nvfp4",
    "ct_quip_v_rhad32_nvfp4a16",
    "ct_quip_vu_had32_nvfp4",
    "ct_quip_v_had64_nvfp4a16",
    "ct_quip_vu_rmat16_nvfp4a16",
    "ct_spinquant_r1r2r4_had16_nvfp4",
    "ct_spinquant_r1r2r4_rhad_nvfp4a16",
    "ct_spinquant_r3_had16_nvfp4a16",  # refused by convert: q_attn / k_cache (attention-side, online)
]

# Tiny Qwen3-MoE (4 experts, top-2, no shared experts; every layer sparse), the router ("mlp.gate") left
# unquantized. Two intermediate sizes: 128 (2I = 256: vLLM's FlashInfer CUTLASS MoE takes it at TP 1 and 2) and
# 48 (not a multiple of 128, nor 2I: FlashInfer CUTLASS refuses it, TRT-LLM-gen pads it).
MOE_CFG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,  # the dense MLP's (unused: every layer is sparse)
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
MOE_BASES = {"base_moe_bf16": 128, "base_moe_i48_bf16": 48}  # base -> moe_intermediate_size
MOE_FIXTURES = [
    *MOE_BASES,
    "ct_moe_nvfp4",
    "ct_moe_nvfp4a16",
    "ct_moe_i48_nvfp4",
    "modelopt_moe_nvfp4",
    "modelopt_moe_w4a16_nvfp4",
    "modelopt_moe_i48_nvfp4",
]
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]  # llm-compressor's Qwen3-MoE examples: the router stays bf16

# Tiny DeepSeek-V3: MLA attention (q_lora_rank set, so vLLM fuses q_a_proj + kv_a_proj_with_mqa), the first layer
# dense (first_k_dense_replace 1, intermediate 192), then an MoE layer of 4 routed experts (intermediate 128) in 2
# groups (grouped top-2 of top-1 group, noaux_tc: sigmoid scores with e_score_correction_bias) and 1 shared expert.
# Attention stays bf16 (both producers told so): the fused path refuses NVFP4 MLA (docs/moe.md); only MLPs are FP4.
TINY_CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                tie_word_embeddings=False, dtype="bfloat16")
DEEPSEEK_CFG = dict(
    **TINY_CFG, intermediate_size=192, moe_intermediate_size=128, first_k_dense_replace=1,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
)
DEEPSEEK_FIXTURES = ["base_deepseek_v3_bf16", "ct_deepseek_v3_nvfp4", "modelopt_deepseek_v3_nvfp4"]
DEEPSEEK_IGNORE = [*MOE_IGNORE, "re:.*self_attn.*"]

# Tiny Mixtral (both layers sparse, 4 experts, top-2): transformers 5 holds its experts fused and saves them, as
# both producers export them, under Mixtral's own names ``block_sparse_moe.experts.E.w1/w2/w3``. Intermediate 64:
# 2I = 128, which vLLM's FlashInfer CUTLASS MoE takes at TP 1 but not at TP 2 (TRT-LLM-gen pads it).
MIXTRAL_CFG = dict(**TINY_CFG, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                   head_dim=16)
MIXTRAL_FIXTURES = ["base_mixtral_bf16", "ct_mixtral_nvfp4", "modelopt_mixtral_nvfp4"]

# Tiny Qwen2-MoE: layer 0 dense (mlp_only_layers, intermediate 192), layer 1 with 4 routed experts (intermediate
# 128, top-2) and a shared expert (intermediate 96) behind its sigmoid gate (mlp.shared_expert_gate, [1, 64]),
# q/k/v with biases. Both routers stay bf16.
QWEN2_MOE_CFG = dict(**TINY_CFG, intermediate_size=192, moe_intermediate_size=128, shared_expert_intermediate_size=96,
                     num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], num_key_value_heads=2)
QWEN2_MOE_FIXTURES = ["base_qwen2_moe_bf16", "ct_qwen2_moe_nvfp4", "modelopt_qwen2_moe_nvfp4"]
QWEN2_MOE_IGNORE = [*MOE_IGNORE, "re:.*mlp.shared_expert_gate$"]
MIXTRAL_IGNORE = ["lm_head", "re:.*block_sparse_moe.gate$"]

FIXTURES = [
    "base_bf16",
    "ct_nvfp4a16",
    "ct_nvfp4",
    "ct_nvfp4a16_sharded",
    "modelopt_nvfp4",
    "modelopt_w4a16_nvfp4",
    "modelopt_nvfp4_sharded",
    *TRANSFORM_FIXTURES,
    *MOE_FIXTURES,
    *DEEPSEEK_FIXTURES,
    *MIXTRAL_FIXTURES,
    *QWEN2_MOE_FIXTURES,
]


def build_random_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(**MODEL_CFG)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    # Widen the weight distribution a little so scales differ between rows/groups.
    with torch.no_grad():
        g = torch.Generator().manual_seed(SEED + 1)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return model


def build_random_moe_model(intermediate: int):
    """The tiny Qwen3-MoE."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE_CFG, "moe_intermediate_size": intermediate}))
    _randomized(model)
    return model


def _randomized(model):
    """``model`` in bf16 with every weight (the experts' 3-D parameters too) ~ N(0, 0.05^2) from a fixed seed;
    returns the generator for anything else drawn after."""
    import torch

    model.to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return g


def build_random_mixtral_model():
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL_CFG))
    _randomized(model)
    return model


def build_random_qwen2_moe_model():
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(SEED)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**QWEN2_MOE_CFG))
    _randomized(model)
    return model


def build_random_deepseek_model():
    """The tiny DeepSeek-V3, its router's score correction bias ~ N(0, 0.1^2) in float32 (zero at init, which
    would hide a bias that is dropped)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_CFG))
    g = _randomized(model)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:  # float32 in DeepSeek's checkpoints
                module.e_score_correction_bias = torch.randn(module.e_score_correction_bias.shape, generator=g) * 0.1
    return model


def build_model(base_name: str = "base_bf16"):
    """Load a committed bf16 base (llm-compressor insists on a model with an on-disk path)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = OUT / base_name
    if not (base / "config.json").exists():
        globals()[f"make_{base_name}"](base_name)
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()


def tiny_tokenizer():
    """In-memory word-level tokenizer (llm-compressor wants a processor once a dataset is given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(MODEL_CFG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def calib_batches(n=4, seq=32):
    import torch

    g = torch.Generator().manual_seed(SEED + 2)
    return [torch.randint(0, MODEL_CFG["vocab_size"], (1, seq), generator=g) for _ in range(n)]


def fresh_dir(name) -> Path:
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


# --------------------------------------------------------------------------- base
def make_base_bf16(name):
    model = build_random_model()
    model.save_pretrained(fresh_dir(name))


# --------------------------------------------------------------------------- llm-compressor
def _llmc(name, scheme, calibrate, shard, transforms=(), base="base_bf16", ignore=("lm_head",)):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = build_model(base)
    recipe = [*transforms, QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))]
    kwargs = {}
    if calibrate:
        ids = [b[0].tolist() for b in calib_batches()]
        kwargs = dict(
            tokenizer=tiny_tokenizer(),
            dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}),
            num_calibration_samples=len(ids),
            max_seq_length=len(ids[0]),
        )
    model = oneshot(model=model, recipe=recipe, **kwargs)
    out = fresh_dir(name)
    extra = dict(max_shard_size=SHARD_SIZE) if shard else {}
    model.save_pretrained(out, save_compressed=True, **extra)


def make_ct_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False)


def make_ct_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False)


def make_ct_nvfp4a16_sharded(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=True)


def _quip(rotations, kind, block, ignore_v=(), ignore_u=()):
    """QuIPModifier; with per-rotation ignores its transform_config is given explicitly (same schemes otherwise)."""
    from compressed_tensors.transform import TransformConfig
    from llmcompressor.modifiers.transform import QuIPModifier

    modifier = QuIPModifier(rotations=rotations, transform_type=kind, transform_block_size=block)
    if not (ignore_v or ignore_u):
        return modifier
    groups = {"v": modifier._create_v_scheme(), "u": modifier._create_u_scheme()}
    for rotation, extra in (("v", ignore_v), ("u", ignore_u)):
        for args in groups[rotation].apply:
            args.ignore = [*args.ignore, *extra]
    config = TransformConfig(config_groups={r: groups[r] for r in rotations})
    return QuIPModifier(rotations=rotations, transform_type=kind, transform_block_size=block, transform_config=config)


def _spinquant(kind, block, rotations=("R1", "R2", "R4")):
    from llmcompressor.modifiers.transform import SpinQuantModifier

    return SpinQuantModifier(rotations=list(rotations), transform_type=kind, transform_block_size=block)


DOWN, GATE_UP, KV = ["re:.*down_proj$"], ["re:.*gate_proj$", "re:.*up_proj$"], ["re:.*k_proj$", "re:.*v_proj$"]


def make_ct_quip_v_had16_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, transforms=[_quip(["v"], "hadamard", 16)])


def make_ct_quip_vu_rhad16_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False, transforms=[_quip(["v", "u"], "random-hadamard", 16)])


def make_ct_quip_v_rhad32_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False,
          transforms=[_quip(["v"], "random-hadamard", 32, ignore_v=DOWN)])


def make_ct_quip_vu_had32_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False,
          transforms=[_quip(["v", "u"], "hadamard", 32, ignore_v=DOWN, ignore_u=GATE_UP)])


def make_ct_quip_v_had64_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, transforms=[_quip(["v"], "hadamard", 64, ignore_v=DOWN)])


def make_ct_quip_vu_rmat16_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, transforms=[_quip(["v", "u"], "random-matrix", 16)])


def make_ct_spinquant_r1r2r4_had16_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False, transforms=[_spinquant("hadamard", 16)])


def make_ct_spinquant_r1r2r4_rhad_nvfp4a16(name):
    """No block size: R1 spans the hidden size (64), R4 the whole K of down_proj (176 = 11 * 16)."""
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, transforms=[_spinquant("random-hadamard", None)])


def make_ct_spinquant_r3_had16_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, transforms=[_spinquant("hadamard", 16, ["R3"])])


# --------------------------------------------------------------------------- modelopt
def _modelopt(name, cfg_name, shard, base="base_bf16", exclude=()):
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = build_model(base)
    cfg = getattr(mtq, cfg_name)
    if exclude:  # modelopt's own way: extra quant_cfg entries that disable matching quantizers
        cfg = {**cfg, "quant_cfg": [*cfg["quant_cfg"], *({"quantizer_name": f"{pattern}", "enable": False}
                                                          for pattern in exclude)]}
    batches = calib_batches()

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(input_ids=b)

    model = mtq.quantize(model, cfg, forward_loop)
    out = fresh_dir(name)
    extra = dict(max_shard_size=SHARD_SIZE) if shard else {}
    export_hf_checkpoint(model, export_dir=out, **extra)


def make_modelopt_nvfp4(name):
    _modelopt(name, "NVFP4_DEFAULT_CFG", shard=False)


def make_modelopt_w4a16_nvfp4(name):
    _modelopt(name, "W4A16_NVFP4_CFG", shard=False)


def make_modelopt_nvfp4_sharded(name):
    _modelopt(name, "NVFP4_DEFAULT_CFG", shard=True)


# --------------------------------------------------------------------------- MoE (Qwen3-MoE)
def make_base_moe_bf16(name):
    build_random_moe_model(MOE_BASES[name]).save_pretrained(fresh_dir(name))


make_base_moe_i48_bf16 = make_base_moe_bf16


def make_ct_moe_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False, base="base_moe_bf16", ignore=MOE_IGNORE)


def make_ct_moe_nvfp4a16(name):
    _llmc(name, "NVFP4A16", calibrate=False, shard=False, base="base_moe_bf16", ignore=MOE_IGNORE)


def make_ct_moe_i48_nvfp4(name):
    _llmc(name, "NVFP4", calibrate=True, shard=False, base="base_moe_i48_bf16", ignore=MOE_IGNORE)


def make_modelopt_moe_nvfp4(name):
    _modelopt(name, "NVFP4_DEFAULT_CFG", shard=False, base="base_moe_bf16")


def make_modelopt_moe_w4a16_nvfp4(name):
    _modelopt(name, "W4A16_NVFP4_CFG", shard=False, base="base_moe_bf16")


def make_modelopt_moe_i48_nvfp4(name):
    _modelopt(name, "NVFP4_DEFAULT_CFG", shard=False, base="base_moe_i48_bf16")


# --------------------------------------------------------------------------- MoE (DeepSeek-V3, Mixtral, Qwen2-MoE)
def _arch_moe_makers(arch: str, build, ignore: list[str], exclude: list[str]) -> dict:
    """``make_base_<arch>_bf16``, ``make_ct_<arch>_nvfp4`` (llm-compressor NVFP4, calibrated, ``ignore``) and
    ``make_modelopt_<arch>_nvfp4`` (NVFP4_DEFAULT_CFG, also disabling ``exclude``)."""
    base = f"base_{arch}_bf16"
    return {
        f"make_{base}": lambda name: build().save_pretrained(fresh_dir(name)),
        f"make_ct_{arch}_nvfp4": lambda name: _llmc(name, "NVFP4", calibrate=True, shard=False, base=base,
                                                     ignore=ignore),
        f"make_modelopt_{arch}_nvfp4": lambda name: _modelopt(name, "NVFP4_DEFAULT_CFG", shard=False, base=base,
                                                              exclude=exclude),
    }


for _arch, _spec in {"deepseek_v3": (build_random_deepseek_model, DEEPSEEK_IGNORE, ["*self_attn*"]),
                     "mixtral": (build_random_mixtral_model, MIXTRAL_IGNORE, []),
                     "qwen2_moe": (build_random_qwen2_moe_model, QWEN2_MOE_IGNORE, [])}.items():
    globals().update(_arch_moe_makers(_arch, *_spec))


# --------------------------------------------------------------------------- cleanup / summary
KEEP_SUFFIXES = (".safetensors", ".json")
DROP_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def tidy(name):
    """Drop files that are not part of the checkpoint format (e.g. recipe.yaml is kept)."""
    d = OUT / name
    for p in d.iterdir():
        if p.name in DROP_FILES:
            p.unlink()


def summarize(name) -> str:
    from safetensors import safe_open

    d = OUT / name
    lines = [f"### {name}", ""]
    files = sorted(p.name for p in d.iterdir())
    lines.append("files: " + ", ".join(f"`{f}` ({(d / f).stat().st_size} B)" for f in files))
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.get("quantization_config")
    lines += ["", "config.json quantization_config:", "```json", json.dumps(qc, indent=1), "```"]
    if (d / "hf_quant_config.json").exists():
        lines += ["hf_quant_config.json:", "```json", (d / "hf_quant_config.json").read_text().strip(), "```"]
    lines += ["", "| tensor | dtype | shape | file |", "| --- | --- | --- | --- |"]
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sorted(sf.keys()):
                sl = sf.get_slice(k)
                lines.append(f"| `{k}` | {sl.get_dtype()} | {list(sl.get_shape())} | {f.name} |")
    lines.append("")
    return "\n".join(lines)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def crosscheck() -> str:
    """Dequantize every quantized linear (low nibble = even k) and compare with base_bf16."""
    import glob

    import torch
    from safetensors.torch import load_file

    def load(name):
        sd = {}
        for f in sorted(glob.glob(str(OUT / name / "*.safetensors"))):
            sd.update(load_file(f))
        return sd

    lut = torch.tensor(E2M1)

    def codes(p):
        return lut[torch.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1).long()]

    base = load("base_bf16")
    ct, mo = load("ct_nvfp4"), load("modelopt_nvfp4")
    rows = ["| layer | ct weight_global_scale | modelopt weight_scale_2 | product | ct input_global_scale "
            "| modelopt input_scale | rel.err ct | rel.err modelopt | codes differing ct vs modelopt |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i in range(MODEL_CFG["num_hidden_layers"]):
        for l in LINEARS:
            p = f"model.layers.{i}.{l}"
            w = base[p + ".weight"].float()
            a, b = codes(ct[p + ".weight_packed"]), codes(mo[p + ".weight"])
            gs, ws2 = ct[p + ".weight_global_scale"].item(), mo[p + ".weight_scale_2"].item()
            dq_ct = a * ct[p + ".weight_scale"].float().repeat_interleave(16, 1) / gs
            dq_mo = b * mo[p + ".weight_scale"].float().repeat_interleave(16, 1) * ws2
            rel = lambda d: ((d - w).norm() / w.norm()).item()
            rows.append(f"| {p} | {gs:g} | {ws2:.6g} | {gs * ws2:.5f} | {ct[p + '.input_global_scale'].item():g} "
                        f"| {mo[p + '.input_scale'].item():.6g} | {rel(dq_ct):.4f} | {rel(dq_mo):.4f} "
                        f"| {(a != b).sum().item()}/{a.numel()} |")
    return "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=FIXTURES)
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument(
        "--modelopt-python",
        default=sys.executable,
        help="interpreter of a venv with nvidia-modelopt (modelopt 0.47 wants transformers<5.15, "
        "llmcompressor 0.14 wants transformers>=5.15, so they need two venvs)",
    )
    args = ap.parse_args()
    if args.only:
        globals()["make_" + args.only](args.only)
        tidy(args.only)
        return
    status = {}
    if not args.summary_only:
        for name in FIXTURES:
            print(f"=== {name}", flush=True)
            py = args.modelopt_python if name.startswith("modelopt") else sys.executable
            r = subprocess.run([py, __file__, "--only", name], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
            status[name] = r.returncode
            print(f"=== {name}: rc={r.returncode}", flush=True)
    parts = []
    for name in FIXTURES:
        if (OUT / name / "config.json").exists():
            parts.append(summarize(name))
    check = crosscheck()
    parts.append("## Cross-check: dequantized ct_nvfp4 / modelopt_nvfp4 vs base_bf16\n\n" + check)
    (OUT / "summary.md").write_text("# Producer fixtures: full tensor listing\n\n" + "\n".join(parts))
    print("\n".join(parts))
    if status:
        print(status)
        if any(status.values()):
            sys.exit(1)


if __name__ == "__main__":
    main()
