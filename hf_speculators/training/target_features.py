"""The frozen target's hidden states that a drafter learns from, computed on the fly or read from a disk cache."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def check_aux_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """`layer_ids` after checking that they name distinct decoder layers of a target with `num_layers` layers.

    Raises:
        `ValueError`: an id outside `0 .. num_layers - 1` or a repeated id (e.g. the default `[2, L // 2, L - 3]` of a
            target with fewer than 7 layers), saying which ids to pass instead.
    """
    bad = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(
            f"aux layer ids {layer_ids} do not name {len(layer_ids)} distinct decoder layers of this target, which "
            f"has layers 0..{num_layers - 1}: pass --aux-layers with distinct ids in that range (EAGLE-3's default "
            "[2, L // 2, L - 3] needs at least 7 layers)."
        )
    return list(layer_ids)


class TargetFeatures:
    """The target's features of a batch: the hidden states *entering* the decoder layers `aux_layer_ids`
    (`outputs.hidden_states[i]`, the residual stream vLLM and speculators capture) and its last hidden state (after
    the final norm), from which the target's logits follow through its LM head.

    Computed without gradients in one target forward per batch (on the fly, the default). Peak memory of that
    forward: the target's weights plus `(L + 1) x batch x length x H` activations kept by `output_hidden_states`
    (about 0.27 MB per token for an 8B Llama in bfloat16), freed after the batch.

    With `cache_dir`, each example's features are written once (`{index}.safetensors`, in `cache_dtype`) and read
    back in later epochs instead of running the target again: `length x (len(aux_layer_ids) + 1) x H x 2` bytes per
    example in 16 bits.

    Args:
        target (`PreTrainedModel`): the frozen target.
        aux_layer_ids (`list[int]`): layers whose inputs to return (empty: the last hidden state only).
        cache_dir (`str` or `Path`, *optional*): the on-disk cache.
        cache_dtype (`torch.dtype`, defaults to `torch.bfloat16`).
    """

    def __init__(self, target, aux_layer_ids: list[int], cache_dir: str | Path | None = None,
                 cache_dtype: torch.dtype = torch.bfloat16):
        self.target, self.aux_layer_ids, self.cache_dtype = target, list(aux_layer_ids), cache_dtype
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def compute(self, input_ids: torch.LongTensor, attention_mask: torch.LongTensor):
        """`(aux, last)`: `aux` `(batch, length, len(aux_layer_ids) * H)` (`None` without aux layers) and `last`
        `(batch, length, H)`, for `input_ids` and `attention_mask` `(batch, length)`."""
        output = self.target.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                         output_hidden_states=bool(self.aux_layer_ids))
        aux = torch.cat([output.hidden_states[i] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return aux, output.last_hidden_state

    def __call__(self, batch: dict):
        """The features of a batch made by `hf_speculators.training.loop.collate` (see `compute`)."""
        if self.cache_dir is None:
            return self.compute(batch["input_ids"], batch["attention_mask"])
        lengths = batch["attention_mask"].sum(-1).tolist()
        paths = [self.cache_dir / f"{int(index)}.safetensors" for index in batch["index"]]
        if not all(path.is_file() for path in paths):
            aux, last = self.compute(batch["input_ids"], batch["attention_mask"])
            for row, (path, length) in enumerate(zip(paths, lengths)):
                tensors = {"last": last[row, :length]} | ({} if aux is None else {"aux": aux[row, :length]})
                save_file({k: v.to(self.cache_dtype).contiguous().cpu() for k, v in tensors.items()}, str(path))
            return aux, last
        rows = [load_file(str(path)) for path in paths]
        width, device, dtype = batch["input_ids"].shape[1], batch["input_ids"].device, self.target.dtype

        def stacked(name):
            return torch.stack([torch.nn.functional.pad(row[name], (0, 0, 0, width - row[name].shape[0]))
                                for row in rows]).to(device=device, dtype=dtype)

        return (stacked("aux") if self.aux_layer_ids else None), stacked("last")


def next_token_weights(loss_mask: torch.LongTensor) -> torch.FloatTensor:
    """`(batch, length)` weights of the predictions made at each position: 1 where the NEXT token is a trained
    (generated) token, else 0 (`loss_mask` shifted left by one, the last position 0)."""
    return torch.nn.functional.pad(loss_mask[:, 1:], (0, 1)).float()
