"""The global front: admission, routing and per-request streaming state."""
