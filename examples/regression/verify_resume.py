"""Verify that resuming the reference exercise is exact.

    python -B verify_resume.py --output runs/proof

Runs train.py four times in fresh processes (continuous 10, interrupted 5,
full resume 5, resume without RNG restore 5), compares them after the cut with
absolute tolerance 1e-12 and relative 0, prints the verdict table and writes
runs/proof/verification.json. Exit code 0 when the full resume agrees and the
negative case diverges, 1 when a comparison fails, 2 when the verification
could not be completed. A thin call of `ripresa verify`.
"""

import sys
from pathlib import Path

from ripresa.cli import main

if __name__ == "__main__":
    train = Path(__file__).resolve().with_name("train.py")
    sys.exit(main(["verify", "--contract", *sys.argv[1:], "--", sys.executable, "-B", str(train)]))
