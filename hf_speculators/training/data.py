"""Training data for draft heads and draft models: prompts from files or `datasets`, and the target's own answers.

A drafter is accepted when it agrees with the target on what the target generates, so the default is on-policy
data (Medusa's "self-distillation", speculators' response regeneration): the target regenerates the response to
each prompt with its chat template where it has one, and the loss covers the generated tokens only.

Sources (`load_texts`), read through `datasets`:

- a `.jsonl` / `.json` file: each record's `prompt`, `turns[0]` (Spec-Bench, MT-bench), `question` (GSM8K),
  `instruction`, the first user turn of `messages` / `conversations`, or `text` (a document);
- a `.txt` file: one document per blank-line separated paragraph;
- a folder: every `*.txt`, `*.md`, `*.rst` and `*.py` file under it is a document;
- anything else: a `datasets` id, `NAME` or `NAME:SPLIT` (default split `train`), with the fields above.

A document (plain text, no chat turn) becomes a prompt of `prompt_tokens` tokens cut at a random place; a prompt
field is used as it is. Regenerated data is a `datasets.Dataset` of `input_ids` and `loss_mask` rows; `save_examples`
writes it as JSONL (token ids kept, so that a rerun with `regenerate=False` trains on exactly the same tokens).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, load_dataset

from ..prompts import encode_prompt
from .evaluate import pad_id

PROMPT_FIELDS = ("prompt", "turns", "question", "instruction", "messages", "conversations")
DOCUMENT_SUFFIXES = ("*.txt", "*.md", "*.rst", "*.py")


@dataclass(frozen=True)
class Text:
    """One training text: `prompt` (a prompt to answer, `True`) or a document to cut a prompt from (`False`);
    `response` is a reference answer, used only without regeneration."""

    text: str
    prompt: bool
    response: str | None = None


def _user_turn(messages) -> str | None:
    for message in messages or []:
        if isinstance(message, dict) and message.get("role", message.get("from")) in ("user", "human"):
            return message.get("content", message.get("value"))
    return None


def _record_text(record: dict) -> Text | None:
    """The `Text` of a JSON or `datasets` record (see the module docstring), `None` when it has no usable field."""
    response = record.get("response", record.get("output", record.get("answer")))
    for field in PROMPT_FIELDS:
        value = record.get(field)
        if field == "turns" and isinstance(value, list) and value:
            value = value[0]
        elif field in ("messages", "conversations"):
            value = _user_turn(value)
        if isinstance(value, str) and value.strip():
            return Text(value, True, response if isinstance(response, str) else None)
    text = record.get("text")
    return Text(text, False) if isinstance(text, str) and text.strip() else None


def _read_source(source: str):
    """The records of one source as a `datasets.Dataset`."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = [str(file) for pattern in DOCUMENT_SUFFIXES for file in sorted(path.rglob(pattern))]
        if not files:
            raise ValueError(f"{source}: the folder holds no {', '.join(DOCUMENT_SUFFIXES)} file.")
        return load_dataset("text", data_files=files, sample_by="document", split="train")
    if path.is_file():
        if path.suffix.lower() in (".jsonl", ".json"):
            return load_dataset("json", data_files=str(path), split="train")
        return load_dataset("text", data_files=str(path), sample_by="paragraph", split="train")
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"Training data {source!r} does not exist: pass a JSONL or text file, a folder or a "
                                "datasets id.")
    name, _, split = source.partition(":")
    return load_dataset(name, split=split or "train")


