"""Test-support code that is no part of the ripresa package (fault injectors, docs/FAULTS.md)."""
