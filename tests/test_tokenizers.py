"""Draft models of another tokenizer: string-level exact matching (greedy), token-level intersection (sampling),
vocabulary detection, bounds and errors (hf_speculators.translation through DraftModelDrafter)."""

import copy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    PreTrainedTokenizerFast,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_speculators as hs
from batch_helpers import batched_generate, laid_out, two_token_joint
from hf_speculators.drafters.draft_model import DraftModelDrafter, vocabulary_bridge
from hf_speculators.translation import TokenizerBridge, VocabularyMap, same_vocabulary
from speculative_helpers import PROMPTS, prompt_ids, speculative_generate
from test_lossless import chi_square, chi_square_critical
from tiny_models import CHARACTERS, build_model, build_target, build_tokenizer

DEMO = Path(hs.__file__).parent / "demo"
CORPUS = ["The quick brown fox jumps over the lazy dog. ", "def add(a, b):\n    return a + b\n\n",
          "Hello world!  Two  spaces, café naïve 東京 🙂 ", "the theory of there and then; they think. "] * 40
BATCH_PROMPTS = [PROMPTS["random"], PROMPTS["repetitive"], (5, 61, 23), PROMPTS["one_token"]]


# ------------------------------------------------------------------------------------------------ tokenizers, models


def byte_level_tokenizer(vocab_size: int = 300):
    """A GPT-2-style byte-level BPE (`Ġ` marks spaces)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def metaspace_tokenizer(vocab_size: int = 400):
    """A SentencePiece-style BPE (`▁` marks spaces, byte fallback)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                         decoders.ByteFallback(), decoders.Fuse()])
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


# draft id d of the reversed-vocabulary drafts is target id REVERSED[d] (characters reversed, specials kept)
REVERSED = torch.tensor(list(reversed(range(len(CHARACTERS)))) + [len(CHARACTERS), len(CHARACTERS) + 1])


def reversed_draft(noise: float = 0.0):
    """The Llama target with its vocabulary reversed (its tokenizer: `reversed_tokenizer`), its LM head perturbed by
    `noise`: the target itself in another vocabulary (noise 0: every draft token accepted)."""
    model = build_target("llama")
    with torch.no_grad():
        embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embeddings.copy_(embeddings[REVERSED])
        head.copy_(head[REVERSED] + noise * torch.randn(head.shape, generator=torch.Generator().manual_seed(5)))
    return model


def reversed_tokenizer(missing: tuple[int, ...] = ()):
    """The tiny character tokenizer with its characters reversed; the characters of the target ids `missing` are
    replaced by texts the target's vocabulary lacks (those target tokens are outside the intersection)."""
    characters = [f"§{c}" if len(CHARACTERS) - 1 - i in missing else c for i, c in enumerate(reversed(CHARACTERS))]
    return build_tokenizer(characters=characters)


# target ids the sampling tests' draft tokenizer lacks: 63 is the second most likely first token after the prompt
MISSING = (12, 32, 63, 72, 92)


@pytest.fixture(scope="module")
def bpe_pair():
    """A byte-level target tokenizer and a SentencePiece-style draft tokenizer, and random models of each."""
    target_tokenizer, draft_tokenizer = byte_level_tokenizer(), metaspace_tokenizer()
    target = build_model("llama", hidden_size=48, num_layers=2, seed=1, vocab_size=len(target_tokenizer))
    draft = build_model("gpt2", hidden_size=32, num_layers=1, seed=2, vocab_size=len(draft_tokenizer))
    return target, target_tokenizer, draft, draft_tokenizer


# ------------------------------------------------------------------------------------------------ greedy (SLEM)


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 6])
def test_greedy_with_another_vocabulary_is_plain_greedy(zoo, tokenizer, num_draft_tokens):
    """The target in a reversed vocabulary drafts through text: every token of its own greedy output accepted."""
    drafter = DraftModelDrafter(reversed_draft(), num_draft_tokens=num_draft_tokens,
                                draft_tokenizer=reversed_tokenizer())
    for name in ("random", "repetitive"):
        out = speculative_generate(zoo.target("llama"), prompt_ids(name), drafter, target_tokenizer=tokenizer,
                                   return_dict_in_generate=True)
        assert torch.equal(out.sequences, zoo.reference("llama", name))
        assert out.speculative_stats.acceptance_rate > 0.9


