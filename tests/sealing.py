"""Test helpers for sealed results (`circuitbook.seal`).

Tests that write or edit a results record on purpose and mean it to be graded do what the build does
after an execution, here: `finish` marks a hand-made record `ok` and stores it as an execution
(`build._store_execution` seals it), `reseal` makes an edited record whole again by the store's own key.
`repack` rewrites an archive as a forger would (every digest recomputed) or, given a key, as the holder
of that key would (sealed too). `trust` gives a store a visit key, as `circuitbook visit-key` does.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import nbformat

from circuitbook import build, context, transfer


def finish(chapter="demo", notebook="01_make", label="smoke") -> dict:
    """What the build does after a notebook ran to the end: mark its results ok and keep the executed
    notebook (here an empty one carrying the results' digest) with its cache record; the record is sealed."""
    data = context.mark(chapter, notebook, label, "ok", "", context.current()["execution"])
    executed = nbformat.v4.new_notebook(metadata={"circuitbook": {"results_sha256": context.results_digest(data)}})
    tmp = context.runs_root() / "executed.tmp.ipynb"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(executed, tmp)
    nb = build.Notebook(context.notebook_source(chapter, notebook), chapter, notebook, data["input_hash"])
    build._store_execution(label, nb, tmp, 0.0)
    return json.loads(context.results_path(chapter, notebook, label).read_text())


def reseal(chapter: str, notebook: str, label: str) -> None:
    """Make the store's record of chapter/notebook at label whole again after a test edited its results or
    its executed notebook on purpose: the notebook's results digest, its cache record's SHA-256, and the seal
    by the store's own key."""
    from circuitbook import seal

    results = context.results_path(chapter, notebook, label)
    data = json.loads(results.read_text())
    executed = context.executed_notebook_path(chapter, notebook, label)
    nb = nbformat.read(executed, as_version=4)
    nb.metadata.setdefault("circuitbook", {})["results_sha256"] = context.results_digest(data)
    nbformat.write(nb, executed)
    sha = hashlib.sha256(executed.read_bytes()).hexdigest()
    record = executed.with_suffix(".json")
    meta = json.loads(record.read_text())
    meta["sha256"] = sha
    record.write_text(json.dumps(meta))
    results.write_text(json.dumps(seal.apply(data, sha, seal.store_key(create=True))))


def trust(store: Path, key: bytes) -> str:
    """Give `store` a visit key (what `circuitbook visit-key` writes); returns its id."""
    from circuitbook import seal

    folder = Path(store) / ".keys" / "visits"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{seal.key_id(key)}.key"
    path.write_bytes(key)
    path.chmod(0o600)
    return seal.key_id(key)


def store_key_of(store: Path) -> bytes:
    """The key a store seals with (its .keys/seal.key)."""
    return (Path(store) / ".keys" / "seal.key").read_bytes()


def members(archive) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def repack(src, dest, change=None, key: bytes | None = None, extra: dict[str, bytes] | None = None):
    """Rewrite an archive: change(files, manifest) edits its members (parsed results records are passed as
    dicts under their names in `files`); then every digest a forger can recompute is recomputed (each executed
    notebook's results digest, each cache record's SHA-256, the manifest), and with `key` each `ok` record is
    sealed by it, as the holder of that key would. extra: members added as they are."""
    from circuitbook import seal

    files = members(src)
    manifest = json.loads(files.pop(transfer.MANIFEST))
    parsed = {n: json.loads(d) for n, d in files.items() if n.startswith("results/")}
    files.update(parsed)
    if change:
        change(files, manifest)
    for entry in manifest.get("notebooks") or []:
        name, executed, record = entry["results"], entry.get("executed"), entry.get("record")
        data = files[name]
        if executed and executed in files:
            nb = nbformat.reads(files[executed].decode(), as_version=4)
            if nb.metadata.get("circuitbook", {}).get("results_sha256") != context.results_digest(data):
                nb.metadata.setdefault("circuitbook", {})["results_sha256"] = context.results_digest(data)
                files[executed] = nbformat.writes(nb).encode()
            sha = hashlib.sha256(files[executed]).hexdigest()
            if record and record in files:
                meta = json.loads(files[record])
                meta["sha256"] = sha
                files[record] = json.dumps(meta).encode()
            if key is not None and data.get("status") == "ok":
                data = seal.apply(data, sha, key)
        files[name] = json.dumps(data).encode()
    files.update(extra or {})
    manifest["files"] = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    with tarfile.open(dest, "w:gz") as tar:
        for name, data in [*files.items(), (transfer.MANIFEST, json.dumps(manifest).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest
