"""Moving bytes: the memory-budgeted pipeline over a storage plugin, staging, the I/O loop."""