def test_greedy_batch_with_another_vocabulary(zoo, tokenizer):
    """Batch size 4: each row its own plain greedy output, a noisy reversed draft (rows accept differently)."""
    drafter = DraftModelDrafter(reversed_draft(noise=0.3), num_draft_tokens=4, draft_tokenizer=reversed_tokenizer())
    out = batched_generate(zoo.target("llama"), drafter, BATCH_PROMPTS, target_tokenizer=tokenizer)
    references = [zoo.target("llama").generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0].tolist()
                  for p in BATCH_PROMPTS]
    assert torch.equal(out.sequences, laid_out(BATCH_PROMPTS, references))
    assert 0 < out.speculative_stats.acceptance_rate < 1


PROMPT_TEXTS = ["The quick brown", "def add(a,  b):\n\n    return", "café 東京 🙂 the", "Hello"]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_with_byte_level_target_and_sentencepiece_draft(bpe_pair, batch_size):
    """Multi-character tokens, runs of spaces, blank lines and multi-byte characters: still plain greedy."""
    target, target_tokenizer, draft, draft_tokenizer = bpe_pair
    drafter = DraftModelDrafter(draft, num_draft_tokens=4, draft_tokenizer=draft_tokenizer)
    prompts = [target_tokenizer.encode(text) for text in PROMPT_TEXTS]
    pad = target_tokenizer.eos_token_id
    kwargs = dict(do_sample=False, max_new_tokens=24, pad_token_id=pad)
    if batch_size == 1:
        for ids in prompts:
            plain = target.generate(torch.tensor([ids]), **kwargs)
            out = speculative_generate(target, torch.tensor([ids]), drafter, target_tokenizer=target_tokenizer,
                                       **kwargs)
            assert torch.equal(out, plain)
        return
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    plain = target.generate(input_ids, attention_mask=mask, **kwargs)
    out = speculative_generate(target, input_ids, drafter, attention_mask=mask, target_tokenizer=target_tokenizer,
                               **kwargs)
    assert torch.equal(out, plain)


@pytest.mark.skipif(not (DEMO / "draft_sp").is_dir(), reason="the demo draft of another tokenizer is not built")
def test_demo_pair_greedy_at_batch_sizes_1_and_4():
    target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target", padding_side="left")
    draft = AutoModelForCausalLM.from_pretrained(DEMO / "draft_sp", dtype=torch.float32).eval()
    drafter = DraftModelDrafter(draft, num_draft_tokens=4,
                                draft_tokenizer=AutoTokenizer.from_pretrained(DEMO / "draft_sp"))
    texts = ["Question: Tom has 3 apples and buys 5 more. How many does he have?\nAnswer:",
             "def fibonacci(n):\n    ", "ROMEO:\nWhat light through yonder", "import os\nimport sys\n\n"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, max_new_tokens=32, pad_token_id=tokenizer.eos_token_id)
    plain = target.generate(**inputs, **kwargs)
    out = speculative_generate(target, inputs.input_ids, drafter, attention_mask=inputs.attention_mask,
                               target_tokenizer=tokenizer, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.mean_acceptance_length > 1.5
    for text in texts[:2]:
        one = tokenizer(text, return_tensors="pt")
        out = speculative_generate(target, one.input_ids, drafter, target_tokenizer=tokenizer, **kwargs)
        assert torch.equal(out, target.generate(**one, **kwargs))


def test_streamer_and_stop_strings(tokenizer):
    """A translated drafter streams every committed token once and stops at a stop string as plain generate does."""
    model = hs.enable(build_target("llama"))
    drafter = DraftModelDrafter(reversed_draft(noise=0.3), num_draft_tokens=3, draft_tokenizer=reversed_tokenizer())
    plain = model.generate(prompt_ids("random"), do_sample=False, max_new_tokens=24)
    stop = tokenizer.decode(plain[0, 14:16])  # two characters generated on the way
    streamed = []

    class Collect:
        def put(self, value):
            streamed.extend(value.flatten().tolist())

        def end(self):
            pass

    out = model.generate(prompt_ids("random"), candidate_generator=drafter, tokenizer=tokenizer, streamer=Collect(),
                         do_sample=False, max_new_tokens=24)
    assert torch.equal(out, plain) and streamed == plain[0].tolist()
    kwargs = dict(do_sample=False, max_new_tokens=24, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(model.generate(prompt_ids("random"), candidate_generator=drafter, **kwargs),
                       model.generate(prompt_ids("random"), **kwargs))


# ------------------------------------------------------------------------------------------------ sampling (TLI)


def _first_two_counts(model, drafter, tokenizer, warpers, config, num_runs: int):
    """Counts of the first two sampled tokens `(vocab, vocab)` over `num_runs` seeded speculative calls."""
    prompt = prompt_ids("random")
    stopping = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 2)])
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    for _ in range(num_runs):
        out = hs.generate(model, prompt, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator,
                          target_tokenizer=tokenizer)
        first, second = out[0, -2:].tolist()
        counts[first, second] += 1
    return counts


