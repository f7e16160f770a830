"""`python -m edgefinfer.distill` / `torchrun ... -m edgefinfer.distill`: the distill command on its own."""

import sys

from edgefinfer.app.distill_command import main

sys.exit(main())
