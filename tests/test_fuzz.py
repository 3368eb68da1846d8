"""Fuzzing the parsers of untrusted input: each either returns a correct result or raises RepackError.

Never another exception, never a hang, never an allocation sized by a field of the input.

(a) ``read_header`` on random bytes and on structured-but-mutated safetensors files (random dtypes, shapes
    with huge/negative/non-int dims, offsets, length fields up to 2**64-1, truncation): a returned header is
    checked for consistency (every tensor inside the file, size = numel * itemsize, no overlaps, readable).
(b) ``parse_manifest`` / ``read_manifest`` / ``open_bundle`` on mutations of a real manifest.
(c) ``read_source`` on random config.json / hf_quant_config.json / index.json contents around a real checkpoint.

Memory and time are bounded concretely: each example runs under tracemalloc with a peak limit and under
a wall-clock alarm.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repack.bundle.manifest import Manifest, parse_manifest, read_manifest
from repack.bundle.reader import Bundle, open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.safetensors_io import DTYPES, read_header, read_tensor
from repack.sample import SAMPLE_DIR
from repack.sample.synthetic import random_nvfp4, write_checkpoint

FUZZ = settings(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(examples: int) -> settings:
    return settings(FUZZ, max_examples=examples)


TIME_LIMIT_S = 5.0  # per example; a real parse takes milliseconds
PEAK_LIMIT = 8 << 20  # bytes of Python allocations per example beyond the input itself


@contextlib.contextmanager
def bounded(input_size: int = 0):
    """Fail if the block takes more than TIME_LIMIT_S or allocates more than PEAK_LIMIT + 4 x input."""

    def timeout(signum, frame):
        raise AssertionError(f"took more than {TIME_LIMIT_S} s: a hang")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak <= PEAK_LIMIT + 4 * input_size, f"allocated {peak} bytes parsing a {input_size}-byte input"
    finally:
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def accepts_or_refuses(fn, *args, input_size: int = 0):
    """``fn(*args)`` or None if it raised RepackError; any other exception fails the test."""
    with bounded(input_size):
        try:
            return fn(*args)
        except RepackError as exc:
            message = str(exc)
            assert message and "internal error" not in message
            return None


# --- (a) safetensors headers ------------------------------------------------------------------------------------

DTYPE_NAMES = sorted(DTYPES)
HUGE = [2**31, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
dims = st.one_of(st.integers(0, 8), st.integers(-3, 70), st.sampled_from(HUGE + [-(2**63)]))
weird = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4), st.builds(list),
                  st.builds(dict), st.just("x" * 3), st.builds(lambda: [[1]]))  # fresh objects: no shared aliasing
shape_values = st.one_of(st.lists(dims, max_size=4), st.lists(st.one_of(dims, weird), max_size=3), weird)
dtype_values = st.one_of(st.sampled_from(DTYPE_NAMES), st.sampled_from(["F4", "u8", "", "F8_E8M0", "I128"]), weird)


@st.composite
def safetensors_files(draw) -> bytes:
    """A consistent small safetensors file, then zero or more mutations of its header, length or size."""
    count = draw(st.integers(0, 4))
    header: dict = {}
    offset = 0
    for i in range(count):
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        name = draw(st.text(max_size=8)) + f".{i}"
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(st.just({"format": "pt"}), st.dictionaries(st.text(max_size=3), weird,
                                                                                           max_size=2)))
    data = draw(st.binary(min_size=offset, max_size=offset))
    for _ in range(draw(st.integers(0, 3))):
        names = [n for n in header if n != "__metadata__"]
        kind = draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "add", "shift"]))
        if kind == "add" or not names:
            header[draw(st.text(max_size=6))] = {"dtype": draw(dtype_values), "shape": draw(shape_values),
                                                 "data_offsets": draw(st.lists(dims, max_size=3))}
            continue
        name = draw(st.sampled_from(names))
        entry = header[name]
        if not isinstance(entry, dict):
            header[name] = draw(weird)
        elif kind == "dtype":
            entry["dtype"] = draw(dtype_values)
        elif kind == "shape":
            entry["shape"] = draw(shape_values)
        elif kind == "offsets":
            entry["data_offsets"] = draw(st.one_of(st.lists(dims, max_size=3), weird))
        elif kind == "entry":
            header[name] = draw(st.one_of(weird, st.dictionaries(st.sampled_from(["dtype", "shape", "x"]), weird)))
        elif kind == "shift" and isinstance(entry.get("data_offsets"), list):
            delta = draw(st.integers(-16, 16))
            entry["data_offsets"] = [o + delta if type(o) is int else o for o in entry["data_offsets"]]
    body = json.dumps(header).encode() + b" " * draw(st.integers(0, 7))
    length = draw(st.one_of(st.just(len(body)), st.integers(0, len(body) + 16), st.sampled_from(HUGE[:8]),
                            st.integers(0, 2**64 - 1)))
    blob = struct.pack("<Q", length % 2**64) + body + data + draw(st.binary(max_size=8))
    if draw(st.integers(0, 4)) == 0:
        blob = blob[: draw(st.integers(0, len(blob)))]
    return blob


def check_header(file: Path, blob: bytes) -> None:
    entries = accepts_or_refuses(read_header, file, input_size=len(blob))
    if entries is None:
        return
    header_len = int.from_bytes(blob[:8], "little")
    assert len(blob) >= 8 + header_len
    spans = []
    for name, entry in entries.items():
        assert entry.name == name and entry.file == file and entry.dtype_name in DTYPES
        assert all(type(d) is int and d >= 0 for d in entry.shape)
        assert 8 + header_len <= entry.begin <= entry.end <= len(blob), (name, entry)
        assert entry.nbytes == math.prod(entry.shape) * DTYPES[entry.dtype_name].itemsize
        if entry.nbytes:
            spans.append((entry.begin, entry.end))
        tensor = read_tensor(entry)
        assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype
        assert tensor.reshape(-1).view(torch.uint8).numpy().tobytes() == blob[entry.begin : entry.end]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping tensors accepted"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@fuzz(300)
@given(blob=st.binary(max_size=300))
def test_read_header_random_bytes(scratch, blob):
    file = scratch / "random.safetensors"
    file.write_bytes(blob)
    check_header(file, blob)


@fuzz(400)
@given(blob=safetensors_files())
def test_read_header_mutated_files(scratch, blob):
    file = scratch / "mutated.safetensors"
    file.write_bytes(blob)
    check_header(file, blob)


def test_read_header_accepts_what_the_fuzzer_builds_unmutated(scratch):
    """The structured strategy is not vacuous: unmutated files parse, and agree with the safetensors library."""
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.zeros(3, 5, dtype=torch.float16), "b": torch.arange(7, dtype=torch.int32),
               "c": torch.zeros(0, 4), "s": torch.tensor(1.5)}
    save_file(tensors, scratch / "real.safetensors")
    entries = read_header(scratch / "real.safetensors")
    for name, value in load_file(scratch / "real.safetensors").items():
        assert torch.equal(read_tensor(entries[name]), value)


def _header_file(path: Path, header: object, length: int | None = None, data: bytes = b"") -> int:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    blob = struct.pack("<Q", len(body) if length is None else length) + body + data
    path.write_bytes(blob)
    return len(blob)


@pytest.mark.parametrize(
    "header,length,match",
    [
        ({}, 2**60, "header length 1152921504606846976 bytes exceeds"),
        ({}, 2**64 - 1, "exceeds"),
        ({}, 90_000_000, "runs past the end of the file"),
        ({"w": {"dtype": "U8", "shape": [2**40, 2**40], "data_offsets": [0, 2**80]}}, None, "spans bytes"),
        ({"w": {"dtype": "U8", "shape": [2**40, 2**40], "data_offsets": [0, 0]}}, None, "larger than the whole file"),
        ({"w": {"dtype": "F64", "shape": [2**62] * 4000, "data_offsets": [0, 8]}}, None, "larger than the whole file"),
        ({"w": {"dtype": "U8", "shape": ["x", 2**40], "data_offsets": [0, 1]}}, None, "invalid shape"),
        ({"w": {"dtype": "U8", "shape": ["x", 2**27], "data_offsets": [0, 1]}}, None, "invalid shape"),
        ({"w": {"dtype": "U8", "shape": [2**40, "x"], "data_offsets": [0, 1]}}, None, "invalid shape"),
        ({"w": {"dtype": "U8", "shape": [1] * 300_000 + [2**62], "data_offsets": [0, 1]}}, None, "larger than the"),
        ({"w": {"dtype": "U8", "shape": [0] + [2**62] * 300_000, "data_offsets": [0, 0]}}, None, None),
        (b"[" * 200_000 + b"]" * 200_000, None, "header is not JSON"),
        (b'{"w": {"dtype": "U8", "shape": [1' + b"0" * 100_000 + b'], "data_offsets": [0, 1]}}', None, "not JSON"),
    ],
    ids=["length-2^60", "length-2^64-1", "length-past-eof", "offsets-2^80", "shape-2^80-bytes", "shape-4000-dims",
         "string-times-2^40", "string-times-2^27", "2^40-times-string", "300k-dims", "300k-dims-with-zero",
         "nested-200k", "int-100k-digits"],
)
def test_size_fields_never_drive_allocation_or_time(scratch, header, length, match):
    file = scratch / "hostile.safetensors"
    size = _header_file(file, header, length, data=b"\x00" * 8)
    entries = accepts_or_refuses(read_header, file, input_size=size)
    if match is None:
        assert entries is not None and entries["w"].nbytes == 0
        return
    assert entries is None
    with pytest.raises(RepackError, match=match):
        read_header(file)


# --- JSON values, and mutations of real documents ---------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([10**400, -1, 0, 2**63, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["", "sm100", "sm120", "F32", "U8", "../x", "a/b", "\x00", "0" * 64, "nvfp4-repack-bundle",
                     "compressed-tensors", "modelopt", "nvfp4-pack-quantized", "NVFP4", "float"]),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


@st.composite
def mutated(draw, document, max_mutations: int = 4):
    """``document`` after 1..max_mutations edits at random paths: replace, delete, insert, or retype a value."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, max_mutations))):
        doc = _mutate_once(draw, doc)
    return doc