def _sampling_statistic(zoo, tokenizer, num_runs: int = 1000, noise: float = 0.0,
                        missing: tuple[int, ...] = MISSING) -> float:
    """Chi-square over the critical value of the first two tokens sampled with top-k, top-p and temperature,
    drafted by a reversed-vocabulary draft whose tokenizer lacks the characters `missing` (outside the intersection:
    never drafted, only recovered or bonus tokens)."""
    model = zoo.target("llama")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(4), TopPLogitsWarper(0.9)])
    config = GenerationConfig(do_sample=True, max_length=prompt_ids("random").shape[1] + 2, top_k=4, top_p=0.9,
                              temperature=0.8, num_beams=1, num_return_sequences=1, output_scores=False,
                              output_logits=False, return_dict_in_generate=False)
    drafter = DraftModelDrafter(reversed_draft(noise=noise), num_draft_tokens=2,
                                draft_tokenizer=reversed_tokenizer(missing))
    counts = _first_two_counts(model, drafter, tokenizer, warpers, config, num_runs)
    joint = two_token_joint(model, prompt_ids("random"), warpers)
    return chi_square(counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1)


def test_sampling_with_another_vocabulary_is_lossless(zoo, tokenizer):
    assert _sampling_statistic(zoo, tokenizer) < 1


def test_the_sampling_test_catches_unprocessed_draft_probabilities(zoo, tokenizer, monkeypatch):
    """Broken control (transformers#47932): the draft samples from its processed distribution but reports its raw
    one as draft_probs; the same statistic then fails by far."""
    pick = DraftModelDrafter._pick

    def raw_probs(self, state, prefixes, logits):
        tokens, _ = pick(self, state, prefixes, logits)
        return tokens, torch.softmax(logits.float(), dim=-1)

    monkeypatch.setattr(DraftModelDrafter, "_pick", raw_probs)
    assert _sampling_statistic(zoo, tokenizer) > 2


def test_draft_samples_only_the_intersection(tokenizer):
    """With draft characters unknown to the target, draft_probs put no mass outside the intersection."""
    draft_tokenizer = reversed_tokenizer(MISSING)
    vocabulary = VocabularyMap(tokenizer, draft_tokenizer, 96, 96)
    outside = torch.ones(96, dtype=torch.bool)
    outside[vocabulary.target_ids] = False
    assert outside.nonzero().flatten().tolist() == list(MISSING)
    widened = torch.softmax(vocabulary.widen(torch.randn(3, 96)), dim=-1)
    assert float(widened[:, outside].sum()) == 0.0
    assert torch.allclose(widened.sum(-1), torch.ones(3))


# ------------------------------------------------------------------------------------------------ the vocabulary map


def test_vocabulary_map_normalises_space_markers_and_is_injective(bpe_pair):
    _, target_tokenizer, _, draft_tokenizer = bpe_pair
    vocabulary = VocabularyMap(target_tokenizer, draft_tokenizer, len(target_tokenizer), len(draft_tokenizer))
    assert len(set(vocabulary.target_ids.tolist())) == len(vocabulary) == len(set(vocabulary.draft_ids.tolist()))
    pairs = dict(zip(vocabulary.draft_ids.tolist(), vocabulary.target_ids.tolist()))
    the = draft_tokenizer.convert_tokens_to_ids("▁the")
    assert target_tokenizer.convert_ids_to_tokens(pairs[the]) == "Ġthe"  # " the" on both sides
    assert bool((vocabulary.to_draft_ids[vocabulary.target_ids] == vocabulary.draft_ids).all())
    # a byte-level token holding one byte of "é" is not the SentencePiece "é" (a whole character)
    first_byte = target_tokenizer.convert_tokens_to_ids("Ã")
    assert first_byte not in pairs.values()


