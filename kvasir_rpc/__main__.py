"""``python -m kvasir_rpc``: the ``kvasir`` command (kvasir_rpc.dev.cli), loaded only when run
this way; importing kvasir_rpc never loads the development tooling."""

import gc
import sys

from kvasir_rpc.dev.cli import main

code = main()
gc.freeze()  # as python -m backbone does: exit without the final collection's walk over torch's objects
sys.exit(code)
