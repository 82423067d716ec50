"""Tiny-VLM toolkit and model/processor loading: the four Qwen-VL architectures (Qwen3-VL-MoE too), GLM-4.1V, Gemma 3,
SmolVLM."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.errors import UserError
from vlrft.models.loading import load_policy, load_processor
from vlrft.models.tiny import ARCHES, TinySpec, build_processor, build_tiny_model

REPO = Path(__file__).resolve().parents[1]


def image(h=60, w=90, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def image_prompt(processor, n_images=1):
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "What color is the shape?"}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("arch", ARCHES)
def test_build_save_load_round_trip_gives_identical_logits(arch, tiny_vlm_dir):
    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    inputs = processor(text=[image_prompt(processor)], images=[image()], return_tensors="pt")

    fresh = build_tiny_model(TinySpec(arch=arch), build_processor(TinySpec(arch=arch)).tokenizer).eval()
    loaded = load_policy(folder).eval()
    assert type(loaded).__name__ == type(fresh).__name__
    with torch.no_grad():
        a = fresh(**inputs).logits
        b = loaded(**inputs).logits
    assert a.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.equal(a, b)
    # the saved tokenizer is the one that was built: same ids for the same text
    assert processor.tokenizer("What color is red?").input_ids == build_processor(TinySpec(arch=arch)).tokenizer(
        "What color is red?").input_ids


VISION_TOWERS = ("model.visual.", "model.vision_tower.", "model.vision_model.")  # the families' tower prefixes


@pytest.mark.parametrize("arch", ARCHES)
def test_every_tiny_family_sees_its_images_and_trains_its_vision_tower(arch, tiny_vlm_dir):
    """The same prompt with two different images gives clearly different logits, and a loss on the last logits puts
    gradient on the vision tower. Tiny Gemma 3's projector used to be all zeros: its images changed nothing (max
    |logit difference| 0, tower gradient 0), so no image-path test on it could fail."""
    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    model = load_policy(folder).float().eval()
    logits = []
    for seed in (0, 1):
        inputs = processor(text=[image_prompt(processor)], images=[image(seed=seed)], return_tensors="pt")
        model.zero_grad()
        out = model(**inputs).logits
        out[0, -1].log_softmax(-1)[:8].sum().backward()
        if seed == 0:
            tower = [(name, p.grad) for name, p in model.named_parameters() if name.startswith(VISION_TOWERS)]
            grad_norm = sum(float(g.norm()) for _, g in tower if g is not None)
        logits.append(out.detach())
    assert tower, "no vision tower parameter found"
    difference = (logits[0] - logits[1]).abs().amax()
    assert difference > 0.05, f"{arch}: two images move the logits by at most {float(difference):.2e}"
    assert (logits[0][0, -1] - logits[1][0, -1]).abs().amax() > 1e-3  # the next-token logits too
    assert grad_norm > 1e-2, f"{arch}: vision tower gradient norm {grad_norm:.2e}"


def test_build_is_deterministic_and_seeded(tmp_path):
    tok = build_processor(TinySpec()).tokenizer
    a = build_tiny_model(TinySpec(seed=3), tok).state_dict()
    b = build_tiny_model(TinySpec(seed=3), tok).state_dict()
    c = build_tiny_model(TinySpec(seed=4), tok).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"])
def test_processor_rows_and_image_tokens_follow_grid_thw(arch, tiny_processor):
    processor = tiny_processor(arch)
    merge = processor.image_processor.merge_size
    images = [image(60, 90, 0), image(120, 40, 1)]
    inputs = processor(text=[image_prompt(processor, 2)], images=images, return_tensors="pt")
    thw = inputs["image_grid_thw"]
    assert thw.shape == (2, 3)
    assert inputs["pixel_values"].shape[0] == int(thw.prod(dim=1).sum())
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image|>" if arch == "glm4v" else "<|image_pad|>")
    n_tokens = int((inputs["input_ids"] == image_token_id).sum())
    assert n_tokens == int(thw.prod(dim=1).sum()) // merge**2
    # different image sizes give different grids: the count is per image, not a constant
    assert thw[0].tolist() != thw[1].tolist()


def test_hub_style_folder_loads_with_auto_classes(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_vlm_dir("qwen2_5_vl")
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json", "chat_template.jinja"} <= {
        p.name for p in folder.iterdir()}
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.eos_token_id == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_glm4v_folder_has_the_released_layout(tiny_vlm_dir):
    """GLM-4.1V's tiny folder: its own classes, special tokens, chat layout and the three ids that end a turn."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_vlm_dir("glm4v")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(model).__name__ == "Glm4vForConditionalGeneration"
    assert type(processor).__name__ == "Glm4vProcessor"
    tok = processor.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image|>") == processor.image_token_id
    assert model.config.image_start_token_id == tok.convert_tokens_to_ids("<|begin_of_image|>")
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids(t)
                                                    for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert tok.pad_token == "<|endoftext|>"
    text = image_prompt(processor)
    assert text == ("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>What color is the shape?"
                    "<|assistant|>\n")
    ids = processor(text=[text], images=[image()], return_tensors="pt")["input_ids"][0].tolist()
    assert tok.convert_ids_to_tokens(ids[:3]) == ["[gMASK]", "<sop>", "<|user|>"]  # no BOS added by the tokenizer


