"""Compressed snapshots (``Options.zstd_level``) against plain ones and DCP's zstd extension,
on real model states, in one run.

Run from the repository root::

    python -m benchmarks.compression                      # GPT-2 of 6 layers, 3 rounds
    python -m benchmarks.compression --layers 2 --rounds 1   # about a minute
    python -m benchmarks.compression --s3                 # also against moto's S3 server

The state: a GPT-2 (transformers, built from a config: ``--layers`` layers of width 768, a
vocabulary of 16,384) trained ``--steps`` steps of AdamW on random tokens, its weights and the
optimizer's two moments, in fp32 and, converted, in bf16 (weights and moments both). Every
method takes and restores the same flat dict of tensors (plus the step counts):

- ``statesnap``: ``Snapshot.take`` / ``Snapshot(path).restore`` into preallocated tensors.
- ``statesnap zstd-N``: the same with ``Options(zstd_level=N)``.
- ``dcp``: ``dcp.save(flat, storage_writer=FileSystemWriter(path), no_dist=True)`` /
  ``dcp.load`` into the same preallocated tensors.
- ``dcp zstd``: ``FileSystemWriter(path, _extensions=[ZStandard()])`` (torch's experimental
  stream extension, zstandard's default level 3); read back by ``FileSystemReader``, which
  finds the extension in the checkpoint's metadata.

Each take is fsync'd (statesnap's default, and ``FileSystemWriter``'s ``sync_files=True``); each
restore follows its take, so its files are in the page cache: the restore times are of reading
from memory and decompressing, the case where decompression costs most. Methods run in turn,
their order reversed every other round; every restore is checked bitwise once. With ``--s3``
the statesnap methods also take to and restore from a bucket of moto's S3 server
(``benchmarks.s3server``), whose client and server share this machine's cores.

Reports, per state and method, the ratio stored bytes ÷ raw tensor bytes, take and restore GB/s
(raw bytes ÷ median seconds), and per-round time ratios against ``dcp zstd``. Prints Markdown;
``--json`` also writes the raw rounds; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.incremental import commit, machine
from snapshot import Options, Snapshot, StateDict

MIB = 1 << 20


def build_states(layers: int, steps: int) -> dict[str, dict[str, Any]]:
    """The fp32 and bf16 states: ``name -> tensor`` of a GPT-2's weights and AdamW's moments
    after ``steps`` steps, and the optimizer's step counts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=768, n_head=12, vocab_size=16384, n_positions=256,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (2, 64))
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    # Copies: GPT-2 ties its output layer to its embedding, which statesnap stores once.
    flat: dict[str, Any] = {f"model.{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for group in optim.param_groups:
        for p in group["params"]:
            s = optim.state[p]
            flat[f"optim.{names[id(p)]}.exp_avg"] = s["exp_avg"]
            flat[f"optim.{names[id(p)]}.exp_avg_sq"] = s["exp_avg_sq"]
            flat[f"optim.{names[id(p)]}.step"] = s["step"]
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.ndim else v.clone()
            for k, v in flat.items()}  # fmt: skip
    return {"fp32": flat, "bf16": bf16}


def raw_bytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


