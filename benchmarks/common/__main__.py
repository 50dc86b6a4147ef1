"""``python -m benchmarks.common``: the machine description and the check of the harness's tools
(see :mod:`benchmarks.common.machine`)."""

from benchmarks.common.machine import main

main()
