"""The GPU side: one process, one pipeline, one job at a time."""
