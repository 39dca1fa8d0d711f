"""`kvserve simulate`: the real scheduler and KV manager with a model-free runner."""
