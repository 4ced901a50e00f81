"""Structured output through generate: a regex compiled by outlines-core into a token
automaton on the device (specjax.grammar) walks every row's output and every draft path:
its moves equal outlines-core's own; sampling under it is exact under speculation
(chi-square against the enumerated joint of plain constrained decoding, for a chain and a
sampled tree, constrained rows beside free ones); greedy output equals plain constrained
decoding for every drafter; a JSON schema's output parses and validates; the engine holds a
grammar per slot (preempted rows resume in their state); bad constraints are refused by
name. The server's, through the openai client, in test_serve.py."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.grammar import DEAD, FREE, Automaton, Grammar, GrammarError, Vocabulary
from tests.test_sampling import PROMPT, ROWS, V, _tiny, _transformers_probs
from tests.test_sampling_params import GREEDY_CASES, GREEDY_DRAFTERS, _check, _joint

TEXTS = {i: c for i, c in enumerate("abcdefg")}  # token 7 is EOS
EOS = 7


@pytest.fixture(scope="module")
def tiny_pair():
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


@pytest.fixture(scope="module")
def vocabulary():
    return Vocabulary.from_texts(TEXTS, eos=EOS, vocab_size=V)


def test_the_device_automaton_moves_as_outlines_core_s_index(vocabulary):
    """Every (state, token) step and every state's mask equal the library's transitions;
    rows of one automaton each walk their own grammar (a free row beside them); a
    disallowed token leads to DEAD, which (like FREE) allows everything and stays."""
    from outlines_core import Index

    pattern = "a(b|cd)*e"
    grammar = Grammar.regex(pattern, vocabulary)
    other = Grammar.choice(["bad", "gee"], vocabulary)
    bits = sum(bin(int(w)).count("1") for w in grammar.masks[grammar.mask, 0])
    assert grammar.num_edges < bits  # defaults carry most moves
    automaton, initial = Automaton.of([grammar, None, other], V)
    assert list(initial) == [grammar.initial, FREE, other.initial]
    index = Index(pattern, vocabulary.index_vocabulary)
    moves = index.get_transitions()
    states = sorted(set(moves) | {t for e in moves.values() for t in e.values()})
    number = {s: i for i, s in enumerate(states)}
    Q = grammar.num_states
    q = jnp.broadcast_to(jnp.repeat(jnp.arange(Q), V), (3, Q * V))
    t = jnp.broadcast_to(jnp.tile(jnp.arange(V), Q), (3, Q * V))
    got = np.asarray(automaton.step(q, t))[0].reshape(Q, V)
    allows = np.asarray(automaton.allows(jnp.broadcast_to(jnp.arange(Q), (3, Q)), V))[0]
    for s in states:
        for token in range(V):
            want = moves.get(s, {}).get(token)
            assert got[number[s], token] == (DEAD if want is None else number[want]), (s, token)
            assert allows[number[s], token] == (want is not None)
    assert np.asarray(automaton.allows(jnp.array([DEAD, FREE, DEAD]), V)).all()
    assert list(np.asarray(automaton.step(jnp.array([DEAD, FREE, DEAD]), jnp.array([0, 0, 0])))) == [DEAD, FREE, DEAD]
    b, a, d, g, e = 1, 0, 3, 6, 4
    walked = automaton.run(jnp.asarray(initial), jnp.array([[a, b, e, EOS], [b, a, d, EOS], [b, a, d, EOS]]),
                           jnp.array([4, 4, 4]))
    assert int(walked[0]) in grammar.finals and int(walked[1]) == FREE and int(walked[2]) in other.finals
    dead = automaton.run(jnp.asarray(initial), jnp.array([[e, e], [e, e], [g, a]]), jnp.array([2, 2, 2]))
    assert list(np.asarray(dead)) == [DEAD, FREE, DEAD]


def _reference_greedy(target, automaton, initial, prompt, n):
    """Plain constrained greedy decoding: the argmax of forward's logits over the allowed."""
    seq, state = list(prompt), jnp.asarray(initial[:1])
    for _ in range(n):
        logits = np.array(specjax.forward(target, np.array([seq], np.int32))[0, -1])
        token = int(np.where(np.asarray(automaton.allows(state, V))[0], logits, -np.inf).argmax())
        seq.append(token)
        state = automaton.step(state, jnp.array([token]))
        if token == EOS:
            break
    return seq[len(prompt):]