def test_translated_ids_are_bounds_checked(bpe_pair):
    """Ids at or over the target's logits width are never mapped to nor proposed."""
    _, target_tokenizer, _, draft_tokenizer = bpe_pair
    width = 200  # the target's tokenizer has 300 ids
    vocabulary = VocabularyMap(target_tokenizer, draft_tokenizer, width, len(draft_tokenizer))
    assert int(vocabulary.target_ids.max()) < width
    bridge = TokenizerBridge(target_tokenizer, draft_tokenizer, width, len(draft_tokenizer))
    text_ids = draft_tokenizer.encode(" the theory of there and then", add_special_tokens=False)
    committed = target_tokenizer.encode("def add(a, b):")
    candidates = bridge.to_target(committed, draft_tokenizer.encode("def add(a, b):"), text_ids)
    assert all(token < width for token in candidates)
    full = TokenizerBridge(target_tokenizer, draft_tokenizer, len(target_tokenizer), len(draft_tokenizer))
    assert full.to_target(committed, draft_tokenizer.encode("def add(a, b):"), text_ids)[: len(candidates)] == (
        candidates)


def test_string_level_matching_across_a_word_boundary(bpe_pair):
    """The draft's text continues a word the committed target tokens end inside: the proposal decodes to exactly
    the committed text plus the draft's text."""
    _, target_tokenizer, _, draft_tokenizer = bpe_pair
    bridge = TokenizerBridge(target_tokenizer, draft_tokenizer, len(target_tokenizer), len(draft_tokenizer))
    committed = target_tokenizer.encode("I read the") + target_tokenizer.encode("o")  # "theo" split off canonically
    context = bridge.to_draft(committed)
    continuation = draft_tokenizer.convert_tokens_to_ids(["r", "y", "▁", "o", "f"])  # inside a word: no "▁r"
    proposal = bridge.to_target(committed, context, continuation)
    assert proposal and target_tokenizer.decode(committed + proposal) == "I read theory of"


def test_a_draft_eos_becomes_the_target_eos(bpe_pair):
    _, target_tokenizer, _, draft_tokenizer = bpe_pair
    bridge = TokenizerBridge(target_tokenizer, draft_tokenizer, len(target_tokenizer), len(draft_tokenizer))
    committed = target_tokenizer.encode("The quick")
    draft_ids = draft_tokenizer.encode(" brown") + [draft_tokenizer.eos_token_id] + draft_tokenizer.encode(" fox")
    proposal = bridge.to_target(committed, bridge.to_draft(committed), draft_ids)
    assert target_tokenizer.decode(proposal) == " brown<|endoftext|>"
    assert proposal[-1] == target_tokenizer.eos_token_id


# ------------------------------------------------------------------------------------------------ detection, errors


def test_same_tokenizer_with_padded_vocabulary_stays_on_the_fast_path(zoo, tokenizer):
    """Vocabularies are compared, not sizes: equal tokenizers with a padded draft logits width need no bridge."""
    padded = build_model("llama", hidden_size=32, num_layers=1, seed=2, vocab_size=128)
    assert vocabulary_bridge(zoo.target("llama"), padded, tokenizer, build_tokenizer()) is None
    assert same_vocabulary(tokenizer, build_tokenizer()) and not same_vocabulary(tokenizer, reversed_tokenizer())
    bridge = vocabulary_bridge(zoo.target("llama"), reversed_draft(), tokenizer, reversed_tokenizer())
    assert isinstance(bridge, TokenizerBridge)  # the same size, another vocabulary


def _counting_forwards(*models):
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in models]
    return calls, handles


