"""vLLM on this machine's GPU: models, engines and measures shared by tests/test_gpu_vllm.py and
scripts/bench_vllm_serve.py.

vLLM 0.33 runs on the lent H200 through the kit in ../shared/vllm-gpu (its README): attention on
``TRITON_ATTN`` (FlashAttention and FlashInfer are not shipped), no tokenizer (prompts are token ids). This module
imports vLLM only inside the functions that need it, so CPU-only machines import it to skip.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from repack.formats import read_source
from repack.nvfp4 import NVFP4Weight
from repack.runtime.transforms import sylvester
from repack.sample.synthetic import write_llama

# Decoder shapes (hidden, heads, kv heads, intermediate, head_dim) of Llama-3-8B and Llama-3-70B.
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, head_dim=128)
LLAMA3_70B = dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672, head_dim=128)
# A small Llama that vLLM's TRITON_ATTN serves (head_dim >= 32; the producer fixtures' 16 is below it).
TINY = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, head_dim=64)
# Every engine of the tests and the benchmark: the kit's attention, token-id prompts, bf16.
KIT_ENGINE = dict(attention_backend="TRITON_ATTN", skip_tokenizer_init=True, dtype="bfloat16", seed=0)


def unavailable() -> str | None:
    """Why vLLM cannot serve an sm90 bundle here, or None (no import of vLLM: CI skips in milliseconds)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm90 GPU (H100 / H200): the plugin's Hopper kernel"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM 0.33 or 0.34 (scripts/stage_vllm_gpu.sh / ../shared/vllm-gpu stage it on the H200)"
    return None


