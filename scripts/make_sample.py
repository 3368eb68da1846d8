"""Write the built-in sample: a tiny randomly initialised Llama, NVFP4-quantized, compressed-tensors format.

    python scripts/make_sample.py            # rewrites repack/sample/tiny-llama-nvfp4/ (needs `tokenizers`)

It shows every convert option: intermediate_size 160 is a multiple of 16 but not of 64 (padding), and splits
into a per-rank K of 80 at --tp 2 (vLLM needs a multiple of 16); the heads (4, 2 kv) divide 2 ranks; q/k/v and
gate/up share one global scale each, as llm-compressor writes them, so --fuse and --tp need no --rescale.
A byte-level tokenizer (256 tokens, the model's vocabulary) lets `vllm serve` start on a bundle of it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repack.sample import SAMPLE_DIR  # noqa: E402
from repack.sample.synthetic import quantize_nvfp4, write_checkpoint  # noqa: E402

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LINEARS = {
    "self_attn.q_proj": ("hidden", "hidden"),
    "self_attn.k_proj": ("kv", "hidden"),
    "self_attn.v_proj": ("kv", "hidden"),
    "self_attn.o_proj": ("hidden", "hidden"),
    "mlp.gate_proj": ("intermediate", "hidden"),
    "mlp.up_proj": ("intermediate", "hidden"),
    "mlp.down_proj": ("hidden", "intermediate"),
}
FUSED = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
         "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}  # vLLM's packed modules: one global scale each


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer without merges: 256 tokens, one per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": CONFIG["max_position_embeddings"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main(out: Path = SAMPLE_DIR) -> None:
    gen = torch.Generator().manual_seed(0)
    dims = {
        "hidden": CONFIG["hidden_size"],
        "intermediate": CONFIG["intermediate_size"],
        "kv": CONFIG["num_key_value_heads"] * CONFIG["head_dim"],
    }
    quantized, plain = {}, {}
    for layer in range(CONFIG["num_hidden_layers"]):
        base = f"model.layers.{layer}"
        weights = {name: torch.randn(dims[rows], dims[cols], generator=gen) * 0.05
                   for name, (rows, cols) in LINEARS.items()}
        amax: dict[str, torch.Tensor] = {}
        for name, w in weights.items():
            group = FUSED.get(name, name)
            amax[group] = torch.maximum(amax.get(group, w.abs().max()), w.abs().max())
        for name, w in weights.items():
            quantized[f"{base}.{name}"] = quantize_nvfp4(w, amax[FUSED.get(name, name)])
        plain[f"{base}.input_layernorm.weight"] = torch.ones(dims["hidden"], dtype=torch.bfloat16)
        plain[f"{base}.post_attention_layernorm.weight"] = torch.ones(dims["hidden"], dtype=torch.bfloat16)
    vocab, hidden = CONFIG["vocab_size"], dims["hidden"]
    plain["model.embed_tokens.weight"] = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(torch.bfloat16)
    plain["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    plain["lm_head.weight"] = (torch.randn(vocab, hidden, generator=gen) * 0.05).to(torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    write_checkpoint(out, quantized, plain, fmt="compressed-tensors", config=CONFIG, ignore=["lm_head"])
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    write_tokenizer(out)
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir())} bytes)")


if __name__ == "__main__":
    main()
