import sys

from kvasir_rpc.cli import main

sys.exit(main())
