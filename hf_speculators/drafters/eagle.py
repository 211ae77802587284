"""Drafting with an EAGLE head (EAGLE-3, EAGLE-1/2) from the target's own hidden states, as a chain or a tree."""

from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache

from ..cache import RaggedCache, truncate
from ..heads.eagle import check_head_fits
from ..heads.eagle_formats import load_eagle_head
from ..heads.files import head_folder
from ..tree import TokenTree
from ..types import Draft
from ..vocab import widen_logits
from .feature import FeatureDrafter
from .tree import DynamicTree, StaticTree, grow_tree, tree_shape


class EagleDrafter(FeatureDrafter):
    """Drafts with an EAGLE head on the target's hidden states (EAGLE-1/2, Li et al. 2024; EAGLE-3, Li et al. 2025).

    At a step whose committed length is n, the target's cache holds n - 1 tokens and its newest feature is f_{n-2}
    (recorded inside the target's own forwards, see `FeatureDrafter`). The head's own KV cache holds the pairs
    (f_t, x_{t+1}) at position t for committed t; each call rolls it back to the committed pairs and feeds the
    new ones, whose last output drafts x_n. A chain then feeds each draft token back with the head's output
    (pre-norm, or post-norm with `norm_output`), one head forward per token. A tree (`StaticTree` or
    `DynamicTree`, as `TreeDrafter` takes it) feeds each depth's frontier in one forward, each node attending to
    the committed pairs and its own ancestors.

    For a batch (`propose_batch`, chains only) the head keeps one cache row per sequence (`RaggedCache`): each row
    is rolled back to its own committed pairs, and one head forward per draft position serves every row.

    A reduced draft vocabulary maps back with `target_id = draft_id + d2t[draft_id]`; the draft's scores are
    laid out in the target's vocabulary with the lowest score elsewhere, then go through the call's logits
    processors and warpers, so the draft distribution is zero outside the draft vocabulary and rejection sampling
    stays lossless. Chains are sampled from that distribution under sampling (`draft_probs` set); trees take each
    node's most likely children (`draft_probs=None`, one-hot under rejection sampling, also lossless).

    Runs only inside `hf_speculators.generate` (it reads the target's hidden states), on the target types
    `DecoderLayers` takes (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX, GPT-2).

    Args:
        head (`Eagle3Head` or `EagleHead`): the draft head (see `hf_speculators.heads.eagle`); moved to the target's
            device and dtype when drafting starts.
        num_draft_tokens (`int`, defaults to 5): draft tokens per step of a chain (k); ignored with `tree`.
        tree (`StaticTree`, `DynamicTree`, a list of paths or a mapping, *optional*): draft a token tree of this
            shape (see `tree_shape`) instead of a chain; its depth is the number of draft tokens.

    Raises:
        `ValueError`: at construction for `num_draft_tokens < 1` or a malformed tree; at the start of generation,
            naming the field, for a head that does not fit the target (see `check_head_fits`), or a static tree
            asking for a child rank beyond the draft vocabulary.
        `RuntimeError`: from `get_candidates` (transformers' own loop does not pass hidden states).

    Example:

    ```python
    drafter = hs.EagleDrafter.from_pretrained("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", num_draft_tokens=3)
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "eagle"

    def __init__(self, head, num_draft_tokens: int = 5,
                 tree: "StaticTree | DynamicTree | Sequence | Mapping | None" = None):
        self.tree = None if tree is None else tree_shape(tree)
        super().__init__(num_draft_tokens if self.tree is None else self.tree.depth)
        self.head = head
        self._cache = self._target_head = self._embeddings = self._draft_to_target = self._vocab_size = None
        self._batch_cache: RaggedCache | None = None  # the head's cache of a batch, one row per running sequence

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, *, revision: str | None = None, token: str | None = None,
                        num_draft_tokens: int = 5, tree=None) -> "EagleDrafter":
        """An `EagleDrafter` with the head of a checkpoint in any format `detect_eagle_format` knows.

        Args:
            repo_id_or_path (`str`): a local folder or a Hub id (its JSON and weight files are downloaded).
            revision (`str`, *optional*): a Hub branch, tag or commit. token (`str`, *optional*): a Hub token.
            num_draft_tokens, tree: as for the constructor.

        Raises:
            `FileNotFoundError`: a local path that is not a folder, or a folder without weights.
            `ValueError`: files of no known EAGLE format, or a malformed checkpoint (naming the field or tensor).
        """
        return cls(load_eagle_head(head_folder(repo_id_or_path, revision, token)), num_draft_tokens, tree)

    def feature_points(self, target) -> tuple[list[int], bool]:
        return self.head.feature_points(target.config.get_text_config().num_hidden_layers)

    def prepare(self, target, generation_config, logits_processor, generator, tokenizer=None, cache=None) -> None:
        check_head_fits(self.head, target)
        if isinstance(self.tree, StaticTree) and max(self.tree.ranks) >= self.head.draft_vocab_size:
            raise ValueError(
                f"The tree asks for child rank {max(self.tree.ranks)} of a {self.head.draft_vocab_size}-token draft "
                "vocabulary."
            )
        super().prepare(target, generation_config, logits_processor, generator, tokenizer, cache)
        self.head.to(device=target.device, dtype=target.dtype).eval()
        own = self.head.embed_tokens
        self._embeddings = own if own is not None else target.get_input_embeddings()
        self._target_head = target.get_output_embeddings()
        self._vocab_size = self.head.vocab_size
        d2t = self.head.d2t
        self._draft_to_target = None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t
        self._cache = DynamicCache()
        self._batch_cache = None

    def _forward(self, token_ids, hidden_states, tree: TokenTree, num_prefix: int):
        """Runs the head over pairs (hidden state, token) after its cache: the last `token_ids.shape[1]` entries of
        `num_prefix` pairs followed by `tree`'s nodes. Returns the states to feed back `(1, q, H)` and the logits
        in the target's vocabulary `(q, vocab_size)`."""
        num_query = token_ids.shape[1]
        position_ids = tree.position_ids(num_prefix, num_query)
        one_query = tree.is_chain and num_query == 1
        mask = None if one_query else tree.attention_mask(num_prefix, num_query, self.head.fc.weight.dtype)
        feedback, logits = self.head(self._embeddings(token_ids), hidden_states, position_ids, self._cache, mask,
                                     self._target_head)
        return feedback, self._target_width(logits[0])

    def _target_width(self, logits: torch.FloatTensor) -> torch.FloatTensor:
        """Draft-vocabulary logits `(q, draft_vocab)` laid out in the target's vocabulary, lowest elsewhere."""
        if self._draft_to_target is None:
            return logits
        return widen_logits(logits, self._draft_to_target, self._vocab_size)

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> Draft:
        # 1. the features of the tokens committed since the last call: rows for positions position .. n - 2
        position, rows = self.committed_features(input_ids)
        if rows is None:  # a one-token prompt: no feature yet
            return Draft.empty(input_ids.device)
        # 2. roll the head's cache back to the committed pairs (f_t, x_{t+1}), t < position; feed the new ones
        truncate(self._cache, position)
        num_pairs = input_ids.shape[1] - 1
        hidden = self.head.combine(rows.to(self.head.fc.weight.dtype))[None]
        no_nodes = TokenTree.chain(0, input_ids.device)
        feedback, logits = self._forward(input_ids[:, position + 1 :], hidden, no_nodes, num_pairs)
        if self.tree is None:
            return self._chain(input_ids, feedback[:, -1:], logits[-1:], num_pairs, max_tokens)
        return self._tree(input_ids, feedback[:, -1:], logits[-1:], num_pairs, max_tokens)

    def _chain(self, input_ids, feedback, logits, num_pairs: int, max_tokens: int) -> Draft:
        """A chain of `max_tokens` draft tokens, each fed back with the head's output for the next one."""
        prefix, tokens, probs = input_ids, [], []
        for step in range(max_tokens):
            token, token_probs = self._draft_token(prefix, logits)
            tokens.append(token)
            probs.append(token_probs)
            if step + 1 == max_tokens:
                break
            prefix = torch.cat([prefix, token.view(1, 1)], dim=-1)
            no_nodes = TokenTree.chain(0, input_ids.device)
            feedback, logits = self._forward(token.view(1, 1), feedback, no_nodes, num_pairs + step + 1)
        return Draft.chain(torch.stack(tokens), torch.stack(probs) if self.do_sample else None)

    def _tree(self, input_ids, feedback, logits, num_pairs: int, max_tokens: int) -> Draft:
        """A token tree of `self.tree`'s shape; each node is fed with its parent's output state."""
        fed_back = {-1: feedback}  # node -> the head's output state after it, (1, 1, H)

        def forward(nodes, frontier: list[int], fed_tree: TokenTree) -> torch.FloatTensor:
            token_ids = torch.tensor([[nodes.token_ids[node] for node in frontier]], device=input_ids.device)
            hidden = torch.cat([fed_back[nodes.parent_ids[node]] for node in frontier], dim=1)
            outputs, frontier_logits = self._forward(token_ids, hidden, fed_tree, num_pairs)
            fed_back.update({node: outputs[:, i : i + 1] for i, node in enumerate(frontier)})
            return frontier_logits

        nodes = grow_tree(self.tree, input_ids, self.logits_processor, logits, max_tokens, forward)
        truncate(self._cache, num_pairs)  # the nodes' keys and values are dropped; the committed pairs stay
        return nodes.draft(self.tree.select(nodes), input_ids.device)

    @torch.no_grad()
    def propose_batch(self, input_ids: list[torch.LongTensor], max_tokens: list[int], rows: list[int]) -> list[Draft]:
        """As `propose` for each row (a chain), with one batched head forward per draft position (see the class)."""
        # 1. each row's features of its newly committed tokens; rows without any (a one-token prompt) draft nothing
        committed = self.committed_features_batch(input_ids, rows)
        num_new = torch.tensor([0 if features is None else len(features) for _, features in committed])
        budgets = [budget if count else 0 for budget, count in zip(max_tokens, num_new.tolist())]
        if max(budgets) == 0:
            return [Draft.empty(ids.device) for ids in input_ids]
        # 2. roll each row of the head's cache back to its committed pairs; feed the new pairs in one forward
        cache = self._head_cache(rows)
        cache.truncate(torch.tensor([position for position, _ in committed]))
        some = next(features for _, features in committed if features is not None and len(features))
        features = torch.nn.utils.rnn.pad_sequence(  # [batch, max new, width]
            [some[:0] if features is None else features for _, features in committed], batch_first=True)
        token_ids = torch.nn.utils.rnn.pad_sequence(
            [ids[0, position + 1 :] for ids, (position, _) in zip(input_ids, committed)], batch_first=True)
        new_valid = torch.arange(features.shape[1]) < num_new[:, None]
        feedback, logits = self._forward_batch(token_ids, self.head.combine(features.to(self.head.fc.weight.dtype)),
                                               new_valid)
        last = (num_new - 1).clamp_min(0).to(logits.device)
        batch = torch.arange(len(rows), device=logits.device)
        return self._chain_batch(input_ids, feedback[batch, last][:, None], logits[batch, last], budgets)

    def _head_cache(self, rows: list[int]) -> RaggedCache:
        """The head's cache of a batch, for the rows `rows` (rows that finished are dropped)."""
        if self._batch_cache is None:
            self._batch_cache = RaggedCache(DynamicCache(), torch.zeros(len(rows), 0, dtype=torch.bool), rows=rows)
        self._batch_cache.keep_rows(rows)
        return self._batch_cache

    def _forward_batch(self, token_ids, hidden_states, new_valid: torch.BoolTensor):
        """Runs the head over one pair per slot `(batch, q)` after the batch's cache, the slots `new_valid` marks
        holding a pair; returns the states to feed back `(batch, q, H)` and the logits `(batch, q, vocab_size)`."""
        device = token_ids.device
        _, position_ids = self._batch_cache.inputs(new_valid)
        mask = self._batch_cache.additive_mask(new_valid, self.head.fc.weight.dtype).to(device)
        feedback, logits = self.head(self._embeddings(token_ids), hidden_states, position_ids.to(device),
                                     self._batch_cache.cache, mask, self._target_head)
        self._batch_cache.append(new_valid)
        return feedback, self._target_width(logits)

    def _chain_batch(self, input_ids, feedback, logits, budgets: list[int]) -> list[Draft]:
        """Each row's chain of `budgets[i]` draft tokens from its first logits `(batch, vocab)` and states
        `(batch, 1, H)`; rows whose chain is complete ride along as holes."""
        prefixes, tokens, probs = list(input_ids), [[] for _ in budgets], [[] for _ in budgets]
        for step in range(max(budgets)):
            drafting = [i for i, budget in enumerate(budgets) if budget > step]
            step_tokens, step_probs = self._draft_tokens([prefixes[i] for i in drafting], logits[drafting])
            for j, i in enumerate(drafting):
                tokens[i].append(step_tokens[j])
                probs[i].append(None if step_probs is None else step_probs[j])
                prefixes[i] = torch.cat([prefixes[i], step_tokens[j].view(1, 1)], dim=-1)
            if step + 1 == max(budgets):
                break
            fed = torch.zeros(len(budgets), 1, dtype=torch.long, device=logits.device)
            fed[drafting, 0] = step_tokens
            feedback, logits = self._forward_batch(fed, feedback, torch.tensor(budgets)[:, None] > step + 1)
            logits = logits[:, 0]
        return [Draft.chain(torch.stack(row_tokens), torch.stack(row_probs) if self.do_sample else None)
                if row_tokens else Draft.empty(ids.device)
                for ids, row_tokens, row_probs in zip(input_ids, tokens, probs)]

    def __repr__(self) -> str:
        shape = f"num_draft_tokens={self.num_draft_tokens}" if self.tree is None else f"tree={self.tree!r}"
        return f"EagleDrafter({type(self.head).__name__}, {shape})"
