"""``python -m kvasir_rpc``: the ``kvasir`` command (kvasir_rpc.dev.cli), loaded only when run
this way; importing kvasir_rpc never loads the development tooling."""

import gc
import sys

from kvasir_rpc import run_main
from kvasir_rpc.dev.cli import _prog, main


def _main_then_freeze() -> int:
    code = main()
    gc.freeze()  # as python -m backbone does: exit without the final collection's walk over torch's objects
    return code


run_main(_prog(sys.argv[1:]), _main_then_freeze)
