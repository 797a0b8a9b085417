"""A liar with free identities, for the tests: runs ``tests/liar_worker.py`` again and again,
each time with a fresh wallet, as soon as the last one has exited (a quarantined wallet is
refused by the hub, and the worker then stops).

    python tests/serial_liar.py --identities N --wallets DIR -- LIE ARGS -- <python -m worker arguments>

Each identity's wallet is ``DIR/liar-K.wallet`` (made by the worker); ``DIR/identities``
holds how many were started. A SIGTERM stops the current one and the loop.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import subprocess
import sys
import types

LIAR = pathlib.Path(__file__).with_name("liar_worker.py")


def main() -> int:
    argv = sys.argv[1:]
    first = argv.index("--")
    second = argv.index("--", first + 1)
    p = argparse.ArgumentParser()
    p.add_argument("--identities", type=int, required=True)
    p.add_argument("--wallets", type=pathlib.Path, required=True)
    args = p.parse_args(argv[:first])
    lie, worker_args = argv[first + 1 : second], argv[second + 1 :]
    args.wallets.mkdir(parents=True, exist_ok=True)
    current: list[subprocess.Popen[bytes]] = []
    stopping = [False]

    def stop(signum: int, frame: types.FrameType | None) -> None:
        stopping[0] = True
        for proc in current:
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    for k in range(args.identities):
        if stopping[0]:
            break
        (args.wallets / "identities").write_text(str(k + 1))
        wallet = args.wallets / f"liar-{k}.wallet"
        print(f"serial liar: identity {k + 1} of {args.identities}, wallet {wallet}", flush=True)
        proc = subprocess.Popen([sys.executable, str(LIAR), *lie, "--", *worker_args, "--wallet", str(wallet)])
        current[:] = [proc]
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
