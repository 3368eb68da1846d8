"""nvfp4-repack: pre-bake NVFP4 checkpoints into serving kernels' runtime layouts, offline, on CPU."""

__version__ = "0.1.0"
BUNDLE_FORMAT_VERSION = 3  # 2: online transforms, tp_size / tp_rank / fusion / partitions; 3: per-tensor digests are xxh3-128, named by tensor_digest
