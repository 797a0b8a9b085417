"""A dishonest worker for the tests: the real ``python -m worker`` with one lie patched in.

    python tests/liar_worker.py LIE [--after N] [--segments P] [--unchecked] [--announce-plain]
        -- <python -m worker arguments>

LIE is one of:
  offset  silu(x) + 1e-3 in place of the activation (weights, digest and projections right)
  zeros   all-zero partials and projections (needs no weights)
  nan     all-NaN partials
  bound   honest partials plus 0.9 x the old audit bound (8 bfloat16 half-ulps) on every element,
          the same sign as the element: what passed every audit on a bfloat16 wire
  proj    honest partials, projections 0.1% off (the gate half): only the row checks see it
  pad     honest partials, each DispatchResponse padded with 1 MiB of an unknown field
  reorder HONEST: the same function summed in another order, as a float32 worker written in
          another language would (differences around 1e-7 relative); it must never be caught
  honest  no lie in the numbers (for the lies of the hello: --unchecked, --announce-plain)
  noscale a quantized checkpoint's experts used without their scales (block FP8's weight_scale_inv,
          compressed-tensors' weight_scale): the FP8 values or the integers taken as the weights
          (its digest, made while loading, is the honest one)
  coarse  a bfloat16 checkpoint's experts rounded to block FP8 (128 x 128) to hold half the bytes:
          a coarser format than the checkpoint's
With ``--after N`` the first N calls are answered honestly, then the lie starts. With
``--segments P`` only a share P of the segments (an expert's rows in a call) lie, drawn at
random, and the first call of every Dispatch stream is honest (that is when the first-call
audit happens). ``--unchecked`` leaves ``projections`` out of the hello, as an older worker
would: only sampled audits check it. ``--announce-plain`` announces the plain expert function
(GLU with silu) whatever the checkpoint's is.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import sys
import threading

import torch


def _reordered(hidden, gate_up, down, act, weights):  # type: ignore[no-untyped-def]
    """The expert with both reductions summed in chunks, last chunk first (the plain function,
    ``act`` its activation), accumulated in float32 and rounded once to the checkpoint's dtype,
    as an honest worker in another language would: summed in bfloat16 itself (each partial sum
    rounded), it would accumulate in less than the float32 every check allows for, and an audit
    could catch it now and then (seen in CI on a block-FP8 checkpoint)."""
    dtype = hidden.dtype
    if dtype != torch.float32:
        out, g = _reordered(hidden.float(), gate_up.float(), down.float(), act, weights.float())
        return out.to(dtype), g.to(dtype)
    k = hidden.shape[1]
    g = sum(hidden[:, i : i + 7] @ gate_up[:, i : i + 7].T for i in reversed(range(0, k, 7)))
    gate, up = g.chunk(2, dim=-1)
    h = act(gate) * up
    n = h.shape[1]
    out = sum(h[:, i : i + 5] @ down[:, i : i + 5].T for i in reversed(range(0, n, 5)))
    return out * weights[:, None], g


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("lie", choices=["offset", "zeros", "nan", "bound", "proj", "pad", "reorder", "honest", "noscale",
                                   "coarse"])
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--segments", type=float, default=1.0)
    p.add_argument("--unchecked", action="store_true")
    p.add_argument("--announce-plain", action="store_true")
    args = p.parse_args(argv[:split])

    import worker.__main__ as worker_cli
    import worker._service as service

    honest_forward = service.expert_forward_projections
    calls = {"n": 0}
    lock = threading.Lock()
    local = threading.local()  # the call being computed, in the gRPC handler's thread
    chance = random.Random()

    def lying() -> bool:
        if calls["n"] <= args.after or getattr(local, "first_of_stream", False):
            return False
        return args.segments >= 1.0 or chance.random() < args.segments

    original_compute = service.ExpertServicer._compute
    original_dispatch = service.ExpertServicer.Dispatch

    def compute(self, req):  # type: ignore[no-untyped-def]
        with lock:
            calls["n"] += 1
        return original_compute(self, req)

    def dispatch(self, request_iterator, context):  # type: ignore[no-untyped-def]
        first = [True]

        def requests():  # type: ignore[no-untyped-def]
            for req in request_iterator:
                local.first_of_stream = first[0] and args.segments < 1.0
                first[0] = False
                yield req

        yield from original_dispatch(self, requests(), context)

    def forward(hidden, gate_up, down, fn, weights, biases=None):  # type: ignore[no-untyped-def]
        if args.lie in ("pad", "honest", "noscale") or not lying():
            return honest_forward(hidden, gate_up, down, fn, weights, biases)
        if args.lie == "coarse":
            from kvasir_rpc import dequantize_block_fp8, quantize_block_fp8

            def rounded(w):  # type: ignore[no-untyped-def]
                return dequantize_block_fp8(*quantize_block_fp8(w), w.dtype)

            return honest_forward(hidden, rounded(gate_up), rounded(down), fn, weights, biases)
        if not fn.plain:
            raise SystemExit(f"liar_worker: lies only on the plain expert function, not {fn.describe()}")
        act = fn.act
        if args.lie == "offset":
            return honest_forward(hidden, gate_up, down, lambda g: act(g) + 1e-3, weights)
        if args.lie == "reorder":
            return _reordered(hidden, gate_up, down, act, weights)
        if args.lie == "proj":
            out, projections = honest_forward(hidden, gate_up, down, act, weights)
            inter = projections.shape[1] // 2
            return out, torch.cat([projections[:, :inter] * 1.001, projections[:, inter:]], dim=1)
        if args.lie == "bound":
            out, projections = honest_forward(hidden, gate_up, down, act, weights)
            return out + 0.9 * 8 * 2.0**-9 * out.abs(), projections
        shape, inter = (hidden.shape[0], down.shape[0]), gate_up.shape[0]
        if args.lie == "zeros":
            return torch.zeros(shape, dtype=hidden.dtype), torch.zeros(hidden.shape[0], inter, dtype=hidden.dtype)
        return torch.full(shape, float("nan"), dtype=hidden.dtype), torch.zeros(hidden.shape[0], inter, dtype=hidden.dtype)

    if args.lie == "noscale":
        from kvasir_rpc._quant import QuantizedExpert

        honest_dequantize = QuantizedExpert.dequantize

        def without_scales(self):  # type: ignore[no-untyped-def]
            if not lying():  # loading (the digest) and the honest calls
                return honest_dequantize(self)
            return torch.cat([self.gate.to(self.dtype), self.up.to(self.dtype)]), self.down.to(self.dtype)

        QuantizedExpert.dequantize = without_scales  # type: ignore[method-assign]
        from kvasir_rpc import CtExpert

        honest_ct = CtExpert.dequantize

        def ct_without_scales(self):  # type: ignore[no-untyped-def]
            if not lying():
                return honest_ct(self)
            unscaled = {p: {**t, "weight_scale": torch.ones_like(t["weight_scale"])} for p, t in self.parts.items()}
            return honest_ct(dataclasses.replace(self, parts=unscaled))

        CtExpert.dequantize = ct_without_scales  # type: ignore[method-assign]
    service.expert_forward_projections = forward  # type: ignore[assignment]
    service.ExpertServicer._compute = compute  # type: ignore[method-assign]
    service.ExpertServicer.Dispatch = dispatch  # type: ignore[method-assign]
    if args.unchecked or args.announce_plain:
        from kvasir_rpc import ExpertFunction

        real_handshake = worker_cli.WorkerHandshake

        def lying_handshake(*a, **kw):  # type: ignore[no-untyped-def]
            if args.unchecked:
                kw["projections"] = False
            if args.announce_plain:
                kw["expert_function"] = ExpertFunction().to_proto()
            return real_handshake(*a, **kw)

        worker_cli.WorkerHandshake = lying_handshake  # type: ignore[misc,assignment]
    if args.lie == "pad":
        # Field 99, length-delimited, 1 MiB: an unknown field every parser must skip.
        padding = b"\x9a\x06" + bytes([0x80, 0x80, 0x40]) + b"\x00" * (1 << 20)

        def padded(self, request_iterator, context):  # type: ignore[no-untyped-def]
            for resp in dispatch(self, request_iterator, context):  # serialized answers
                yield resp + padding

        service.ExpertServicer.Dispatch = padded  # type: ignore[method-assign]
    return worker_cli.main(argv[split + 1 :])


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as python -m worker does: a quick exit, without the last collection's walk
    sys.exit(code)
