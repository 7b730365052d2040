"""``python -m workers.relay``: the same as ``aurora relay``."""

import sys

from workers.relay.cli import main

sys.exit(main())
