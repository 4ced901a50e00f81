"""Retrieval drafting (REST): the suffix array against brute force, the trie a row proposes,
greedy output equal to transformers' (chain and tree, ragged batch, EOS) with drafts
accepted, many tokens per pass when the datastore holds the text, the joint distribution of
three sampled tokens exact, save/load round trip, and bad inputs refused clearly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters.base import DraftRequest
from specjax.sampling import Sampling
from specjax.tree import Tree
from tests import tiny
from tests.test_sampling import _chi_square_p
from tests.test_tree import _sampled_joint, exact_joint, tiny_pair  # noqa: F401  (fixtures)

MAX_NEW = 24


# ---- the datastore ---------------------------------------------------------------------


def test_suffix_array_matches_brute_force():
    rng = np.random.RandomState(0)
    for _ in range(40):
        docs = [list(rng.randint(0, 3, rng.randint(0, 12))) for _ in range(rng.randint(1, 4))] + [[1]]
        ds = specjax.Datastore.build(docs)
        tokens, suffixes = np.asarray(ds.tokens), np.asarray(ds.suffixes)
        text = lambda i: list(tokens[i:]) + [-2]  # noqa: E731  (past the end sorts first)
        brute = sorted((i for i in range(len(tokens)) if tokens[i] >= 0), key=text)
        assert [text(i) for i in suffixes] == [text(i) for i in brute]
        assert ds.num_documents == len(docs) - sum(len(d) == 0 for d in docs)
        assert tokens.dtype == np.int32


def test_large_vocabulary_ids_survive():
    ds = specjax.Datastore.build([[70_000, 123_456, 5], [123_456, 5, 99]])
    assert ds.max_token == 123_456
    assert sorted(np.asarray(ds.tokens)[np.asarray(ds.suffixes)].tolist()) == [5, 5, 99, 70_000, 123_456, 123_456]


def test_save_load_round_trip(tmp_path):
    ds = specjax.Datastore.build([[5, 6, 7], [7, 6, 5, 6]])
    ds.save(tmp_path / "ds")
    back = specjax.Datastore.load(tmp_path / "ds")
    np.testing.assert_array_equal(back.tokens, ds.tokens)
    np.testing.assert_array_equal(back.suffixes, ds.suffixes)
    assert (back.max_token, back.num_documents, back.num_tokens) == (7, 2, 7)


def _edit_meta(folder, **changes):
    meta = json.loads((folder / "datastore.json").read_text())
    (folder / "datastore.json").write_text(json.dumps({**meta, **changes}))


def _write_npy(file, header: bytes, data=b""):
    """A version 1.0 .npy file with this raw header."""
    file.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data)


HUGE = b"{'descr': '<i4', 'fortran_order': False, 'shape': (1099511627776,)}\n"  # 2**40 values: 4 TiB


@pytest.mark.parametrize("spoil, message", [
    (lambda p: (p / "suffixes.npy").unlink(), "lacks suffixes.npy"),
    (lambda p: (p / "datastore.json").unlink(), "holds no datastore.json"),
    (lambda p: (p / "datastore.json").write_text("{not json"), "datastore.json is not valid JSON"),
    (lambda p: (p / "datastore.json").write_text("[" * 100_000 + "]" * 100_000), "nests its JSON too deeply"),
    (lambda p: (p / "datastore.json").write_text('{"format": "other"}'), "is not a specjax datastore"),
    (lambda p: _edit_meta(p, version=True), "has version True"),
    (lambda p: _edit_meta(p, num_documents=True), "has num_documents True, not an integer"),
    (lambda p: _edit_meta(p, num_tokens=7.0), "has num_tokens 7.0, not an integer"),
    (lambda p: (p / "tokens.npy").write_bytes(b"\x93NUMPY garbage"), "tokens.npy is corrupt"),
    (lambda p: _write_npy(p / "tokens.npy", HUGE, bytes(40)), "tokens.npy is corrupt: its header claims 1099511627776"),
    (lambda p: _write_npy(p / "suffixes.npy", HUGE), "suffixes.npy is corrupt: its header claims 1099511627776"),
    (lambda p: (p / "suffixes.npy").write_bytes((p / "suffixes.npy").read_bytes()[:-4]),
     "claims 7 int32 values .* but 24 bytes follow"),
    (lambda p: _write_npy(p / "suffixes.npy", b"-" * 9000 + b"1\n"), "suffixes.npy is corrupt"),
    (lambda p: np.save(p / "tokens.npy", np.array([1, None]), allow_pickle=True), "must be a 1-D int32 array, got object"),
    (lambda p: np.save(p / "tokens.npy", np.zeros(3, np.float32)), "must be a 1-D int32 array"),
    (lambda p: np.save(p / "suffixes.npy", np.load(p / "suffixes.npy")[::-1].copy()), "is not sorted"),
    (lambda p: np.save(p / "suffixes.npy", np.load(p / "suffixes.npy")[:-1]), "sizes"),
])
def test_corrupt_datastores_are_refused(tmp_path, spoil, message):
    specjax.Datastore.build([[5, 6, 7], [9, 6, 5, 6]]).save(tmp_path)
    spoil(tmp_path)
    with pytest.raises(specjax.CheckpointError, match=message):
        specjax.Datastore.load(tmp_path)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(specjax.CheckpointError, match="no datastore folder"):
        specjax.Datastore.load(tmp_path / "nowhere")


@pytest.mark.parametrize("docs, message", [
    ([], "at least one non-empty document"),
    ([[], []], "at least one non-empty document"),
    ([[1, -3]], "token id -3"),
    ([[1.5, 2.0]], "integer token ids"),
    ([[[1, 2]]], "1-D list"),
    (np.array([1, 2, 3]), "not one flat list"),
])
def test_bad_documents_are_refused(docs, message):
    with pytest.raises(ValueError, match=message):
        specjax.Datastore.build(docs)


# ---- the trie a row proposes ------------------------------------------------------------

DOCS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 3], [1, 6, 7, 2], [6, 7, 8, 9, 4], [7, 7, 7]]


def _propose(text, tree, K=None):
    drafter = specjax.Retrieval(specjax.Datastore.build(DOCS), max_span=4, max_matches=8, tree=tree).resolve(K)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(text)] = text
    request = DraftRequest(target=None, target_cache=None, tokens=jnp.asarray(tokens),
                           length=jnp.array([len(text)]), done=jnp.array([False]), key=jax.random.key(0),
                           sampling=Sampling.make(0.0, 0, 1.0), k_limit=jnp.array([drafter.tree.depth]),
                           threshold=jnp.float32(0))
    _, _, p = jax.jit(lambda d, r: d.propose(None, r))(drafter, request)  # (not op by op: seconds)
    valid = np.asarray(p.valid[0])
    parents = np.asarray(p.parents)
    parents = parents[0] if parents.ndim == 2 else parents
    return list(zip(np.asarray(p.tokens[0])[valid].tolist(), parents[valid].tolist()))


def test_chain_is_the_most_frequent_continuation():
    # "6 7" is the longest suffix found (4 times): 8 follows 3 of them, then 9 follows 2 of those.
    assert _propose([2, 6, 7], None, K=3) == [(8, 0), (9, 1), (4, 2)]
    assert _propose([0, 0, 0], None, K=3) == []  # no match: nothing proposed


def test_tree_is_the_trie_of_continuations():
    # Nodes in depth order, then in suffix-array order: 2 and 8 after "6 7"; 3 and 9 after 8; 4 after 9.
    assert _propose([2, 6, 7], Tree(3, 2, 6)) == [(2, 0), (8, 0), (3, 2), (9, 2), (4, 4)]
    # A match at a document's end is not a match ("7 7 7" then the separator): "7" follows.
    assert _propose([7], Tree(2, 3, 5)) == [(2, 0), (7, 0), (8, 0), (7, 2), (9, 3)]


# ---- greedy exactness --------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_case(pair):
    """A ragged batch of 4 (row 0 stops at an EOS), transformers' greedy continuations, and a
    datastore holding them, among distractors: other texts, and for row 1 a wrong
    continuation stored twice, so that the chain's most frequent guess is wrong there."""
    target, _, torch_model = pair
    rng = np.random.RandomState(7)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (3, 9, 1, 13)]
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    eos = int(plain.tokens[0, 6])
    expected = [tiny.transformers_greedy(torch_model, p, MAX_NEW, eos) for p in prompts]
    wrong = prompts[1] + expected[1][:5] + [int(t) for t in rng.randint(2, tiny.VOCAB, 8)]
    docs = [p + e for p, e in zip(prompts, expected)] + [wrong, wrong]
    docs += [list(rng.randint(2, tiny.VOCAB, 30)) for _ in range(6)]
    return padded, lengths, eos, expected, specjax.Datastore.build(docs)


