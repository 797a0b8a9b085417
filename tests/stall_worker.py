"""A straggling worker for the tests: the real ``python -m worker``, slow on purpose.

    python tests/stall_worker.py [--after N] [--seconds S] -- <python -m worker arguments>

The first N calls (default 0) are answered at once; each later one only after S seconds
(default: never — it sleeps ten minutes, longer than any test, and is killed first). The
answers are honest: only their timing is wrong. The worker answers its calls in order, so a
stalled call holds up the ones behind it, as a stalled machine would.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time

NEVER_S = 600.0


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--seconds", type=float, default=NEVER_S)
    args = p.parse_args(argv[:split])

    import worker._service as service
    from worker.__main__ import main as worker_main

    original_compute = service.ExpertServicer._compute
    calls = {"n": 0}
    lock = threading.Lock()

    def compute(self, req):  # type: ignore[no-untyped-def]
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n > args.after:
            time.sleep(args.seconds)
        return original_compute(self, req)

    service.ExpertServicer._compute = compute  # type: ignore[method-assign]
    return worker_main(argv[split + 1 :])


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as python -m worker does: a quick exit, without the last collection's walk
    sys.exit(code)