def test_qwen3_vl_moe_folder_has_the_released_layout(tiny_vlm_dir):
    """Qwen3-VL-MoE's tiny folder: its own model class over Qwen3-VL's processor and ChatML template, and a sparse
    MoE block in every decoder layer (experts as two 3-D tensors, a linear router picking top-k), as the released
    Qwen3-VL-30B-A3B; routing is per token, so a row's logits do not depend on the other rows of its batch."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_vlm_dir("qwen3_vl_moe")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size, text.mlp_only_layers) == (4, 2, 32, [])
    for layer in model.model.language_model.layers:
        assert type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock"
        assert tuple(layer.mlp.experts.gate_up_proj.shape) == (4, 2 * 32, 64)
        assert tuple(layer.mlp.experts.down_proj.shape) == (4, 64, 32)
        assert tuple(layer.mlp.gate.weight.shape) == (4, 64)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_prompt(processor).startswith("<|im_start|>system\n")
    one = processor(text=[image_prompt(processor)], images=[image()], return_tensors="pt")
    two = processor(text=[image_prompt(processor), image_prompt(processor)], images=[image(), image(seed=1)],
                    return_tensors="pt")
    with torch.no_grad():
        alone, batched = model(**one).logits[0], model(**two).logits[0]
    assert torch.allclose(alone, batched, atol=1e-5)


def test_gemma3_folder_has_the_released_layout(tiny_vlm_dir):
    """Gemma 3's tiny folder: its classes, `<start_of_turn>` turns with the assistant as `model`, an image as a fixed
    number of `<image_soft_token>`s between `<start_of_image>` and `<end_of_image>` whatever its size, image tokens
    typed 1 in `token_type_ids` (its bidirectional attention over each image), sliding and global layers, and the two
    ids that end a turn."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_vlm_dir("gemma3")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and type(processor).__name__ == "Gemma3Processor"
    tok = processor.tokenizer
    assert image_prompt(processor) == ("<bos><start_of_turn>user\n<start_of_image>What color is the shape?<end_of_turn>\n"
                                       "<start_of_turn>model\n")
    soft = tok.convert_tokens_to_ids("<image_soft_token>")
    assert model.config.image_token_id == soft and model.config.mm_tokens_per_image == 4
    for size in ((60, 90), (200, 30)):
        inputs = processor(text=[image_prompt(processor)], images=[image(*size)], return_tensors="pt")
        ids = inputs["input_ids"][0]
        assert int((ids == soft).sum()) == 4 and tuple(inputs["pixel_values"].shape) == (1, 3, 32, 32)
        assert torch.equal(inputs["token_type_ids"][0], (ids == soft).long())
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>")]
    assert model.config.tie_word_embeddings and not model.config.vision_config.vision_use_head


