"""TLS certificates and SuperNode authentication keys for a Flower deployment, made with `cryptography`.

`make_tls(dir, hosts)` writes a self-signed CA (`ca.crt`) and a server certificate for the SuperLink
(`server.pem`, `server.key`) whose subject alternative names cover `hosts` (IPs and DNS names).
`make_node_keys(dir, names)` writes one EC (SECP384R1) key pair per SuperNode in OpenSSH format
(`<name>` private, `<name>.pub` public), the format `flwr supernode register` and
`flower-supernode --auth-supernode-private-key` expect. For production use your organisation's CA; these are
for tests, trials and small private federations.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def make_tls(directory: str | Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """CA + server certificate for `hosts`; returns the paths of ca.crt, server.pem and server.key."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("promptfcl test CA"))
        .issuer_name(_name("promptfcl test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": d / "ca.crt", "cert": d / "server.pem", "key": d / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["key"], key)
    return paths


def make_node_keys(directory: str | Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """One OpenSSH EC key pair per name; returns {name: (private key path, public key path)}."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = d / name, d / f"{name}.pub"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            )
        )
        private.chmod(0o600)
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        )
        out[name] = (private, public)
    return out
