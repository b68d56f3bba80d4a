"""A deployed course across two machines: certificates, tokens, a server, its clients.

On the server's machine (its address as clients see it, e.g. fl.example.org):

    python docs/examples/two_machines.py prepare --host fl.example.org --clients 2 --dir secrets
    python docs/examples/two_machines.py server --dir secrets

then copy `secrets/ca.pem` and `secrets/client<K>.token` to client K's machine, and there:

    python docs/examples/two_machines.py client --host fl.example.org --id K --dir secrets

`prepare` makes a CA and the server's certificate (`python -m fedcore.certs`) and one token per
client, files only their owner can read. The server listens with TLS on port 50051 and knows
each client by its token; a client dials out (it opens no port) with its own token from a
file, so no token appears on a command line. The same course config (scenarios/quickstart.yaml
here) is on both machines. Each role is `python -m fedcore.run`, which this script only spells out.
"""
import argparse
import os
import secrets
import subprocess
import sys
from pathlib import Path

COURSE = Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.yaml"
PORT = 50051


def _private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def prepare(args) -> int:
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    subprocess.run([sys.executable, "-m", "fedcore.certs", str(folder), "--hosts", args.host,
                    "--force"], check=True)
    tokens = {k: secrets.token_hex(16) for k in range(1, args.clients + 1)}
    _private(folder / "tokens.yaml", "".join(f"{k}: {t}\n" for k, t in tokens.items()))
    for k, token in tokens.items():
        _private(folder / f"client{k}.token", token + "\n")
    print(f"copy {folder / 'ca.pem'} and {folder}/client<K>.token to client K's machine")
    return 0


def _course(args) -> list[str]:
    return [sys.executable, "-m", "fedcore.run", "--cfg", str(COURSE), "federate.mode=distributed",
            f"federate.client_num={args.clients}", f"federate.sample_client_num={args.clients}",
            f"federate.total_round_num={args.rounds}",
            f"distribute.server_port={args.port}", *args.override]


def server(args) -> int:
    folder = Path(args.dir)
    return subprocess.call(_course(args) + [
        "distribute.role=server", f"distribute.server_host={args.listen}",
        f"distribute.tls.cert={folder / 'server.pem'}", f"distribute.tls.key={folder / 'server.key'}",
        f"distribute.tokens_file={folder / 'tokens.yaml'}"])


def client(args) -> int:
    folder = Path(args.dir)
    return subprocess.call(_course(args) + [
        "distribute.role=client", f"distribute.server_host={args.host}", f"distribute.client_id={args.id}",
        f"distribute.tls.ca={folder / 'ca.pem'}", f"distribute.token_file={folder / f'client{args.id}.token'}"],
        env={**os.environ})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("prepare", "server", "client"))
    p.add_argument("--dir", default="secrets", help="certificates and tokens (default: secrets)")
    p.add_argument("--host", default="localhost", help="the server's name or address as clients see it")
    p.add_argument("--listen", default="0.0.0.0", help="server: the address it listens on")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--id", type=int, default=1, help="client: its id, 1..clients")
    p.add_argument("override", nargs="*", help="more KEY=VALUE overrides for the course")
    args = p.parse_intermixed_args(argv)
    return {"prepare": prepare, "server": server, "client": client}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
