"""A client's communicator in a process where importing torch (or PyYAML) fails.

`python tests/torchless_probe.py PORT CA CERT KEY TOKEN RETRY_S`: dials the server over
TLS with the token, prints what happened (welcomed, refused, gave up), and the
torch/yaml modules that got loaded (none). CA/CERT/KEY may be '-' (plaintext).
"""
import sys


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "yaml"):
            raise ImportError(f"{name} is not installed here")


sys.meta_path.insert(0, _Blocker())

import time  # noqa: E402

from fedcore.comm.grpc_client import GrpcClientComm  # noqa: E402
from fedcore.kernel.errors import FedcoreError  # noqa: E402
from fedcore.kernel.scheduler import WallClockScheduler  # noqa: E402


class Cfg(dict):
    """The little of a config the communicator reads (no course keys: none are compared)."""

    def section(self, name):
        return {k[len(name) + 1:]: v for k, v in self.items() if k.startswith(name + ".")}


def main(port, ca, cert, key, token, retry):
    plain = ca == "-"
    cfg = Cfg({"distribute.server_host": "127.0.0.1", "distribute.server_port": int(port),
               "distribute.insecure": plain, "distribute.tls.server_name": None,
               "distribute.tls.ca": None if plain else ca, "distribute.tls.cert": None if plain else cert,
               "distribute.tls.key": None if plain else key,
               "distribute.chunk_size": 1 << 16, "distribute.max_message_bytes": None,
               "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 2.0,
               "distribute.min_bytes_per_second": 1000.0, "distribute.retry_timeout": float(retry),
               "distribute.backoff_initial": 0.05, "distribute.backoff_max": 0.2,
               "distribute.client_id": 1, "distribute.token": token})
    comm = GrpcClientComm(cfg, WallClockScheduler(), tensor_form="numpy")
    comm.start()
    try:
        print("welcomed as client", comm.wait_welcome(), flush=True)
        while comm.fatal is None:      # stay connected until the server goes away for good
            time.sleep(0.05)
        raise comm.fatal
    except FedcoreError as exc:
        print(f"exit {exc.exit_code}: {type(exc).__name__}", flush=True)
    finally:
        print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "yaml")),
              flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