@pytest.mark.parametrize("missing", ["tokenizer", "draft_tokenizer"])
def test_a_missing_tokenizer_fails_before_any_forward(bpe_pair, missing):
    """Through custom_generate, transformers drops tokenizer= before our callable: the message names the argument
    that reaches it (target_tokenizer=), not the one the user passed in vain."""
    target, target_tokenizer, draft, draft_tokenizer = bpe_pair
    drafter = DraftModelDrafter(draft, num_draft_tokens=3,
                                draft_tokenizer=None if missing == "draft_tokenizer" else draft_tokenizer)
    calls, handles = _counting_forwards(target, draft)
    expected = r"pass target_tokenizer= to generate" if missing == "tokenizer" else r"pass DraftModelDrafter\(\.\.\., draft_"
    tokenizers = {"tokenizer": target_tokenizer} if missing == "tokenizer" else {"target_tokenizer": target_tokenizer}
    try:
        with pytest.raises(ValueError, match=expected):
            speculative_generate(target, torch.tensor([target_tokenizer.encode("The quick")]), drafter, **tokenizers)
    finally:
        for handle in handles:
            handle.remove()
    assert not calls


def test_after_enable_a_missing_tokenizer_names_tokenizer(bpe_pair):
    """After `enable(model)` its wrapper maps tokenizer=, so that is the argument the message names."""
    target, target_tokenizer, draft, draft_tokenizer = bpe_pair
    drafter = DraftModelDrafter(draft, num_draft_tokens=3, draft_tokenizer=draft_tokenizer)
    with pytest.raises(ValueError, match=r"pass tokenizer= to generate\.$"):
        hs.enable(copy.deepcopy(target)).generate(torch.tensor([target_tokenizer.encode("The quick")]),
                                                  candidate_generator=drafter, max_new_tokens=4, do_sample=False)


def test_sampling_leaves_the_draft_model_unchanged(zoo, tokenizer):
    """Unlike transformers' universal speculative decoding, nothing of the draft model is pruned or replaced."""
    draft = reversed_draft(noise=0.3)
    head, embeddings = draft.get_output_embeddings(), draft.get_input_embeddings()
    weights = head.weight.clone()
    drafter = DraftModelDrafter(draft, num_draft_tokens=2, draft_tokenizer=reversed_tokenizer(MISSING))
    speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, target_tokenizer=tokenizer,
                         do_sample=True, top_k=4, max_new_tokens=8)
    assert draft.get_output_embeddings() is head and draft.get_input_embeddings() is embeddings
    assert torch.equal(head.weight, weights)


def test_a_tree_drafter_refuses_another_tokenizer(zoo, tokenizer):
    drafter = hs.TreeDrafter(reversed_draft(), draft_tokenizer=reversed_tokenizer())
    with pytest.raises(ValueError, match=r"token trees are drafted in the target's vocabulary: use DraftModelDrafter"):
        speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, target_tokenizer=tokenizer)


@pytest.mark.parametrize("do_sample", [False, True])
def test_bench_runs_transformers_universal_assisted_generation_beside_ours(bpe_pair, do_sample):
    """`hf-universal-assisted` (transformers' assistant_model= with tokenizer= and assistant_tokenizer=) and our
    draft-model method with the draft's tokenizer both reproduce plain greedy output; when sampling, transformers
    (which prunes its assistant's LM head in place) runs a copy, so our drafter's draft model stays whole."""
    from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark

    target, target_tokenizer, draft, draft_tokenizer = bpe_pair
    head = draft.get_output_embeddings()
    methods = named_methods(["hf-universal-assisted", "draft-model"], num_draft_tokens=3)
    settings = BenchSettings(max_new_tokens=12, verbose=False, do_sample=do_sample)
    result = run_benchmark(target, target_tokenizer, ["The quick brown", "def add(a, b):"], methods, settings,
                           draft=draft, draft_tokenizer=draft_tokenizer)
    assert result.ok and {r["method"] for r in result.records} == {"plain", "hf-universal-assisted", "draft-model"}
    assert do_sample or all(r["identical_to_plain"] for r in result.records)
    ours = [r for r in result.records if r["method"] == "draft-model"]
    assert all(r["num_drafted_tokens"] > 0 for r in ours)
    assert draft.get_output_embeddings() is head and head.weight.shape[0] == len(draft_tokenizer)
