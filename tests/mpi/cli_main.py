"""Run a command line under mpiexec: ``cli_main.py train|bench ARGS``."""

import sys

from nccltree.cli import bench, train

if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    sys.exit({"train": train.main, "bench": bench.main}[command](args))
