"""Activation terms of a training micro-batch: the layers' activations, the shared-prompt forward's keys and values,
the LM head's logits chunk and backward, and how large a micro-batch gets."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.plan.architecture import ModelShape

LOGITS_CHUNK_TOKENS = 1024  # ActorVL's default chunk_tokens
LOGITS_CHUNK_ELEMENTS = 1 << 24  # vlrft.models.logprobs: logits per chunk, so large vocabularies get fewer tokens
LOGITS_CHUNK_BYTES = 12  # per logit of the chunk being computed (`logits_bytes`)
LOGITS_KEPT_BYTES = 12  # per logit autograd keeps below the element budget: float32 logits, log-probs, probs


def _layer_activation_bytes(hidden: int, q_dim: int, kv_dim: int, intermediate: int, compute_bytes: int) -> int:
    """Bytes kept per token by one transformer block for backward (fp32 residual stream, `compute_bytes` matmuls).

    Two RMS/LayerNorms in float32 (input, float copy, normalised) plus their low-precision output;
    q/k/v before and after rotary embedding, the attention output; a gated MLP's four intermediates.
    """
    norms = 2 * (12 * hidden + compute_bytes * hidden)
    attention = compute_bytes * (2 * (q_dim + 2 * kv_dim) + 2 * q_dim)
    mlp = 4 * compute_bytes * intermediate
    return norms + attention + mlp


def _tower_activations(tokens: int, layers: int, per_token_layer: int, hidden: int, checkpointing: bool) -> int:
    """A stack of blocks: all activations kept, or (checkpointing) every block's input plus one block replayed."""
    if checkpointing:
        return tokens * (4 * hidden * layers + 2 * per_token_layer)
    return tokens * layers * per_token_layer


def per_token_layer_bytes(shape: ModelShape, compute_bytes: int) -> tuple[int, int]:
    """(a text layer's, a vision block's) activation bytes per token (`_layer_activation_bytes`)."""
    t, v = shape.text, shape.vision
    return (_layer_activation_bytes(t.hidden_size, t.num_heads * t.head_dim, t.kv_dim, t.intermediate_size,
                                    compute_bytes),
            _layer_activation_bytes(v.hidden_size, v.hidden_size, v.hidden_size, v.intermediate_size, compute_bytes))


def activation_bytes(shape: ModelShape, tokens: int, patches: int, checkpointing: bool, compute_bytes: int) -> int:
    """Activations of one micro-batch's forward + backward through the language model (`tokens` positions) and the
    vision tower (`patches` patches)."""
    t, v = shape.text, shape.vision
    text_layer, vision_layer = per_token_layer_bytes(shape, compute_bytes)
    text = _tower_activations(tokens, t.num_layers, text_layer, t.hidden_size, checkpointing)
    text += tokens * t.hidden_size * (12 + 4)  # final norm and the completion states fed to the LM head
    vision = _tower_activations(patches, v.depth, vision_layer, v.hidden_size, checkpointing)
    return text + vision


def completion_pass_bytes(shape: ModelShape, rows: int, prompt_len: int, completion_tokens: int,
                          completion_len: int, checkpointing: bool, compute_bytes: int) -> int:
    """What the shared-prompt forward's completion pass adds per layer call: the rows' copies of their prompt's keys
    (float32 under autocast) and values; transformers' SDPA path repeating a GQA model's keys and values to every
    query head (it does under an attention mask, which this pass always has); and the [rows, C, P + C] mask, bool
    once and in the compute dtype per layer call. One layer's under gradient checkpointing, every layer's kept for
    the backward without it (measured: `tests/test_plan.py`)."""
    t = shape.text
    repeated = t.num_heads * t.head_dim if t.num_heads > t.num_kv_heads else 0
    layers = 1 if checkpointing else t.num_layers
    copies = rows * prompt_len * (t.kv_dim + repeated) * (4 + compute_bytes) * layers
    mask = completion_tokens * (prompt_len + completion_len) * (1 + compute_bytes * layers)
    return copies + mask


def completion_replay_bytes(shape: ModelShape, rows: int, prompt_len: int, completion_tokens: int,
                            completion_len: int, key_bytes: int, compute_bytes: int) -> int:
    """`completion_pass_bytes` of one layer as a completion layer's replay (gradient checkpointing) holds it: each
    row's key/value copies span its prompt and its completion (`PrefixLayer` returns cat(prompt_kv[rows], new_kv)),
    and, keys wider than the compute dtype (float32 under autocast), SDPA gets a low-precision copy of the keys it
    attends over (repeated to every query head where they are). Measured where this replay is the peak (the backward
    in stages): bench/bench_plan_terms.py."""
    t = shape.text
    repeated = t.num_heads * t.head_dim if t.num_heads > t.num_kv_heads else 0
    completions = rows * completion_len * (t.kv_dim + repeated) * (4 + compute_bytes)
    cast = rows * (prompt_len + completion_len) * (repeated or t.kv_dim) * compute_bytes if key_bytes > compute_bytes \
        else 0
    return (completion_pass_bytes(shape, rows, prompt_len, completion_tokens, completion_len, True, compute_bytes)
            + completions + cast)


