"""`python -m edgefinfer ...`: the `edgefinfer` command (an entry point, so it may import the app layer)."""

import sys

from edgefinfer.app.cli import main

sys.exit(main())
