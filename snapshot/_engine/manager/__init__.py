"""The checkpoint manager's step folders: scanning, retention, deletion."""
