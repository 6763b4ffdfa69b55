"""Quantize a checkpoint's routed experts once and save the result, so that later loads only map it.

    python -m models.quant.save <checkpoint folder or pkg:path> <out folder> --format q4_k_m [--dtype bfloat16]

`model.checkpoint=<out folder>` then serves it (models.generate, engine.run): dense weights read as usual,
experts as views of the mapped `experts.safetensors` (see `models.quant.checkpoint`).
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

from core.config import resolve_path
from models.loading import load_model
from models.quant.checkpoint import save_quantized
from models.quant.experts import EXPERT_FORMATS


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.quant.save", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="HF checkpoint folder (or pkg:<path> inside moescope)")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--format", required=True, choices=[f for f in EXPERT_FORMATS if f != "bf16"])
    parser.add_argument("--dtype", default="auto", help="dtype of the dense weights (auto: the checkpoint's)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    spec = {"name": "quantize", "checkpoint": args.checkpoint, "expert_format": args.format}
    _, model, folder = load_model(spec, dtype=args.dtype)
    out = save_quantized(model, args.out, args.format, source=folder)
    print(f"wrote {out} ({args.format}) from {resolve_path(args.checkpoint)} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
