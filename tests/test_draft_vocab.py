"""A reduced draft vocabulary (FR-Spec) for layer skip: drafts only its tokens, output unchanged, clear errors."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hf_speculators as hs
from hf_speculators.loading import DEMO_TARGET
from hf_speculators.vocab import (
    DraftVocabHead, check_draft_vocab, frequent_tokens, load_token_ranking, rank_tokens, ranked_draft_vocab,
)
from speculative_helpers import plain_generate, prompt_ids, speculative_generate
from tiny_models import VOCAB_SIZE, build_model

MAX_NEW_TOKENS = 30


class RecordingLayerSkip(hs.LayerSkipDrafter):
    """Records every token it drafts."""

    drafted: list[int] = []

    def propose(self, state, input_ids, max_tokens, rows):
        drafts = super().propose(state, input_ids, max_tokens, rows)
        self.drafted += [token for draft in drafts for token in draft.token_ids.tolist()]
        return drafts


@pytest.fixture(scope="module")
def targets() -> dict:
    return {arch: build_model(arch, hidden_size=48, num_layers=4, seed=1) for arch in ("llama", "gpt2", "gpt_neox")}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_greedy_output_is_unchanged_and_drafts_stay_inside_the_draft_vocab(targets, arch):
    model, input_ids = targets[arch], prompt_ids("random")
    expected = plain_generate(model, input_ids, max_new_tokens=MAX_NEW_TOKENS)
    # half the vocabulary, so that the target's greedy tokens are sometimes outside it
    draft_vocab = torch.arange(0, VOCAB_SIZE, 2)
    drafter = RecordingLayerSkip(exit_layer=3, num_draft_tokens=3, draft_vocab=draft_vocab)
    drafter.drafted = []
    out = speculative_generate(model, input_ids, drafter, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                               plain_floor=False)  # every step drafts: some draft tokens must be accepted
    assert out.sequences.tolist() == expected.tolist()
    assert drafter.drafted and all(token % 2 == 0 for token in drafter.drafted)
    assert any(token % 2 for token in expected[0, input_ids.shape[1]:].tolist())  # the target left the vocabulary
    assert out.speculative_stats.num_accepted_tokens > 0


def test_the_head_scores_its_tokens_as_the_full_head_and_no_other():
    head = torch.nn.Linear(8, 20, bias=True)
    ids = torch.tensor([1, 4, 19])
    hidden = torch.randn(3, 8)
    logits = DraftVocabHead(head, ids)(hidden)
    assert logits.shape == (3, 20)
    torch.testing.assert_close(logits[:, ids], head(hidden)[:, ids])
    others = torch.ones(20, dtype=torch.bool)
    others[ids] = False
    assert (logits[:, others] == torch.finfo(logits.dtype).min).all()
    assert (torch.softmax(logits, dim=-1)[:, others] == 0).all()  # never drafted, also when sampling


@pytest.mark.parametrize(
    ("draft_vocab", "message"),
    [
        ([], "non-empty 1D sequence of token ids"),
        ([[1, 2]], "non-empty 1D sequence of token ids"),
        ([1.0, 2.0], "non-empty 1D sequence of token ids"),
        ([True, False], "non-empty 1D sequence of token ids"),
        ([3, -1], "distinct non-negative token ids"),
        ([3, 5, 3], "distinct non-negative token ids"),
    ],
)
def test_a_malformed_draft_vocab_raises_at_construction(draft_vocab, message):
    with pytest.raises(ValueError, match=message):
        hs.LayerSkipDrafter(exit_layer=1, draft_vocab=draft_vocab)


def test_a_draft_vocab_is_sorted():
    assert check_draft_vocab([7, 2, 5]).tolist() == [2, 5, 7]


def test_an_id_beyond_the_head_raises_before_generating(targets):
    drafter = hs.LayerSkipDrafter(exit_layer=1, draft_vocab=[0, VOCAB_SIZE])
    with pytest.raises(ValueError, match=f"token id {VOCAB_SIZE}, but the LM head scores {VOCAB_SIZE} tokens"):
        speculative_generate(targets["llama"], prompt_ids("random"), drafter, max_new_tokens=4)


def test_a_head_that_is_not_a_plain_linear_raises():
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear; leave draft_vocab unset"):
        DraftVocabHead(torch.nn.Embedding(10, 4), torch.tensor([1, 2]))


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4, "mat": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]")


def test_frequent_tokens_ranks_by_count_then_id_and_keeps_the_special_tokens():
    texts = ["the cat sat", "the mat", "the cat"]  # the: 3, cat: 2, sat: 1, mat: 1
    assert frequent_tokens(word_tokenizer(), texts, 2).tolist() == [0, 1, 2, 3]
    assert frequent_tokens(word_tokenizer(), texts, 3).tolist() == [0, 1, 2, 3, 4]  # sat (4) before mat (5)


@pytest.mark.parametrize(("texts", "num_tokens", "message"), [
    (["the cat"], 0, "num_tokens must be an integer >= 1"),
    ([""], 4, "The texts hold no token"),
])
def test_frequent_tokens_errors(texts, num_tokens, message):
    with pytest.raises(ValueError, match=message):
        frequent_tokens(word_tokenizer(), texts, num_tokens)


def test_rank_tokens_orders_every_token_seen_by_count_then_id():
    assert rank_tokens(word_tokenizer(), ["the cat sat", "the mat", "the cat"]) == [2, 3, 4, 5]


@pytest.mark.parametrize("content", [[7, 3, 5], {"source": "a corpus", "token_ids": [7, 3, 5]}])
def test_a_token_ranking_file_gives_its_first_ids_as_a_draft_vocab(tmp_path, content):
    (tmp_path / "ranking.json").write_text(json.dumps(content))
    assert load_token_ranking(str(tmp_path / "ranking.json")) == [7, 3, 5]
    assert ranked_draft_vocab(str(tmp_path / "ranking.json"), 2).tolist() == [3, 7]
    assert ranked_draft_vocab(str(tmp_path / "ranking.json")).tolist() == [3, 5, 7]


def test_the_demo_target_ships_its_token_ranking():
    ranking = load_token_ranking("hf_speculators/demo-target/token_ranking.json")
    assert ranking == load_token_ranking(f"{DEMO_TARGET}/token_ranking.json")
    assert len(ranking) == len(set(ranking)) > 1024 and max(ranking) < 4096


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "malformed JSON"),
    ('{"ids": [1]}', "a JSON list of token ids"),
    ('[1, "2"]', "a JSON list of token ids"),
])
def test_a_malformed_ranking_raises_naming_the_file(tmp_path, content, message):
    (tmp_path / "r.json").write_text(content)
    with pytest.raises(ValueError, match=f"r.json: .*{message}"):
        load_token_ranking(str(tmp_path / "r.json"))


def test_a_missing_ranking_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_token_ranking(str(tmp_path / "none.json"))


def test_a_speculative_config_builds_layer_skip_with_a_ranked_draft_vocab(targets, tmp_path):
    (tmp_path / "ranking.json").write_text(json.dumps(list(range(VOCAB_SIZE - 1, -1, -1))))
    config = hs.SpeculativeConfig(method="layer-skip", exit_layer=2, draft_vocab=str(tmp_path / "ranking.json"),
                                  draft_vocab_size=10)
    drafter, _ = config.build(targets["llama"])
    assert drafter.draft_vocab.tolist() == list(range(VOCAB_SIZE - 10, VOCAB_SIZE))
    model, input_ids = targets["llama"], prompt_ids("random")
    out = speculative_generate(model, input_ids, drafter, max_new_tokens=MAX_NEW_TOKENS)
    assert out.tolist() == plain_generate(model, input_ids, max_new_tokens=MAX_NEW_TOKENS).tolist()


def test_the_bench_runs_layer_skip_with_a_ranked_draft_vocab(zoo, tokenizer, tmp_path, capsys):
    """`hf-speculators bench --draft-vocab RANKING --draft-vocab-size N`: exact, and recorded by its size."""
    from hf_speculators.tools.cli import main

    model = zoo.target("llama")
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("abcabcabcab\nxyz.xyz.xy\n")
    (tmp_path / "ranking.json").write_text(json.dumps(rank_tokens(tokenizer, ["abcabc xyz", "abc."])))
    common = ["bench", "--prompts", str(tmp_path / "prompts.txt"), "--model", str(tmp_path / "target"),
              "--methods", "layer-skip", "--exit-layer", "1", "--max-new-tokens", "6",
              "--out", str(tmp_path / "b.jsonl")]
    assert main([*common, "--draft-vocab", str(tmp_path / "ranking.json"), "--draft-vocab-size", "4"]) == 0
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert {r["provenance"]["run"]["methods"]["layer-skip"]["draft_vocab_size"] for r in records} == {4}
    assert all(r["identical_to_plain"] for r in records)
    assert main([*common, "--draft-vocab-size", "4"]) == 2
    assert "--draft-vocab-size takes the first ids of a token ranking" in capsys.readouterr().err
