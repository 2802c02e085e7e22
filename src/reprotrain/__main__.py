"""``python -m reprotrain`` is the ``reprotrain`` command."""

import sys

from reprotrain.cli import main

sys.exit(main())
