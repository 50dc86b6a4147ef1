"""The restore: open -> plan reads -> read -> land, and read_object."""
