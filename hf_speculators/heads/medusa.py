"""Medusa heads (Cai et al. 2024): residual MLP heads on the target's last hidden state, head i drafting the token
i + 1 positions beyond the target's own next token."""

import torch
from torch import nn


class ResBlock(nn.Module):
    """`x + SiLU(linear(x))`, Medusa's residual block (`linear` of shape `(hidden_size, hidden_size)`, with bias).

    The linear layer starts at zero, so a new block is the identity (as in Medusa's `ResBlock`).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:
        return hidden_states + self.act(self.linear(hidden_states))


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads, each `num_layers` `ResBlock`s followed by its own LM head (Medusa v0.1) or by the
    target's LM head (Medusa's "version 2" checkpoints, which ship the blocks only).

    Read from the target's last hidden state (after its final norm) at position t, head i (0-based) predicts the
    token at t + i + 2: the target's own LM head predicts t + 1 (Cai et al. 2024, Section 2.1.1; Medusa's
    `train_legacy.py` pairs head i's logits at t with the label at t + 2 + i). The heads do not depend on each
    other or on the drafted tokens, so all of them run on one hidden state.

    Parameter names follow Medusa's `medusa_head` module list: `heads.{h}.{l}.linear.{weight,bias}` and, with own
    LM heads, `heads.{h}.{num_layers}.weight`; the checkpoint keys are these without `heads.`.

    Args:
        hidden_size (`int`): the target's hidden size.
        num_heads (`int`): the number of heads, >= 1.
        num_layers (`int`, defaults to 1): `ResBlock`s per head, >= 1.
        vocab_size (`int`, *optional*): the width of each head's own LM head; `None` (version 2): the heads end with
            the target's LM head, passed to `forward`.

    Raises:
        `ValueError`: for a size or count that is not an integer >= 1.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1, vocab_size: int | None = None):
        super().__init__()
        sizes = {"hidden_size": hidden_size, "num_heads": num_heads, "num_layers": num_layers}
        if vocab_size is not None:
            sizes["vocab_size"] = vocab_size
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaHeads {name} must be an integer >= 1, got {value!r}.")
        self.hidden_size, self.num_layers, self.vocab_size = hidden_size, num_layers, vocab_size
        self.heads = nn.ModuleList(self._head() for _ in range(num_heads))

    def _head(self) -> nn.Sequential:
        layers = [ResBlock(self.hidden_size) for _ in range(self.num_layers)]
        if self.vocab_size is not None:
            layers.append(nn.Linear(self.hidden_size, self.vocab_size, bias=False))
        return nn.Sequential(*layers)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def has_lm_heads(self) -> bool:
        """Whether each head has its own LM head (Medusa v0.1) rather than the target's (version 2)."""
        return self.vocab_size is not None

    def forward(self, hidden_states: torch.FloatTensor, lm_head: nn.Module | None = None,
                num_heads: int | None = None) -> torch.FloatTensor:
        """The draft logits of the first `num_heads` heads.

        Args:
            hidden_states (`torch.FloatTensor` of shape `(..., hidden_size)`): the target's last hidden states, after
                its final norm.
            lm_head (`nn.Module`, *optional*): the target's LM head (`get_output_embeddings()`); required by heads
                without their own, ignored by the others.
            num_heads (`int`, *optional*): run only the first heads (all by default).

        Returns:
            `torch.FloatTensor` of shape `(num_heads, ..., vocab_size)`: head i's logits for the token i + 2 positions
            after each hidden state's.

        Raises:
            `ValueError`: heads without LM heads called without `lm_head`.
        """
        if not self.has_lm_heads and lm_head is None:
            raise ValueError("These Medusa heads (version 2) end with the target's LM head: pass lm_head=.")
        outputs = torch.stack([head(hidden_states) for head in self.heads[:num_heads]])
        return outputs if self.has_lm_heads else lm_head(outputs)  # one pass of the shared LM head over all heads
