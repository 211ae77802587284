"""Prompts for instruct models: the tokenizer's chat template, applied with a generation prompt.

One code path for the command line (`--chat`, `--no-chat`, `--system`) and the Python benchmark and sweep
(`chat_template=`, `system_prompt=`).
"""

from transformers import BatchEncoding


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
