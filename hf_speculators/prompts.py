"""Prompts: reading prompt files (Spec-Bench, MT-bench, HumanEval, GSM8K, plain text) and encoding a prompt,
through the tokenizer's chat template for instruct models.

One code path for the command line (`--prompts`, `--limit`, `--chat`, `--no-chat`, `--system`), the benchmark,
the sweep and training (`load_prompts`, `chat_template=`, `system_prompt=`).
"""

import gzip
import hashlib
import json
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import torch
from transformers import BatchEncoding

# prompt sets shipped in the package, by the name `--prompts` and `load_prompts` take (licenses: prompt_sets/README.md)
PROMPT_SETS = {"spec-bench": Path(__file__).parent / "prompt_sets" / "spec_bench_question.jsonl.gz"}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        text (`str`): the prompt text (for multi-turn records, the first user turn).
        category (`str`, defaults to `"all"`): the category the summary groups it under.
        question_id (`int` or `str`, *optional*): the id from the prompts file (`question_id` or `task_id`).
    """

    text: str
    category: str = "all"
    question_id: int | str | None = None


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Reads benchmark prompts from a named set (`PROMPT_SETS`: `"spec-bench"`, Spec-Bench's 480 prompts), a JSONL
    file (`.jsonl`) or a plain-text file (any other suffix); a file whose name ends in `.gz` is read gzip-compressed.

    JSONL records give the prompt as `turns[0]` (Spec-Bench, MT-bench), `prompt` (HumanEval) or `question`
    (GSM8K), the category as `category` (default `"all"`) and the id as `question_id` or `task_id`. A plain-text
    file holds one prompt per non-blank line. Blank lines are skipped in both.

    Args:
        path (`str` or `Path`): the name of a shipped set (`"spec-bench"`) or a prompts file.
        limit (`int`, *optional*): keep `limit` prompts, taken round-robin over the categories in the order they
            first appear (each category's prompts in file order), so that a limit covers every category.

    Returns:
        `list[Prompt]`, at least one.

    Raises:
        `FileNotFoundError`: if `path` does not exist.
        `ValueError`: for `limit < 1`, an empty file, a line that is not JSON, or a JSONL record with none of the
            fields above.
    """
    path = prompts_path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompts file {path} not found: pass a JSONL file (e.g. Spec-Bench question.jsonl), a text file or a "
            f"named set ({', '.join(PROMPT_SETS)})."
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    lines = [(n, line) for n, line in enumerate(_read_text(path).splitlines(), 1) if line.strip()]
    read = _prompt_from_json_line if _stem_suffix(path) == ".jsonl" else _prompt_from_text_line
    prompts = [read(line, f"{path}:{n}") for n, line in lines]
    if not prompts:
        raise ValueError(f"Prompts file {path} has no prompts: write one JSON record or one prompt per line.")
    return _round_robin(prompts, limit)


def prompts_path(name_or_path: str | Path) -> Path:
    """The file `name_or_path` names: a shipped set's (`PROMPT_SETS`), else the path itself (a file of a set's name
    is passed as `./NAME`)."""
    return PROMPT_SETS.get(str(name_or_path), Path(name_or_path))


def _stem_suffix(path: Path) -> str:
    """The suffix, lower case, under a `.gz` one: `.jsonl` for `q.jsonl` and `q.jsonl.gz`."""
    name = path.name.lower()
    return Path(name.removesuffix(".gz")).suffix


def _read_text(path: Path) -> str:
    """The file's UTF-8 text, decompressed if its name ends in `.gz`."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.name.lower().endswith(".gz") else data).decode("utf-8")


def _round_robin(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts of the categories interleaved (all of them, in file order, if `limit` is None)."""
    if limit is None:
        return prompts
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    interleaved = [p for group in zip_longest(*by_category.values()) for p in group if p is not None]
    return interleaved[:limit]


def _prompt_from_json_line(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error}); a .jsonl file needs one JSON object per line.") from None
    text = _prompt_text(record) if isinstance(record, dict) else None
    if text is None:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: unknown JSONL format (found {found}); a record needs a non-empty 'turns' list (Spec-Bench, "
            "MT-bench), a 'prompt' string (HumanEval) or a 'question' string (GSM8K)."
        )
    question_id = record.get("question_id", record.get("task_id"))
    return Prompt(text, str(record.get("category", "all")), question_id)