def vllm_version() -> str | None:
    """The installed vLLM's version (from its metadata, no import), recorded with every GPU result."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def random_decoder(shape: dict[str, int], layers: int, gen: torch.Generator) -> dict[str, NVFP4Weight]:
    """NVFP4 q/k/v/o and gate/up/down of ``layers`` decoder layers of ``shape``: random codes, e4m3 block scales
    0.5 .. 1.9 and a multiplier of 0.005 (weights of standard deviation about 0.01, so activations stay finite
    through 32 layers; one multiplier, so each fused group shares it as the producers write them)."""
    h, q, kv, i = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"], \
        shape["intermediate"]  # fmt: skip
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {}
    for layer in range(layers):
        for name, (n, k) in shapes.items():
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
            scales = torch.randint(0x30, 0x40, (n, k // 16), dtype=torch.uint8, generator=gen)
            out[f"model.layers.{layer}.{name}"] = NVFP4Weight(codes, scales.view(torch.float8_e4m3fn),
                                                              torch.tensor([0.005]))
    return out


def write_shaped_llama(root: Path, shape: dict[str, int], layers: int, vocab: int, gen: torch.Generator,
                       max_positions: int = 4096, fmt: str = "compressed-tensors", w4a4: bool = False) -> Path:  # fmt: skip
    """An NVFP4 Llama of ``shape`` (``LLAMA3_8B``, ``LLAMA3_70B``, ``TINY``) in producer format ``fmt`` (W4A16, or
    W4A4 with ``w4a4``), embeddings and bf16 lm_head of standard deviation 0.02."""
    return write_llama(root, fmt, hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                       intermediate=shape["intermediate"], head_dim=shape["head_dim"], vocab=vocab, layers=layers,
                       generator=gen, quantized=random_decoder(shape, layers, gen), max_positions=max_positions,
                       plain_std=0.02, w4a4=w4a4)  # fmt: skip


def add_input_hadamard(root: Path, block: int) -> Path:
    """Give a single-file compressed-tensors checkpoint (``write_shaped_llama``) the online input transform of
    llm-compressor's ``QuIPModifier(rotations=["v"], transform_type="hadamard")`` on every decoder linear, in
    blocks of ``block``: its config group and Sylvester's unnormalized matrix, stored once under the first layer
    that uses it, as the producer writes them (tests/data/producers/README.md). The weights stay as they are (a
    random model, rotated, is a random model); ``write_dequantized`` folds the transform into its reference."""
    config = json.loads((root / "config.json").read_text())
    apply = [{"targets": ["Linear"], "location": location, "inverse": inverse, "ignore": ["lm_head"]}
             for location, inverse in (("input", False), ("weight_input", True))]  # fmt: skip
    config["quantization_config"]["transform_config"] = {"config_groups": {"v": {
        "type": "hadamard", "head_dim": block, "precision": "torch.float64", "randomize": False,
        "requires_grad": False, "apply": apply}}}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config, indent=2))
    path = root / "model.safetensors"
    matrix = {"model.layers.0.self_attn.q_proj.v_input.weight": sylvester(block)}
    save_file(load_file(path) | matrix, path, metadata={"format": "pt"})
    return root


def write_dequantized(source: Path, out: Path) -> Path:
    """A bf16 checkpoint of ``source`` with every quantized linear dequantized, its online transforms folded in
    (``SourceModel.dense_weight``: the reference that vLLM's load of the source and the bundle both approximate),
    one shard per decoder layer. Tensors that belong to a quantized layer (activation scales, transform matrices)
    are dropped, biases kept."""
    model = read_source(source)
    out.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}, indent=2))
    if (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", out)
    shards: dict[str, dict[str, torch.Tensor]] = {"rest": {}}
    for prefix in model.layers:
        weight = model.dense_weight(prefix, torch.bfloat16)
        shards.setdefault(prefix.rpartition(".layers.")[2].split(".")[0], {})[f"{prefix}.weight"] = weight
    for name in model.passthrough:
        owner, _, leaf = name.rpartition(".")
        if owner not in model.layers or leaf == "bias":
            shards["rest"][name] = model.checkpoint.read(name)
    weight_map = {}
    for i, (key, tensors) in enumerate(sorted(shards.items())):
        file = f"model-{i:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


@contextlib.contextmanager
def engine(model: Path, **kwargs: object) -> Iterator[object]:
    """An in-process ``vllm.LLM`` on ``model`` with the kit's settings (``kwargs`` override them), torn down
    afterwards (its GPU memory returned) so that one process can build several."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(model=str(model), **(KIT_ENGINE | kwargs))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def prompt_logprobs(llm: object, prompts: list[list[int]]) -> torch.Tensor:
    """float64 ``[prompts, length - 1]``: each prompt token's log-probability given the tokens before it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return torch.tensor([[step[token].logprob for step, token in zip(o.prompt_logprobs[1:], p[1:])]
                         for o, p in zip(outputs, prompts)], dtype=torch.float64)  # fmt: skip


def greedy(llm: object, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """``tokens`` greedy tokens after each prompt (end-of-sequence ignored)."""
    return [list(o.token_ids) for o in _greedy_outputs(llm, prompts, tokens, None)]


def greedy_with_margins(llm: object, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """``greedy``'s tokens, and at each step how far (nats) the runner-up was below the chosen token: where that is
    near 0, another engine of the same model may break the tie the other way."""
    outputs = _greedy_outputs(llm, prompts, tokens, 2)
    margins = [[float(top[0] - top[1]) for top in (sorted((p.logprob for p in step.values()), reverse=True)
                                                   for step in o.logprobs)] for o in outputs]  # fmt: skip
    return [list(o.token_ids) for o in outputs], margins


def _greedy_outputs(llm: object, prompts: list[list[int]], tokens: int, logprobs: int | None) -> list[object]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def linear_kernels(model: torch.nn.Module) -> list[str]:
    """The NVFP4 kernel classes of a vLLM model's layers (``LLM.apply_model``; module-level, so it pickles)."""
    names = set()
    for module in model.modules():
        for holder in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
            kernel = getattr(holder, "kernel", None)
            if kernel is not None:
                names.add(type(kernel).__name__)
    return sorted(names)


def random_prompts(count: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()
