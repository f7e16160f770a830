"""`python -m edgefinfer.distill` / `torchrun ... -m edgefinfer.distill`: the distill command on its own."""

import sys

from edgefinfer.distill.cli import main

sys.exit(main())
