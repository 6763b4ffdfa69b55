"""Offload mode (LayerScope): experts in host memory, a device expert cache, chunked asynchronous
transfers, torch CPU experts, and the executor that carries out a scheduler's plans layer by layer."""
