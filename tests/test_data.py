"""moequant.measure.data: builtin stdlib sources, hashed splits, seeded samples, local files, clear errors.

Built on the Python standard library sources only, which every machine has; the tokenizer is the
one shipped with the default zoo model.
"""

import ast
import hashlib
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from moequant import zoo
from moequant.errors import UserError
from moequant.measure import data

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(zoo.path(zoo.DEFAULT_MODEL))


def _ids(corpora):
    return {d.id for c in corpora for d in c.documents}


def test_stdlib_split_is_disjoint_complete_and_shared_between_code_and_prose():
    calib = _ids(data.load_documents("builtin:stdlib-code", "calibration"))
    evaluation = _ids(data.load_documents("builtin:stdlib-code", "evaluation"))
    every = {p.relative_to(STDLIB).as_posix() for p in STDLIB.rglob("*.py")}
    assert calib.isdisjoint(evaluation)
    assert calib | evaluation <= every
    assert {"os.py", "json/decoder.py", "asyncio/events.py", "email/message.py"} <= calib | evaluation
    assert not any(i.startswith(("test/", "idlelib/")) or "/tests/" in i for i in calib | evaluation)
    assert 0.05 < len(evaluation) / len(calib | evaluation) < 0.2
    # the split is a pure function of the file path: recompute it independently
    for doc_id in sorted(evaluation)[:20]:
        digest = hashlib.sha256(f"builtin:stdlib/{doc_id}".encode()).digest()
        assert int.from_bytes(digest[:8], "big") / 2**64 < 0.1
    # docstrings of an evaluation file are never calibration prose (no leak between domains)
    prose_calib = _ids(data.load_documents("builtin:stdlib-prose", "calibration"))
    assert prose_calib.isdisjoint(evaluation)


def test_stdlib_prose_is_the_docstrings_of_the_file():
    (corpus,) = data.load_documents("builtin:stdlib-prose", "calibration")
    doc = next(d for d in corpus.documents if d.id == "json/decoder.py")
    text = doc.read()
    tree = ast.parse((STDLIB / "json" / "decoder.py").read_text())
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, nodes) and ast.get_docstring(n)]
    kept = [d for d in docstrings if len(d.split()) >= 4]  # one- to three-word docstrings are left out
    assert kept and all(d in text for d in kept)
    assert len(text) == sum(map(len, kept)) + 2 * (len(kept) - 1)  # nothing but them, blank-line separated
    assert corpus.domain == "prose"


def test_samples_have_requested_count_length_and_domain(tokenizer):
    samples = data.load_samples("builtin:stdlib-code", tokenizer, n_samples=5, seq_len=48, split="evaluation")
    assert len(samples) == 5
    assert all(s.input_ids.shape == (48,) and s.input_ids.dtype == torch.long for s in samples)
    assert {s.domain for s in samples} == {"code"}


def test_samples_come_from_the_requested_split(tokenizer):
    samples = data.load_samples("builtin:stdlib-code", tokenizer, n_samples=3, seq_len=64, split="evaluation", seed=3)
    evaluation = data.load_documents("builtin:stdlib-code", "evaluation")[0].documents
    eval_text = "\n".join((STDLIB / d.id).read_text(errors="replace") for d in evaluation)
    for sample in samples:
        pieces = [p for p in tokenizer.decode(sample.input_ids).split(tokenizer.eos_token) if len(p) > 40]
        piece = max(pieces, key=len)[5:-5]  # trim the edges: a window may cut a token's bytes
        assert piece in eval_text


def test_same_seed_same_samples_other_seed_other_samples(tokenizer):
    a = data.load_samples("builtin:stdlib-prose", tokenizer, n_samples=4, seq_len=32, seed=7)
    b = data.load_samples("builtin:stdlib-prose", tokenizer, n_samples=4, seq_len=32, seed=7)
    c = data.load_samples("builtin:stdlib-prose", tokenizer, n_samples=4, seq_len=32, seed=8)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))


def test_a_plain_tokenizers_tokenizer_gives_the_same_ids(tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(zoo.path(zoo.DEFAULT_MODEL) / "tokenizer.json"))
    # the first window lies inside the first document (no EOS joins it), so both agree
    a = data.load_samples("builtin:stdlib-code", raw, n_samples=1, seq_len=16)
    b = data.load_samples("builtin:stdlib-code", tokenizer, n_samples=1, seq_len=16)
    assert torch.equal(a[0].input_ids, b[0].input_ids)
    assert a[0].input_ids.tolist() == raw.encode(tokenizer.decode(b[0].input_ids), add_special_tokens=False).ids


