#!/usr/bin/env python3
"""Make a CA and one certificate per service for minisgl's internal mTLS.

    python scripts/gen_internal_certs.py OUTDIR [--days 365] [--san NAME ...]

OUTDIR/ca.crt, OUTDIR/ca.key (keep the CA key offline: only this tool needs it), and for each of
gateway, tokenizer, detokenizer, scheduler, worker a directory OUTDIR/<service>/ with ca.crt,
tls.crt, tls.key: point that service's --internal-tls-dir (MINISGL_INTERNAL_TLS_DIR) at it.

Each certificate serves as server and client certificate (both extended key usages). Its SANs:
the service's names (`tokenizer`, `minisgl-tokenizer`), localhost, 127.0.0.1, ::1, any --san, and
the fixed name `minisgl-internal` that every internal client verifies (see
minisgl_core.security: a peer is trusted for being signed by this CA).

Needs the `cryptography` package (requirements-dev.txt); the services themselves do not.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICES = ("gateway", "tokenizer", "detokenizer", "scheduler", "worker")
TARGET_NAME = "minisgl-internal"  # = minisgl_core.security.TLS_TARGET_NAME (no import: standalone)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "minisgl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name("minisgl internal CA"))
            .issuer_name(_name("minisgl internal CA")).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(service: str, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate,
              days: int, extra_sans: list[str]) -> tuple[ec.EllipticCurvePrivateKey,
                                                         x509.Certificate]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    dns = [service, f"minisgl-{service}", "localhost", TARGET_NAME]
    ips: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a))
                                   for a in ("127.0.0.1", "::1")]
    for san in extra_sans:
        try:
            ips.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            dns.append(san)
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dict.fromkeys(dns)]
    cert = (x509.CertificateBuilder().subject_name(_name(f"minisgl-{service}"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names + ips), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def generate(outdir: Path, days: int = 365, extra_sans: list[str] | None = None,
             services: tuple[str, ...] = SERVICES) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca(days)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    _write(outdir / "ca.crt", ca_pem)
    _write(outdir / "ca.key", _pem_key(ca_key), private=True)
    for service in services:
        key, cert = make_leaf(service, ca_key, ca, days, extra_sans or [])
        d = outdir / service
        d.mkdir(exist_ok=True)
        _write(d / "ca.crt", ca_pem)
        _write(d / "tls.crt", cert.public_bytes(serialization.Encoding.PEM))
        _write(d / "tls.key", _pem_key(key), private=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--days", type=int, default=365, help="validity of every certificate")
    parser.add_argument("--san", action="append", default=[],
                        help="extra DNS name or IP on every service certificate (repeatable)")
    args = parser.parse_args(argv)
    generate(args.outdir, args.days, args.san)
    print(f"wrote {args.outdir}/ca.crt and {', '.join(SERVICES)} dirs "
          f"(ca.crt, tls.crt, tls.key) under {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
