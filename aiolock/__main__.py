"""``python -m aiolock``: the same as the ``aiolock`` command."""

import sys

from .cli import main

sys.exit(main())