def test_mix_spreads_samples_over_domains_with_labels(tokenizer):
    samples = data.load_samples("builtin:mix", tokenizer, n_samples=7, seq_len=32, split="evaluation")
    domains = sorted({c.domain for c in data.load_documents("builtin:mix", "evaluation")})
    assert {"code", "prose"} <= set(domains)
    counts = {d: sum(s.domain == d for s in samples) for d in domains}
    assert sum(counts.values()) == 7
    assert max(counts.values()) - min(counts.values()) <= 1
    code = next(s for s in samples if s.domain == "code")
    assert code.source == "builtin:stdlib-code"


@pytest.mark.parametrize("n,k", [(6, 3), (1, 4), (7, 0)])
def test_held_out_samples_leave_the_requested_ones_unchanged_and_are_disjoint(tokenizer, n, k):
    """The calibration probe's samples: further windows of the same split and domains, never one of
    the statistics' samples, which stay exactly what load_samples gives."""
    source = "builtin:mix"
    samples, held = data.load_samples_with_holdout(source, tokenizer, n, k, 64, seed=3)
    plain = data.load_samples(source, tokenizer, n, 64, seed=3)
    assert [s.input_ids.tolist() for s in samples] == [s.input_ids.tolist() for s in plain]
    assert [s.domain for s in samples] == [s.domain for s in plain]
    assert len(held) == k
    used = {tuple(s.input_ids.tolist()) for s in samples}
    assert not any(tuple(s.input_ids.tolist()) in used for s in held)
    both = data.load_samples(source, tokenizer, n + k, 64, seed=3)
    assert sorted(tuple(s.input_ids.tolist()) for s in samples + held) == sorted(
        tuple(s.input_ids.tolist()) for s in both
    )
    if k >= 2:  # spread over domains like any sample set
        assert len({s.domain for s in held}) >= 2


def test_spec_name_resolves_to_the_builtin(tokenizer):
    a = data.load_samples("stdlib-code", tokenizer, n_samples=2, seq_len=16)
    b = data.load_samples("builtin:stdlib-code", tokenizer, n_samples=2, seq_len=16)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))


def test_too_small_source_is_a_clear_error_unless_allow_fewer(tokenizer, tmp_path):
    file = tmp_path / "tiny.jsonl"
    rows = [{"text": f"row {i} says something short about quantization."} for i in range(40)]
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=r"fewer than the 500 asked for"):
        data.load_samples(str(file), tokenizer, n_samples=500, seq_len=64)
    some = data.load_samples(str(file), tokenizer, n_samples=500, seq_len=64, allow_fewer=True)
    assert 0 < len(some) < 500 and all(s.input_ids.shape == (64,) for s in some)
    assert {s.domain for s in some} == {"tiny"}
    # with the probe's held-out samples, the sentence says what the count is made of
    with pytest.raises(UserError, match=r"fewer than the 532 asked for \(its share of 500 samples and 32 held out "):
        data.load_samples_with_holdout(str(file), tokenizer, 500, 32, 64)


def test_local_files_of_every_kind_give_the_same_rows(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Paragraph number {i}: the experts of layer {i % 4} disagree about routing." for i in range(200)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)))
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in texts]))
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    expected = [t for t in texts]
    for suffix in ("jsonl", "json", "parquet", "txt"):
        calib = data.load_documents(str(tmp_path / f"a.{suffix}"), "calibration")[0].documents
        evaluation = data.load_documents(str(tmp_path / f"a.{suffix}"), "evaluation")[0].documents
        got = sorted([d.read().strip() for d in calib + evaluation], key=expected.index)
        assert got == expected, suffix
        assert 0 < len(evaluation) < len(calib)
    samples = data.load_samples(str(tmp_path / "a.parquet"), tokenizer, n_samples=3, seq_len=20)
    assert len(samples) == 3 and samples[0].domain == "a"


def test_spec_file_with_another_text_field(tokenizer, tmp_path):
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps({"body": f"text {i} " * 20}) for i in range(30)))
    (tmp_path / "q.yaml").write_text("file: q.jsonl\ntext_field: body\ndomain: questions\n")
    samples = data.load_samples(str(tmp_path / "q.yaml"), tokenizer, n_samples=2, seq_len=16)
    assert [s.domain for s in samples] == ["questions", "questions"]


