"""vLLM serves sm90 bundles on this machine's Hopper GPU: in-process, in its default multiprocess engine, and
through ``vllm serve``'s OpenAI server. Skips cleanly without an sm90 GPU or without vLLM (CI has neither).

On the H200 (vLLM 0.33 staged by ../shared/vllm-gpu, 0.34 by scripts/stage_vllm_gpu.sh; docs/serving.md has the
commands); each result records the vLLM version it ran on:

    PYTHONPATH=.:/tmp/site python3 -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py

Serving runs on vLLM's TRITON_ATTN (the kit ships no FlashAttention), except the producers' fixtures, whose head_dim
of 16 is below its minimum of 32: FLEX_ATTENTION. References: the same checkpoint served by vLLM's own load of the
source (its default NVFP4 kernel on Hopper), and a bf16 model of the source's dequantized weights served by vLLM
(``write_dequantized``). Bound: the bundle's prompt log-probabilities differ from the bf16 model's by a mean of at
most ``2 x`` (plus 0.005 nats) what vLLM's own load of the source reaches (where vLLM serves that source on this
GPU; the test prints why not), and by less than 0.1 nats. Greedy tokens of the bundle in vLLM are the greedy tokens
of ``patch_model`` on the same bundle (transformers), except where the two are within 0.05 nats of a tie.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from repack.convert import convert

from . import vllm_gpu
from .conftest import PRODUCERS

REASON = vllm_gpu.unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

ROOT = Path(__file__).resolve().parents[1]
LOAD_FORMAT = "nvfp4_repack"


@pytest.fixture(autouse=True)
def _record_vllm_version(request, record_property):
    """Every result names the vLLM it ran on (the junit property ``vllm``, and a line in the -s output)."""
    version = vllm_gpu.vllm_version()
    record_property("vllm", version)
    print(f"\n[vLLM {version}] {request.node.nodeid}")
# Small engines: eager, a short context, a fixed 256 MiB KV cache, so that one process builds them one by one.
SMALL = dict(enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 << 20,
             max_num_seqs=8)  # fmt: skip
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 48, 16
TIE_NATS = 0.05


@dataclass
class Served:
    source: Path
    bundle: Path
    dense: Path
    vocab: int
    attention: str


# Synthetic checkpoints: (format, W4A4, layers, input Hadamard block or 0) of Llama-3-8B's decoder shapes, vocab
# 32000, served on TRITON_ATTN; the rotated one as llm-compressor's QuIP writes it (``add_input_hadamard``).
SYNTHETIC = {"ct-w4a16-8b": ("compressed-tensors", False, 2, 0), "modelopt-w4a4-8b": ("modelopt", True, 1, 0),
             "ct-w4a16-had128-8b": ("compressed-tensors", False, 1, 128)}  # fmt: skip
# The producers' own fixtures (head_dim 16, below TRITON_ATTN's 32): served on FLEX_ATTENTION. The rotated ones
# (docs/transforms-serving.md) run their input transform inside RepackSm90NvFp4LinearKernel: a Walsh-Hadamard block
# of 16, one of 32 with vLLM's output transform after it, and SpinQuant's whole-K R4 (not fused: before the GEMM).
FIXTURES = ["modelopt_w4a16_nvfp4", "modelopt_nvfp4", "ct_nvfp4a16", "ct_nvfp4"]
ROTATED = ["ct_quip_v_had16_nvfp4a16", "ct_quip_vu_had32_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16"]


def serve_case(name: str, tmp_path: Path, seed: int) -> Served:
    """Source, sm90 ``--fuse`` bundle and dequantized bf16 model of a producer fixture or a ``SYNTHETIC`` case."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if name in SYNTHETIC:
        fmt, w4a4, layers, block = SYNTHETIC[name]
        source = vllm_gpu.write_shaped_llama(tmp_path / "source", vllm_gpu.LLAMA3_8B, layers, 32000,
                                             torch.Generator().manual_seed(seed), 128, fmt, w4a4)  # fmt: skip
        if block:
            vllm_gpu.add_input_hadamard(source, block)
    else:
        source = PRODUCERS / name
    convert(source, "sm90", tmp_path / "bundle", fuse=True)
    dense = vllm_gpu.write_dequantized(source, tmp_path / "dense")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    return Served(source, tmp_path / "bundle", dense, vocab, "TRITON_ATTN" if name in SYNTHETIC else "FLEX_ATTENTION")