@pytest.mark.parametrize("tree, K", [(None, 6), (Tree(6, 2, 10), None)], ids=["chain", "tree"])
def test_greedy_equals_transformers(pair, greedy_case, tree, K):
    target, _, _ = pair
    padded, lengths, eos, expected, ds = greedy_case
    out = specjax.generate(target, padded, lengths, draft=specjax.Retrieval(ds, max_span=8, tree=tree),
                           num_draft_tokens=K, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert tiny.rows(out) == expected
    assert out.num_tokens[0] < MAX_NEW  # the EOS row stopped early
    assert int(out.stats.accepted.sum()) > 0
    # The datastore holds the text being generated: many tokens per target pass.
    per_pass = float(out.num_tokens.sum() / out.stats.steps.sum())
    assert per_pass > 2.5, per_pass


def test_retrieval_refuses_bad_settings(pair):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts([[5, 6]], bucket=16)
    ds = specjax.Datastore.build([[5, 6, 7]])
    bad = [
        (specjax.Retrieval("docs"), {}, TypeError, "needs a specjax.Datastore"),
        (specjax.Retrieval(ds, max_span=2, min_span=3), {}, ValueError, "min_span <= max_span"),
        (specjax.Retrieval(ds, max_matches=0), {}, ValueError, "max_matches must be an int >= 1"),
        (specjax.Retrieval(ds, tree=Tree.from_paths([(0,), (1,)])), {}, ValueError, "not rank paths"),
        (specjax.Retrieval(ds, max_matches=2, tree=Tree(2, 4, 5)), {}, ValueError, "at most 4 nodes"),
        (specjax.Retrieval(ds, tree=Tree(2, 2, 4)), {"num_draft_tokens": 3}, ValueError, "conflicts"),
        (specjax.Retrieval(specjax.Datastore.build([[5, 500]])), {}, ValueError, "outside the target's vocabulary"),
    ]
    for drafter, kw, error, message in bad:
        with pytest.raises(error, match=message):
            specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=2, **kw)


