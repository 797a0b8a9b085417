"""``kvasir bench``: the paths side by side in one run, reported as ratios.

Everything runs on this machine at once, so absolute figures move between runs; the
ratios between paths measured in the same run are what to compare.

A module per path, each with the option that runs it alone:

    dispatch            (no option) the dispatch paths side by side, then decode, hops,
                        gateway_processes and assist: the full run's ratios and figures
    decode              --decode: remote over local, and over the placement's fabric-free
                        ceiling (the same experts on workers emulated in the backbone's process),
                        at RTT 0, 13 and 50 ms; what the checks cost it, the CPU per byte of each
                        process
    checks              --checks: what row checks and audits cost the remote decode
    assist              --assist: one stream, plain greedy against --assist lookup and draft
    hops                --hops: CPU ns per byte of each process a Dispatch call crosses
    gateway_processes   --gateway-processes: a gateway of one process against two
    shapes              --shape NAME: real releases' widths, their wire bytes and memory
    formats             --formats: an expert held in each served format, dequantizing's cost
    service             --service: the backbone service under 1, 8 and 32 concurrent callers
    kv_cache            --kv-cache: backbone serve's local decode against transformers' generate
    seed_table          --seed-table: the seed's reference figures beside ours, side by side

and what they share: ``_checkpoint`` (the bench's checkpoint), ``_streams`` (Dispatch streams
and the summary of their times), ``_decode_swarm`` (the decode benches' swarm), ``cpu``
(processes' CPU time) and ``floors`` (what each hop must pay per byte).
"""

from kvasir.bench._checkpoint import HIDDEN, INTER, make_bench_checkpoint
from kvasir.bench._decode_swarm import DECODE_MODEL, _core_split, start_decode_swarm  # _core_split: tools/profile_decode.py
from kvasir.bench._streams import _Stream  # for tools/profile_relays.py
from kvasir.bench.assist import ASSIST_PASSAGE, ASSIST_RTTS_MS, assist_keys, run_assist_bench
from kvasir.bench.checks import row_check_cost, run_checks_bench
from kvasir.bench.decode import (
    DECODE_RELAYS,
    RTTS_MS,
    ceiling_args,
    decode_hop_figures,
    decode_hops,
    decode_ratios,
    run_decode_bench,
)
from kvasir.bench.dispatch import BATCHES, run_bench
from kvasir.bench.formats import run_formats_bench
from kvasir.bench.gateway_processes import run_gateway_processes_bench
from kvasir.bench.hops import HOP_BATCH, HOP_PATHS, add_floors, hop_figures, hop_table, run_hop_bench
from kvasir.bench.service import run_service_bench
from kvasir.bench.shapes import (
    COMPUTE_NOTE,
    RELEASED_BYTES_PER_PARAM,
    SHAPE_ALL,
    SHAPE_BATCH,
    SHAPE_BATCHES,
    SHAPE_EXPERTS,
    SHAPES,
    SWARM_SIZES,
    WIRE_CALL_ID,
    WIRE_COMPUTE_MICROS,
    WIRE_DTYPES,
    WIRE_LAYER,
    CallBytes,
    ReleaseShape,
    call_bytes,
    memory_figures,
    run_shape_bench,
    shape_dispatch,
    shape_segments,
    shape_table,
    shape_wire,
    shapes_named,
    wire_figures,
)

__all__ = [
    "run_bench", "make_bench_checkpoint", "run_assist_bench", "run_gateway_processes_bench", "run_shape_bench",
    "SHAPES", "ReleaseShape", "run_checks_bench", "run_decode_bench", "run_hop_bench", "run_formats_bench",
    "run_service_bench", "assist_keys", "add_floors", "hop_figures", "hop_table", "decode_hops",
    "decode_hop_figures", "row_check_cost", "start_decode_swarm", "call_bytes", "memory_figures", "shape_dispatch",
    "decode_ratios", "ceiling_args",
    "shape_segments", "shape_table", "shape_wire", "shapes_named", "wire_figures", "CallBytes",
    "ASSIST_PASSAGE", "ASSIST_RTTS_MS", "BATCHES", "COMPUTE_NOTE", "DECODE_MODEL", "DECODE_RELAYS", "HIDDEN",
    "HOP_BATCH", "HOP_PATHS", "INTER", "RELEASED_BYTES_PER_PARAM", "RTTS_MS", "SHAPE_ALL", "SHAPE_BATCH",
    "SHAPE_BATCHES", "SHAPE_EXPERTS", "SWARM_SIZES", "WIRE_CALL_ID", "WIRE_COMPUTE_MICROS", "WIRE_DTYPES",
    "WIRE_LAYER",
]
