"""``python -m ripresa`` — the same as the ``ripresa`` command."""

import sys

from .cli import main

sys.exit(main())
