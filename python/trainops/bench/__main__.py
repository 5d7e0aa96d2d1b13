"""``python -m trainops.bench <target> [options]``, the same as ``python -m trainops bench``."""

import sys

from .harness import main

sys.exit(main())
