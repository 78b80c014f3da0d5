"""``python -m ps_train.prepare criteo SRC DST``: convert Criteo TSV files once into a prepared
folder that ``data=criteo data.prepared=DST`` trains from by memory-mapping it.

SRC is a Criteo file (plain or gzip) or a folder of them (``day_0`` .. ``day_23`` or
``train.txt``, read in day order, as ``data.root`` is). Exit status: 0 done, 1 a malformed
line or damaged input (the message names file, line and problem), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ps_train.workloads.ctr.data.gunzip import AUTO, INFLATERS
from ps_train.workloads.ctr.data.line_blocks import BLOCK_BYTES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ps_train.prepare", description="Convert a dataset once into memory-mapped arrays for training."
    )
    sub = p.add_subparsers(dest="dataset", required=True)
    c = sub.add_parser(
        "criteo",
        help="Criteo TSV (Kaggle train.txt or Terabyte day_*, plain or .gz)",
        description="Criteo TSV files -> DST/{labels,dense,hashes,missing}.npy + manifest.json; "
        "train with data=criteo data.prepared=DST.",
    )
    c.add_argument("src", help="a Criteo file, or a folder of day_0 .. day_23 / train.txt (optionally .gz)")
    c.add_argument("dst", help="the folder to create (written under a hidden name, renamed when complete)")
    c.add_argument(
        "--skip-malformed",
        action="store_true",
        help="count and skip malformed lines (as data.skip_malformed=true); default: stop at the first",
    )
    c.add_argument("--force", action="store_true", help="replace DST if it exists (once the new one is complete)")
    c.add_argument("--workers", type=int, default=None, help="parsing threads (default: the number of CPUs)")
    c.add_argument("--block-mb", type=int, default=BLOCK_BYTES >> 20, help="MiB of text per parsed block")
    c.add_argument(
        "--gunzip",
        choices=[AUTO, "isal", "zlib"],
        default=AUTO,
        help=f"the inflater of .gz input (default: the fastest installed, here {next(iter(INFLATERS))})",
    )
    c.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.workers is not None and args.workers < 1 or args.block_mb < 1:
        print("error: --workers and --block-mb must be >= 1", file=sys.stderr)
        return 2
    # The converter (numpy, pyarrow) is imported once the arguments are known: --help and
    # argument errors answer at once.
    from ps_train.workloads.ctr.data.criteo import CriteoFormatError
    from ps_train.workloads.ctr.data.criteo_prepare import prepare_criteo
    from ps_train.workloads.ctr.data.prepared import PreparedDataError

    try:
        m = prepare_criteo(
            args.src,
            args.dst,
            skip_malformed=args.skip_malformed,
            force=args.force,
            workers=args.workers,
            block_bytes=args.block_mb << 20,
            progress=not args.quiet,
            gunzip=args.gunzip,
        )
    except (CriteoFormatError, PreparedDataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.dst}: {m.rows} rows from {m.lines} lines of {len(m.sources)} file(s)"
        + (f", {m.malformed} malformed skipped" if m.malformed else "")
        + f" in {m.seconds:.1f} s; train with data=criteo data.prepared={args.dst}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
