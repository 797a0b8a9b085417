"""``python -m kvasir_rpc``: the ``kvasir`` command (kvasir_rpc.dev.cli), loaded only when run
this way; importing kvasir_rpc never loads the development tooling."""

import sys

from kvasir_rpc.dev.cli import main

sys.exit(main())
