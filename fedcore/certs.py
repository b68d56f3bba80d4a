"""`python -m fedcore.certs DIR [--hosts H ...] [--clients N] [--days D]`: certificates for TLS.

Makes a private CA and, signed by it, a server certificate for the given host
names and addresses and one client certificate per client (for mutual TLS),
as PEM files: `ca.pem`/`ca.key`, `server.pem`/`server.key`,
`client-K.pem`/`client-K.key`. Keys are ECDSA P-256, written readable by the
owner only. Meant for a quick secure start (a lab, a test bed); an
organisation with its own PKI issues these instead. Needs the `cryptography`
package (`pip install "fedcore[certs]"`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import sys
from pathlib import Path

from fedcore.kernel.errors import EXIT_OK, ConfigError, FedcoreError
from fedcore.kernel.files import write_atomic

__all__ = ["make_certificates", "main"]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_dns_name(host: str) -> bool:
    """A DNS name a certificate may carry: labels of letters, digits, underscores (found in
    internal names) and inner hyphens, at most 63 characters each and 253 in all, the first
    possibly a wildcard."""
    import re
    labels = host[2:].split(".") if host.startswith("*.") else host.split(".")
    return (0 < len(host) <= 253
            and all(re.fullmatch(r"\w([\w-]{0,61}\w)?", label, re.ASCII) for label in labels))


def make_certificates(folder: str | Path, hosts: list[str] = ("localhost", "127.0.0.1"),
                      clients: int = 1, days: int = 365, force: bool = False) -> dict[str, Path]:
    """Write a CA, a server certificate for `hosts` and `clients` client certificates into
    `folder`; returns {"ca", "ca_key", "server_cert", "server_key", "client_K_cert", ...}."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError('certs: making certificates needs the cryptography package: '
                          'pip install "fedcore[certs]"') from None
    if not hosts:
        raise ConfigError("--hosts: name at least one host name or address the server is reached at")
    for host in hosts:
        if not (_is_ip(host) or _is_dns_name(host)):
            raise ConfigError(f"--hosts: '{host}' is neither an IP address nor a DNS name (letters, "
                              "digits, underscores and hyphens, dot-separated, no final dot; '*.' may "
                              "start it)")
    if clients < 0 or days < 1:
        raise ConfigError("--clients must be >= 0 and --days >= 1")
    folder = Path(folder)
    stems = ["ca", "server"] + [f"client-{k}" for k in range(1, clients + 1)]
    existing = [f"{s}{ext}" for s in stems for ext in (".pem", ".key") if (folder / f"{s}{ext}").exists()]
    if existing and not force:
        raise ConfigError(f"certs: '{folder / existing[0]}' exists; choose another folder or pass "
                          "--force to replace the files")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"certs: cannot create '{folder}' ({exc.strerror or exc})") from None

    now = _dt.datetime.now(_dt.timezone.utc)

    def name(common_name: str):
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcore"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def issue(subject, key, issuer, issuer_key, *, ca: bool, sans=None, usage=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - _dt.timedelta(minutes=5))
                   .not_valid_after(now + _dt.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                  critical=False))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False), critical=True)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    written: dict[str, Path] = {}

    def write(stem: str, label: str, cert, key) -> None:
        pem = folder / f"{stem}.pem"
        write_atomic(pem, cert.public_bytes(serialization.Encoding.PEM))   # no planted link followed
        key_file = folder / f"{stem}.key"
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        write_atomic(key_file, data)
        os.chmod(key_file, 0o600)   # whatever outputs.private says: a private key
        written["ca" if label == "ca" else f"{label}_cert"] = pem
        written[f"{label}_key"] = key_file

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("fedcore CA")
    ca = issue(ca_name, ca_key, ca_name, ca_key, ca=True)
    write("ca", "ca", ca, ca_key)
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    server_key = ec.generate_private_key(ec.SECP256R1())
    write("server", "server", issue(name(hosts[0]), server_key, ca_name, ca_key, ca=False, sans=sans,
                                    usage=ExtendedKeyUsageOID.SERVER_AUTH), server_key)
    for k in range(1, clients + 1):
        key = ec.generate_private_key(ec.SECP256R1())
        write(f"client-{k}", f"client_{k}", issue(name(f"client-{k}"), key, ca_name, ca_key, ca=False,
                                                  usage=ExtendedKeyUsageOID.CLIENT_AUTH), key)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.certs",
                                description="Make a CA, a server and client certificates for TLS.")
    p.add_argument("folder", metavar="DIR", help="where to write the PEM files")
    p.add_argument("--hosts", nargs="+", default=["localhost", "127.0.0.1"],
                   help="names and addresses clients use to reach the server "
                        "(default: localhost 127.0.0.1)")
    p.add_argument("--clients", type=int, default=1, help="client certificates to make (default 1)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace files that exist")
    args = p.parse_args(argv)
    try:
        make_certificates(args.folder, args.hosts, args.clients, args.days, args.force)
    except FedcoreError as exc:
        print(f"fedcore: {exc}", file=sys.stderr)
        return exc.exit_code
    d = Path(args.folder)
    print(f"wrote a CA, a server certificate for {', '.join(args.hosts)} and {args.clients} client "
          f"certificate(s) to {d}/ (keep ca.key off the course's machines)")
    server = f"  server: distribute.tls.cert={d / 'server.pem'} distribute.tls.key={d / 'server.key'}"
    if args.clients:   # the CA on the server asks every client for a certificate (mutual TLS)
        print(f"{server} distribute.tls.ca={d / 'ca.pem'}")
        print(f"  client K: distribute.tls.ca={d / 'ca.pem'} distribute.tls.cert={d / 'client-K.pem'} "
              f"distribute.tls.key={d / 'client-K.key'}")
    else:              # no client certificates: TLS with tokens, the server's CA not set
        print(server)
        print(f"  clients: distribute.tls.ca={d / 'ca.pem'} (and a token)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