def prompt_kv_bytes(shape: ModelShape, prompt_tokens: int, key_bytes: int, value_bytes: int,
                    keys_kept: bool = True) -> int:
    """The shared-prompt forward's record of every layer's prompt keys and values, and every layer's gradients of them.

    autograd runs the nodes that are ready in the reverse of the order the forward made them, so the whole completion
    pass's backward runs before the prompt pass's: each layer's gradients of its records, handed back by the
    completion pass, wait for the prompt pass's layer to add its own. At the top prompt layer's backward all layers'
    records and gradients are alive, with that layer's own gradients (measured: 0.95-1.06x, 4 and 8 layers,
    bench/bench_plan_terms.py). Keys follow the residual stream's dtype (float32 under autocast over float32 weights),
    values the compute dtype. Not `keys_kept` (no checkpointing, keys wider than the compute dtype): once the forward
    is done nothing holds the float32 key records (the attention keeps its low-precision copies, `activations`).
    """
    layers = shape.text.num_layers
    records = layers * _kv_layer_bytes(shape, prompt_tokens, key_bytes if keys_kept else 0, value_bytes)
    return records + (layers + 1) * _kv_layer_bytes(shape, prompt_tokens, key_bytes, value_bytes)


def _kv_layer_bytes(shape: ModelShape, prompt_tokens: int, key_bytes: int, value_bytes: int) -> int:
    return prompt_tokens * shape.text.kv_dim * (key_bytes + value_bytes)


def head_backward_bytes(shape: ModelShape, trained: bool, float32_weights: bool, completion_tokens: int) -> int:
    """What the LM head's backward (`vlrft.models.logprobs`) allocates beside the model's own gradients: for bf16
    products over float32 weights the head cast once, and when the logits exceed one chunk (the chunked backward) and
    the head trains, its float32 gradient accumulated over the chunks (below, autograd adds into .grad directly)."""
    chunked = completion_tokens * shape.text.vocab_size > LOGITS_CHUNK_ELEMENTS
    return shape.text.vocab_size * shape.text.hidden_size * ((4 if trained and chunked else 0)
                                                              + (2 if float32_weights else 0))


