"""The tiny VLMs' tokenizers (`vlrft.models.tiny`): a byte-level BPE trained here on a fixed corpus, with each
family's pre-tokenizer, special tokens, named image tokens and chat template."""

from __future__ import annotations

import json
from functools import lru_cache

from vlrft.models.chat_template import (GEMMA3_CHAT_TEMPLATE, GLM4V_CHAT_TEMPLATE, INTERNVL_CHAT_TEMPLATE,
                                        LLAVA_ONEVISION_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, SMOLVLM_CHAT_TEMPLATE)

# LLaVA-OneVision's image and video tokens, as its tokenizer names them.
LLAVA_ONEVISION_TOKENS = {"image_token": "<image>", "video_token": "<video>"}
# InternVL 3's image tokens, as its tokenizer_config.json names them (the processor reads them by these names).
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}
# Qwen-VL's special tokens (also InternVL 3's and LLaVA-OneVision's Qwen2 tokenizers).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# GLM-4.1V's special tokens (its tokenizer_config.json's added tokens that the chat template and processor use).
GLM4V_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<|begin_of_box|>",
    "<|end_of_box|>",
]
# Gemma 3's special tokens: its pad / eos / bos / unk at ids 0-3 as released, turn markers, and the image tokens its
# tokenizer_config.json names boi_token, eoi_token and image_token.
GEMMA3_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                         "<end_of_image>", "<image_soft_token>"]
# SmolVLM's special tokens (SmolVLM2's tokenizer: SmolLM2's, and the image tokens its processor writes, a tile's
# <row_r_col_c> for up to 6 x 6 tiles).
SMOLVLM_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>",
                          "<fake_token_around_image>", "<image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
# GLM-4's pre-tokenizer split: as Qwen's, but digits in runs of up to three.
GLM4_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen's pre-tokenizer split (digits one by one, letters with an optional leading space or symbol).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Words the tokenizer learns as whole tokens: chat roles, the synthetic task's vocabulary, answer tags.
_CORPUS_WORDS = (
    "system user assistant You are a helpful assistant. "
    "What color is the shape? Which shape is in the image? How many shapes are there? Where is the shape? "
    "Answer with one word. Answer with a number. Think step by step and put the final answer in \\boxed{}. "
    "red green blue yellow purple orange white black gray circle square triangle star left right top bottom "
    "center middle small large big one two three four five six seven eight nine ten zero none yes no "
    "<think> </think> <answer> </answer> The answer is A B C D E option choice count number image picture "
    "video frame question solve find angle length area degree point line triangle ABC x y = + - * / ( ) [ ] "
    "the of and a to in is that it for on with as was at by this be from or have an are not but what all were "
    "when we there can been has more if will one so about which their would out up into them then its only "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 0.5 3.14 \\frac{1}{2} \\sqrt{2} \\boxed{4} ,.;:!?'\" "
)


@lru_cache(maxsize=4)
def _train_tokenizer_json(vocab_size: int, family: str = "qwen") -> str:
    """Train a byte-level BPE with the family's pre-tokenizer and special tokens on a fixed corpus; returns
    tokenizer.json text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM4_PRETOKENIZE_REGEX if family == "glm4v" else QWEN_PRETOKENIZE_REGEX),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens={"glm4v": GLM4V_SPECIAL_TOKENS, "gemma3": GEMMA3_SPECIAL_TOKENS,
                        "smolvlm": SMOLVLM_SPECIAL_TOKENS}.get(family, SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The words once more one per line (no leading space), so short answers like "red" are single tokens.
    tok.train_from_iterator([_CORPUS_WORDS] * 20 + ["\n".join(_CORPUS_WORDS.split())] * 20, trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 512, family: str = "qwen"):
    """A Qwen2 tokenizer (transformers class) over a BPE trained here, with the Qwen special tokens; for
    `family="glm4v"` the fast tokenizer class GLM-4.1V ships, with its special tokens and chat template."""
    if family == "glm4v":
        return _build_glm4v_tokenizer(vocab_size)
    if family == "gemma3":
        return _build_gemma3_tokenizer(vocab_size)
    if family == "smolvlm":
        return _build_smolvlm_tokenizer(vocab_size)
    from transformers import Qwen2Tokenizer

    # InternVL 3 and LLaVA-OneVision ship Qwen2's tokenizer with their image tokens as named special tokens
    named = {"internvl": INTERNVL_TOKENS, "llava_onevision": LLAVA_ONEVISION_TOKENS}.get(family, {})

    model = json.loads(_train_tokenizer_json(vocab_size))["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        **({"extra_special_tokens": named} if named else {}),
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = {"internvl": INTERNVL_CHAT_TEMPLATE,
                               "llava_onevision": LLAVA_ONEVISION_CHAT_TEMPLATE}.get(family, QWEN_VL_CHAT_TEMPLATE)
    return tokenizer


def _build_glm4v_tokenizer(vocab_size: int):
    """GLM-4.1V's tokenizer: `PreTrainedTokenizerFast` (as its tokenizer_config.json names it), `<|endoftext|>` as
    end-of-text and padding, no BOS added (the chat template writes `[gMASK]<sop>`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size, "glm4v")),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        padding_side="left",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": GLM4V_SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = GLM4V_CHAT_TEMPLATE
    return tokenizer


def _build_gemma3_tokenizer(vocab_size: int):
    """Gemma 3's tokenizer: `<bos>` written by the chat template (none added here), `<pad>` padding on the left, and
    boi/eoi/image tokens as the named special tokens its processor reads (`tokenizer.boi_token`, ...)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size, "gemma3")),
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", model_max_length=32768,
        padding_side="left",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def _build_smolvlm_tokenizer(vocab_size: int):
    """SmolVLM2's tokenizer: `<|im_start|>` as BOS (written by the chat template), `<end_of_utterance>` ending a
    turn, `<|im_end|>` padding, and the image tokens as the named special tokens its processor reads."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size, "smolvlm")),
        bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
        model_max_length=32768, padding_side="left",
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SMOLVLM_SPECIAL_TOKENS[4:]})
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tokenizer