@pytest.mark.parametrize("drafter", GREEDY_CASES)
def test_greedy_constrained_output_equals_plain_constrained_decoding(tiny_pair, vocabulary, drafter):
    target, draft = tiny_pair
    pattern = "(ab|c)+d?e"
    grammar = Grammar.regex(pattern, vocabulary)
    automaton, initial = Automaton.of([grammar], V)
    prompts = [PROMPT, PROMPT[::-1] + [6]]
    padded, lengths = specjax.pad_prompts(prompts)
    out = specjax.generate(target, padded, lengths, draft=GREEDY_DRAFTERS[drafter](draft), max_new_tokens=12,
                           grammar=[grammar, None], eos_token_id=EOS)
    got = list(np.asarray(out.tokens[0, :int(out.num_tokens[0])]))
    assert got == _reference_greedy(target, automaton, initial, prompts[0], 12), drafter
    if got[-1] == EOS:
        assert re.fullmatch(pattern, "".join(TEXTS[t] for t in got[:-1]))
    free = specjax.generate(target, padded[1:], lengths[1:], max_new_tokens=12, eos_token_id=EOS)
    assert list(np.asarray(out.tokens[1])) == list(np.asarray(free.tokens[0]))  # the free row: as if alone


def _exact_joint(target, automaton, initial, temperature):
    """P(t1, t2 | prompt) [V, V] of plain constrained decoding, enumerated."""
    seqs = np.array([PROMPT + [t1] for t1 in range(V)])
    logits = np.asarray(specjax.forward(target, seqs))
    state = jnp.asarray(initial[:1])
    first = np.where(np.asarray(automaton.allows(state, V))[0], logits[0, len(PROMPT) - 1], -np.inf)
    p1 = _transformers_probs(first, temperature)
    after = np.asarray(automaton.allows(automaton.step(state[:, None], jnp.arange(V)[None]), V))[0]  # [V, V]
    p2 = np.stack([_transformers_probs(np.where(after[t1], logits[t1, len(PROMPT)], -np.inf), temperature)
                   if p1[t1] > 0 else np.zeros(V) for t1 in range(V)])
    return p1[:, None] * p2


@pytest.mark.parametrize("drafter", ["chain", pytest.param("sampled_tree", marks=pytest.mark.slow)])
def test_sampling_under_a_regex_is_exact_under_speculation(tiny_pair, vocabulary, drafter):
    """Constrained rows beside free ones in one call: each half distributed as plain decoding
    under its own constraint (the second token's mask depends on the first)."""
    target, draft = tiny_pair
    grammar = Grammar.regex("[a-c](b|d[a-f])e?", vocabulary)
    automaton, initial = Automaton.of([grammar], V)
    drafters = {"chain": specjax.DraftModel(draft),
                "sampled_tree": specjax.DraftModel(draft, specjax.Tree.from_paths([(0,), (1,), (0, 0), (1, 0)],
                                                                                  "sampled"))}
    half = ROWS // 2
    prompts = np.tile(np.array(PROMPT, np.int32), (2 * half, 1))
    out = specjax.generate(target, prompts, np.full(2 * half, len(PROMPT), np.int32), draft=drafters[drafter],
                           key=jax.random.key(8), max_new_tokens=2, temperature=1.2,
                           num_draft_tokens=2 if drafter == "chain" else None, grammar=[grammar] * half + [None] * half)
    tokens = np.asarray(out.tokens)
    _check(_joint(tokens[:half]), _exact_joint(target, automaton, initial, 1.2))
    free = _exact_joint(target, Automaton.of([None], V)[0], np.array([FREE]), 1.2)
    _check(_joint(tokens[half:]), free)


@pytest.mark.slow  # the suite's time on 2 cores (the engine's rows equal generate's: test_the_engine_holds...)
def test_the_engine_samples_under_a_regex_exactly_beside_greedy_rows(tiny_pair, vocabulary):
    """Through the engine: seeded requests under a regex (chi-square against the enumerated
    joint of plain constrained decoding) share calls with greedy constrained requests and free
    sampled ones (each half its own plain joint; the greedy ones generate's alone)."""
    target, draft = tiny_pair
    grammar = Grammar.regex("[a-c](b|d[a-f])e?", vocabulary)
    automaton, initial = Automaton.of([grammar], V)
    padded, lengths = specjax.pad_prompts([PROMPT])
    greedy_alone = specjax.generate(target, padded, lengths, max_new_tokens=2, grammar=grammar).tokens[0]
    rows = 1200
    with specjax.Engine(target, draft=draft, slots=16, max_len=16, num_draft_tokens=2, steps_per_call=2) as engine:
        requests = [engine.submit(PROMPT, max_new_tokens=2, seed=i, temperature=1.2, grammar=grammar if i % 2 else None)
                    for i in range(rows)]
        greedy = [engine.submit(PROMPT, max_new_tokens=2, grammar=grammar) for _ in range(16)]
        tokens = np.array([r.result(timeout=600) for r in requests])
        assert [r.result() for r in greedy] == [list(np.asarray(greedy_alone))] * 16
    _check(_joint(tokens[1::2]), _exact_joint(target, automaton, initial, 1.2))
    _check(_joint(tokens[0::2]), _exact_joint(target, Automaton.of([None], V)[0], np.array([FREE]), 1.2))


