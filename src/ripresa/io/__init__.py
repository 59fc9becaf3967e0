"""I/O primitives: crash-safe file operations, run locks, HMAC signatures. Imports only errors."""