def chunk_tokens(shape: ModelShape) -> int:
    """Tokens per LM-head chunk, as vlrft.models.logprobs.chunk_tokens_for picks them."""
    return max(1, min(LOGITS_CHUNK_TOKENS, LOGITS_CHUNK_ELEMENTS // max(shape.text.vocab_size, 1)))


def logits_bytes(shape: ModelShape, completion_tokens: int) -> int:
    """The [tokens, vocabulary] tensors of the logprob computation (`vlrft.models.logprobs.token_logprobs`) alive at
    once. Above one chunk's element budget the chunked head keeps nothing per chunk: one chunk's float32 logits and
    logsumexp's two temporaries (forward), or its recomputed logits, probabilities and their bf16 copies (backward),
    12 B a logit. Below it autograd keeps every chunk's float32 logits, log-probabilities and probabilities (12 B a
    logit) and the chunk being formed or differentiated adds its 12 B."""
    vocab = shape.text.vocab_size
    chunk = min(chunk_tokens(shape), completion_tokens) * vocab * LOGITS_CHUNK_BYTES
    if completion_tokens * vocab > LOGITS_CHUNK_ELEMENTS:
        return chunk
    return completion_tokens * vocab * LOGITS_KEPT_BYTES + chunk


def weight_cast_bytes(shape: ModelShape, frozen_tower: bool) -> int:
    """Autocast's bf16 copies of the float32 weights, kept for the backward without checkpointing: not the
    embeddings (a lookup) nor the LM head (the chunked head keeps its float32 weight), nor a frozen tower's."""
    head_and_embeddings = shape.text.vocab_size * shape.text.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return 2 * (shape.num_parameters - head_and_embeddings - (shape.tower_count() if frozen_tower else 0))


@dataclass(frozen=True)
class SharedGradients:
    """Bytes of the gradients of the trained parameters both passes of the shared-prompt forward run through: a
    decoder layer's (`per_layer`) and the embeddings' and final norm's (`root`, when they train)."""

    per_layer: int = 0
    root: int = 0
    in_flight: int = 0  # a layer's largest weight's gradient as its backward makes it: compute dtype, then cast

    def total(self, layers: int) -> int:
        return self.per_layer * layers + self.root


def shared_gradients(shape: ModelShape, grad_bytes: int, compute_bytes: int, lora_rank: int = 0,
                     lora_targets: tuple[str, ...] = ()) -> SharedGradients:
    """The language model's trained parameters (both passes run through them; the vision tower and LM head run once)
    as `SharedGradients` of `grad_bytes` each: LoRA's adapters in its layers, or all of it."""
    layers = shape.text.num_layers
    if lora_rank > 0:
        return SharedGradients(grad_bytes * shape.lora_parameters(lora_rank, list(lora_targets), part="text") // layers)
    text = [t for t in shape.tensors() if t.part == "text" and ".layers." in t.name]
    in_layers, largest = sum(t.numel for t in text), max(t.numel for t in text)
    return SharedGradients(grad_bytes * in_layers // layers, grad_bytes * (shape.count("text") - in_layers),
                           largest * (compute_bytes + (grad_bytes if grad_bytes != compute_bytes else 0)))


def _pixel_bytes(shape: ModelShape, patches: int, compute_bytes: int) -> int:
    """The patches' pixels (float32) and, under autocast, the patch embedding's low-precision copy it keeps."""
    v = shape.vision
    per_patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return patches * per_patch * (4 + (compute_bytes if compute_bytes < 4 else 0))


def _moments(shape: ModelShape, batch: "MicroBatchSize", copies: int, checkpointing: bool, compute_bytes: int,
             shared: SharedGradients, kv_layer: int, replay: int = 0):
    """(activations, waiting parameter gradients, waiting record gradients) at each moment of forward + backward
    that can be the peak. autograd runs the whole completion pass's backward before the prompt pass's (its nodes are
    newer); in one graph each parameter's gradient from the completion pass waits for the prompt pass's: at the top
    prompt layer's backward all of them are alive (`shared`), beside the prompt pass's layer inputs and one replayed
    layer. A backward in stages (`vlrft.models.staged_backward`) has none (`shared` empty): its peak is then often a
    completion layer's replay, before that layer's backward, with its key/value copies over prompt and completion
    (`replay`: `completion_replay_bytes`; in one graph too, where the layers above's gradients wait). A token
    budget's split between prompt and completion tokens is unknown: both extremes are tried."""
    t, v = shape.text, shape.vision
    layer, vision_layer = per_token_layer_bytes(shape, compute_bytes)
    stream, depth, layers = 4 * t.hidden_size, v.depth, t.num_layers
    patches, pixels = batch.vision_patches, _pixel_bytes(shape, batch.vision_patches, compute_bytes)
    completions = min(batch.completion_tokens, batch.tokens)
    splits = {(batch.prompt_tokens, min(completions, batch.tokens - batch.prompt_tokens)),
              (batch.tokens - completions, completions)}
    waiting = shared.total(layers)
    if not checkpointing:
        yield activation_bytes(shape, batch.tokens, patches, False, compute_bytes) + copies + pixels, 0, 0  # forward
        for prompt, _ in splits:  # the completion pass's backward done
            yield activation_bytes(shape, prompt, patches, False, compute_bytes) + pixels, waiting, layers * kv_layer
        return
    vision = patches * 4 * v.hidden_size * depth + pixels  # the tower's block inputs, until its backward (the last)
    yield vision + 2 * patches * vision_layer, 0, 0
    for prompt, completion in splits:
        kept = prompt * stream * (layers + 1) + vision  # the prompt pass's layer inputs and last output
        yield kept + prompt * layer + shared.in_flight, waiting, layers * kv_layer  # the top prompt layer replayed
        for below in range(1, layers + 1):  # completion layer `below` replayed, the inputs of those under it kept
            done, replayed = layers - below + 1, kept + completion * (stream * below + layer)
            yield replayed + copies, shared.per_layer * done, kv_layer * done  # in its backward, its gradients made
            # before its backward: its key/value copies over prompt and completion, the layers above's gradients
            yield replayed + replay, shared.per_layer * (done - 1), kv_layer * done


def micro_batch_terms(shape: ModelShape, batch: "MicroBatchSize", prompt_len: int, completion_len: int,
                      checkpointing: bool, compute_bytes: int, float32_weights: bool, frozen_tower: bool = False,
                      shared: SharedGradients = SharedGradients()) -> dict[str, int]:
    """`activations`, `prompt_kv`, `pending_grads` (`shared`: the parameter gradients of the completion pass waiting
    for the prompt pass's, at the peak) and (float32 weights under bf16 autocast, no checkpointing) `weight_casts` of
    one training micro-batch (`micro_batch_size`) whose prompts are `prompt_len` tokens and rows `completion_len`
    after them. `activations` and `pending_grads` are read at the moment of the largest sum (`_moments`). Measured
    against the live tensors by bench/bench_plan_terms.py."""
    key_bytes = 4 if float32_weights else compute_bytes
    copies = completion_pass_bytes(shape, batch.rows, prompt_len, batch.completion_tokens, completion_len,
                                   checkpointing, compute_bytes)
    replay = completion_replay_bytes(shape, batch.rows, prompt_len, batch.completion_tokens, completion_len,
                                     key_bytes, compute_bytes)
    kv_layer = _kv_layer_bytes(shape, batch.prompt_tokens, key_bytes, compute_bytes)
    activations, pending, _ = max(_moments(shape, batch, copies, checkpointing, compute_bytes, shared, kv_layer,
                                           replay), key=sum)
    keys_kept = checkpointing or key_bytes == compute_bytes
    terms = {"activations": activations,
             "prompt_kv": prompt_kv_bytes(shape, batch.prompt_tokens, key_bytes, compute_bytes, keys_kept)}
    if pending:
        terms["pending_grads"] = pending
    if float32_weights and not checkpointing:
        terms["weight_casts"] = weight_cast_bytes(shape, frozen_tower)
    return terms


def prompt_patches(cfg, shape: ModelShape, images_per_prompt: int, videos_per_prompt: int) -> int:
    """Vision patches of one prompt at most: each image at data.max_pixels, each video as data.video_max_frames
    frames at data.max_pixels (a temporal patch spans `temporal_patch_size` frames), all of it within
    data.max_prompt_length tokens of merge^2 patches each (a longer prompt is refused)."""
    v, d = shape.vision, cfg.data
    per_frame = d.max_pixels // (v.patch_size ** 2)
    video = -(-d.video_max_frames // max(1, v.temporal_patch_size)) * per_frame
    return min(images_per_prompt * per_frame + videos_per_prompt * video,
               d.max_prompt_length * v.spatial_merge_size ** 2)


@dataclass(frozen=True)
class MicroBatchSize:
    """What one training micro-batch holds at most, as the activation terms count it."""

    tokens: int  # the forward's tokens
    vision_patches: int
    rows: int
    prompt_tokens: int
    completion_tokens: int
    what: str  # how it was bounded, for the plan's notes


def micro_batch_size(cfg, shape: ModelShape, world: int, patches: int, seq_len: int) -> MicroBatchSize:
    """The largest micro-batch a rank trains on: bounded by `train.max_tokens_per_micro_batch` when set, else by
    `train.micro_batch_completions_per_rank` rows over the prompts they come from. `patches`: vision patches per
    prompt; `seq_len`: a trajectory's tokens."""
    r, t, d = cfg.rollout, cfg.train, cfg.data
    if t.max_tokens_per_micro_batch > 0:
        # A token budget bounds the forward's tokens, not its rows (a row longer than the budget runs alone). Each
        # prompt's vision tokens count in the budget (merge^2 patches each), which so bounds the patches too.
        tokens = max(t.max_tokens_per_micro_batch, seq_len)
        prompts = max(1, cfg.prompts_per_step // world)
        vision = min(prompts * patches, tokens * shape.vision.spatial_merge_size ** 2)
        what = f"token budget {tokens} tokens per micro-batch (train.max_tokens_per_micro_batch)"
        completion_tokens = tokens  # short completions of many rows can fill the budget
        prompt_tokens = min(prompts * d.max_prompt_length, tokens)
        rows = min(prompts * r.n, tokens)  # at most the rank's rows, one token each at least
    else:
        # The shared-prompt forward runs each distinct prompt once and the rows' completions after it; a micro-batch's
        # rows come from ceil(rows / n) groups, one more when it starts inside a group (rows left out, filtering).
        rows = t.micro_batch_completions_per_rank
        prompts = min(rows, -(-rows // max(1, r.n)) + (1 if rows > 1 else 0))
        tokens = prompts * d.max_prompt_length + rows * r.tokens_after_prompt
        vision = prompts * patches
        what = (f"micro-batch of {rows} rows: {prompts} prompt(s) of {d.max_prompt_length} tokens, once each, and "
                f"{rows} x {r.tokens_after_prompt} after them")
        completion_tokens = rows * r.tokens_after_prompt
        prompt_tokens = prompts * d.max_prompt_length
    return MicroBatchSize(tokens, vision, rows, prompt_tokens, completion_tokens, what)

