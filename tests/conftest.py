"""Test session setup: 8 host devices for shard_map tests (before jax is imported anywhere)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
