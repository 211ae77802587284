"""Fitting the drafters that transformers ships to a frozen target on its own outputs: multi-token-prediction
layers (`MtpModel`), DFlash block drafters and Gemma 4 assistants. A short Adam run over a few sequences: enough to
make tiny test and benchmark drafters that are often accepted, not a training recipe for real models (see `trainers`
for those)."""

import torch


def _fit(module, parameters, batches: list[tuple], batch_loss, steps: int, lr: float):
    """Full-batch Adam on `parameters` of `module` for `steps` steps, each minimizing the sum of `batch_loss(*batch)`
    over `batches`; returns `module` in eval mode."""
    optimizer = torch.optim.Adam(parameters, lr=lr)
    module.train()
    for _ in range(steps):
        loss = sum(batch_loss(*batch) for batch in batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return module.eval()


def distill_mtp(mtp_model, target, sequences: list[torch.LongTensor], steps: int = 60, lr: float = 3e-3):
    """Trains the MTP layers (the target frozen) so that layer k at position t predicts token x_{t+2+k} of
    `sequences` from the target's last hidden states (DeepSeek-V3's MTP objective, cross-entropy summed over the
    layers), with full-batch Adam.

    Args:
        mtp_model (`MtpModel`): transformers' MTP layers tied to `target`; its shared embeddings and LM head stay
            as they are.
        target (`PreTrainedModel`): the target; its parameters are left frozen (`requires_grad=False`).
        sequences (`list[torch.LongTensor]`): token sequences `(1, length)`, best the target's own greedy outputs.
        steps (`int`, defaults to 60): optimizer steps. lr (`float`, defaults to 3e-3): Adam's learning rate.

    Returns:
        `mtp_model`, in eval mode.
    """
    target.requires_grad_(False)
    with torch.no_grad():
        features = [target(ids, output_hidden_states=True).hidden_states[-1] for ids in sequences]
    parameters = [p for name, p in mtp_model.named_parameters()
                  if not name.startswith(("embed_tokens", "shared_head"))]

    def sequence_loss(ids, hidden):
        loss, layer_hidden = 0.0, hidden[:, :-1]
        for k in range(len(mtp_model.layers)):
            length = ids.shape[1] - 2 - k
            if length < 1:
                break
            layer_hidden = layer_hidden[:, :length]
            positions = torch.arange(k + 1, k + 1 + length)[None]
            layer_hidden = mtp_model.forward_layer(k, layer_hidden, positions, None,
                                                   input_ids=ids[:, k + 1 : k + 1 + length])
            logits = mtp_model._project_to_logits(layer_hidden)
            loss = loss + torch.nn.functional.cross_entropy(logits[0], ids[0, k + 2 : k + 2 + length])
        return loss

    return _fit(mtp_model, parameters, list(zip(sequences, features)), sequence_loss, steps, lr)


def distill_dflash(model, target, sequences: list[torch.LongTensor], steps: int = 60, lr: float = 3e-3):
    """Trains a DFlash block drafter (the target frozen) so that the block anchored at every other position a of
    `sequences` (the token x_a, then `block_size - 1` mask tokens), with the context of the target's features of
    the tokens before a, predicts x_{a+1} .. x_{a+block_size-1} (cross-entropy), with full-batch Adam. The blocks
    of one sequence share one forward: each block sees the context before its anchor and itself.

    `model` (`MuseGlimmerAssistantModel`, its logits through `target`'s LM head) is returned in eval mode; the other
    arguments are `distill_mtp`'s.
    """
    target.requires_grad_(False)
    block, mask_id = model.config.block_size, model.config.mask_token_id
    embeddings, head = target.get_input_embeddings(), target.get_output_embeddings()
    batches = []
    with torch.no_grad():
        for ids in sequences:
            hidden_states = target(ids, output_hidden_states=True).hidden_states
            context = torch.cat([hidden_states[i + 1] for i in model.config.target_layer_ids], dim=-1)
            anchors = torch.arange(1, ids.shape[1] - block + 1, 2)
            noise = torch.full((len(anchors), block), mask_id)
            noise[:, 0] = ids[0, anchors]
            slots = anchors[:, None] + torch.arange(block)  # [anchors, block] each block token's position
            length = ids.shape[1]
            sees = torch.zeros(len(anchors), block, length + len(anchors) * block, dtype=torch.bool)
            sees[:, :, :length] = torch.arange(length) < anchors[:, None, None]
            for j in range(len(anchors)):
                sees[j, :, length + j * block : length + (j + 1) * block] = True
            mask = torch.zeros(sees.shape).masked_fill_(~sees, torch.finfo(torch.float32).min)
            mask = mask.view(1, 1, len(anchors) * block, -1)
            position_ids = torch.cat([torch.arange(length), slots.flatten()])[None]
            labels = ids[0, slots[:, 1:]]  # [anchors, block - 1]
            batches.append((embeddings(noise.view(1, -1)), context, mask, position_ids, labels))

    def block_loss(noise_embeds, context, mask, position_ids, labels):
        out = model(noise_embeds=noise_embeds, context_hidden_states=context, position_ids=position_ids,
                    attention_mask={"full_attention": mask, "sliding_attention": mask})
        logits = head(out.last_hidden_state.view(len(labels), block, -1)[:, 1:])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return _fit(model, model.parameters(), batches, block_loss, steps, lr)


def distill_gemma4_assistant(assistant, target, sequences: list[torch.LongTensor], steps: int = 60, lr: float = 3e-3):
    """Trains a Gemma 4 assistant (the target frozen) so that, at every position p of `sequences`, it predicts
    x_{p+1} from the pair (target embedding of x_p, target last hidden state h_{p-1}) with the target's keys and values
    of the tokens before p (cross-entropy), with full-batch Adam. The positions of one sequence are the rows of one
    forward, each seeing only its own tokens (a padding mask), as `Gemma4AssistantDrafter` drafts.

    `assistant` (`Gemma4AssistantForCausalLM`) is returned in eval mode; the other arguments are `distill_mtp`'s.
    """
    from ..drafters.gemma4_assistant import shared_layers

    target.requires_grad_(False)
    layers = shared_layers(target)
    batches = []
    with torch.no_grad():
        for ids in sequences:
            out = target(ids, output_hidden_states=True, return_shared_kv_states=True)
            positions = torch.arange(1, ids.shape[1] - 1)  # p: a token before it, and one after it to predict
            shared = {layer_type: tuple(t.expand(len(positions), -1, -1, -1) for t in out.shared_kv_states[layer_type])
                      for layer_type in layers}
            embeds = torch.cat([target.get_input_embeddings()(ids[0, positions]),
                                out.hidden_states[-1][0, positions - 1]], dim=-1)[:, None]
            mask = (torch.arange(ids.shape[1]) < positions[:, None]).long()
            batches.append((embeds, positions[:, None], mask, shared, ids[0, positions + 1]))

    def positions_loss(embeds, position_ids, mask, shared, labels):
        logits = assistant(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask,
                           shared_kv_states=shared, use_cache=False).logits[:, 0]
        return torch.nn.functional.cross_entropy(logits, labels)

    return _fit(assistant, assistant.parameters(), batches, positions_loss, steps, lr)
