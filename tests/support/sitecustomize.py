"""Switch on the test fault injectors in a child process (tests only; docs/FAULTS.md).

The tests put this folder on a child's ``PYTHONPATH`` together with
``RIPRESA_CRASH_AT`` / ``RIPRESA_FAIL_AT`` / ``RIPRESA_DIST_FAULT``
(``ripresa_faults.fault_env``); Python imports this module at start-up, and it
installs the injectors before the child's own code runs. Without this folder
on the path the variables do nothing. An invalid value stops the process with
exit status 2 and a message: a fault that silently does not fire would make a
crash test pass for the wrong reason.
"""

import os
import sys

if any(os.environ.get(name) for name in ("RIPRESA_CRASH_AT", "RIPRESA_FAIL_AT", "RIPRESA_DIST_FAULT")):
    try:
        import ripresa_faults

        ripresa_faults.install_from_env()
    except Exception as exc:  # noqa: BLE001 - any failure to arm a fault must stop the child
        sys.stderr.write(f"ripresa test fault injection: {exc}\n")
        sys.stderr.flush()
        os._exit(2)
