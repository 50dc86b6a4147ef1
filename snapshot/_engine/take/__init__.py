"""The take: flatten -> plan -> write -> commit, and what a take checks and reuses."""
