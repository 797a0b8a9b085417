"""``kvasir bench --formats``: one expert at a release's widths held in each format a worker
serves (bfloat16 as it is; block FP8, MXFP4, compressed-tensors FP8 and int4 as stored, then
dequantized per call): the bytes it holds against bfloat16's, and what dequantizing costs
against computing one row and a batch through it, side by side in one run, as ratios.

The wire does not depend on the format (the model's activation dtype, bfloat16 for these), so
the bytes per row are given once."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["run_formats_bench"]

#: Qwen3-30B-A3B's expert widths (hidden, intermediate): the common FP8 and int4 target.
WIDTHS = (2048, 768)
BATCH = 128


def _held(fmt: str, gate_up: Any, down: Any) -> Any:
    """The expert ``(gate_up [2I, H], down [H, I])`` bfloat16 as a worker holds it in ``fmt``."""
    import torch

    from kvasir_rpc import (
        CtExpert,
        Mxfp4Expert,
        QuantizedExpert,
        compress_ct,
        ct_scheme_of,
        quantize_block_fp8,
        quantize_mxfp4,
    )

    inter = gate_up.shape[0] // 2
    gate, up = gate_up[:inter], gate_up[inter:]
    if fmt == "fp8":
        (g, gs), (u, us), (d, ds) = (quantize_block_fp8(w, 128) for w in (gate, up, down))
        return QuantizedExpert(g, u, d, gs, us, ds, dtype=torch.bfloat16)
    if fmt == "mxfp4":  # gpt-oss's orientation: [in, out] dequantized
        (gub, gus), (db, dss) = quantize_mxfp4(gate_up.t()), quantize_mxfp4(down.t())
        return Mxfp4Expert(gub, gus, db, dss, dtype=torch.bfloat16)
    ct = ct_scheme_of(fmt[3:], 128)
    parts = {name: compress_ct(ct, w) for name, w in (("gate", gate), ("up", up), ("down", down))}
    return CtExpert(ct.kind, ct.scheme, parts, dtype=torch.bfloat16)


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    import time

    fn()  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_formats_bench(*, quick: bool = False, widths: tuple[int, int] = WIDTHS,
                      say: Callable[[str], None] = print) -> dict[str, object]:
    """Per format: bytes held (and the ratio to bfloat16's), the median ms to dequantize one
    expert, and that against the median ms of one row and of BATCH rows through it (bfloat16
    compute, as every format computes once dequantized), on one thread."""
    import torch

    from kvasir_rpc import ExpertFunction, expert_forward

    hidden, inter = widths
    calls = 3 if quick else 9
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(hidden, inter, generator=g) * 0.02).to(torch.bfloat16)
    fn = ExpertFunction()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compute = {}
        for n in (1, BATCH):
            x = (torch.randn(n, hidden, generator=g)).to(torch.bfloat16)
            w = torch.full((n,), 0.5, dtype=torch.bfloat16)
            compute[n] = _median_ms(functools.partial(expert_forward, x, gate_up, down, fn, w), calls)
        bf16_bytes = gate_up.nbytes + down.nbytes
        formats: dict[str, dict[str, float]] = {
            "bfloat16": {"bytes": bf16_bytes, "held_vs_bfloat16": 1.0, "dequantize_ms": 0.0}}
        for fmt in ("fp8", "mxfp4", "ct-fp8", "ct-int4"):
            held = _held(fmt, gate_up, down)
            ms = _median_ms(held.dequantize, calls)
            formats[fmt] = {"bytes": held.nbytes, "held_vs_bfloat16": round(held.nbytes / bf16_bytes, 4),
                            "dequantize_ms": round(ms, 3),
                            "dequantize_vs_1_row": round(ms / compute[1], 2),
                            f"dequantize_vs_{BATCH}_rows": round(ms / compute[BATCH], 2)}
            say(f"{fmt:8} holds {held.nbytes / 1e6:6.2f} MB ({held.nbytes / bf16_bytes:.3f} of bfloat16); "
                f"dequantizing {ms:7.2f} ms = {ms / compute[1]:5.1f} x one row, {ms / compute[BATCH]:4.2f} x "
                f"{BATCH} rows")
    finally:
        torch.set_num_threads(threads)
    say(f"bfloat16 holds {bf16_bytes / 1e6:6.2f} MB; one row {compute[1]:.3f} ms, {BATCH} rows {compute[BATCH]:.2f} ms "
        f"(one thread, H {hidden}, I {inter})")
    wire = {"in": 2 * hidden, "out": 2 * hidden, "projections": 2 * 2 * inter}
    return {"widths": {"hidden": hidden, "intermediate": inter}, "formats": formats,
            "compute_ms": {"1_row": round(compute[1], 3), f"{BATCH}_rows": round(compute[BATCH], 3)},
            "wire_bytes_per_row_bfloat16": wire}
