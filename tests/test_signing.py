"""Signatures of published results (circuitbook.signing): known answers and hostile edits."""
import json

import pytest

from circuitbook import signing


def test_a_signature_verifies_with_a_listed_key_and_only_then(runs_dir, tmp_path):
    publishers = tmp_path / "publishers.json"
    kid = signing.add_publisher(publishers)
    assert kid and signing.add_publisher(publishers) is None, "listed once"
    keys = signing.read_publishers(publishers)
    data = b'{"values": {"aa1": 0.97}}'
    sig = signing.sign(data)
    assert sig["key"] == kid and signing.verify(data, sig, keys, "index.json") == kid
    with pytest.raises(signing.SignatureError, match="index.json: its signature does not verify"):
        signing.verify(data.replace(b"0.97", b"0.99"), sig, keys, "index.json")
    with pytest.raises(signing.SignatureError, match="which publishers.json does not list"):
        signing.verify(data, sig, {}, "index.json")
    with pytest.raises(signing.SignatureError, match="no signature"):
        signing.verify(data, {"key": kid}, keys, "index.json")


def test_a_forger_with_another_key_is_not_a_publisher(runs_dir, tmp_path, monkeypatch):
    publishers = tmp_path / "publishers.json"
    signing.add_publisher(publishers)
    keys = signing.read_publishers(publishers)
    monkeypatch.setenv("CIRCUITBOOK_RUNS", str(tmp_path / "forger-runs"))
    forged = signing.sign(b"data")  # a new store: a new key
    with pytest.raises(signing.SignatureError, match="does not list"):
        signing.verify(b"data", forged, keys, "index.json")
    # listing a key under another key's id is refused
    data = json.loads(publishers.read_text())
    (kid,) = data["keys"]
    data["keys"]["0" * 16] = data["keys"].pop(kid)
    publishers.write_text(json.dumps(data))
    with pytest.raises(signing.SignatureError, match="is not the id of its Ed25519 public key"):
        signing.read_publishers(publishers)


def test_the_private_key_is_made_once_private_and_never_silently_replaced(runs_dir):
    key = signing.private_key()
    path = runs_dir / ".keys" / signing.KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert signing.public_bytes(signing.private_key()) == signing.public_bytes(key), "the same key again"
    path.write_bytes(b"short")
    with pytest.raises(signing.SignatureError, match="is damaged .5 bytes"):
        signing.private_key()
    assert path.read_bytes() == b"short", "not replaced"
