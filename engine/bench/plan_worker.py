"""A worker of `bench_planning.py --base-tree`: times every decode `scheduler.plan` call of simulated runs with the
modules of the source tree it runs in (its working directory), one request at a time.

Each stdin line is a JSON request {"model", "batch", "machine", "system", "gen_len", "plans"}; each answer one JSON
line {"seconds": [...], "plans": [repr of every plan, when asked]}. It imports nothing of any tree until it has put its
working directory first on the path, so two workers (this tree and another checkout) time their own code side by side
while the caller alternates the requests between them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def serve() -> None:
    """Answer requests until stdin closes (the routings of a point are prepared once per worker)."""
    sys.path[0] = str(Path.cwd())  # the tree under test, not this script's folder
    from engine.bench.bench_planning import point_run_spec, timed_run
    from engine.sim.run import prepare_routing

    routings: dict[tuple, object] = {}
    for line in sys.stdin:
        req = json.loads(line)
        spec = point_run_spec(req["model"], req["batch"], req["machine"], req["system"], req["gen_len"])
        routing = routings.setdefault((req["model"], req["batch"], req["machine"], spec.sequences),
                                      prepare_routing(spec))
        seconds, plans = timed_run(spec, routing)
        print(json.dumps({"seconds": seconds, "plans": [repr(p) for p in plans] if req["plans"] else []}), flush=True)


if __name__ == "__main__":
    serve()
