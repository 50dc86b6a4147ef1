"""Plugins that let other frameworks store their checkpoints with statesnap
(``snapshot.integrations.lightning``). Each module imports its framework; the facade imports
none of them."""
