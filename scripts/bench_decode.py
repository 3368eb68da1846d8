"""End-to-end decode and prefill speed of a Llama-3-8B-shaped model: NVFP4 (an sm90 bundle through ``patch_model``)
against the same weights dequantized to bf16, on a Hopper GPU, with transformers.

Random NVFP4 weights (e2m1 codes, block scales near 1 and a multiplier that gives the weights a standard deviation
of about 0.01, so that activations stay finite through the layers) are written as a compressed-tensors
checkpoint of the quantized linears only, converted with ``repack.convert.convert`` to an sm90 bundle and patched
into a copy of the model: ``nvfp4`` with q/k/v and gate/up fused at load (``patch_model``'s default),
``nvfp4-unfused`` with ``fuse=False`` (``--fusion``); ``bf16`` holds the same weights dequantized (embeddings,
norms and lm_head are bf16 in all). Each mode then runs the models in turn:

* ``eager``: one token per step through ``model(...)`` with a static KV cache (no CUDA graphs): what Python and
  launch overhead cost, where the op's per-call CPU time shows.
* ``graph``: the same step captured once into a CUDA graph (static cache, static input buffers) and replayed.
* ``compiled``: ``torch.compile(model, mode="reduce-overhead")`` (inductor with CUDA graphs) on the decode step.
* prefill: eager forwards of ``--prefill`` tokens at batch 1, no cache (best of ``--repeats`` windows of 5).

Decode tokens/s = batch x steps / time after warm-up steps, the prompt (``--prompt`` tokens) prefilled eagerly
first. ``--layers`` keeps the run short (a real Llama-3-8B has 32; the dense embeddings and lm_head weigh more in
fewer layers, which pulls every ratio towards 1).

    PYTHONPATH=.:scripts python3 scripts/bench_decode.py [--layers 8] [--batches 1,8,32] [--modes eager,graph,compiled]
                                                         [--repeats 3] [--fusion on,off] [--json out.json]
                                                         [--breakdown compiled:1,eager:1]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from bench_sm90 import write_json

from repack.convert import convert
from repack.nvfp4 import NVFP4Weight, dequantize
from repack.runtime import patch_model
from repack.sample.synthetic import write_checkpoint

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)  # fmt: skip
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def random_weight(n: int, k: int, gen: torch.Generator) -> NVFP4Weight:
    """Random codes; e4m3 block scales 0.5 .. 1.9 (bits 0x30 .. 0x3F); multiplier 0.005: weight std about 0.01."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0x30, 0x40, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return NVFP4Weight(codes, scales, torch.tensor([0.005], dtype=torch.float32))


