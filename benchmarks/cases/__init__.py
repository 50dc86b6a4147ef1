"""The cases of ``python -m benchmarks.bench_io --case NAME``, one module each.

Every case module has the same small interface:

``NAME``
    the ``--case`` value;
``DEFAULTS``
    its default ``--modes`` (takes: ``cache``, ``fsync``) and ``--temps`` (restores: ``warm``,
    ``cold``);
``LIBRARY_VARIANTS``
    whether it runs its statesnap methods from other trees of the library too (``--library
    NAME=PATH``, see :func:`benchmarks.harness.with_libraries`);
``add_arguments(parser)``
    its own options (every case's options are on the one command line);
``run(args, runner) -> (rows, markdown lines)``
    runs the case with a :class:`benchmarks.harness.Runner` and returns its measurements and
    the tables it prints (``args.statesnap_env``: the ``--env`` variables for statesnap's
    workers; ``args.libraries``: the ``--library`` trees);
``needed_bytes(args)`` (optional)
    the free disk the case needs, when the command line's estimate does not fit it.
"""

from benchmarks.cases import (
    async_loop,
    async_stall,
    async_training,
    checksums,
    dist,
    main,
    many_small,
    parallel_2d,
    read_object,
    reshard,
    restore_memory,
    s3,
    scaling,
)

CASES = {
    m.NAME: m
    for m in (
        main,
        many_small,
        restore_memory,
        read_object,
        scaling,
        dist,
        async_stall,
        async_loop,
        async_training,
        checksums,
        s3,
        reshard,
        parallel_2d,
    )
}

__all__ = ["CASES"]