def _mutate_once(draw, node):
    if isinstance(node, dict) and node and draw(st.integers(0, 3)) > 0:
        key = draw(st.sampled_from(sorted(node)))
        action = draw(st.sampled_from(["descend", "descend", "replace", "delete", "insert"]))
        if action == "descend":
            node[key] = _mutate_once(draw, node[key])
        elif action == "replace":
            node[key] = draw(json_values)
        elif action == "delete":
            del node[key]
        else:
            node[draw(st.text(max_size=8))] = draw(json_values)
        return node
    if isinstance(node, list) and node and draw(st.integers(0, 3)) > 0:
        index = draw(st.integers(0, len(node) - 1))
        action = draw(st.sampled_from(["descend", "replace", "delete", "append"]))
        if action == "descend":
            node[index] = _mutate_once(draw, node[index])
        elif action == "replace":
            node[index] = draw(json_values)
        elif action == "delete":
            del node[index]
        else:
            node.append(draw(json_values))
        return node
    if type(node) is int and draw(st.booleans()):
        as_float = node + 0.5 if abs(node) < 2**53 else 1e308
        return draw(st.sampled_from([-node, node + 1, node * 2**40, str(node), as_float, None, True]))
    return draw(json_values)


# --- (b) manifests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-bundle") / "bundle"
    convert(SAMPLE_DIR, "sm100", out)
    return out


