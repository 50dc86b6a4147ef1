"""Process groups: coordination, replicated values, shared reads, lost ranks."""