def test_smolvlm_folder_has_the_released_layout(tiny_vlm_dir):
    """SmolVLM's tiny folder: its classes, `<|im_start|>User:` turns ending `<end_of_utterance>`, an image split into
    32 x 32 tiles (2 x 2 for a square, 2 x 1 for a wide one), each `<fake_token_around_image><row_r_col_c>` and 4
    `<image>` tokens, then the whole image as `<global-img>` and 4 more; tiles padded per sample with all-zero ones
    masked out in pixel_attention_mask; a Llama language model under a SigLIP tower."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_vlm_dir("smolvlm")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(model).__name__ == "SmolVLMForConditionalGeneration" and type(processor).__name__ == "SmolVLMProcessor"
    assert image_prompt(processor) == "<|im_start|>User:<image>What color is the shape?<end_of_utterance>\nAssistant:"
    tok = processor.tokenizer
    wide_text = [image_prompt(processor), image_prompt(processor)]
    inputs = processor(text=wide_text, images=[[image(90, 90)], [image(30, 200)]], return_tensors="pt", padding=True)
    assert tuple(inputs["pixel_values"].shape) == (2, 5, 3, 32, 32)
    assert inputs["pixel_attention_mask"].flatten(2).any(-1).tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert not inputs["pixel_values"][1, 3:].any()  # padding tiles are all zero, which the model drops
    wide = tok.decode(inputs["input_ids"][1][inputs["attention_mask"][1].bool()])
    tile = "<image>" * 4
    assert wide == ("<|im_start|>User:<fake_token_around_image><row_1_col_1>" + tile + "<fake_token_around_image>"
                    "<row_1_col_2>" + tile + "\n\n<fake_token_around_image><global-img>" + tile +
                    "<fake_token_around_image>What color is the shape?<end_of_utterance>\nAssistant:")
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<image>") and processor.image_seq_len == 4
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<end_of_utterance>")
    assert type(model.model.text_model).__name__ == "LlamaModel"
    # FSDP2's units: the classes its _no_split_modules lists, its tower's attention (not its encoder layers) and its
    # Llama's decoder layers (two ranks train it sharded: tests/test_families_distributed.py)
    from vlrft.parallel.fsdp2 import shard_units

    assert sorted(type(u).__name__ for u in shard_units(model)) == ["LlamaDecoderLayer"] * 2 + [
        "SmolVLMVisionAttention"] * 2


def test_vlrft_tiny_command_builds_a_qwen3_vl_moe_with_the_experts_asked_for(tmp_path, capsys):
    """`vlrft tiny DIR --arch qwen3_vl_moe --num-experts 8 --num-experts-per-tok 2`: the spec's MoE sizes are flags."""
    import json

    from vlrft.cli import main

    assert main(["tiny", str(tmp_path / "moe"), "--arch", "qwen3_vl_moe", "--num-experts", "8",
                 "--num-experts-per-tok", "2", "--moe-intermediate-size", "16"]) == 0
    assert "wrote a tiny qwen3_vl_moe model" in capsys.readouterr().out
    text = json.loads((tmp_path / "moe" / "config.json").read_text())["text_config"]
    # transformers 5 writes num_experts under its attribute name, num_local_experts (the plan reads both)
    assert (text["num_local_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]) == (8, 2, 16)
    model = load_policy(tmp_path / "moe")
    assert tuple(model.model.language_model.layers[0].mlp.experts.down_proj.shape) == (8, 64, 16)


def test_loading_errors_say_what_to_fix(tmp_path, tiny_vlm_dir):
    with pytest.raises(UserError, match="model path '.*missing' is not a folder"):
        load_policy(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        load_policy(tmp_path / "empty")
    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="unknown architecture 'bert'"):
        load_policy(weird)
    for family in ("paligemma", "llava_next", "idefics3"):  # image-text-to-text, but not (yet) tested here
        other = tmp_path / family
        other.mkdir()
        (other / "config.json").write_text(f'{{"model_type": "{family}"}}')
        (other / "preprocessor_config.json").write_text("{}")
        for load in (load_policy, load_processor):
            with pytest.raises(UserError) as error:
                load(other)
            assert str(error.value) == (
                f"model family '{family}' of '{other}' is not supported by vlrft yet; supported: Qwen2-VL (qwen2_vl), "
                "Qwen2.5-VL (qwen2_5_vl), Qwen3-VL (qwen3_vl), Qwen3-VL-MoE (qwen3_vl_moe), GLM-4.1V (glm4v), Gemma 3 "
                "(gemma3), InternVL 3 (internvl), LLaVA-OneVision (llava_onevision), SmolVLM (smolvlm); check "
                "model.path")
    no_proc = tmp_path / "no_proc"
    no_proc.mkdir()
    (no_proc / "config.json").write_text((tiny_vlm_dir("qwen2_vl") / "config.json").read_text())
    with pytest.raises(UserError, match="has no processor .* processor.save_pretrained"):
        load_processor(no_proc)


@pytest.mark.slow
def test_without_torchvision_images_work_and_video_names_the_package(tiny_vlm_dir, tmp_path):
    folder = tiny_vlm_dir("qwen2_vl")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torchvision"] = None  # as if torchvision were not installed
        import numpy as np
        from PIL import Image
        from vlrft.errors import MissingDependencyError
        from vlrft.models.loading import load_policy, load_processor
        from vlrft.models.tiny import TinySpec, build_tiny_vlm
        from vlrft.vision_stack import has_torchvision
        assert not has_torchvision()
        for folder in [{str(folder)!r}, str(build_tiny_vlm({str(tmp_path / 'built')!r}, TinySpec(arch="qwen3_vl")))]:
            proc = load_processor(folder)
            img = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
            text = "<|vision_start|><|image_pad|><|vision_end|>What color?"
            inputs = proc(text=[text], images=[img], return_tensors="pt")
            assert inputs["pixel_values"].shape[0] == int(inputs["image_grid_thw"].prod(-1).sum())
            load_policy(folder)(**inputs)
            try:
                proc(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[img, img]])
            except MissingDependencyError as exc:
                assert "torchvision" in str(exc), exc
            else:
                raise AssertionError("video without torchvision did not raise")
        # GLM-4.1V, built and loaded without torchvision: its PIL image processor, and an image fitted by the data
        # layer to its bound (28 * 28 * 16 pixels, stored doubled for two frames) passes it unchanged
        from vlrft.config import DataConfig
        from vlrft.data import PromptEncoder, Sample
        glm = str(build_tiny_vlm({str(tmp_path / 'glm4v')!r}, TinySpec(arch="glm4v")))
        proc = load_processor(glm)
        assert type(proc).__name__ == "Glm4vProcessor" and type(proc.image_processor).__name__ == "Glm4vImageProcessorPil"
        Image.fromarray((np.random.RandomState(0).rand(256, 256, 3) * 255).astype("uint8")).save({str(tmp_path / 'big.png')!r})
        batch = PromptEncoder(proc, DataConfig()).encode([Sample("big", "<image>What color?",
                                                                 images=[{str(tmp_path / 'big.png')!r}])]).batch
        assert batch.images[0][0].size == (112, 112) and batch.visual.image_grid_thw.tolist() == [[1, 8, 8]]
        import torch
        ids = torch.tensor(batch.prompt_ids)
        load_policy(glm)(input_ids=ids, mm_token_type_ids=(ids == proc.image_token_id).long(),
                         **batch.visual.model_inputs())
        # Gemma 3, Qwen3-VL-MoE, InternVL 3, LLaVA-OneVision and SmolVLM too (their PIL image processors); Gemma's,
        # InternVL's and SmolVLM's processors keep their saved image_seq_length / image_seq_len (4 tokens an image or
        # tile, not the default the model's features would not match), SmolVLM's without a video processor
        from vlrft.vision import mm_token_type_ids, token_type_kwargs
        for arch in ("gemma3", "qwen3_vl_moe", "internvl", "llava_onevision", "smolvlm"):
            folder = str(build_tiny_vlm({str(tmp_path)!r} + "/" + arch, TinySpec(arch=arch)))
            proc, model = load_processor(folder), load_policy(folder)
            batch = PromptEncoder(proc, DataConfig()).encode([Sample("big", "<image>What color?",
                                                                     images=[{str(tmp_path / 'big.png')!r}])]).batch
            ids = torch.tensor(batch.prompt_ids)
            types = mm_token_type_ids(ids, model.config.image_token_id, -1)
            model(input_ids=ids, **token_type_kwargs(model.model, types), **batch.visual.model_inputs())
            assert arch != "gemma3" or int(types.sum()) == 4, (arch, int(types.sum()))
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch,units", [
    ("glm4v", ["Glm4vTextDecoderLayer"] * 2 + ["Glm4vVisionBlock"] * 2),
    ("qwen3_vl_moe", ["Qwen3VLMoeTextDecoderLayer"] * 2 + ["Qwen3VLMoeVisionBlock"] * 2),
    # Gemma 3 lists SigLIP's embeddings as a unit of their own too
    ("gemma3", ["Gemma3DecoderLayer"] * 2 + ["SiglipEncoderLayer"] * 2 + ["SiglipVisionEmbeddings"])])
