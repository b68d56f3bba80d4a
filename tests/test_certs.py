"""python -m fedcore.certs makes a CA, server and client certificates a course can use over TLS."""
import ipaddress
import stat

import pytest

from tests.conftest import need_extra

need_extra("certs")

from fedcore.certs import main, make_certificates
from tests.deploy_helpers import server_port, text, wait_exit, write_cfg


def test_certificates_chain_to_the_ca_with_the_right_names_and_uses(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    files = make_certificates(tmp_path, ["localhost", "10.0.0.7", "fl.example.org"], clients=2)
    ca = x509.load_pem_x509_certificate(files["ca"].read_bytes())
    server = x509.load_pem_x509_certificate(files["server_cert"].read_bytes())
    clients = [x509.load_pem_x509_certificate(files[f"client_{k}_cert"].read_bytes()) for k in (1, 2)]
    for cert in [server, *clients]:
        cert.verify_directly_issued_by(ca)     # raises if the signature or issuer is wrong
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "fl.example.org"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert all(list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) ==
               [ExtendedKeyUsageOID.CLIENT_AUTH] for c in clients)
    for key in ("ca_key", "server_key", "client_1_key", "client_2_key"):
        assert stat.S_IMODE(files[key].stat().st_mode) == 0o600


def test_existing_files_are_not_replaced_without_force(tmp_path, capsys):
    assert main([str(tmp_path), "--clients", "0"]) == 0
    before = (tmp_path / "ca.pem").read_bytes()
    assert main([str(tmp_path)]) == 2
    assert "ca.pem' exists" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == before
    assert main([str(tmp_path), "--force"]) == 0 and (tmp_path / "ca.pem").read_bytes() != before


@pytest.mark.slow
def test_a_course_runs_over_mutual_tls_with_the_files_made(tmp_path, procs):
    assert main([str(tmp_path / "certs"), "--clients", "1"]) == 0
    c = tmp_path / "certs"
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.heartbeat_interval": 0.5,
                                               "distribute.heartbeat_timeout": 3.0,
                                               "federate.client_num": 1})
    out = tmp_path / "server"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", f"distribute.tls.cert={c / 'server.pem'}",
                           f"distribute.tls.key={c / 'server.key'}", f"distribute.tls.ca={c / 'ca.pem'}")
    port = server_port(out, server)
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.client_id={k}",
                             f"distribute.server_port={port}", f"distribute.tls.ca={c / 'ca.pem'}",
                             f"distribute.tls.cert={c / f'client-{k}.pem'}",
                             f"distribute.tls.key={c / f'client-{k}.key'}") for k in (1,)]
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    for client in clients:
        assert wait_exit(client, 60) == 0, text(client)[-3000:]
    assert "insecure" not in text(server)
    assert (out / "summary.json").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_tls_files_that_do_not_fit_are_refused_in_one_line_naming_the_key(tmp_path, procs):
    # gRPC rejects a key that is not the certificate's only as the server starts, which the
    # server then reported as a port it could not listen on; the files are checked first.
    from fedcore.comm.stream import check_tls_files
    from fedcore.kernel.errors import ConfigError
    files = {k: str(v) for k, v in make_certificates(tmp_path / "certs", clients=1).items()}
    check_tls_files({"cert": files["server_cert"], "key": files["server_key"], "ca": files["ca"]}, server=True)
    check_tls_files({"cert": files["client_1_cert"], "key": files["client_1_key"], "ca": files["ca"]}, server=False)
    with pytest.raises(ConfigError, match=r"^distribute\.tls\.key: .*key values mismatch"):
        check_tls_files({"cert": files["server_cert"], "key": files["client_1_key"]}, server=True)
    with pytest.raises(ConfigError, match=r"^distribute\.tls\.key: "):
        check_tls_files({"cert": files["ca_key"], "key": files["server_key"]}, server=True)
    with pytest.raises(ConfigError, match=r"^distribute\.tls\.ca: .* holds no PEM certificate"):
        check_tls_files({"ca": files["server_key"]}, server=False)
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.token": "t"})
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={tmp_path / 'out'}", f"distribute.tls.cert={files['server_cert']}",
                           f"distribute.tls.key={files['client_1_key']}")
    assert wait_exit(server, 120) == 2
    lines = text(server).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedcore: distribute.tls.key: "), lines


def test_host_names_are_checked_and_no_client_certificates_means_no_ca_on_the_server(tmp_path, capsys):
    from fedcore.kernel.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^--hosts: 'bad host!' is neither an IP address nor a DNS name"):
        make_certificates(tmp_path / "a", ["bad host!"])
    make_certificates(tmp_path / "b", ["*.example.org", "fl-1.example.org", "10.0.0.7", "::1"], clients=0)
    # with no client certificate made, the server line has no CA (a CA on the server demands
    # client certificates: mutual TLS no client could pass); the clients get it to check the server
    assert main([str(tmp_path / "c"), "--clients", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    server = next(line for line in out if line.strip().startswith("server:"))
    assert "distribute.tls.ca" not in server
    assert any(line.strip().startswith("clients: distribute.tls.ca=") for line in out)


def test_the_tls_file_check_takes_what_grpc_takes_and_names_an_encrypted_key(tmp_path):
    # The check is whether the files fit, not Python's policy: a 1024-bit RSA key (which gRPC
    # accepts, and Python's default security level refuses) passes. An encrypted key, which gRPC cannot
    # use, is refused in one line, without asking for a passphrase.
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID
    from fedcore.comm.stream import check_tls_files
    from fedcore.kernel.errors import ConfigError
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "weak.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "weak.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (tmp_path / "locked.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                            serialization.BestAvailableEncryption(b"secret")))
    check_tls_files({"cert": str(tmp_path / "weak.pem"), "key": str(tmp_path / "weak.key"),
                     "ca": str(tmp_path / "weak.pem")}, server=True)
    with pytest.raises(ConfigError, match=r"^distribute\.tls\.key: '.*locked\.key' is encrypted"):
        check_tls_files({"cert": str(tmp_path / "weak.pem"), "key": str(tmp_path / "locked.key")}, server=True)
