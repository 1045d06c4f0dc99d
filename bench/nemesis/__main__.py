"""``python -m bench.nemesis --seed N [--iterations K | --seconds S] [--json]``: one seeded
nemesis (the same seed and iterations replay the same fault schedule); exit 0 with no
violation, 1 otherwise."""

from __future__ import annotations

import argparse
import json
import sys

from bench.nemesis.harness import NemesisConfig, run_nemesis
from bench.nemesis.report import as_dict, summary_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nemesis", description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--iterations", type=int, help="how many iterations (replays exactly)")
    length.add_argument("--seconds", type=float, help="start iterations for this long")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keep-logs", action="store_true", help="keep every run's output")
    args = parser.parse_args(argv)
    iterations = args.iterations if args.iterations or args.seconds else 10
    config = NemesisConfig(
        args.seed, iterations=iterations, seconds=args.seconds, keep_logs=args.keep_logs
    )

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result = run_nemesis(config, say=say)
    if args.json:
        print(json.dumps(as_dict(result)))
    else:
        print("\n".join(summary_lines(result)))
    return 1 if result.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
