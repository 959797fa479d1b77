"""A local ``mlflow server`` process for tests and benchmarks (sqlite backend, HTTP on a free port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine.testing import free_port


class Server:
    """An ``mlflow server`` process of its own (process group), with its store under ``folder``."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.uri = f"http://127.0.0.1:{port}"
        mlflow = Path(sys.executable).with_name("mlflow")
        self.log = open(folder / "server.log", "w")
        self.process = subprocess.Popen(
            [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
             "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
