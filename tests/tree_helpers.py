"""Tiny seeded fp32 models and scripted drafters for the token-tree and relaxed-verification tests (no network)."""

import copy

import torch

# Before any model runs: on the 2-core shared test machines more threads make every forward much slower.
torch.set_num_threads(1)

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

import hf_speculators as hs  # noqa: E402

VOCAB_SIZE = 64
ARCHS = ("llama", "qwen2", "gpt_neox", "gpt2")
# A larger init than the default (0.02) makes next-token distributions peaky: greedy output is not one repeated
# token and top-1/top-2 logit gaps stay far above fp32 rounding.
INIT_RANGE = 0.25


def _config(arch: str, hidden_size: int, num_layers: int):
    common = dict(vocab_size=VOCAB_SIZE, initializer_range=INIT_RANGE, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    sizes = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                 num_attention_heads=4, max_position_embeddings=256)
    if arch == "llama":
        return LlamaConfig(num_key_value_heads=2, **sizes, **common)
    if arch == "qwen2":
        return Qwen2Config(num_key_value_heads=2, **sizes, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(**sizes, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=4, n_positions=256, **common)
    if arch == "mistral_sliding":  # sliding-window attention: trees are refused on it
        return MistralConfig(num_key_value_heads=2, sliding_window=16, **sizes, **common)
    raise ValueError(f"unknown architecture {arch!r}")


def tiny_model(arch: str, hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """A seeded fp32 causal LM in eval mode whose generation config has no BOS, EOS or PAD token."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, hidden_size, num_layers), dtype=torch.float32).eval()
    config = model.generation_config
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    return model


def noisy_copy(model, scale: float = 0.5, seed: int = 1):
    """A copy of `model` with every weight perturbed: a draft whose top tokens often, not always, match."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in noisy.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(scale * parameter.std() * noise)
    return noisy


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ids 0, 1, 2 are [UNK], <s>, </s>, then `words`."""
    vocab = {token: i for i, token in enumerate(["[UNK]", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def prompt(length: int = 10, seed: int = 0) -> torch.LongTensor:
    """Random prompt ids `(1, length)`."""
    return torch.randint(0, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def plain_greedy(model, input_ids: torch.LongTensor, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    return model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


def speculative(model, input_ids: torch.LongTensor, drafter, max_new_tokens: int, **kwargs):
    """`hf_speculators.generate` through `model.generate`, returning the dict output with `speculative_stats`."""
    kwargs = {"do_sample": False, **kwargs}
    return model.generate(input_ids, custom_generate=hs.generate, candidate_generator=drafter,
                          max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kwargs)


class WrongFirstTreeDrafter(hs.Drafter):
    """Knows the reference output; at every depth drafts a wrong child first and the right one second.

    The accepted path is then nodes 1, 3, 5, ... (never a prefix), so each step gathers KV rows in the target
    cache; with `share_tokens=True` every depth also has a second wrong sibling with the first one's token.
    """

    def __init__(self, reference: torch.LongTensor, depth: int = 3, share_tokens: bool = False):
        super().__init__(num_draft_tokens=depth)
        self.reference, self.share_tokens = reference[0], share_tokens

    def propose(self, input_ids, max_tokens):
        right = self.reference[input_ids.shape[1] : input_ids.shape[1] + max_tokens].tolist()
        token_ids, parent_ids, parent = [], [], -1
        for token in right:
            wrong = [(token + 1) % VOCAB_SIZE] * (2 if self.share_tokens else 1)
            for sibling in wrong + [token]:
                token_ids.append(sibling)
                parent_ids.append(parent)
            parent = len(token_ids) - 1
        return hs.Draft.from_lists(token_ids, parent_ids, input_ids.device)