def test_a_json_schema_s_output_parses_and_validates():
    """A schema over a character vocabulary: sampled rows end at EOS with JSON that
    validates against it (jsonschema)."""
    import jsonschema

    config = specjax.ModelConfig(model_type="llama", vocab_size=24, hidden_size=16, num_layers=2, num_heads=2,
                                 num_kv_heads=1, head_dim=8, intermediate_size=24, max_position_embeddings=64,
                                 norm_eps=1e-6, tie_word_embeddings=False)
    target = specjax.models.init(config, jax.random.key(2), jnp.float32)
    texts = dict(enumerate('{}"ok:truefalsn, 0123'))
    vocabulary = Vocabulary.from_texts(texts, eos=23, vocab_size=24)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 20, 300]}},
              "required": ["ok"], "additionalProperties": False}
    grammar = Grammar.json_schema(schema, vocabulary)
    prompts = np.zeros((6, 3), np.int32)
    out = specjax.generate(target, prompts, np.full(6, 3, np.int32), max_new_tokens=40, temperature=1.0,
                           key=jax.random.key(0), grammar=grammar, eos_token_id=23)
    for row in range(6):
        n = int(out.num_tokens[row])
        tokens = list(np.asarray(out.tokens[row, :n]))
        assert tokens[-1] == 23, tokens
        jsonschema.validate(json.loads("".join(texts[t] for t in tokens[:-1])), schema)


def test_the_shipped_tokenizer_s_vocabulary_compiles_a_schema():
    """A byte-level BPE tokenizer's tokens as bytes (GPT-2's byte map): a schema compiles
    over them, and every token the start state allows begins the JSON text."""
    tokenizer = specjax.load_tokenizer("checkpoints/target")
    vocabulary = Vocabulary.of(tokenizer, len(tokenizer))
    grammar = Grammar.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                                  vocabulary)
    automaton, initial = Automaton.of([grammar], len(tokenizer))
    allowed = np.flatnonzero(np.asarray(automaton.allows(jnp.asarray(initial), len(tokenizer)))[0])
    assert len(allowed) > 0 and all(tokenizer.decode([int(i)]).startswith("{") for i in allowed)


def _string(n):
    return {"type": "string", "maxLength": n}


EVERYDAY = {  # schemas a server should take at its default capacity (issue 78: the first was refused)
    "two strings": {"type": "object", "properties": {"name": _string(10), "city": _string(10)},
                    "required": ["name", "city"]},
    "an enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "an integer and a boolean": {"type": "object", "required": ["age", "ok"],
                                 "properties": {"age": {"type": "integer"}, "ok": {"type": "boolean"}}},
    "a nested object": {"type": "object", "required": ["user"], "properties": {"user": {
        "type": "object", "properties": {"first": _string(20), "last": _string(20), "email": _string(50),
                                         "city": _string(30), "country": _string(20)},
        "required": ["first", "last", "email", "city", "country"]}}},
    "an array of short strings": {"type": "object", "properties": {"tags": {"type": "array", "items": _string(10),
                                                                            "maxItems": 5}}, "required": ["tags"]},
}


def test_everyday_schemas_fit_an_engine_s_default_room_and_move_as_outlines_core_s_index():
    """Over the shipped tokenizer's 4,096 ids, each schema fits the room an engine's slot
    holds by default (at 49c56b6 two strings of up to 10 characters took 40,895 exceptional
    moves by token, over the 16,384 held: a bounded string's state sends each token length
    elsewhere; by class they take 987); the device automaton of the two strings' moves, for
    every (state, token), as the library's transitions, and allows what they allow."""
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    from specjax.serve.requests import Limits
    from specjax.serve.sizing import grammar_capacity

    tokenizer = specjax.load_tokenizer("checkpoints/target")
    V = len(tokenizer)
    vocabulary = Vocabulary.of(tokenizer, V)
    room = grammar_capacity(None, None, V)
    limits = Limits(V, 64, 1, 0, None, room)
    for name, schema in EVERYDAY.items():
        grammar = Grammar.json_schema(schema, vocabulary, capacity=room)
        limits.check([1], 4, 0.0, 0, 1.0, 0.0, {}, [EOS], 0, None, grammar=grammar)  # (raises where it does not fit)
        assert room.refusal(name, grammar.num_states, grammar.num_masks, grammar.num_edges) is None
    grammar = Grammar.json_schema(EVERYDAY["two strings"], vocabulary)
    assert grammar.num_edges < 2000 and grammar.num_masks < 100, (grammar.num_edges, grammar.num_masks)
    index = Index(build_regex_from_schema(json.dumps(EVERYDAY["two strings"])), vocabulary.index_vocabulary)
    moves = index.get_transitions()
    states = sorted(set(moves) | {t for e in moves.values() for t in e.values()})
    number = {s: i for i, s in enumerate(states)}
    want = np.full((len(states), V), DEAD)
    for s, edges in moves.items():
        for token, to in edges.items():
            want[number[s], token] = number[to]
    automaton, initial = Automaton.of([None, grammar], V)
    Q = grammar.num_states
    q = jnp.broadcast_to(jnp.repeat(jnp.arange(Q), V), (2, Q * V))
    t = jnp.broadcast_to(jnp.tile(jnp.arange(V), Q), (2, Q * V))
    assert (np.asarray(automaton.step(q, t))[1].reshape(Q, V) == want).all()
    allows = np.asarray(automaton.allows(jnp.broadcast_to(jnp.arange(Q), (2, Q)), V))[1]
    assert (allows == (want != DEAD)).all() and initial[1] == number[index.get_initial_state()]


