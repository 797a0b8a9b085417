"""``python -m kvasir``: the ``kvasir`` command (kvasir.cli)."""

import gc
import sys

from kvasir.cli import _prog, main
from kvasir_rpc import run_main


def _main_then_freeze() -> int:
    code = main()
    gc.freeze()  # as python -m backbone does: exit without the final collection's walk over torch's objects
    return code


run_main(_prog(sys.argv[1:]), _main_then_freeze)
