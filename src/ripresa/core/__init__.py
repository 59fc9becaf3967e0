"""Core: what a training state is (state, RNG streams, data order, identity, structural schema)."""
