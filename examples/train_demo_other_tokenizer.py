"""Train the demo draft with a tokenizer of its own: hf_speculators/demo/draft_sp (a different-tokenizer draft for
the demo target, used by `DraftModelDrafter(draft, draft_tokenizer=...)`, string-level exact matching and
token-level intersection).

Stages:

1. ``tokenizer``: a SentencePiece-style BPE (Hugging Face ``tokenizers``: Metaspace pre-tokenizer with the ``▁``
   space marker, byte fallback) of ``--vocab-size`` tokens, trained on the demo family's corpus; the demo target's
   tokenizer is a byte-level BPE of 4096 tokens with the ``Ġ`` marker, so the two vocabularies differ in size,
   merges and space marker.
2. ``generate``: sequence-level distillation data (Kim and Rush 2016): the demo target's greedy continuations of
   random windows of the training documents, for ``--generate-minutes``.
3. ``draft``: a small Llama with next-token cross-entropy, in its own tokenizer, on the target's continuations
   (re-tokenized as text) mixed with the corpus. With ``--init-from`` (the demo draft, which shares the target's
   tokenizer) it starts from that model with its vocabulary transplanted: its layers kept, each new token's
   embedding (tied to the LM head) the mean of the old embeddings of the old tokens of its text (vocabulary
   transfer, as in Gee et al. 2022, "Fast Vocabulary Transfer"); a byte-fallback token takes its byte's embedding.

``--tokenizer`` reuses a trained tokenizer, ``--generations`` keeps the continuations in a JSON file (read, extended,
written back) and ``--continue-from`` continues training a draft of the new tokenizer, so that the stages can run
as separate passes. The shipped draft was made in three passes (its model card has the commands).
"""

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_speculators.loading import DEMO_TARGET
from hf_speculators.translation import token_texts

_spec = importlib.util.spec_from_file_location("family", Path(__file__).parent / "train_demo_family.py")
family = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(family)  # the demo family's corpus, splits and training loop

SPECIALS = ["<unk>", "<s>", "</s>"]
EOS = "</s>"
PROMPT_TOKENS = 48
NEW_TOKENS = 128
GENERATE_BATCH = 32
WARMUP = 40  # optimizer steps of linear warmup
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768, num_attention_heads=4)


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: `▁` marks spaces (prepended to the first word), unknown bytes fall back to
    `<0xNN>` tokens, so every text encodes and decodes back to itself."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                                      special_tokens=SPECIALS + byte_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token=EOS,
                                   pad_token=EOS)


@torch.no_grad()
def target_continuations(target, stream: np.ndarray, minutes: float, tokenizer, seed: int = 0,
                         count: int | None = None) -> list[str]:
    """The target's greedy continuations (`NEW_TOKENS` each) of random `PROMPT_TOKENS`-token windows of `stream`,
    prompt included, as text, for `minutes` or, given, until there are `count` (windows drawn with `seed + 2`)."""
    rng, texts, start = np.random.default_rng(seed + 2), [], time.time()
    while len(texts) < count if count is not None else time.time() - start < minutes * 60:
        starts = rng.integers(0, len(stream) - PROMPT_TOKENS, GENERATE_BATCH)
        prompts = torch.from_numpy(np.stack([stream[s : s + PROMPT_TOKENS] for s in starts]).astype(np.int64))
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out, skip_special_tokens=True)
        print(f"[generate] {len(texts)} continuations {time.time() - start:.0f}s", flush=True)
    return texts