def load_texts(sources: list[str] | str, max_texts: int | None = None, seed: int = 0) -> list[Text]:
    """The training texts of `sources` (see the module docstring), shuffled with `seed` and cut to `max_texts`.

    Raises:
        `FileNotFoundError`: a local path that does not exist.
        `ValueError`: no source, or sources that hold no usable text (an empty dataset), naming them.
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise ValueError("No training data: pass --data FILE_OR_DATASET (JSONL, text, a folder or a datasets id).")
    texts = []
    for source in sources:
        records = _read_source(source)
        found = [text for text in map(_record_text, records) if text is not None]
        if not found:
            raise ValueError(
                f"{source}: no training text found: the dataset is empty or its records have none of the fields "
                f"{', '.join(PROMPT_FIELDS + ('text',))}."
            )
        texts += found
    random.Random(seed).shuffle(texts)
    return texts[:max_texts]


def split_held_out(items: list, num_held_out: int) -> tuple[list, list]:
    """`(train, held_out)`: the last `num_held_out` items are held out (items are shuffled by `load_texts`).

    Raises:
        `ValueError`: fewer than `num_held_out + 1` items.
    """
    if len(items) <= num_held_out:
        raise ValueError(f"{len(items)} training texts cannot spare {num_held_out} for held-out evaluation: give "
                         "more data or fewer held-out prompts.")
    return items[: len(items) - num_held_out], items[len(items) - num_held_out:]


def prompt_ids(tokenizer, text: Text, chat: bool, prompt_tokens: int, rng: random.Random) -> list[int]:
    """The token ids of the prompt of `text`: a prompt through the chat template when `chat`, a document cut to
    `prompt_tokens` tokens at a random token offset (drawn from `rng`)."""
    if text.prompt:
        return encode_prompt(tokenizer, text.text, chat)["input_ids"][0].tolist()
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
    start = rng.randrange(max(1, len(ids) - prompt_tokens))
    return ids[start : start + prompt_tokens]


@torch.no_grad()
def regenerate(target, tokenizer, texts: list[Text], *, max_new_tokens: int = 128, prompt_tokens: int = 64,
               chat: bool = False, batch_size: int = 16, do_sample: bool = False, seed: int = 0,
               progress=None) -> Dataset:
    """On-policy examples: the target's own responses to `texts`, generated in left-padded batches.

    Args:
        target (`PreTrainedModel`): the target model.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        texts (`list[Text]`): from `load_texts`.
        max_new_tokens (`int`, defaults to 128): the longest response.
        prompt_tokens (`int`, defaults to 64): the prompt length cut from a document.
        chat (`bool`): wrap prompts in the chat template (`hf_speculators.prompts.use_chat_template` decides).
        batch_size (`int`, defaults to 16): prompts per `generate` call.
        do_sample (`bool`): sample with the target's generation config (greedy by default, as greedy serving runs).
        seed (`int`): seeds the prompt cuts and sampling.
        progress (`callable`, *optional*): called with the number of prompts done after each batch.

    Returns:
        `datasets.Dataset` with `input_ids` (prompt and response) and `loss_mask` (1 on response tokens) per row;
        rows whose response is empty are dropped.
    """
    rng, generator_seed, pad = random.Random(seed), seed, pad_id(tokenizer)
    rows = {"input_ids": [], "loss_mask": []}
    for start in range(0, len(texts), batch_size):
        prompts = [prompt_ids(tokenizer, text, chat, prompt_tokens, rng) for text in texts[start : start + batch_size]]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(generator_seed + start)
        output = target.generate(input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                                 max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad)
        for prompt, generated in zip(prompts, output[:, width:].tolist()):
            response = _until_eos(generated, target.generation_config.eos_token_id, pad)
            if response:
                rows["input_ids"].append(prompt + response)
                rows["loss_mask"].append([0] * len(prompt) + [1] * len(response))
        if progress is not None:
            progress(min(start + batch_size, len(texts)))
    return Dataset.from_dict(rows)


def _until_eos(ids: list[int], eos, pad_id: int) -> list[int]:
    """`ids` up to and including the first EOS token (the padding `generate` adds after it dropped)."""
    stops = set(eos if isinstance(eos, list) else [eos]) - {None} or {pad_id}
    for i, token in enumerate(ids):
        if token in stops:
            return ids[: i + 1]
    return ids


def reference_examples(tokenizer, texts: list[Text], chat: bool = False) -> Dataset:
    """Off-policy examples from the records' own responses (`regenerate=False` on prompt/response data): the loss
    covers the response tokens. Documents are trained on whole (loss on every token but the first).

    Raises:
        `ValueError`: no text with a response or document.
    """
    rows = {"input_ids": [], "loss_mask": []}
    for text in texts:
        if text.prompt and text.response:
            prompt = encode_prompt(tokenizer, text.text, chat)["input_ids"][0].tolist()
            response = tokenizer(text.response, add_special_tokens=False)["input_ids"]
        elif not text.prompt:
            ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
            prompt, response = ids[:1], ids[1:]
        else:
            continue
        if response:
            rows["input_ids"].append(prompt + response)
            rows["loss_mask"].append([0] * len(prompt) + [1] * len(response))
    if not rows["input_ids"]:
        raise ValueError("No example to train on without regeneration: the records have prompts but no response "
                         "(a 'response', 'output' or 'answer' field); regenerate them with the target instead.")
    return Dataset.from_dict(rows)


def save_examples(examples: Dataset, path: str | Path) -> Path:
    """Writes `examples` as JSONL (`input_ids`, `loss_mask` per line); `load_examples` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for row in examples:
            file.write(json.dumps({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}) + "\n")
    return path


def is_examples_file(source: str) -> bool:
    """Whether `source` is a JSONL file of token-id examples (`save_examples`'s format)."""
    path = Path(source).expanduser()
    if not (path.is_file() and path.suffix == ".jsonl"):
        return False
    with path.open(encoding="utf-8") as file:
        first = file.readline()
    try:
        return {"input_ids", "loss_mask"} <= set(json.loads(first))
    except (json.JSONDecodeError, TypeError):
        return False


def load_examples(path: str | Path, vocab_size: int) -> Dataset:
    """The examples `save_examples` wrote.

    Raises:
        `ValueError`: an empty file, rows whose mask does not fit their ids, or ids outside `vocab_size` (examples
            tokenized for another model).
    """
    examples = load_dataset("json", data_files=str(path), split="train")
    if len(examples) == 0:
        raise ValueError(f"{path}: no examples.")
    for row in examples:
        if len(row["input_ids"]) != len(row["loss_mask"]):
            raise ValueError(f"{path}: a row's loss_mask is not as long as its input_ids.")
        if max(row["input_ids"]) >= vocab_size or min(row["input_ids"]) < 0:
            raise ValueError(f"{path}: token ids outside the target's vocabulary of {vocab_size}: these examples "
                             "were tokenized for another model.")
    return examples


def token_counts(examples: Dataset, vocab_size: int) -> torch.LongTensor:
    """`(vocab_size,)` counts of each token id over the loss-masked (generated) tokens of `examples`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in examples:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts
