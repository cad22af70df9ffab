"""``python -m loraplex.loadtest``: see ``cli.py``."""

import sys

from loraplex.loadtest.cli import main

sys.exit(main())
