"""Serverless experts (MoEless) over expert parallelism: the mechanism side.

- `ep_layer`: the shard_map MoE layer (replica slots per device, all_to_all dispatch / combine);
- `replica_store`: per-layer slot buffers on the devices, warm starts, weight movement counted;
- `executor`: an `ExpertExecutor` that plugs the above into the model forward, per layer asking a
  policy (`schedulers/`) for the placement of the forecast loads;
- `latency_model`, `simulator`: the MoEless §3.3 latency / cost model and the trace simulator.
"""
