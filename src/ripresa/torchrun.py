"""``python -m ripresa.torchrun``: the documented launcher; the code is :mod:`ripresa.session.torchrun`."""

import signal
import sys

if __name__ == "__main__":  # pragma: no cover
    # the launcher's first act, before any import: a SIGUSR1 from now on stays pending until the
    # forwarder takes it (docs/ARCHITECTURE.md, "Signals through the launcher")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

from .session.torchrun import main  # noqa: E402

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
