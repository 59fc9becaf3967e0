"""On-disk formats: the torch-native ``checkpoint.pt`` (and, later, the ANDREA ``.bin``)."""