def _prompt_text(record: dict) -> str | None:
    """`turns[0]` (Spec-Bench, MT-bench), else `prompt` (HumanEval), else `question` (GSM8K); `None` if none."""
    turns = record.get("turns")
    text = turns[0] if isinstance(turns, list) and turns else record.get("prompt", record.get("question"))
    return text if isinstance(text, str) and text else None


def _prompt_from_text_line(line: str, where: str) -> Prompt:
    if line.lstrip().startswith("{") and line.rstrip().endswith("}"):
        raise ValueError(f"{where}: this line looks like JSON; name the file *.jsonl to read it as JSONL records.")
    return Prompt(line)




def use_chat_template(tokenizer, chat: bool | None, system_prompt: str | None = None) -> bool:
    """Whether prompts go through the chat template.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the target's tokenizer.
        chat (`bool`, *optional*): `True` (`--chat`), `False` (`--no-chat`) or `None`: when the tokenizer has one.
        system_prompt (`str`, *optional*): a system turn (`--system`), which needs the chat template.

    Raises:
        `ValueError`: `chat=True` or a system prompt with a tokenizer that has no chat template, or a system prompt
            with `chat=False`.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = has_template if chat is None else chat
    if (chat or system_prompt is not None) and not has_template:
        asked = "chat_template=True (--chat)" if chat else "a system prompt (--system)"
        raise ValueError(
            f"{asked} needs a chat template, and the tokenizer has no chat template (a base model's tokenizer): "
            "drop --chat and --system (chat_template=False, system_prompt=None) to pass the prompt as it is."
        )
    if system_prompt is not None and not chat:
        raise ValueError("A system prompt (--system) goes into the chat template: drop --no-chat "
                         "(chat_template=False) or the system prompt.")
    return chat


def encode_prompt(tokenizer, text: str, chat: bool, system_prompt: str | None = None) -> BatchEncoding:
    """Tokenizes one prompt; with `chat`, as the user turn of the tokenizer's chat template (after a system turn
    if `system_prompt` is given) followed by the generation prompt (`add_generation_prompt=True`). The template
    writes its own special tokens, so none are added on top of it.

    Returns:
        `BatchEncoding` with `input_ids` and `attention_mask`, `torch.LongTensor`s of shape `(1, prompt_tokens)`.
    """
    if chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=not chat, return_tensors="pt")


def encode_truncated(tokenizer, text: str, chat_template: bool, max_prompt_tokens: int, device,
                     system_prompt: str | None = None) -> tuple[torch.LongTensor, bool]:
    """Tokenizes `text` (through the chat template if asked, `encode_prompt`) and keeps its last `max_prompt_tokens`
    tokens.

    Returns:
        `tuple[torch.LongTensor, bool]`: the ids `(1, prompt_tokens)` on `device`, and whether the prompt was cut.

    Raises:
        `ValueError`: a prompt of no tokens.
    """
    input_ids = encode_prompt(tokenizer, text, chat_template, system_prompt).input_ids
    if input_ids.shape[1] == 0:
        raise ValueError(f"Prompt {text!r} tokenizes to no tokens; remove it from the prompts file.")
    return input_ids[:, -max_prompt_tokens:].to(device), input_ids.shape[1] > max_prompt_tokens


def prompt_budget(models, max_prompt_tokens: int, max_new_tokens: int) -> int:
    """The longest prompt (tokens), at most `max_prompt_tokens`, that leaves room for `max_new_tokens` within the
    position limit (`max_position_embeddings`) of every model of `models` (`None` entries skipped).

    Raises:
        `ValueError`: `max_new_tokens` leaves no room for a prompt.
    """
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models if m is not None]
    budget = min([max_prompt_tokens] + [limit - max_new_tokens for limit in limits if limit])
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the models' position limit "
            f"({min(limit for limit in limits if limit)} tokens): lower max_new_tokens."
        )
    return budget


def prompts_fingerprint(prompts: list[Prompt]) -> str:
    """A fingerprint of the prompts (texts, categories, ids), so that a resumed run checks it has the same."""
    text = json.dumps([[p.text, p.category, p.question_id] for p in prompts])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
