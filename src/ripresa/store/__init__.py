"""Storage: run folders of generations (CheckpointStore), retention, async writes, history."""
