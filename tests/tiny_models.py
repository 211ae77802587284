"""Tiny, seeded fp32 models and a character-level tokenizer for the tests (no network)."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 96
ARCHS = ("llama", "qwen2", "gpt_neox", "gpt2")
SLIDING_WINDOW = 5
# A larger init than the transformers default (0.02) makes the next-token distributions peaky, so that greedy
# output is not a constant token and top-1/top-2 logit gaps are far above fp32 rounding.
INIT_RANGE = 0.25


def make_config(arch: str, hidden_size: int, num_layers: int, vocab_size: int = VOCAB_SIZE):
    """The config of a tiny causal LM of family `arch`, without BOS/EOS/PAD tokens (tests set EOS explicitly)."""
    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    common = dict(vocab_size=vocab_size, initializer_range=INIT_RANGE, tie_word_embeddings=False, **no_special)
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **common)
    if arch == "mistral":  # full attention (sliding_window=None, as Mistral 7B v0.2 and later)
        return MistralConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             sliding_window=None, **common)
    if arch == "qwen3":  # Qwen2 plus per-head q/k norms inside attention
        return Qwen3Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                           max_position_embeddings=256, **common)
    if arch == "qwen2_sliding":  # layer 1 attends to a 5-token window: its cache keeps only recent tokens
        return Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=4, max_position_embeddings=256, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=4, n_positions=256, **common)
    raise ValueError(f"unknown architecture {arch!r}")


def build_model(arch: str, hidden_size: int = 48, num_layers: int = 2, seed: int = 0,
                vocab_size: int = VOCAB_SIZE):
    """A seeded fp32 causal LM in eval mode whose generation config has no EOS, BOS or PAD token."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, hidden_size, num_layers, vocab_size),
                                             dtype=torch.float32)
    model.eval()
    generation_config = model.generation_config
    generation_config.bos_token_id = generation_config.eos_token_id = generation_config.pad_token_id = None
    return model


def build_target(arch: str):
    return build_model(arch, hidden_size=48, num_layers=2, seed=1)


def build_noisy_copy(arch: str, noise: float = 0.1, seed: int = 5):
    """A draft that often but not always agrees with `build_target(arch)`: its copy with a perturbed output layer.
    (A small random draft almost never agrees with the target, so it exercises rejections only.)"""
    model = build_target(arch)
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight += noise * torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    return model


def build_draft(arch: str, vocab_size: int = VOCAB_SIZE, num_layers: int = 1):
    """A smaller model of the same family and (by default) the same vocabulary as `build_target(arch)`."""
    return build_model(arch, hidden_size=32, num_layers=num_layers, seed=2, vocab_size=vocab_size)


# Character-level tokenizer: 94 printable ASCII characters (no space) + two special tokens = VOCAB_SIZE ids.
CHARACTERS = [chr(c) for c in range(33, 127)]
SPECIAL_TOKENS = ["<unk>", "<eos>"]


def build_tokenizer(characters: list[str] = CHARACTERS) -> PreTrainedTokenizerFast:
    """A character-level `PreTrainedTokenizerFast` whose ids cover exactly the tiny models' vocabulary."""
    vocab = {token: i for i, token in enumerate(list(characters) + SPECIAL_TOKENS)}
    assert len(vocab) == VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters concatenate, as StopStringCriteria expects of a vocabulary
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