@pytest.mark.parametrize("make, message", [
    (lambda v: Grammar.regex("(", v), r"the regex '\(' cannot be compiled"),
    (lambda v: Grammar.regex(5, v), "a regex must be a string"),
    (lambda v: Grammar.choice([], v), "a non-empty list of strings"),
    (lambda v: Grammar.json_schema({"type": "nonsense"}, v), "the JSON schema cannot be compiled"),
    (lambda v: Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}, v),
     "the JSON schema's properties.n.maximum is not supported"),
    (lambda v: Grammar.json_schema({"anyOf": [{"type": "array", "uniqueItems": True}]}, v),
     r"anyOf\[0\].uniqueItems is not supported"),
])
def test_bad_constraints_are_refused_by_name(vocabulary, make, message):
    with pytest.raises(GrammarError, match=message):
        make(vocabulary)


def test_generate_refuses_a_grammar_list_of_the_wrong_length(tiny_pair, vocabulary):
    target, _ = tiny_pair
    padded, lengths = specjax.pad_prompts([PROMPT, PROMPT])
    with pytest.raises(ValueError, match="a list of 2 of them"):
        specjax.generate(target, padded, lengths, max_new_tokens=2, grammar=[Grammar.regex("a", vocabulary)])


@pytest.mark.slow  # (a minute of the suite on 2 cores)
def test_the_engine_holds_a_grammar_per_slot_and_resumes_it_after_preemption(tiny_pair, vocabulary):
    """Constrained rows (two grammars, greedy and seeded sampling) beside a free one, in an
    engine whose page pool is too small for all (rows are preempted and resume from their
    output: the grammar's state walked over it on the host): each equals generate alone; a
    grammar larger than a slot's room is refused at submit."""
    target, draft = tiny_pair
    grammar, choice = Grammar.regex("(ab|c|d)[a-f]{10}", vocabulary), Grammar.choice(["bad", "cab"], vocabulary)
    jobs = [(PROMPT, grammar, {}), (PROMPT[::-1], None, {}), (PROMPT, choice, {}),
            (PROMPT + [1], grammar, dict(temperature=1.0, seed=3)), ([2, 3], grammar, dict(temperature=0.8, seed=5))]
    with specjax.Engine(target, draft=draft, num_draft_tokens=2, slots=4, max_len=32, kv_pages=7, page_size=4,
                        steps_per_call=1, max_grammar_states=16, max_grammar_edges=32) as engine:
        with engine._lock:
            requests = [engine.submit(p, 14, stop_token_ids=[EOS], grammar=g, **s) for p, g, s in jobs]
        results = [r.result(timeout=300) for r in requests]
        with pytest.raises(ValueError, match=r"a row holds 16 states \(Engine\(max_grammar_states=\.\.\.\)\)"):
            engine.submit(PROMPT, 4, grammar=Grammar.regex("[a-f]{20}", vocabulary))
        preemptions = engine.stats()["preemptions"]
    for (prompt, g, s), result in zip(jobs, results):
        key = {} if "seed" not in s else {"key": jax.random.key(s["seed"]), "temperature": s["temperature"]}
        padded, lengths = specjax.pad_prompts([prompt])
        alone = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=2, max_new_tokens=14,
                                 grammar=g, eos_token_id=EOS, **key)
        assert result == list(np.asarray(alone.tokens[0, :int(alone.num_tokens[0])])), (prompt, s)
    assert preemptions > 0, ([len(r) for r in results], preemptions)
    with pytest.raises(ValueError, match="this engine holds no grammars"):
        specjax.Engine(target, slots=2, max_len=16, max_grammar_states=0).submit(PROMPT, 2, grammar=grammar)
