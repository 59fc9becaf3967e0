"""``python -m ripresa.torchrun``: the documented launcher; the code is :mod:`ripresa.session.torchrun`."""

import sys

from .session.torchrun import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
