"""python -m backbone generate --model DIR --hub HOST:PORT --hub-token-file PATH --prompt TEXT --max-new-tokens N
[--batch B] [--compare-local] [--assist lookup|draft] [--json]
python -m backbone serve --model DIR --hub HOST:PORT [--listen HOST:PORT] [--http HOST:PORT] ...

The command line is ``backbone.cli``."""

from __future__ import annotations

import gc

from backbone.cli import main
from kvasir_rpc import run_main


def _main_then_freeze() -> int:
    code = main()
    # On the way out: the interpreter's last collection walks every object torch and
    # transformers made, for seconds, to free memory the OS takes back at exit anyway.
    # Frozen objects are skipped; the rest of shutdown (atexit, flushing) is as usual.
    gc.freeze()
    return code


if __name__ == "__main__":
    run_main("backbone", _main_then_freeze)