@pytest.fixture(scope="module")
def real_manifest(bundle_dir) -> dict:
    return json.loads((bundle_dir / "manifest.json").read_text())


def test_real_manifest_parses(real_manifest):
    manifest = parse_manifest(real_manifest)
    assert parse_manifest(json.loads(manifest.to_json())) == manifest


@fuzz(300)
@given(data=st.data())
def test_parse_manifest_mutated(real_manifest, data):
    document = data.draw(mutated(real_manifest))
    manifest = accepts_or_refuses(parse_manifest, document, input_size=len(json.dumps(document)))
    if manifest is not None:
        assert isinstance(manifest, Manifest)
        assert parse_manifest(json.loads(manifest.to_json())) == manifest  # what parses, round-trips
        manifest.all_tensors


@fuzz(100)
@given(document=json_values)
def test_parse_manifest_random_json(document):
    assert accepts_or_refuses(parse_manifest, document) is None


@fuzz(150)
@given(data=st.data())
def test_open_bundle_with_mutated_manifest(bundle_dir, real_manifest, data):
    """The full reader path (JSON bytes, target, layer geometry, config) on a real bundle folder."""
    if data.draw(st.integers(0, 5)) == 0:
        raw = data.draw(st.binary(max_size=200))
    else:
        raw = json.dumps(data.draw(mutated(real_manifest))).encode()
    (bundle_dir / "manifest.json").write_bytes(raw)
    try:
        bundle = accepts_or_refuses(open_bundle, bundle_dir, input_size=len(raw))
        if bundle is not None:
            assert isinstance(bundle, Bundle)
            for prefix in bundle.manifest.layers:  # reading through a parsed manifest stays clean too
                accepts_or_refuses(bundle.runtime_layer, prefix)
    finally:
        (bundle_dir / "manifest.json").write_text(json.dumps(real_manifest))
    assert read_manifest(bundle_dir) == parse_manifest(real_manifest)


