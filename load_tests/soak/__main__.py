"""``python -m load_tests.soak --help``: the soak's command line (``run.main``)."""

import sys

from .run import main

sys.exit(main())