def test_malformed_jsonl_line_names_file_and_line(tokenizer, tmp_path):
    file = tmp_path / "bad.jsonl"
    file.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    with pytest.raises(UserError) as err:
        data.load_samples(str(file), tokenizer, n_samples=1, seq_len=4)
    message = str(err.value)
    assert str(file) in message and "line 3" in message and message.count(".") >= 1 and "\n" not in message


def test_missing_text_field_names_file_line_and_field(tokenizer, tmp_path):
    file = tmp_path / "nofield.jsonl"
    file.write_text('{"text": "fine"}\n{"content": "wrong key"}\n')
    with pytest.raises(UserError, match=r"nofield\.jsonl, line 2: no text field 'text'"):
        data.load_samples(str(file), tokenizer, n_samples=1, seq_len=4)
    parquet = tmp_path / "nofield.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), parquet)
    with pytest.raises(UserError, match=r"no text field 'text'; fields present: content"):
        data.load_samples(str(parquet), tokenizer, n_samples=1, seq_len=4)


def test_hub_source_offline_is_a_clear_error(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"hub dataset 'Salesforce/wikitext' needs the network"):
        data.load_samples("wikitext-2", tokenizer, n_samples=1, seq_len=8)
    with pytest.raises(UserError, match=r"hub dataset 'someone/thing' needs the network"):
        data.load_samples("hf:someone/thing", tokenizer, n_samples=1, seq_len=8)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"source": "builtin:nope"}, r"builtin:nope is not a builtin source; accepted: builtin:stdlib-code"),
        ({"source": "nothing-like-this"}, r"data source 'nothing-like-this' is not known"),
        ({"source": "missing.parquet"}, r"data file missing.parquet does not exist"),
        ({"source": "x.csv"}, r"data file x.csv does not exist"),
        ({"source": "builtin:stdlib-code", "split": "train"}, r"split 'train' is not one of calibration, evaluation"),
        ({"source": "builtin:stdlib-code", "n_samples": 0}, r"n_samples must be a positive integer, got 0"),
        ({"source": "builtin:stdlib-code", "seq_len": 2.5}, r"seq_len must be a positive integer"),
    ],
)
def test_bad_arguments_are_user_errors(tokenizer, kwargs, pattern):
    args = {"n_samples": 1, "seq_len": 8, **kwargs}
    with pytest.raises(UserError, match=pattern):
        data.load_samples(tokenizer=tokenizer, **args)


def test_unsupported_extension(tokenizer, tmp_path):
    file = tmp_path / "x.csv"
    file.write_text("text\nhello\n")
    with pytest.raises(UserError, match=r"unsupported extension '.csv'; accepted: .txt, .jsonl, .json, .parquet"):
        data.load_samples(str(file), tokenizer, n_samples=1, seq_len=2)


@pytest.mark.parametrize("ahead", [1, 3, 64])
def test_windows_pack_each_documents_own_token_ids_in_order_whatever_the_batch(tokenizer, tmp_path, monkeypatch, ahead):
    """Round 0 reads and tokenizes ENCODE_AHEAD documents per batch; the windows are still each document's
    own first chunk (tokenized alone, EOS after its end) packed in the documents' seeded order, the same for
    every batch size (empty documents skipped)."""
    texts = [f"Document {i} says {'more ' * (i % 7)}about expert {i % 5}." if i % 9 else "   " for i in range(60)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    monkeypatch.setattr(data, "ENCODE_AHEAD", ahead)
    samples = data.load_samples(str(tmp_path / "d.jsonl"), tokenizer, n_samples=6, seq_len=16)
    corpus = data.load_documents(str(tmp_path / "d.jsonl"), "calibration")[0]
    docs = sorted(corpus.documents, key=lambda d: data._seeded_order(0, corpus.source, d.id))
    stream = []
    for d in docs:
        text = d.read()
        if text.strip():
            stream += (tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])[:16]
    assert sum(len(t) for t in texts if t.strip()) > 0 and tokenizer.eos_token_id is not None
    got = torch.cat([s.input_ids for s in samples]).tolist()
    assert len(samples) == 6 and got == stream[: 6 * 16]
