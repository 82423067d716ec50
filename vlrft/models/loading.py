"""Load a VLM policy and its processor from a local folder or a Hub-format checkpoint.

Loads the families vlrft is tested with (`vlrft.families`); any other is refused in one line naming
them. Without torchvision the processor is built image-only (PIL image backend) and asking it for video
raises a clear error.
Mistakes a user can make (wrong path, a folder without a processor, an unknown architecture)
raise `UserError` with the fix in the message.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from vlrft.errors import UserError
from vlrft.families import BY_MODEL_TYPE, supported_families
from vlrft.vision_stack import has_torchvision, require_video_support

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


ADAPTER_CONFIG = "adapter_config.json"


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def widest_stored_dtype(folder: Path) -> torch.dtype | None:
    """The widest floating dtype in `folder`'s safetensors files, read from their headers (None: no such file)."""
    from safetensors import safe_open

    widest = None
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                dtype = SAFETENSORS_FLOATS.get(f.get_slice(name).get_dtype())
                if dtype is not None and (widest is None or dtype.itemsize > widest.itemsize):
                    widest = dtype
    return widest


def model_fingerprint(path: str | Path) -> str | None:
    """A short digest of a local model folder's contents (None for anything else, e.g. a Hub id): its config and,
    for each weight file, its name, size and first and last 64 KiB. Equal for a copy of the folder, different for
    another fine-tune (it changes the bytes at both ends of every file); reading 128 KiB per file, not the weights.
    A change confined to the middle of a large file is not seen."""
    import hashlib

    folder = Path(path)
    if not (folder / "config.json").is_file():
        return None
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def stored_dtype_name(path: str | Path, config=None) -> str:
    """The dtype a model is published in: the widest floating dtype of a local folder's safetensors files, else its
    config's (`dtype`, top level or `text_config`, as Qwen3-VL writes it; `config` if given, else read), else
    float32."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    folder = Path(path)
    stored = widest_stored_dtype(folder) if folder.is_dir() else None
    if stored is None:
        from transformers import AutoConfig

        try:
            config = config or AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError):
            return "float32"
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        stored = getattr(config, "dtype", None) or getattr(text, "dtype", None)
        stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    return names.get(stored, "float32")


def adapter_base(path: str | Path) -> str | None:
    """The base model a LoRA adapter folder (a LoRA run's `checkpoints/step_k/model`) was trained on, else None."""
    config = Path(path) / ADAPTER_CONFIG
    if not config.is_file() or (Path(path) / "config.json").is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError as exc:
        raise UserError(f"'{config}' is not valid JSON ({exc}); re-save the adapter") from None
    if not base:
        raise UserError(f"LoRA adapter '{path}' does not name its base model (base_model_name_or_path in "
                        f"{ADAPTER_CONFIG}); set it to the base model's folder")
    if not Path(base).exists() and (str(base).startswith((".", "/", "~")) or str(base).count("/") != 1):
        raise UserError(f"LoRA adapter '{path}' was trained on '{base}', which is not found; edit "
                        f"base_model_name_or_path in {config} to point at the base model folder")
    return str(base)


def _check_model_dir(path: str | Path) -> Path | None:
    """Return the folder for a local path, None for a Hub id; raise when a local-looking path is missing."""
    p = Path(path)
    if p.is_dir():
        if adapter_base(p) is not None:
            return p
        if not (p / "config.json").is_file():
            raise UserError(f"model folder '{path}' has no config.json; point model.path at a folder written by "
                            "save_pretrained (or a Hub checkpoint)")
        return p
    if p.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise UserError(f"model path '{path}' is not a folder; pass a model folder (e.g. one made by "
                        "`vlrft tiny DIR`) or a Hub id like Qwen/Qwen2.5-VL-3B-Instruct")
    return None


def model_type_of(path: str | Path) -> str:
    """The `model_type` in a checkpoint's config.json (Hub ids are resolved through transformers)."""
    local = _check_model_dir(path)
    if local is not None and adapter_base(local) is not None:
        return model_type_of(adapter_base(local))
    if local is not None:
        try:
            return json.loads((local / "config.json").read_text())["model_type"]
        except (KeyError, json.JSONDecodeError) as exc:
            raise UserError(f"'{local / 'config.json'}' is not a valid model config ({exc}); re-save the model") from None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path)).model_type