def test_fsdp2_units_are_the_no_split_modules_and_a_sharded_forward_is_exact(arch, units, tiny_vlm_dir, tmp_path):
    """FSDP2 shards GLM-4.1V, Qwen3-VL-MoE and Gemma 3 by the classes they list in `_no_split_modules` (decoder layers
    and vision blocks, nothing hard-coded per family; a MoE layer's experts and router shard with their layer);
    wrapped so in one process (gloo, world size 1, not torchrun), the logits and the LM head's and first layer's MLP
    gradients equal the unwrapped model's."""
    from vlrft.parallel.fsdp2 import shard_units

    folder = tiny_vlm_dir(arch)
    model = load_policy(folder)
    assert set(units) <= set(model._no_split_modules)
    assert sorted(type(u).__name__ for u in shard_units(model)) == sorted(units)
    script = textwrap.dedent(f"""
        import numpy as np, torch, torch.distributed as dist
        from PIL import Image
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from vlrft.parallel.fsdp2 import shard_units
        from vlrft.models.loading import load_policy, load_processor
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        processor = load_processor({str(folder)!r})
        img = Image.fromarray((np.random.RandomState(0).rand(56, 84, 3) * 255).astype("uint8"))
        text = processor.apply_chat_template([{{"role": "user", "content": [{{"type": "image"}},
                                               {{"type": "text", "text": "What color?"}}]}}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=[text], images=[img], return_tensors="pt")
        plain, sharded = load_policy({str(folder)!r}), load_policy({str(folder)!r})
        for unit in shard_units(sharded):
            fully_shard(unit)
        fully_shard(sharded)
        assert sum(isinstance(m, FSDPModule) for m in sharded.modules()) == {len(units) + 1}
        a, b = plain(**inputs).logits, sharded(**inputs).logits
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
        a.logsumexp(-1).sum().backward()
        b.logsumexp(-1).sum().backward()
        grad = sharded.lm_head.weight.grad.full_tensor()
        assert torch.allclose(plain.lm_head.weight.grad, grad, atol=1e-6 * max(1.0, float(grad.abs().max())))
        mlp = [(n, p) for n, p in sharded.model.language_model.layers[0].mlp.named_parameters()]
        plain_mlp = dict(plain.model.language_model.layers[0].mlp.named_parameters())
        assert mlp and all(torch.allclose(plain_mlp[n].grad, p.grad.full_tensor(), atol=1e-6) for n, p in mlp)
        dist.destroy_process_group()
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_qwen3_vl_moe_lora_wraps_attention_and_its_experts_when_named(tiny_vlm_dir):
    """LoRA on Qwen3-VL-MoE: its experts are two 3-D parameters per layer and its router a bare weight, none of them a
    linear layer, so 'all-linear' wraps the attention projections (q/k/v/o_proj) and, unless frozen, the vision tower;
    'experts.gate_up_proj' / 'experts.down_proj' put an adapter on every expert (PEFT's target_parameters), which
    trains, and merges into the expert weights; routers stay frozen. A dense Qwen's 'gate_proj' or 'experts' is
    refused in one line saying how its experts are named."""
    from vlrft.models.actor import apply_lora

    folder = tiny_vlm_dir("qwen3_vl_moe")
    adapted = apply_lora(load_policy(folder), 4, 8, 0.0, ["all-linear"], exclude_vision=True)
    wrapped = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if ".lora_A." in n}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n and "self_attn" in n for n in trained)
    with_tower = apply_lora(load_policy(folder), 4, 8, 0.0, ["all-linear"])
    assert any(".visual." in n and ".lora_A." in n for n, _ in with_tower.named_parameters())
    model = load_policy(folder)
    experts = apply_lora(model, 4, 8, 0.0, ["q_proj", "experts.gate_up_proj", "experts.down_proj"],
                         exclude_vision=True)
    on_experts = [n for n, p in experts.named_parameters() if p.requires_grad and ".mlp.experts." in n]
    assert len(on_experts) == 2 * 2 * 2  # two layers, two expert weights, A and B
    ids = torch.tensor([[1, 150, 160, 170, 180]])
    experts(input_ids=ids).logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in experts.named_parameters()
               if p.requires_grad and ".mlp.experts." in n and ".lora_B." in n)  # A: 0 while B starts at 0
    with torch.no_grad():
        for n, p in experts.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)  # B starts at zero: give the adapters an effect to merge
        adapted_logits = experts(input_ids=ids).logits
        merged = experts.merge_and_unload()
        assert torch.allclose(merged(input_ids=ids).logits, adapted_logits, atol=1e-5)
    assert tuple(merged.model.language_model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 64, 64)
    for names in (["q_proj", "gate_proj"], ["q_proj", "experts"]):
        with pytest.raises(UserError, match=r"name no linear layer of Qwen3VLMoeForConditionalGeneration outside the "
                                            r"frozen vision tower; its linear layers are \['k_proj', 'lm_head', "
                                            r"'o_proj', 'q_proj', 'v_proj'\] .*'experts.gate_up_proj' and "
                                            r"'experts.down_proj' name for adapters on every expert"):
            apply_lora(load_policy(folder), 4, 8, 0.0, names, exclude_vision=True)


def test_glm4v_lora_targets_its_own_layer_names_and_a_name_it_lacks_is_one_line(tiny_vlm_dir):
    """LoRA on GLM-4.1V: 'all-linear' and its own names (q/k/v/o_proj, the fused gate_up_proj, down_proj) wrap the
    language model; Qwen's 'gate_proj', which GLM-4.1V has only in its vision tower, is refused when the tower is
    frozen instead of training on the rest of the list."""
    from vlrft.models.actor import apply_lora

    adapted = apply_lora(load_policy(tiny_vlm_dir("glm4v")), 4, 8, 0.0, ["all-linear"], exclude_vision=True)
    wrapped = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if ".lora_A." in n}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert not any("visual" in n and "lora_" in n for n, _ in adapted.named_parameters())
    named = apply_lora(load_policy(tiny_vlm_dir("glm4v")), 4, 8, 0.0, ["q_proj", "gate_up_proj"])
    assert sum(".lora_A." in n for n, _ in named.named_parameters()) == 2 * 2  # two layers, two names
    with pytest.raises(UserError, match=r"\['gate_proj'\] name no linear layer of Glm4vForConditionalGeneration "
                                        r"outside the frozen vision tower; its linear layers are .*'gate_up_proj'"):
        apply_lora(load_policy(tiny_vlm_dir("glm4v")), 4, 8, 0.0, ["q_proj", "gate_proj"], exclude_vision=True)


@pytest.mark.parametrize("arch,tower,units", [
    ("internvl", {"q_proj", "k_proj", "v_proj", "projection_layer", "fc1", "fc2"},
     ["Qwen2DecoderLayer"] * 2 + ["InternVLVisionLayer"] * 2),
    ("llava_onevision", {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"},
     ["Qwen2DecoderLayer"] * 2 + ["SiglipEncoderLayer"] * 2 + ["SiglipVisionEmbeddings"])])
def test_internvl_and_llava_onevision_lora_names_and_fsdp2_units(arch, tower, units, tiny_vlm_dir):
    """LoRA on InternVL 3 and LLaVA-OneVision (Qwen2 language models): 'all-linear' with the tower frozen wraps the
    decoder's q/k/v/o and gate/up/down projections and the projector between tower and language model (linear_1,
    linear_2, outside the tower), nothing in the tower (InternViT: q/k/v_proj, projection_layer, fc1/fc2; SigLIP:
    q/k/v/out_proj, fc1/fc2); with the tower, its layers too; a name the model lacks is one line listing its own.
    FSDP2's units are the classes of their `_no_split_modules` (two ranks train sharded by them in
    tests/test_families_distributed.py)."""
    from vlrft.models.actor import apply_lora
    from vlrft.parallel.fsdp2 import shard_units

    folder = tiny_vlm_dir(arch)
    model = load_policy(folder)
    assert set(units) <= set(model._no_split_modules)
    assert sorted(type(u).__name__ for u in shard_units(model)) == sorted(units)
    frozen = apply_lora(load_policy(folder), 4, 8, 0.0, ["all-linear"], exclude_vision=True)
    wrapped = {n.split(".lora_A.")[0] for n, _ in frozen.named_parameters() if ".lora_A." in n}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj", "linear_1", "linear_2"}
    assert not any(".vision_tower." in n for n in wrapped)
    full = apply_lora(load_policy(folder), 4, 8, 0.0, ["all-linear"])
    in_tower = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in full.named_parameters()
                if ".lora_A." in n and ".vision_tower." in n}
    assert in_tower == tower
    with pytest.raises(UserError, match=r"\['gate_up_proj'\] name no linear layer of .* its linear layers are"):
        apply_lora(load_policy(folder), 4, 8, 0.0, ["q_proj", "gate_up_proj"], exclude_vision=True)


def test_smolvlm_lora_wraps_its_llama_and_connector_and_the_tower_unless_frozen(tiny_vlm_dir):
    """LoRA on SmolVLM: 'all-linear' wraps the Llama's projections and the connector's (model.connector, outside the
    tower freeze_vision_tower freezes), and the SigLIP tower's (q/k/v/out_proj, fc1, fc2) only when it trains."""
    from vlrft.models.actor import apply_lora

    def wrapped(model, where):
        return {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters()
                if ".lora_A." in n and f".{where}." in n}

    frozen = apply_lora(load_policy(tiny_vlm_dir("smolvlm")), 4, 8, 0.0, ["all-linear"], exclude_vision=True)
    assert wrapped(frozen, "text_model") == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    assert wrapped(frozen, "connector") == {"proj"} and not wrapped(frozen, "vision_model")
    full = apply_lora(load_policy(tiny_vlm_dir("smolvlm")), 4, 8, 0.0, ["all-linear"])
    assert wrapped(full, "vision_model") == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
