"""Secrets material for ``diloco auth init``: bcrypt hashes of the passwords and TLS certificates
(a CA, a server certificate, per-user client certificates) made with the ``openssl`` command.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from diloco.auth_permissions import AuthError

BCRYPT_COST = 11

# -- bcrypt ----------------------------------------------------------------------------------------


def bcrypt_hasher() -> Callable[[str], str] | None:
    """A function password -> bcrypt hash (``$2b$11$...``), or None if this Python cannot make one."""
    try:
        import bcrypt  # type: ignore[import-not-found]

        return lambda pw: bcrypt.hashpw(pw.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
    except ImportError:
        pass
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # stdlib until Python 3.12; bcrypt only where libcrypt supports $2b$
        salt = crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2**BCRYPT_COST)
        probe = crypt.crypt("probe", salt)
        if not probe or not probe.startswith("$2"):
            return None
        return lambda pw: crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2**BCRYPT_COST))
    except Exception:
        return None


# -- TLS with the openssl command ------------------------------------------------------------------


def openssl_binary() -> str:
    found = shutil.which("openssl")
    if not found:
        raise AuthError("--tls needs the openssl command (apt-get install openssl), or bring your own "
                        "certificates and write the tls { } block by hand (see docs/security.md)")
    return found


def _run_openssl(args: list[str]) -> None:
    p = subprocess.run([openssl_binary(), *args], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise AuthError(f"openssl {args[0]} failed: {(p.stderr or p.stdout).strip()[:400]}")


def split_hosts(hosts: Iterable[str]) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) for a server certificate; always 127.0.0.1, ::1 and localhost."""
    dns, ips = ["localhost"], ["127.0.0.1", "::1"]
    for h in hosts:
        h = h.strip()
        if not h:
            continue
        try:
            ip = str(ipaddress.ip_address(h))
            if ip not in ips:
                ips.append(ip)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.*-]{0,251}[A-Za-z0-9])?", h):
                raise AuthError(f"--hosts {h!r}: expected a DNS name or an IP address") from None
            if h not in dns:
                dns.append(h)
    return dns, ips


def _cert_config(cn: str, kind: str, dns: Sequence[str] = (), ips: Sequence[str] = ()) -> str:
    ext = {
        "ca": ["basicConstraints = critical,CA:TRUE,pathlen:0", "keyUsage = critical,keyCertSign,cRLSign",
               "subjectKeyIdentifier = hash"],
        "server": ["basicConstraints = critical,CA:FALSE", "keyUsage = critical,digitalSignature",
                   "extendedKeyUsage = serverAuth", "subjectKeyIdentifier = hash",
                   "authorityKeyIdentifier = keyid", "subjectAltName = @alt"],
        "client": ["basicConstraints = critical,CA:FALSE", "keyUsage = critical,digitalSignature",
                   "extendedKeyUsage = clientAuth", "subjectKeyIdentifier = hash",
                   "authorityKeyIdentifier = keyid"],
    }[kind]
    text = f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {cn}\n[ext]\n" + "\n".join(ext) + "\n"
    if kind == "server":
        alt = [f"DNS.{i + 1} = {d}" for i, d in enumerate(dns)] + [f"IP.{i + 1} = {a}" for i, a in enumerate(ips)]
        text += "[alt]\n" + "\n".join(alt) + "\n"
    return text


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 before any secret is written to it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def make_ca(tls_dir: Path, cn: str, days: int) -> tuple[Path, Path]:
    """A self-signed EC P-256 CA: (ca.pem, ca.key)."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    cert, key = tls_dir / "ca.pem", tls_dir / "ca.key"
    with tempfile.TemporaryDirectory() as tmp:
        cnf = Path(tmp) / "ca.cnf"
        cnf.write_text(_cert_config(cn, "ca"))
        _run_openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
        os.chmod(key, 0o600)
        _run_openssl(["req", "-new", "-x509", "-config", str(cnf), "-extensions", "ext", "-key", str(key),
                      "-sha256", "-days", str(days), "-set_serial", f"0x{secrets.token_hex(16)}", "-out", str(cert)])
    return cert, key


def make_cert(tls_dir: Path, name: str, ca: tuple[Path, Path], kind: str, days: int,
              dns: Sequence[str] = (), ips: Sequence[str] = ()) -> tuple[Path, Path]:
    """A certificate signed by ``ca`` (``kind`` server: with the SANs; client: CN = user): (pem, key)."""
    cert, key = tls_dir / f"{name}.pem", tls_dir / f"{name}.key"
    with tempfile.TemporaryDirectory() as tmp:
        cnf, csr = Path(tmp) / "c.cnf", Path(tmp) / "c.csr"
        cnf.write_text(_cert_config(name, kind, dns, ips))
        _run_openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
        os.chmod(key, 0o600)
        _run_openssl(["req", "-new", "-config", str(cnf), "-key", str(key), "-out", str(csr)])
        _run_openssl(["x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-sha256",
                      "-days", str(days), "-set_serial", f"0x{secrets.token_hex(16)}", "-extfile", str(cnf),
                      "-extensions", "ext", "-out", str(cert)])
    return cert, key


