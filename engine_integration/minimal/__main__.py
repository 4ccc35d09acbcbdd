"""``python -m lmkv_engines.minimal``: the ``engine`` command."""

import sys

from .cli import main

sys.exit(main())
