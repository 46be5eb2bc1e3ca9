"""`sparsehi` console script (placeholder until the runtime lands)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsehi", description="Hierarchical sparse attention demo and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="long-context decode demo")
    args = parser.parse_args(argv)
    print(f"sparsehi {args.command}: not implemented yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
