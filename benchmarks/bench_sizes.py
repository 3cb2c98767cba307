"""The size of what a user sees and what a maintainer reads: a benchmark of the code itself; prints JSON.

    python benchmarks/bench_sizes.py [--against REF] [--out FILE]

* ``ConsensusConfig``: its fields (knobs) and the combinations it refuses (``config.REFUSED``, and the engine's one
  refusal that needs the topology: overlap with the rack tier);
* ``prunex-hvd train --help``: its options, and those whose help does not show the default;
* the engine's files: lines each (``engine/hsadmm.py`` the largest), and with ``--against REF`` (a git revision)
  the same files' lines there.

Limits it checks (``"within_limits"``): at most 20 knobs, 5 refused combinations, 40 options, every option showing
its default; the round's facade ``engine/hsadmm.py`` at most 250 lines and no engine file over 400
(``tests/test_architecture.py`` holds the engine to the same).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"knobs": 20, "refused_combinations": 5, "train_options": 40, "facade_lines": 250, "engine_file_lines": 400}
ENGINE_REFUSALS = 1   # RackExchange: overlap with the rack tier


def lines(text: str) -> int:
    return text.count("\n") + (not text.endswith("\n") and bool(text))


def engine_files(ref: str = None) -> dict:
    """Lines of every engine file, here or at git revision ``ref``."""
    if ref is None:
        root = os.path.join(REPO, "prunex_hvd", "engine")
        paths = sorted(os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(root) for f in fs
                       if f.endswith(".py"))
        return {p: lines(open(os.path.join(REPO, p)).read()) for p in paths}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref, "prunex_hvd/engine"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return {p: lines(subprocess.run(["git", "show", f"{ref}:{p}"], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout) for p in listed if p.endswith(".py")}


def train_options() -> dict:
    from prunex_hvd.app.cli import build_parser

    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    text = train.format_help()
    options = [a for a in train._actions if a.option_strings]
    silent = [a.option_strings[0] for a in options
              if a.help is not argparse.SUPPRESS and a.dest != "help" and "%(default)" not in (a.help or "")
              and "(default:" not in train._get_formatter()._expand_help(a) if a.help]
    undocumented = [a.option_strings[0] for a in options if not a.help and a.dest != "help"]
    return {"count": len(options), "without_default_shown": silent + undocumented, "help_lines": lines(text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=None, help="a git revision to count the engine's lines at too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from prunex_hvd.engine import config

    knobs = [f.name for f in dataclasses.fields(config.ConsensusConfig)]
    options = train_options()
    engine = engine_files()
    doc = {"bench": "sizes", "knobs": len(knobs), "knob_names": knobs,
           "refused_combinations": len(config.REFUSED) + ENGINE_REFUSALS, "train_options": options["count"],
           "train_options_without_default": options["without_default_shown"], "engine_lines": engine,
           "hsadmm_lines": engine.get("prunex_hvd/engine/hsadmm.py")}
    if args.against:
        before = engine_files(args.against)
        doc["against"] = {"ref": args.against, "engine_lines": before,
                          "hsadmm_lines": before.get("prunex_hvd/engine/hsadmm.py")}
    doc["within_limits"] = (doc["knobs"] <= LIMITS["knobs"]
                            and doc["refused_combinations"] <= LIMITS["refused_combinations"]
                            and doc["train_options"] <= LIMITS["train_options"]
                            and not doc["train_options_without_default"]
                            and doc["hsadmm_lines"] <= LIMITS["facade_lines"]
                            and max(engine.values()) <= LIMITS["engine_file_lines"])
    doc["limits"] = LIMITS
    emit(doc, args.out)


if __name__ == "__main__":
    main()