def stored_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def targets(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


class Method:
    """How one method takes ``state`` to ``path`` and restores it into ``out``."""

    def __init__(self, name: str, take: Callable[..., None], restore: Callable[..., None]):
        self.name, self.take, self.restore = name, take, restore


def statesnap(level: int, storage_options: dict[str, Any] | None = None) -> Method:
    options = Options(zstd_level=level)

    def take(path: str, state: dict[str, Any]) -> None:
        Snapshot.take(path, {"m": StateDict(state)}, options=options,
                      storage_options=storage_options)  # fmt: skip

    def restore(path: str, out: dict[str, Any]) -> None:
        Snapshot(path, storage_options=storage_options).restore({"m": StateDict(out)})

    return Method(f"statesnap zstd-{level}" if level else "statesnap", take, restore)


def dcp(compressed: bool) -> Method:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    def take(path: str, state: dict[str, Any]) -> None:
        extensions = [ZStandard()] if compressed else None
        writer = dcp.FileSystemWriter(path, _extensions=extensions)
        dcp.save(state, storage_writer=writer, no_dist=True)

    def restore(path: str, out: dict[str, Any]) -> None:
        dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True)

    return Method("dcp zstd" if compressed else "dcp", take, restore)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(
    states: dict[str, dict[str, Any]],
    methods: list[Method],
    rounds: int,
    scratch: str,
    where: Callable[[str], str] | None = None,
    stored: Callable[[str], int] = stored_bytes,
    remove: Callable[[str], None] = lambda p: shutil.rmtree(p, ignore_errors=True),
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per state, per method: each round's take and restore seconds and stored bytes."""
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    for state_name, state in states.items():
        rows: dict[str, list[dict[str, float]]] = {m.name: [] for m in methods}
        out[state_name] = rows
        for rnd in range(rounds):
            order = methods if rnd % 2 == 0 else methods[::-1]
            for m in order:
                tag = f"{state_name}-{m.name.replace(' ', '-')}-{rnd}"
                path = where(tag) if where is not None else os.path.join(scratch, tag)
                into = targets(state)
                take_s = timed(lambda: m.take(path, state))  # noqa: B023
                nbytes = stored(path)
                restore_s = timed(lambda: m.restore(path, into))  # noqa: B023
                if rnd == 0 and not same(into, state):
                    raise SystemExit(f"{m.name}: the {state_name} state came back different")
                rows[m.name].append({"take": take_s, "restore": restore_s, "stored": nbytes})
                remove(path)
                print(
                    f"  {state_name} {m.name} round {rnd + 1}: take {take_s:.3f} s, "
                    f"restore {restore_s:.3f} s, {nbytes / MIB:.1f} MiB",
                    file=sys.stderr,
                )
    return out


def table(
    results: dict[str, dict[str, list[dict[str, float]]]],
    states: dict[str, dict[str, Any]],
    reference: str | None,
) -> list[str]:
    head = "| state | method | stored ÷ raw | take GB/s | restore GB/s |"
    rule = "|---|---|---|---|---|"
    if reference:
        head += f" take time ÷ {reference}'s | restore time ÷ {reference}'s |"
        rule += "---|---|"
    lines = [head, rule]
    for state_name, rows in results.items():
        raw = raw_bytes(states[state_name])
        for name, rounds in rows.items():
            take = statistics.median(r["take"] for r in rounds)
            restore = statistics.median(r["restore"] for r in rounds)
            ratio = statistics.median(r["stored"] for r in rounds) / raw
            line = (
                f"| {state_name} {raw / MIB:.0f} MiB | {name} | {ratio:.3f} | "
                f"{raw / take / 1e9:.3f} | {raw / restore / 1e9:.3f} |"
            )
            if reference:
                ref = rows[reference]
                for op in ("take", "restore"):
                    per = [r[op] / f[op] for r, f in zip(rounds, ref, strict=True)]
                    line += f" {statistics.median(per):.2f} |"
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3])
    parser.add_argument("--s3", action="store_true", help="also statesnap against moto's S3")
    parser.add_argument("--s3-rounds", type=int, default=1)
    parser.add_argument("--scratch", default=None, help="a folder on the disk to measure")
    parser.add_argument("--json", default=None, help="also write the raw rounds here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    states = build_states(args.layers, args.steps)
    methods = [statesnap(0), *(statesnap(level) for level in args.levels), dcp(False), dcp(True)]
    scratch = tempfile.mkdtemp(prefix="statesnap-zstd-", dir=args.scratch)
    raw: dict[str, Any] = {}
    try:
        raw["disk"] = run(states, methods, args.rounds, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        f"### compression — {time.strftime('%Y-%m-%d %H:%M')}, library commit {commit()}",
        "",
        f"Command: `python -m benchmarks.compression --layers {args.layers} --steps {args.steps} "
        f"--rounds {args.rounds} --levels {','.join(map(str, args.levels))}"
        f"{' --s3' if args.s3 else ''}`",
        "",
        f"Machine: {machine()}. State: GPT-2 of {args.layers} layers (width 768, vocabulary "
        f"16,384) after {args.steps} AdamW steps: its weights and both moments. Medians of "
        f"{args.rounds} rounds; local disk, fsync'd takes, restores from the page cache.",
        "",
        *table(raw["disk"], states, "dcp zstd"),
        "",
    ]
    if args.s3:
        from benchmarks.s3server import S3Server

        with S3Server() as server:
            options = server.storage_options()
            s3_methods = [statesnap(0, options), *(statesnap(lv, options) for lv in args.levels)]
            buckets: dict[str, str] = {}

            def where(tag: str) -> str:
                buckets[tag] = server.new_bucket()
                return f"s3://{buckets[tag]}/snap"

            def stored(url: str) -> int:
                return server.stored(url.split("/")[2])["apparent"]

            def remove(url: str) -> None:
                server.remove_bucket(url.split("/")[2])

            raw["s3"] = run(states, s3_methods, args.s3_rounds, scratch, where, stored, remove)
        lines += [
            f"S3 (moto's server on this machine), {args.s3_rounds} round(s):",
            "",
            *table(raw["s3"], states, "statesnap"),
            "",
        ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": raw}, f, indent=1)


if __name__ == "__main__":
    main()
