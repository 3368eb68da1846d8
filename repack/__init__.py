"""nvfp4-repack: pre-bake NVFP4 checkpoints into serving kernels' runtime layouts, offline, on CPU."""

__version__ = "0.1.0"
BUNDLE_FORMAT_VERSION = 6  # 2: online transforms, tp_size / tp_rank / fusion / partitions; 3: per-tensor digests are
# xxh3-128, named by tensor_digest; 4: files and tensors hashed with BLAKE3, named by file_digest / tensor_digest, and
# a Hub source's own sha256 of each shard file (source.hub_sha256); 5: FusedMoE layers (``moe``), output transforms on
# some partitions (a layer transform's ``partitions``) and whole-K/N matrices (``whole``), which a reader of 4 would
# silently drop or misapply; 6: the engine versions whose state the bundle is (``engines``: ``{"vllm": ["0.33",
# "0.34"]}``), which the plugin checks against the running engine