# ---- sampling: the joint distribution of the first three tokens ------------------------


@pytest.mark.parametrize("tree, K", [(None, 3), (Tree(3, 2, 6), None)], ids=["chain", "tree"])
def test_sampling_is_exact(tiny_pair, exact_joint, tree, K):  # noqa: F811
    """V = 8; the datastore is random text over the vocabulary plus the prompt's own pattern,
    so rows find matches and both accept and reject drafts."""
    target, _ = tiny_pair
    rng = np.random.RandomState(0)
    docs = [list(rng.randint(0, 8, 24)) for _ in range(12)] + [[1, 2, 3, 1, 2, 4, 4, 5], [3, 1, 2, 0, 7]]
    drafter = specjax.Retrieval(specjax.Datastore.build(docs), max_span=4, max_matches=8, tree=tree)
    if K is not None:
        drafter = drafter.resolve(K)
    observed = _sampled_joint(target, drafter)
    assert observed[exact_joint == 0].sum() == 0
    assert _chi_square_p(observed, exact_joint) > 1e-3


# ---- the command line ---------------------------------------------------------------------


def test_cli_builds_a_datastore_from_files_and_folders(tmp_path, capsys):
    from specjax import cli

    corpus = ["the cat sat on the mat", "a dog sat on the log by the mat"]
    tokenizer = tiny.save_tokenizer(tmp_path / "tok", corpus * 10)
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text(corpus[0])
    (tmp_path / "docs" / "sub" / "b.txt").write_text(corpus[1])
    (tmp_path / "docs" / "sub" / "bin.dat").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "c.txt").write_text("the cat")
    cli.main(["datastore", "build", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "ds"),
              str(tmp_path / "docs"), str(tmp_path / "c.txt")])
    assert "3 documents" in capsys.readouterr().out
    ds = specjax.Datastore.load(tmp_path / "ds")
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (corpus[0], corpus[1], "the cat")]
    np.testing.assert_array_equal(ds.tokens, specjax.Datastore.build(expected).tokens)
    assert json.loads((tmp_path / "ds" / "datastore.json").read_text())["num_documents"] == 3
    with pytest.raises(ValueError, match="no file or folder"):
        cli.main(["datastore", "build", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "x"),
                  str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="give FILES_OR_DIRS or --stdlib-train"):
        cli.main(["datastore", "build", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "x")])