def build_models(layers: int, work: Path, fusion: list[str]) -> tuple[dict[str, torch.nn.Module], float]:
    """``{"bf16": model, "nvfp4": patched with q/k/v and gate/up fused, "nvfp4-unfused": patched with fuse=False}``
    (the NVFP4 ones per ``fusion``: "on", "off"), all on the GPU, same weights; and the seconds the sm90
    conversion took."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, torch_dtype="bfloat16", **LLAMA3_8B)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
            dense = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    quantized = {}
    for i in range(layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                prefix = f"model.layers.{i}.{block}.{name}"
                module = dense.get_submodule(prefix)
                weight = random_weight(module.out_features, module.in_features, gen)
                quantized[prefix] = weight
                on_gpu = NVFP4Weight(weight.codes.cuda(), weight.block_scales.cuda(), weight.multiplier.cuda())
                with torch.no_grad():
                    module.weight.copy_(dequantize(on_gpu, torch.float32).to(torch.bfloat16))
    source = write_checkpoint(work / "source", quantized, {}, fmt="compressed-tensors", ignore=["lm_head"],
                              config=config.to_dict() | {"architectures": ["LlamaForCausalLM"]})  # fmt: skip
    del quantized
    started = time.perf_counter()
    convert(source, "sm90", work / "bundle")
    seconds = time.perf_counter() - started
    models = {"bf16": dense}
    for variant in fusion:
        patched = copy.deepcopy(dense)
        patch_model(patched, work / "bundle", device="cuda", fuse=variant == "on")
        models["nvfp4" if variant == "on" else "nvfp4-unfused"] = patched
    return models, seconds


def synced_seconds(fn: Callable[[], object], runs: int) -> float:
    """Seconds for ``runs`` calls of ``fn`` (which queues GPU work), the queue drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_step(model: torch.nn.Module, batch: int, mode: str, prompt: int, total: int) -> Callable[[], object]:
    """A zero-argument decode step (the next token of every sequence, greedy) after an eager prefill of ``prompt``
    random tokens into a fresh static cache of ``total`` positions; each call advances one position."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=total)
    positions = torch.arange(total, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=positions[:prompt]).logits
    state = {"pos": prompt, "tok": logits[:, -1:].argmax(-1)}
    forward = torch.compile(model, mode="reduce-overhead") if mode == "compiled" else model

    def run(tok: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = forward(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=position,
                          position_ids=position.expand(tok.shape[0], 1))  # fmt: skip
        return out.logits[:, -1:].argmax(-1)

    if mode == "graph":  # static buffers; one capture after a warm-up on a side stream
        static_tok, static_pos = state["tok"].clone(), positions[prompt : prompt + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(static_tok, static_pos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_next = run(static_tok, static_pos)

        def step() -> None:
            static_pos.add_(1)  # the cache position advances on the GPU; the token feeds back in place
            graph.replay()
            static_tok.copy_(static_next)

        return step

    def step() -> None:
        if mode == "compiled":
            torch.compiler.cudagraph_mark_step_begin()
        pos = state["pos"]
        state["tok"] = run(state["tok"], positions[pos : pos + 1])
        state["pos"] = pos + 1

    return step


# Kernel-name fragments (lower case) of each GPU-time category in --breakdown; the first match wins.
KERNEL_GROUPS = {
    "NVFP4 linears (this op)": ("_gemv_kernel", "_tc_kernel", "_kslot_kernel"),
    "bf16 GEMMs (cuBLAS)": ("gemm", "nvjet", "cutlass", "xmma", "splitk"),
    "attention": ("flash", "fmha", "attention", "sdpa", "efficient"),
}


def gpu_time_breakdown(model, batch: int, mode: str, prompt: int, steps: int = 32) -> dict[str, float]:
    """GPU time per decode step (ms) by kernel group (``KERNEL_GROUPS``, the rest "other"), from a
    ``torch.profiler`` trace of ``steps`` steps, and the step's wall time: what the step's time is spent on."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = decode_step(model, batch, mode, prompt, prompt + 4 + steps + 1)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = synced_seconds(step, steps)
    totals = {name: 0.0 for name in [*KERNEL_GROUPS, "other"]}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.lower()
        group = next((g for g, keys in KERNEL_GROUPS.items() if any(key in name for key in keys)), "other")
        totals[group] += event.time_range.elapsed_us() / 1e3 / steps
    return totals | {"GPU busy": sum(totals.values()), "step wall": wall * 1e3 / steps}


def decode_tokens_per_s(model, batch: int, mode: str, prompt: int, steps: int, warmup: int, repeats: int) -> float:
    """The best of ``repeats`` windows of ``steps`` decode steps (the host's own load moved eager runs by up to 2x
    between runs, docs/benchmarks.md)."""
    step = decode_step(model, batch, mode, prompt, prompt + warmup + (repeats + 1) * steps + 1)
    for _ in range(warmup):
        step()
    return max(batch * steps / synced_seconds(step, steps) for _ in range(repeats))