def _check_architecture(path: str | Path) -> str:
    """The checkpoint's `model_type`, refused in one line unless it is a family vlrft supports: another family fails
    later and deeper (a processor output no layer knows, placeholder tokens of another kind, positions by another
    rule), or worse, trains on a silently wrong layout."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = model_type_of(path)
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise UserError(f"unknown architecture '{model_type}' in '{path}': not an image-text-to-text model; vlrft "
                        f"trains {supported_families()}; check model.path")
    if model_type not in BY_MODEL_TYPE:
        raise UserError(f"model family '{model_type}' of '{path}' is not supported by vlrft yet; supported: "
                        f"{supported_families()}; check model.path")
    return model_type


def load_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                trust_remote_code: bool = False, device: str | torch.device = "cpu"):
    """Load a vision-language model (`AutoModelForImageTextToText`); a LoRA adapter folder is merged into its base."""
    from transformers import AutoModelForImageTextToText

    _check_architecture(path)
    if dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    base = adapter_base(path) if Path(path).is_dir() else None
    if base is not None:
        from vlrft.errors import require

        peft = require("peft", "loading a LoRA adapter", "peft")
        model = load_policy(base, dtype, attn_implementation, trust_remote_code, "cpu")
        merged = peft.PeftModel.from_pretrained(model, str(path)).merge_and_unload()
        return merged.requires_grad_(True).to(device)  # as trainable as any loaded model (PEFT froze the base)
    model = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def _image_only_processor_class(cls):
    """Subclass of a processor class without the video sub-processor (it needs torchvision)."""

    class ImageOnlyProcessor(cls):
        @classmethod
        def get_attributes(klass):
            return [a for a in super().get_attributes() if a != "video_processor"]

        if cls.__name__ == "SmolVLMProcessor":  # its own reads the video processor's frame defaults, for videos only
            def apply_chat_template(self, *args, **kwargs):
                from transformers.processing_utils import ProcessorMixin

                return ProcessorMixin.apply_chat_template(self, *args, **kwargs)

        def __call__(self, *args, videos=None, **kwargs):
            if videos is not None:
                require_video_support("processing video")
            return super().__call__(*args, **kwargs)

    # Keep the real class name: save_pretrained writes it as processor_class, which must stay loadable.
    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = cls.__name__
    return ImageOnlyProcessor


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """Load the processor saved with a model; image-only (PIL backend) when torchvision is absent."""
    local = _check_model_dir(path)
    _check_architecture(path)  # before the processor of another family fails in its own way
    if local is not None and adapter_base(local) is not None and not any((local / f).is_file() for f in PROCESSOR_FILES):
        return load_processor(adapter_base(local), trust_remote_code)  # an adapter saved without its processor
    if local is not None and not any((local / f).is_file() for f in PROCESSOR_FILES):
        raise UserError(f"model folder '{path}' has no processor (none of {', '.join(PROCESSOR_FILES)}); copy the "
                        "processor files from the base checkpoint or run processor.save_pretrained on the folder")
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if has_torchvision():
        return AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    processor_name = _processor_class_name(path)
    cls = getattr(transformers, processor_name, None)
    if cls is None:
        raise UserError(f"processor class '{processor_name}' of '{path}' is not in this transformers version; "
                        "upgrade transformers or install torchvision")
    image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil", trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    # SmolVLM's constructor requires a video processor: none (get_attributes leaves it out)
    none = {"video_processor": None} if "video_processor" in inspect.signature(cls.__init__).parameters else {}
    return _image_only_processor_class(cls)(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=getattr(tokenizer, "chat_template", None), **none,
                                             **_saved_processor_options(path, cls))


def _saved_processor_options(path: str | Path, cls) -> dict:
    """The processor's own options saved in processor_config.json that its constructor takes (Gemma 3's
    image_seq_length: without it the processor expands each image to its default 256 tokens, not the model's)."""
    import inspect

    saved_file = Path(path) / "processor_config.json"
    if not saved_file.is_file():
        return {}
    saved = json.loads(saved_file.read_text())
    accepted = inspect.signature(cls.__init__).parameters
    parts = ("image_processor", "tokenizer", "video_processor", "chat_template", "feature_extractor")
    return {k: v for k, v in saved.items() if k in accepted and k not in parts}


def _processor_class_name(path: str | Path) -> str:
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    local = Path(path)
    for name in PROCESSOR_FILES:
        f = local / name
        if f.is_file():
            cls = json.loads(f.read_text()).get("processor_class")
            if cls:
                return cls
    model_type = AutoConfig.from_pretrained(str(path)).model_type
    if model_type not in PROCESSOR_MAPPING_NAMES:
        raise UserError(f"no processor class is known for model type '{model_type}' ('{path}')")
    return PROCESSOR_MAPPING_NAMES[model_type]
