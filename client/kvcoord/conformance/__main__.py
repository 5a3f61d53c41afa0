"""``python -m kvcoord.conformance FILE...``: the same as ``kvcoord conformance``."""

import sys

from .cli import main

sys.exit(main())
