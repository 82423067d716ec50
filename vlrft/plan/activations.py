"""Activation terms of a training micro-batch: the layers' activations, the shared-prompt forward's keys and values,
the LM head's logits chunk and backward, and how large a micro-batch gets."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.plan.architecture import ModelShape

LOGITS_CHUNK_TOKENS = 1024  # ActorVL's default chunk_tokens
LOGITS_CHUNK_ELEMENTS = 1 << 24  # vlrft.models.logprobs: logits per chunk, so large vocabularies get fewer tokens
LOGITS_BYTES_PER_ELEMENT = 28  # bf16 logits, fp32 copies (scaled, probs, probs*logits), backward grads


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


def prompt_kv_bytes(shape: ModelShape, prompt_tokens: int, checkpointing: bool, key_bytes: int, value_bytes: int
                    ) -> int:
    """The shared-prompt forward's record of every layer's prompt keys and values, and their gradients.

    The completion pass reads every layer's prompt keys/values, and their gradients reach the prompt pass only after
    the completion pass's whole backward: both are alive for all layers at once. Under checkpointing that comes on
    top of the layer inputs; without it the records are among a layer's activations, and only the gradients count.
    Keys follow the residual stream's dtype (float32 under autocast over float32 weights), values the compute dtype.
    """
    per_token = shape.text.num_layers * shape.text.kv_dim * (key_bytes + value_bytes)
    return prompt_tokens * per_token * (2 if checkpointing else 1)


def head_backward_bytes(shape: ModelShape, trained: bool, float32_weights: bool) -> int:
    """What the chunked LM head's backward (`vlrft.models.logprobs`) allocates beside the model's own gradients: the
    head's float32 gradient accumulated over the chunks (when the head trains) and, for bf16 products over float32
    weights, the head cast once."""
    return shape.text.vocab_size * shape.text.hidden_size * ((4 if trained else 0) + (2 if float32_weights else 0))


def chunk_tokens(shape: ModelShape) -> int:
    """Tokens per LM-head chunk, as vlrft.models.logprobs.chunk_tokens_for picks them."""
    return max(1, min(LOGITS_CHUNK_TOKENS, LOGITS_CHUNK_ELEMENTS // max(shape.text.vocab_size, 1)))


def logits_bytes(shape: ModelShape, micro_batch: int, completion_len: int) -> int:
    """The LM-head chunk alive at once: its completion tokens (capped by the element budget) times the vocabulary."""
    tokens = min(chunk_tokens(shape), micro_batch * completion_len)
    return tokens * shape.text.vocab_size * LOGITS_BYTES_PER_ELEMENT



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

