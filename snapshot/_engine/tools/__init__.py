"""What the command line, verify, diff, inspection and export drive."""
