"""patch_model's fused q/k/v and gate/up: sm90's stacked runtime tensors, and whole models against float64."""

from __future__ import annotations

import pytest
import torch

from repack.convert import convert
from repack.errors import RepackError
from repack.nvfp4 import NVFP4Weight
from repack.runtime import patch_model
from repack.runtime.layer import FusedLinear
from repack.sample.synthetic import llama_layers, random_nvfp4, write_llama
from repack.targets import resolve_target

from .conftest import PRODUCERS
from .test_runtime import dequantized_llama

SM90 = resolve_target("sm90")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("ns,k", [([48, 16, 144], 80), ([176, 176], 272), ([4096 // 32, 32, 32], 64)])
def test_sm90_stack_rows_is_the_transform_of_the_stacked_weights(ns, k, random_seed):
    """Copying stripes gives, byte for byte, what the one layout transform makes of the weights stacked along N
    (what convert --fuse writes), with N not a multiple of the 128-row padding and K padded."""
    gen = torch.Generator().manual_seed(random_seed)
    parts = [random_nvfp4(n, k, gen) for n in ns]
    multiplier = parts[0].multiplier
    parts = [NVFP4Weight(p.codes, p.block_scales, multiplier) for p in parts]
    stacked = SM90.stack_rows([SM90.to_runtime(p) for p in parts], ns, k)
    whole = SM90.to_runtime(NVFP4Weight(torch.cat([p.codes for p in parts]),
                                        torch.cat([p.block_scales for p in parts]), multiplier))  # fmt: skip
    for name, tensor in whole.tensors().items():
        assert torch.equal(_bits(stacked.tensors()[name]), _bits(tensor)), name


def test_sm90_stack_rows_refuses_a_stripe_across_two_layers():
    gen = torch.Generator().manual_seed(3)
    parts = [SM90.to_runtime(random_nvfp4(n, 32, gen)) for n in (48, 8, 8)]
    assert SM90.stack_rows(parts, [48, 8, 8], 32) is None


def _gemm_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the fused layers' GEMMs, one hook per FusedLinear."""
    calls = [0]
    for module in model.modules():
        if isinstance(module, FusedLinear):
            module.layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("fixture", ["ct_nvfp4a16", "modelopt_nvfp4"])
def test_fused_model_matches_unfused_and_float64(tmp_path, fixture):
    """The producers' tiny Llamas (q/k/v and gate/up share their multipliers), sm90 on the reference backend:
    fused at load, fused by convert --fuse and unfused give the same logits, close to the float64 dequantized
    model; a fused forward runs one GEMM per fused layer and holds no activations afterwards."""
    convert(PRODUCERS / fixture, "sm90", tmp_path / "b")
    convert(PRODUCERS / fixture, "sm90", tmp_path / "f", fuse=True)
    reference = dequantized_llama(fixture).double()
    tokens = torch.randint(0, reference.config.vocab_size, (2, 11))
    logits = {}
    for name, bundle, fuse in (("unfused", "b", False), ("fused", "b", True), ("convert --fuse", "f", True)):
        model = dequantized_llama(fixture).to(torch.bfloat16)
        patch_model(model, tmp_path / bundle, fuse=fuse)
        fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
        assert len(fused) == (0 if name == "unfused" else 2 * reference.config.num_hidden_layers), name
        calls = _gemm_calls(model)
        with torch.no_grad():
            logits[name] = model(tokens).logits
        assert calls[0] == len(fused)
        assert all(m._input is None and m._output is None for m in fused)
    with torch.no_grad():
        ref = reference(tokens).logits
    for name, got in logits.items():
        assert torch.equal(got, logits["unfused"]), name
        assert float((got.double() - ref).norm() / ref.norm()) < 3e-2, name


def test_fused_model_compiles_fullgraph(tmp_path):
    convert(PRODUCERS / "ct_nvfp4a16", "sm90", tmp_path / "b")
    model = dequantized_llama("ct_nvfp4a16").to(torch.bfloat16)
    patch_model(model, tmp_path / "b")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        assert torch.equal(compiled(tokens).logits, model(tokens).logits)


def test_members_called_apart_or_twice_get_their_own_input(tmp_path):
    """Any call order is right: a member called on a new input, or again on the same one, runs the GEMM again."""
    convert(PRODUCERS / "ct_nvfp4a16", "sm90", tmp_path / "b")
    unfused, fused = (dequantized_llama("ct_nvfp4a16").to(torch.bfloat16) for _ in range(2))
    patch_model(unfused, tmp_path / "b", fuse=False)
    patch_model(fused, tmp_path / "b")
    a, b = (torch.randn(3, 64).to(torch.bfloat16) for _ in range(2))
    attn, plain = fused.model.layers[0].self_attn, unfused.model.layers[0].self_attn
    for name, x in (("q_proj", a), ("k_proj", b), ("k_proj", b), ("v_proj", a), ("q_proj", a)):
        assert torch.equal(getattr(attn, name)(x), getattr(plain, name)(x)), name


def test_unequal_multipliers_stay_unfused(tmp_path):
    """Layers with their own multipliers cannot share the fused layer's one: they stay separate (and right)."""
    gen = torch.Generator().manual_seed(11)
    layers = llama_layers(64, 4, 2, 96, gen, shared_scales=False)
    root = write_llama(tmp_path / "m", "compressed-tensors", hidden=64, heads=4, kv_heads=2, intermediate=96,
                       generator=gen, quantized=layers)  # fmt: skip
    convert(root, "sm90", tmp_path / "b")
    import transformers

    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(root)).to(torch.bfloat16)
    patch_model(model, tmp_path / "b")
    assert not any(isinstance(m, FusedLinear) for m in model.modules())


@pytest.mark.parametrize("fmt,exclude", [("modelopt", "model.layers.1.*"), ("compressed-tensors", r"re:model\.layers\.1\.")])
def test_a_model_with_more_layers_than_the_bundle_is_refused(tmp_path, fmt, exclude):
    """Regression (issue 26): a model with more decoder layers than the bundle's source was patched silently, its
    extra layers keeping their random weights. Which linears are quantized is the bundle's quantization config's
    (ignore / exclude_modules); one the config leaves unquantized is the model's own business."""
    import json

    import transformers

    root = write_llama(tmp_path / "m", fmt, hidden=64, heads=4, kv_heads=2, intermediate=96,
                       generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    convert(root, "sm100", tmp_path / "b")
    config = transformers.AutoConfig.from_pretrained(root)
    config.num_hidden_layers = 2
    model = transformers.LlamaForCausalLM(config)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(RepackError, match=r"^model\.layers\.1\.self_attn\.q_proj \(and 6 more\): a quantized linear "
                                          "of the model that the bundle does not hold"):
        patch_model(model, tmp_path / "b")
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())  # nothing patched
    for name in ("config.json", "hf_quant_config.json"):  # the extra layer left unquantized by the config
        path = tmp_path / "b" / name
        if path.exists():
            data = json.loads(path.read_text())
            holder = data["quantization_config"] if name == "config.json" else data["quantization"]
            key = "exclude_modules" if "exclude_modules" in holder else "ignore"
            holder[key] = [*holder[key], exclude]
            path.write_text(json.dumps(data))
    patch_model(model, tmp_path / "b")
    assert isinstance(model.model.layers[1].self_attn.q_proj, torch.nn.Linear)
    assert not isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_tensor_parallel_rank_is_refused(tmp_path):
    gen = torch.Generator().manual_seed(5)
    root = write_llama(tmp_path / "m", "compressed-tensors", hidden=64, heads=4, kv_heads=2, intermediate=96,
                       generator=gen)  # fmt: skip
    convert(root, "sm90", tmp_path / "b", tp=2)
    with pytest.raises(RepackError, match="rank 1 of --tp 2"):
        patch_model(torch.nn.Module(), tmp_path / "b" / "rank-1")


def test_biases_follow_their_members(tmp_path):
    """q/k/v biases (attention_bias, as Qwen2 has) are passthrough tensors named after the unfused modules: they
    land in the fused layer's stacked bias, and the model with them matches its float64 dequantized twin."""
    import transformers

    from repack.nvfp4 import dequantize
    from repack.sample.synthetic import write_checkpoint

    gen = torch.Generator().manual_seed(17)
    layers = llama_layers(64, 4, 2, 96, gen)
    biases = {f"model.layers.0.self_attn.{p}_proj.bias": torch.randn(n, generator=gen).to(torch.bfloat16)
              for p, n in (("q", 64), ("k", 32), ("v", 32))}  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=64,
                                      attention_bias=True, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).double().eval()
    plain = {name: t.detach().to(torch.bfloat16) for name, t in reference.state_dict().items()
             if name.removesuffix(".weight") not in layers and name not in biases} | biases  # fmt: skip
    root = write_checkpoint(tmp_path / "m", layers, plain, fmt="compressed-tensors", ignore=["lm_head"],
                            config=config.to_dict() | {"architectures": ["LlamaForCausalLM"]})  # fmt: skip
    state = reference.state_dict()
    with torch.no_grad():
        for name, value in plain.items():
            state[name].copy_(value)
        for prefix, weight in layers.items():
            state[f"{prefix}.weight"].copy_(dequantize(weight))
    convert(root, "sm90", tmp_path / "b")
    convert(root, "sm90", tmp_path / "f", fuse=True)
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ref = reference(tokens).logits
    for bundle, fuse in (("b", True), ("b", False), ("f", True)):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
        patch_model(model, tmp_path / bundle, fuse=fuse)
        assert any(isinstance(m, FusedLinear) for m in model.modules()) == fuse
        with torch.no_grad():
            got = model(tokens).logits.double()
        assert float((got - ref).norm() / ref.norm()) < 3e-2, (bundle, fuse)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_a_model_with_fewer_layers_than_the_bundle_is_refused_untouched(tmp_path, fmt):
    """Regression (issue 38): patching a bundle into a model with fewer decoder layers than its source raised, but
    only after layer 0's q_proj had become a PackedLinear and embed_tokens had been overwritten. Every place is
    checked before anything changes, as for a model with more layers."""
    import transformers

    root = write_llama(tmp_path / "m", fmt, hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2,
                       generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    convert(root, "sm100", tmp_path / "b")
    config = transformers.AutoConfig.from_pretrained(root)
    config.num_hidden_layers = 1
    model = transformers.LlamaForCausalLM(config)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(RepackError, match=r"^model has no module 'model\.layers\.1\.[a-z_.]+' for the bundle's layer "
                                          r"\(a model with fewer layers than the bundle's source\?\); nothing was patched$"):
        patch_model(model, tmp_path / "b")
    assert all(isinstance(m, torch.nn.Linear) for m in model.model.layers[0].self_attn.children())
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())  # embed_tokens too
