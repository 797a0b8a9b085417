"""A stranger who asks the hub for plans it never means to serve: ``N`` planning hellos
(``--experts auto``), each from a fresh wallet, each offering only experts ``LO-HI`` of every
layer, with room for all of them; it takes each suggested slice and never joins.

    python tests/plan_hoarder.py ws://HOST:PORT LAYERS LO-HI N

Prints one JSON line: how many plans it got and how many experts they named."""

from __future__ import annotations

import hashlib
import json
import sys

import trio

from kvasir_rpc import Wallet, WorkerHandshake
from worker._tunnel import request_plan


def main() -> int:
    url, layers, span, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    lo, hi = (int(x) for x in span.split("-"))
    offered = {layer: tuple(range(lo, hi + 1)) for layer in range(layers)}
    capacity = sum(len(v) for v in offered.values())
    plans = experts = 0
    for _ in range(n):
        wallet = Wallet.generate()

        def handshake(wallet: Wallet = wallet) -> WorkerHandshake:
            return WorkerHandshake(wallet, slices=offered, weights_digest=hashlib.sha256(b"").digest(),
                                   device="cpu", model_type="qwen3_moe", expert_capacity=capacity)

        plan = trio.run(request_plan, url, handshake)
        plans += 1
        experts += sum(len(v) for v in plan.values())
    print(json.dumps({"plans": plans, "experts": experts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