@torch.no_grad()
def transplanted(source, source_tokenizer, tokenizer) -> LlamaForCausalLM:
    """`source` (a tied-embedding Llama of `source_tokenizer`) with its vocabulary replaced by `tokenizer`'s: every
    layer kept, each new token's embedding the mean of the source embeddings of its text's source tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    old = source.get_input_embeddings().weight
    rows = []
    for token_id, text in enumerate(token_texts(tokenizer, len(tokenizer))):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if text is None and piece.startswith("<0x") and piece.endswith(">"):  # a byte-fallback token
            ids = [source_tokenizer.convert_tokens_to_ids(byte_char[int(piece[3:-1], 16)])]
        elif text is None or token_id in tokenizer.all_special_ids:
            ids = [source_tokenizer.eos_token_id]
        else:
            ids = source_tokenizer.encode(text, add_special_tokens=False)
        rows.append(old[ids].mean(0))
    config = LlamaConfig(**{**source.config.to_dict(), "vocab_size": len(tokenizer),
                            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                            "pad_token_id": tokenizer.eos_token_id})
    model = LlamaForCausalLM(config)
    state = {k: v for k, v in source.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    model.load_state_dict(state, strict=False)
    model.get_input_embeddings().weight.copy_(torch.stack(rows))
    model.tie_weights()
    return model.float()


def token_stream(texts: list[str], tokenizer) -> np.ndarray:
    eos = tokenizer.eos_token_id
    return np.array([i for ids in tokenizer(texts)["input_ids"] for i in ids + [eos]], dtype=np.int32)


@torch.no_grad()
def held_out_loss(model, stream: np.ndarray, windows: int = 64) -> float:
    data, total = family.batches(stream, np.random.default_rng(1)), 0.0
    for _ in range(windows // family.BATCH):
        ids = next(data)
        total += F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
    return round(total / (windows // family.BATCH), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("hf_speculators/demo/draft_sp"))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--tokenizer", type=Path, help="reuse this tokenizer folder instead of training one")
    parser.add_argument("--init-from", type=Path, help="transplant this draft (the target's tokenizer) to start from")
    parser.add_argument("--continue-from", type=Path, help="continue training this draft (of the new tokenizer)")
    parser.add_argument("--generations", type=Path, help="a JSON file of the target's continuations: read if it "
                        "exists, and written with those generated for --generate-minutes added")
    parser.add_argument("--peak-lr", type=float, default=3e-3)
    parser.add_argument("--generate-minutes", type=float, default=8)
    parser.add_argument("--continuations", type=int, help="generate this many continuations instead (batches of "
                        f"{GENERATE_BATCH})")
    parser.add_argument("--draft-minutes", type=float, default=12)
    parser.add_argument("--draft-steps", type=int)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    docs = family.load_documents(args.data)
    tokenizer = (PreTrainedTokenizerFast.from_pretrained(args.tokenizer) if args.tokenizer
                 else train_tokenizer(docs, args.vocab_size))
    target = LlamaForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    target_tokenizer = PreTrainedTokenizerFast.from_pretrained(DEMO_TARGET)
    target_train, _ = family.encode_splits(docs, target_tokenizer)
    kept = json.loads(args.generations.read_text()) if args.generations and args.generations.is_file() else []
    generations = kept + target_continuations(target, target_train, args.generate_minutes, target_tokenizer,
                                              seed=len(kept), count=args.continuations)
    if args.generations:
        args.generations.write_text(json.dumps(generations))
    train_docs = [doc for i, doc in enumerate(docs) if i % family.HELD_OUT_EVERY]
    held_out_docs = [doc for i, doc in enumerate(docs) if i % family.HELD_OUT_EVERY == 0]
    distilled = token_stream(generations, tokenizer) if generations else np.zeros(0, dtype=np.int32)
    corpus = token_stream(train_docs, tokenizer)
    # as many corpus tokens as distilled ones, so the target's own continuations are half of every batch
    train_stream = np.concatenate([distilled, corpus[: max(len(distilled), family.SEQ_LEN * 1000)]])
    print(f"{len(generations)} continuations: {len(distilled)} distilled + corpus tokens", flush=True)

    if args.continue_from:
        draft = LlamaForCausalLM.from_pretrained(args.continue_from, dtype=torch.float32)
    elif args.init_from:
        draft = transplanted(LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32),
                             PreTrainedTokenizerFast.from_pretrained(args.init_from), tokenizer)
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id, **DRAFT_SHAPE)
        draft = LlamaForCausalLM(config)
    print(f"[draft] held-out loss before training {held_out_loss(draft, token_stream(held_out_docs, tokenizer))}")
    steps = family.train(draft, lambda ids: draft(ids, labels=ids).loss, train_stream, args.draft_minutes,
                         args.draft_steps, args.peak_lr, "draft", warmup=WARMUP)
    args.out.mkdir(parents=True, exist_ok=True)
    family.save(draft, args.out)
    tokenizer.save_pretrained(args.out)
    stats = {"held_out_loss": held_out_loss(draft, token_stream(held_out_docs, tokenizer)),
             "distilled_tokens": int(len(distilled)), "continuations": len(generations), "steps": steps,
             "parameters": sum(p.numel() for p in draft.parameters())}
    print(stats, flush=True)
    (args.out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
