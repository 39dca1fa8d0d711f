"""Requests, the scheduler and the engine loop (torch-free except the runner it drives)."""
