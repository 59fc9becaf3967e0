"""Verification: exact-resume verdicts, tree comparison, loss trajectories."""
