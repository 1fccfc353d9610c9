"""The node's host-memory KV tier behind every engine's own pool (see host_store)."""
