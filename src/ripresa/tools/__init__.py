"""Tools on checkpoints (inspect, convert, export); they take a model factory, never the engine."""
