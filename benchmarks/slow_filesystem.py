"""An fsspec filesystem for benchmarks/hub.py: the local one under ``slow://``, sleeping
``ENGINE_BENCH_SLOW_DELAY`` seconds (default 0.5) per file written. A module of its own so the
upload process of engine-hub can unpickle it (benchmarks/hub.py puts this folder on PYTHONPATH)."""

import os
import time

from fsspec.implementations.local import LocalFileSystem


class SlowFileSystem(LocalFileSystem):
    protocol = "slow"

    def put_file(self, lpath, rpath, *args, **kwargs):
        time.sleep(float(os.environ.get("ENGINE_BENCH_SLOW_DELAY", "0.5")))
        return super().put_file(lpath, rpath, *args, **kwargs)
