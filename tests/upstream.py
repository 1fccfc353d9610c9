"""How Triton 2.51 itself fails, as the tests recognise it (docs/platform.md)."""

# The Python backend aborts the whole server when a stub dies holding a shared-memory lock
# (tritonserver's thread gets this exception, uncaught).
UPSTREAM_ABORT = "boost::interprocess::lock_exception"