# --- (c) config.json, hf_quant_config.json, index.json ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fuzz-ckpt")
    gen = torch.Generator().manual_seed(0)
    layers = {f"model.layers.{i}.proj": random_nvfp4(16, 32, gen) for i in range(2)}
    out = {}
    for fmt in ("compressed-tensors", "modelopt"):
        out[fmt] = write_checkpoint(base / fmt, layers, {"norm.weight": torch.ones(4)}, fmt=fmt, shards=2,
                                    config={"model_type": "llama"})
    return out


def _json_files(root: Path) -> dict[str, bytes | None]:
    names = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")
    return {n: (root / n).read_bytes() if (root / n).exists() else None for n in names}


def _restore(root: Path, files: dict[str, bytes | None]) -> None:
    for name, content in files.items():
        if content is None:
            (root / name).unlink(missing_ok=True)
        else:
            (root / name).write_bytes(content)


@fuzz(250)
@given(data=st.data())
def test_read_source_with_mutated_json(checkpoints, data):
    fmt = data.draw(st.sampled_from(sorted(checkpoints)))
    root = checkpoints[fmt]
    original = _json_files(root)
    try:
        for name, content in original.items():
            choice = data.draw(st.integers(0, 5))
            if content is None:
                if choice == 0:
                    (root / name).write_text(json.dumps(data.draw(json_values)))
                continue
            if choice <= 2:
                (root / name).write_text(json.dumps(data.draw(mutated(json.loads(content)))))
            elif choice == 3:
                as_json = st.builds(lambda v: json.dumps(v).encode(), json_values)
                (root / name).write_bytes(data.draw(st.one_of(st.binary(max_size=64), as_json)))
            elif choice == 4 and name != "config.json":
                (root / name).unlink()
        source = accepts_or_refuses(read_source, root)
        if source is not None:
            # Accepted: the layers are exactly the checkpoint's, whatever the JSON said.
            assert set(source.layers) == {"model.layers.0.proj", "model.layers.1.proj"}
            for layer in source.layers.values():
                assert (layer.n, layer.k) == (16, 32)
                source.load_layer(layer)
    finally:
        _restore(root, original)


@fuzz(100)
@given(config=st.dictionaries(st.sampled_from(["quantization_config", "transform_config", "model_type", "x"]),
                              json_values, max_size=3))
def test_read_source_with_random_config(checkpoints, config):
    root = checkpoints["compressed-tensors"]
    original = _json_files(root)
    try:
        (root / "config.json").write_text(json.dumps(config))
        assert accepts_or_refuses(read_source, root) is None  # no random config makes this an NVFP4 checkpoint
    finally:
        _restore(root, original)
