"""``python -m snapshot``: see :mod:`snapshot.cli`."""

import sys

from snapshot.cli import main

sys.exit(main())
