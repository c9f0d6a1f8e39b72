"""Dynamo's trace of one encoder layer, per variant: the part of every compiled start that no cache keeps.

torch.compile's Dynamo interprets the Python of a compiled layer at every start, warm ones included (AOT
autograd's and Inductor's caches keep what comes after it). This times that trace alone for one encoder layer of
--model (the first of --tower's, bench_train.py's config and batch), converted as bench_train.py converts it,
under bf16 autocast: the layer is compiled with backend="eager" (Dynamo only), each trace after
torch._dynamo.reset(), its seconds the first call's minus a second call's (which runs the recorded graph without
tracing). Variants alternate within each of --rounds rounds, so that drift of the host lands on all alike; per
variant, the median. A variant ending in "-blocks" is its base with the fused layer's own paths turned off
(blocks/layer_leaves.py: the attention block's and the MLP's forwards run, each op a leaf of its own), where the
base takes the two graph leaves (every linear 8-bit) or the stock layer's calls (every linear below its token
floor, e.g. ViT-L/14's text tower at its batch: --model vit-l-14 --tower text).

    PYTHONPATH=src python benchmarks/dynamo_trace.py --variants bf16 int8 int8-blocks fp8 fp8-blocks \\
        --json $OUT/dynamo_trace.json
    PYTHONPATH=src python benchmarks/dynamo_trace.py --device cpu --tiny   # smoke test
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train
import common


def parse_args(argv=None):
    parser = common.parser_of(__doc__)
    parser.add_argument("--model", choices=sorted(bench_train.MODELS), default="vit-b-16")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["bf16", "int8", "int8-blocks", "fp8", "fp8-blocks"],
        help="a bench_train.py base (bf16, int8, fp8, ...), optionally with -blocks",
    )
    parser.add_argument("--rounds", type=int, default=5, help="traces per variant, alternating")
    parser.add_argument(
        "--tower",
        choices=["vision", "text"],
        default="vision",
        help="whose first layer: the text tower's runs on bench_train.py's text length (77 tokens for CLIP, 64 for "
        "SigLIP), without an attention mask (the trace is what is timed)",
    )
    parser.add_argument("--json", help="write the rows here")
    common.add_smoke_flags(parser)
    args = parser.parse_args(argv)
    common.check_device(parser, args)
    for variant in args.variants:
        if not bench_train.is_base(variant.removesuffix("-blocks")):
            parser.error(f"unknown variant {variant!r}: {bench_train.BASES_HELP}")
    return args


class _Layer:
    """One variant's layer, its input, and what its traces measured."""

    def __init__(self, variant: str, config, device: str, batch: int, tower: str = "vision"):
        self.variant, self.base = variant, variant.removesuffix("-blocks")
        model = bench_train.build_model(config, self.base, False, "none", device)
        if tower == "vision":
            self.layer = model.vision_model.encoder.layers[0]
            tokens = (config.vision_config.image_size // config.vision_config.patch_size) ** 2 + 1
            width = config.vision_config.hidden_size
        else:
            self.layer = model.text_model.encoder.layers[0]
            tokens = min(bench_train.TEXT_TOKENS, config.text_config.max_position_embeddings)
            width = config.text_config.hidden_size
        self.x = torch.randn(batch, tokens, width, device=device)
        self.device, self.seconds, self.nodes = device, [], None

    def _call(self, compiled) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(self.device, dtype=torch.bfloat16):
            compiled(self.x, None)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def trace(self) -> None:
        from hf_switchback.blocks import layer_leaves

        graphs = []

        def backend(gm, example_inputs):
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        enabled = layer_leaves.ENABLED
        layer_leaves.ENABLED = not self.variant.endswith("-blocks")
        try:
            torch._dynamo.reset()
            compiled = torch.compile(self.layer, backend=backend, dynamic=False, fullgraph=True)
            first = self._call(compiled)
            self.seconds.append(first - self._call(compiled))
        finally:
            layer_leaves.ENABLED = enabled
        self.nodes = graphs[-1]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    config = bench_train.clip_config(args.model, tiny=args.tiny)
    batch = 4 if args.tiny else bench_train.MODELS[args.model]["batch"]
    layers = [_Layer(variant, config, args.device, batch, args.tower) for variant in args.variants]
    for layer in layers:  # untimed: the process's one-time work (Dynamo's, the libraries', our operators')
        layer.trace()
        layer.seconds.clear()
    for _ in range(args.rounds):
        for layer in layers:
            layer.trace()
    rows = []
    for layer in layers:
        rows.append(
            dict(
                model=args.model,
                tower=args.tower,
                variant=layer.variant,
                batch=batch,
                trace_s=statistics.median(layer.seconds),
                traces_s=layer.seconds,
                graph_nodes=layer.nodes,
            )
        )
        print(
            f"{layer.variant:14s} trace {rows[-1]['trace_s']:.4f} s (median of {len(layer.seconds)})"
            f"  graph nodes {layer.nodes}",
            flush=True,
        )
    if args.json:
        common.write_json(
            Path(args.json),
            dict(env=dict(common.versions(args.device), argv=sys.argv[1:]), rows=rows),
            indent=1,
        )
    return rows


if __name__ == "__main__":
    main()