def prefill_tokens_per_s(model, tokens: int, repeats: int, runs: int = 5) -> float:
    """The best of ``repeats`` windows of ``runs`` forwards of ``tokens`` tokens (batch 1, no cache)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    forward()
    return max(tokens * runs / synced_seconds(forward, runs) for _ in range(repeats))


def check_models(models: dict[str, torch.nn.Module]) -> dict[str, float]:
    """Relative error of each patched model's logits against the bf16 model's on random tokens (same weights)."""
    ids = torch.randint(0, models["bf16"].config.vocab_size, (2, 16), device="cuda")
    errors = {}
    with torch.no_grad():
        ref = models["bf16"](ids).logits.double()
        for name, model in models.items():
            got = model(ids).logits.double()
            if not torch.isfinite(got).all():
                raise AssertionError(f"{name} produced non-finite logits")
            errors[name] = float((got - ref).norm() / ref.norm())
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--modes", default="eager,graph,compiled")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per point, best kept")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--fusion", default="on,off", help="NVFP4 models: q/k/v and gate/up fused (on), unfused (off)")
    parser.add_argument("--breakdown", help="MODE:BATCH[,...]: instead of the tables, GPU time per step by kernel group")
    parser.add_argument("--prepared-ab", action="store_true",
                        help="also each NVFP4 model with the tensor-core kernel through tc_linear (no TcLaunch)")
    parser.add_argument("--json")
    args = parser.parse_args()
    ab = args.prepared_ab
    with tempfile.TemporaryDirectory() as tmp:
        models, convert_s = build_models(args.layers, Path(tmp), args.fusion.split(","))
    errors = check_models(models)
    print(f"{args.layers} Llama-3-8B layers; sm90 conversion {convert_s:.1f} s; logits rel. error against bf16 {errors}")
    report: dict = {"layers": args.layers, "convert_s": convert_s, "logits_rel_err": errors, "decode": [], "prefill": {}}
    if args.breakdown:
        report["breakdown"] = []
        for spec in args.breakdown.split(","):
            mode, batch = spec.split(":")
            for name, model in models.items():
                row = {"mode": mode, "batch": int(batch), "model": name}
                row |= gpu_time_breakdown(model, int(batch), mode, args.prompt)
                report["breakdown"].append(row)
                print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
                write_json(args.json, report)
        return
    for name, model in models.items():  # first: GPU-bound, and a run cut short still has it
        report["prefill"][name] = prefill_tokens_per_s(model, args.prefill, args.repeats)
    print(f"prefill {args.prefill} tokens, tok/s: {report['prefill']}", flush=True)
    write_json(args.json, report)
    for mode in args.modes.split(","):
        for batch in map(int, args.batches.split(",")):
            row = {"mode": mode, "batch": batch}
            for name, model in models.items():
                variants = [(name, True)] + ([(f"{name} (tc run)", False)] if ab and name != "bf16" else [])
                for label, prepared_tc in variants:
                    set_prepared_tc(model, prepared_tc)
                    try:
                        row[label] = decode_tokens_per_s(model, batch, mode, args.prompt, args.steps, args.warmup,
                                                         args.repeats)  # fmt: skip
                    except Exception as exc:  # reported in the table, the other points still run
                        row[label] = f"{type(exc).__name__}: {exc}"[:160]
                set_prepared_tc(model, True)
            report["decode"].append(row)
            print(row, flush=True)
            write_json(args.json, report)
    names = [label for name in models for label in ([name, f"{name} (tc run)"] if ab and name != "bf16" else [name])]
    print_table(report, names, args.prefill)


def set_prepared_tc(model: torch.nn.Module, on: bool) -> None:
    """Eager tensor-core calls through the prepared ``TcLaunch`` (on) or ``tc_linear`` (off), as
    ``NVFP4_REPACK_PREPARED_TC`` sets it, switched in one process for ``--prepared-ab``: each layer re-prepares."""
    from repack.runtime.backends.triton_sm90 import dispatch

    dispatch.PREPARED_TC = on
    for module in model.modules():
        if hasattr(module, "_prepared"):
            module._prepared = None


def print_table(report: dict, names: list[str], prefill: int) -> None:
    """Markdown: tok/s per model, and each NVFP4 model's ratio to bf16."""
    quantized = names[1:]
    head = " | ".join([f"{n} tok/s" for n in names] + [f"{n} / bf16" for n in quantized])
    print(f"\n| mode | batch | {head} |\n|" + " --- |" * (2 + len(names) + len(quantized)))
    rows = [(r["mode"], r["batch"], r) for r in report["decode"]]
    rows.append((f"prefill {prefill} (eager)", 1, report["prefill"]))
    for mode, batch, r in rows:
        cells = [f"{r[n]:.0f}" if isinstance(r.get(n), float) else str(r.get(n, "-")) for n in names]
        ratios = [f"{r[n] / r['bf16']:.2f}x" if all(isinstance(r.get(m), float) for m in ("bf16", n)) else "-"
                  for n in quantized]  # fmt: skip
        print(f"| {mode} | {batch} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
