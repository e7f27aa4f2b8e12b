"""``python -m engine.parallel.rank RANK SIZE INIT_METHOD PARENT_PID``: a tensor-parallel
rank started by the engine (:class:`engine.parallel.launch.WorkerProcesses`); its engine
configuration arrives pickled on stdin."""

from __future__ import annotations

import pickle
import sys

from engine.parallel.launch import worker_main


def main(argv: list[str]) -> None:
    rank, size, init_method, parent = argv
    config = pickle.loads(sys.stdin.buffer.read())
    worker_main(config, int(rank), int(size), init_method, int(parent))


if __name__ == "__main__":
    main(sys.argv[1:])
