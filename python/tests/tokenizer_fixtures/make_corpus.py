"""A real multilingual text corpus for the tokenizer tests, made offline from Debian's man pages.

    python make_corpus.py OUTDIR      (writes OUTDIR/corpus.jsonl, once)

`apt-get download`s a handful of man-page packages (English and translations into Japanese,
Chinese, Russian, Ukrainian, Greek, Vietnamese, Turkish, German and Polish: several scripts,
CJK without spaces, box-drawing tables, long runs of punctuation), reads each page straight
out of the .deb (`dpkg-deb --fsys-tarfile`: nothing is installed or unpacked) and keeps its
roff source, decompressed, as one document: real text in many scripts, with roff's own
markup. Pages that are not UTF-8, and `.so` aliases, are skipped. About 300 KB of text per
package (every k-th page, in path order), 3 MB in all; a few seconds, most of it the download.

Needs apt-get with Debian's (or Ubuntu's) package lists (run as root, it runs `apt-get update`
itself when they are missing) and dpkg-deb. The text keeps its upstream licences (GPL and
others) and is never committed: CI makes it, under target/.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile

PACKAGES = [
    "manpages", "manpages-ja", "manpages-zh", "manpages-ru", "manpages-uk", "manpages-el",
    "manpages-vi", "manpages-tr", "manpages-de", "manpages-pl",
]
#: Text kept per package (bytes of UTF-8), about.
PER_PACKAGE = 300_000
#: Changes with anything above: a corpus made by another version of this file is made again.
STAMP = f"v1 {' '.join(PACKAGES)} {PER_PACKAGE}"


def download(debs: str) -> None:
    """The .deb of every package into `debs` (kept: a second run downloads nothing)."""
    os.makedirs(debs, exist_ok=True)
    have = {f.split("_")[0] for f in os.listdir(debs) if f.endswith(".deb")}
    want = [p for p in PACKAGES if p not in have]
    if not want:
        return
    cmd = ["apt-get", "download", "-q", *want]
    done = subprocess.run(cmd, cwd=debs, capture_output=True, text=True)
    if done.returncode != 0 and os.geteuid() == 0:
        # No package lists yet (a fresh container): fetch them, then try again.
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        done = subprocess.run(cmd, cwd=debs, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            f"make_corpus.py: `{' '.join(cmd)}` failed in {debs}:\n{done.stderr.strip()}\n"
            "It needs apt-get with Debian's package lists (as root, `apt-get update`)."
        )


def pages(deb: str) -> list[tuple[str, str]]:
    """(path, text) of every man page of a .deb whose source is UTF-8, in path order."""
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", deb], check=True,
                               capture_output=True).stdout
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for m in tar.getmembers():
            if not (m.isfile() and "/share/man/" in m.name and m.name.endswith(".gz")):
                continue
            raw = gzip.decompress(tar.extractfile(m).read())
            if raw.lstrip().startswith(b".so ") and raw.count(b"\n") <= 2:
                continue  # an alias of another page
            try:
                out.append((m.name.lstrip("./"), raw.decode("utf-8")))
            except UnicodeDecodeError:
                continue
    return sorted(out)


def make(outdir: str) -> str:
    """OUTDIR/corpus.jsonl (made once; its first line is the stamp): the corpus's path."""
    path = os.path.join(outdir, "corpus.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if json.loads(f.readline()).get("stamp") == STAMP:
                return path
    debs = os.path.join(outdir, "debs")
    download(debs)
    rows = []
    for package in PACKAGES:
        (deb,) = [f for f in os.listdir(debs) if f.split("_")[0] == package]
        found = pages(os.path.join(debs, deb))
        total = sum(len(t.encode()) for _, t in found)
        step = max(1, -(-total // PER_PACKAGE))
        rows += [{"text": t, "package": package, "path": p} for p, t in found[::step]]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"stamp": STAMP}) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def documents(path: str) -> list[str]:
    """The texts of a corpus.jsonl, in order."""
    with open(path, encoding="utf-8") as f:
        next(f)
        return [json.loads(line)["text"] for line in f]


if __name__ == "__main__":
    corpus = make(sys.argv[1])
    docs = documents(corpus)
    print(f"{corpus}: {len(docs)} documents, {sum(len(d.encode()) for d in docs)} bytes")
