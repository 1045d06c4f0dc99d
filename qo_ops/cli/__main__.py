"""``python -m qo_ops.cli``: the ``qo-ops`` command."""

import sys

from qo_ops.cli import main

sys.exit(main())
