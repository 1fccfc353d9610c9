"""KV-cache handoff between engine instances: one interface, several transports.

A prefill instance keeps a finished prompt's KV blocks under a lease and names them in a
`KVHandle`; a decode instance pulls the blocks into its own pool through the handle's transport
and then releases the lease. See `base` for the interface, `host_shm` and `nixl` for transports.
"""

TRANSPORTS = ("nixl", "host_shm", "cuda_ipc")  # see base, nixl, host_shm, cuda_ipc
