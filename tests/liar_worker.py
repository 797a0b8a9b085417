"""A dishonest worker for the tests: the real ``python -m worker`` with one lie patched in.

    python tests/liar_worker.py LIE [--after N] -- <python -m worker arguments>

LIE is one of:
  offset  silu(x) + 1e-3 in place of the activation (weights and digest right)
  zeros   all-zero partials (needs no weights)
  nan     all-NaN partials
  pad     honest partials, each DispatchResponse padded with 1 MiB of an unknown field
  reorder HONEST: the same function summed in another order, as a float32 worker written in
          another language would (differences around 1e-7 relative); it must never be caught
With ``--after N`` the first N calls are answered honestly, then the lie starts.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading

import torch


def _reordered(hidden, gate_up, down, act, weights):  # type: ignore[no-untyped-def]
    """The expert with both reductions summed in chunks, last chunk first."""
    k = hidden.shape[1]
    g = sum(hidden[:, i : i + 7] @ gate_up[:, i : i + 7].T for i in reversed(range(0, k, 7)))
    gate, up = g.chunk(2, dim=-1)
    h = act(gate) * up
    n = h.shape[1]
    out = sum(h[:, i : i + 5] @ down[:, i : i + 5].T for i in reversed(range(0, n, 5)))
    return out * weights[:, None]


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("lie", choices=["offset", "zeros", "nan", "pad", "reorder"])
    p.add_argument("--after", type=int, default=0)
    args = p.parse_args(argv[:split])

    import worker._service as service
    from worker.__main__ import main as worker_main

    honest_forward = service.expert_forward
    calls = {"n": 0}
    lock = threading.Lock()

    def lying() -> bool:
        return calls["n"] > args.after

    original_compute = service.ExpertServicer._compute

    def compute(self, req):  # type: ignore[no-untyped-def]
        with lock:
            calls["n"] += 1
        return original_compute(self, req)

    def forward(hidden, gate_up, down, act, weights):  # type: ignore[no-untyped-def]
        if not lying() or args.lie == "pad":
            return honest_forward(hidden, gate_up, down, act, weights)
        if args.lie == "offset":
            return honest_forward(hidden, gate_up, down, lambda g: act(g) + 1e-3, weights)
        if args.lie == "reorder":
            return _reordered(hidden, gate_up, down, act, weights)
        if args.lie == "zeros":
            return torch.zeros(hidden.shape[0], down.shape[0], dtype=hidden.dtype)
        return torch.full((hidden.shape[0], down.shape[0]), float("nan"), dtype=hidden.dtype)

    service.expert_forward = forward  # type: ignore[assignment]
    service.ExpertServicer._compute = compute  # type: ignore[method-assign]
    if args.lie == "pad":
        original_dispatch = service.ExpertServicer.Dispatch
        # Field 99, length-delimited, 1 MiB: an unknown field every parser must skip.
        padding = b"\x9a\x06" + bytes([0x80, 0x80, 0x40]) + b"\x00" * (1 << 20)

        def dispatch(self, request_iterator, context):  # type: ignore[no-untyped-def]
            for resp in original_dispatch(self, request_iterator, context):  # serialized answers
                yield resp + padding

        service.ExpertServicer.Dispatch = dispatch  # type: ignore[method-assign]
    return worker_main(argv[split + 1 :])


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as python -m worker does: a quick exit, without the last collection's walk
    sys.exit(code)
