"""Fetch the scripts the documentation site ships in ``docs/javascripts/vendor/`` (needs npm).

The site must work opened from disk with no network, so the two scripts Material would load
from a CDN are part of it: Mermaid (the diagrams; Material is written against Mermaid 11) and
the shim of iframe-worker (Material's search runs in a Web Worker, which a page opened from
``file://`` cannot start; the shim runs it in an iframe instead).  They are kept in the
repository rather than fetched when the site is built, so that every build of the site, with
``nox -s docs`` or a plain ``mkdocs build``, works offline and needs neither npm nor the
network.

``python tools/vendor_js.py`` packs each package of :data:`VENDORED` at its version with
``npm pack``, copies the file and the package's license, and rewrites ``VERSIONS.txt`` (name,
version, file, sha256 of each); ``tests/test_docs.py`` checks the files against it.  To update
one, change its version here and run it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "docs" / "javascripts" / "vendor"
#: file in VENDOR -> (npm package, version, the file inside the package's tarball).
VENDORED = {
    "mermaid.min.js": ("mermaid", "11.17.2", "package/dist/mermaid.min.js"),
    "iframe-worker-shim.js": ("iframe-worker", "1.0.4", "package/shim/index.js"),
}
VERSIONS = VENDOR / "VERSIONS.txt"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    VENDOR.mkdir(parents=True, exist_ok=True)
    lines = ["# npm package, version, file, sha256 (written by tools/vendor_js.py)"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (package, version, member) in VENDORED.items():
            subprocess.run(
                ["npm", "pack", "--silent", f"{package}@{version}", "--pack-destination", tmp],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with tarfile.open(Path(tmp) / f"{package}-{version}.tgz") as tar:
                for src, dest in ((member, name), ("package/LICENSE", f"{package}.LICENSE.txt")):
                    data = tar.extractfile(src)
                    if data is None:
                        raise SystemExit(f"{package}@{version}: no file {src}")
                    (VENDOR / dest).write_bytes(data.read())
            lines.append(f"{package} {version} {name} {sha256_of(VENDOR / name)}")
    VERSIONS.write_text("\n".join(lines) + "\n")
    print(VERSIONS.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
