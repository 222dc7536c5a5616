"""``python -m b12x_ops``: the ``b12x-ops`` command line (see ``b12x_ops.cli``)."""

import sys

from .cli import main

sys.exit(main())