@pytest.fixture(scope="module", autouse=True)
def plugin():
    from repack.vllm_plugin import register

    register()  # in-process engines: what the entry point does in vLLM's own processes


def served_by_vllm(case: Served, prompts: list[list[int]]) -> dict[str, object]:
    """Prompt log-probabilities and kernels of the bundle, the source and the bf16 model, and the bundle's greedy
    tokens, each model in its own engine; ``source_error`` where vLLM itself cannot serve the source here."""
    out: dict[str, object] = {}
    for role, path, extra in (("bundle", case.bundle, {"load_format": LOAD_FORMAT}), ("source", case.source, {}),
                              ("dense", case.dense, {})):  # fmt: skip
        try:
            with vllm_gpu.engine(path, **SMALL, **extra, attention_backend=case.attention) as llm:
                out[role] = vllm_gpu.prompt_logprobs(llm, prompts)
                out[f"{role}_kernels"] = llm.apply_model(vllm_gpu.linear_kernels)[0]
                if role == "bundle":
                    out["greedy"] = vllm_gpu.greedy(llm, prompts, NEW_TOKENS)
        except Exception as error:  # noqa: BLE001  (only vLLM's own load of the source may fail: recorded)
            if role != "source":
                raise
            out["source_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return out


def patched_gaps(case: Served, prompts: list[list[int]], greedy: list[list[int]]) -> torch.Tensor:
    """``patch_model`` (transformers, the bf16 model with the bundle's layers) fed each prompt and vLLM's greedy
    tokens: per generated position, how far (nats) vLLM's token is below the patched model's best."""
    from transformers import LlamaForCausalLM

    from repack.runtime import patch_model

    model = LlamaForCausalLM.from_pretrained(case.dense, dtype=torch.bfloat16).cuda().eval()
    patch_model(model, case.bundle, device="cuda")
    tokens = torch.tensor([p + g for p, g in zip(prompts, greedy)], device="cuda")
    with torch.no_grad():
        logprobs = model(tokens).logits.float().log_softmax(-1)[:, PROMPT_LEN - 1 : -1]
    chosen = logprobs.gather(-1, tokens[:, PROMPT_LEN:, None])[..., 0]
    return (logprobs.max(-1).values - chosen).cpu()


@pytest.mark.parametrize("name", [*SYNTHETIC, *FIXTURES, *ROTATED])
def test_bundle_serves_like_the_source(tmp_path, random_seed, name):
    """Both producer formats, W4A16 and W4A4 (served weight-only): Llama-3-8B-shaped layers and the producers'
    fixtures, with and without online transforms (the bf16 reference folds them into its weights)."""
    case = serve_case(name, tmp_path, random_seed)
    prompts = vllm_gpu.random_prompts(PROMPTS, PROMPT_LEN, case.vocab, torch.Generator().manual_seed(random_seed))
    got = served_by_vllm(case, prompts)
    to_bundle = float((got["bundle"] - got["dense"]).abs().mean())
    to_source = float((got["source"] - got["dense"]).abs().mean()) if "source" in got else None
    print(f"{name}: mean |logprob - bf16| bundle {to_bundle:.4f}, vLLM's load of the source {to_source} "
          f"(kernels: bundle {got['bundle_kernels']}, source {got.get('source_kernels', got.get('source_error'))})")
    assert got["bundle_kernels"] == ["RepackSm90NvFp4LinearKernel"]
    assert got["dense_kernels"] == []
    assert torch.isfinite(got["bundle"]).all() and torch.isfinite(got["dense"]).all()
    assert to_bundle < 0.1, to_bundle
    if to_source is not None:  # else vLLM cannot serve this source on this GPU (printed): the absolute bound alone
        assert to_bundle <= 2 * to_source + 5e-3, (to_bundle, to_source)
    gaps = patched_gaps(case, prompts, got["greedy"])
    print(f"{name}: greedy vs patch_model: {int((gaps == 0).sum())} of {gaps.numel()} tokens the patched argmax, "
          f"largest gap {float(gaps.max()):.4f} nats")
    assert float(gaps.max()) <= TIE_NATS


CHILD = """
import json, sys
from tests import vllm_gpu

def main():
    with vllm_gpu.engine(sys.argv[1], load_format="nvfp4_repack", **json.loads(sys.argv[2])) as llm:
        prompts = json.loads(sys.argv[3])
        result = {"logprobs": vllm_gpu.prompt_logprobs(llm, prompts).tolist(),
                  "greedy": vllm_gpu.greedy(llm, prompts, int(sys.argv[4])),
                  "plugin_imported_here": "repack.vllm_plugin" in sys.modules}
    print("RESULT " + json.dumps(result), flush=True)

if __name__ == "__main__":
    main()
"""


def plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(e.value == "repack.vllm_plugin:register" for e in entry_points(group="vllm.general_plugins"))


def bundle_and_reference(tmp_path: Path, seed: int) -> tuple[Path, list[list[int]], dict[str, object]]:
    """An sm90 bundle of a two-layer ``TINY`` Llama (vocab 1024), random prompts, and the in-process engine's greedy
    tokens and prompt log-probabilities on it."""
    gen = torch.Generator().manual_seed(seed)
    source = vllm_gpu.write_shaped_llama(tmp_path / "source", vllm_gpu.TINY, 2, 1024, gen, max_positions=128)
    convert(source, "sm90", tmp_path / "bundle", fuse=True)
    prompts = vllm_gpu.random_prompts(PROMPTS, PROMPT_LEN, 1024, gen)
    with vllm_gpu.engine(tmp_path / "bundle", load_format=LOAD_FORMAT, **SMALL) as llm:
        greedy, margins = vllm_gpu.greedy_with_margins(llm, prompts, NEW_TOKENS)
        reference = {"logprobs": vllm_gpu.prompt_logprobs(llm, prompts), "greedy": greedy, "margins": margins}
    return tmp_path / "bundle", prompts, reference


def assert_same_greedy(got: list[list[int]], reference: dict[str, object]) -> None:
    """Each prompt's greedy tokens are the reference engine's, token for token, up to a step where the reference's
    runner-up was within ``TIE_NATS`` of its choice (a near tie, which another engine of the same model may break the
    other way; the two continuations differ after it). Seen on the H200: a random ``TINY`` model, vocab 1024."""
    for prompt, (mine, theirs, margins) in enumerate(zip(got, reference["greedy"], reference["margins"])):
        assert len(mine) == len(theirs), (prompt, mine, theirs)
        split = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if split is not None:
            print(f"prompt {prompt}: greedy tokens split at step {split}, a tie of {margins[split]:.4f} nats")
            assert margins[split] <= TIE_NATS, (prompt, split, margins[split], mine, theirs)


@pytest.mark.skipif(not REASON and not plugin_installed(), reason="nvfp4-repack is not installed (its entry point)")
def test_multiprocess_engine_finds_the_plugin_through_its_entry_point(tmp_path, random_seed):
    """vLLM's default engine (core in a subprocess): a script that never imports the plugin serves the bundle, so
    the ``vllm.general_plugins`` entry point registered the loader in both processes; the in-process engine's prompt
    log-probabilities (to 1e-3) and greedy tokens (``assert_same_greedy``)."""
    bundle, prompts, reference = bundle_and_reference(tmp_path, random_seed)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run([sys.executable, str(script), str(bundle), json.dumps(SMALL), json.dumps(prompts),
                           str(NEW_TOKENS)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["plugin_imported_here"]  # by vLLM's plugin loader: the script itself never imports it
    assert_same_greedy(result["greedy"], reference)
    assert float((torch.tensor(result["logprobs"], dtype=torch.float64) - reference["logprobs"]).abs().max()) <= 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"vllm serve exited with {server.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"vllm serve not healthy after {seconds:.0f} s")


@pytest.mark.skipif(not REASON and not plugin_installed(), reason="nvfp4-repack is not installed (its entry point)")
def test_openai_server_serves_the_bundle(tmp_path, random_seed):
    """One completion through ``vllm serve BUNDLE --load-format nvfp4_repack`` on loopback: the in-process greedy
    tokens (``assert_same_greedy``)."""
    bundle, prompts, reference = bundle_and_reference(tmp_path, random_seed)
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(bundle), "--load-format", LOAD_FORMAT,
               "--attention-backend", "TRITON_ATTN", "--skip-tokenizer-init", "--enforce-eager", "--host",
               "127.0.0.1", "--port", str(port), "--served-model-name", "bundle", "--max-model-len", "128",
               "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "8"]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    try:
        wait_healthy(server, port, 300)
        body = {"model": "bundle", "prompt": prompts[0], "max_tokens": NEW_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
    except Exception:
        log.flush()
        print((tmp_path / "serve.log").read_text()[-6000:])
        raise
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()
    assert_same_greedy([answer["choices"][0]["token_ids"]], reference)
