"""The streamed Hugging Face export of a sharded policy (`vlrft.parallel.hf_export`) is what `save_pretrained` writes."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from _bucket_watch import BucketWatch
from vlrft.parallel.hf_export import INDEX, save_policy_streamed
from vlrft.models.loading import load_policy, load_processor
from vlrft.models.weights import PolicyWeights


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "internvl",
                                  "llava_onevision", "smolvlm"])
def test_streamed_export_holds_what_save_pretrained_writes_in_several_shard_files(tmp_path, tiny_vlm_dir, arch):
    from transformers import AutoModelForImageTextToText

    folder = tiny_vlm_dir(arch)
    model, processor = load_policy(folder, dtype="float32"), load_processor(folder)
    with torch.no_grad():  # weights that differ from the loaded checkpoint's
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    # The export first: save_pretrained records dtype and architectures in the model's config object, which the
    # export must write by itself.
    save_policy_streamed(model, processor, tmp_path / "streamed", is_main=True,
                         gather=lambda params: contextlib.nullcontext(), shard_bytes=1 << 16)
    model.save_pretrained(tmp_path / "reference", safe_serialization=True)

    reference, streamed = _tensors(tmp_path / "reference"), _tensors(tmp_path / "streamed")
    assert streamed.keys() == reference.keys()
    assert all(torch.equal(streamed[k], reference[k]) for k in reference)
    index = json.loads((tmp_path / "streamed" / INDEX).read_text())
    shards = sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    assert len(shards) > 3 and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in streamed.values())
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert config == json.loads((tmp_path / "reference" / "config.json").read_text())

    loaded, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "streamed", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    assert (tmp_path / "streamed" / "preprocessor_config.json").is_file() or \
        (tmp_path / "streamed" / "processor_config.json").is_file()


def test_rank_0_holds_one_bucket_at_a_time(tmp_path, tiny_vlm_dir, monkeypatch):
    """The point of the streamed export: while a bucket is gathered, the one written before it is already freed
    (a loop variable or `enumerate`'s cached tuple kept it alive, doubling rank 0's memory)."""
    folder = tiny_vlm_dir("qwen2_5_vl")
    model, processor = load_policy(folder, dtype="float32"), load_processor(folder)
    watch = BucketWatch(monkeypatch)
    save_policy_streamed(model, processor, tmp_path / "streamed", is_main=True, gather=watch.gather,
                         shard_bytes=1 << 16)
    assert len(watch.alive_at_each_gather) > 3 and len(watch.handed_out) == len(_tensors(tmp_path / "streamed"))
    assert watch.alive_at_each_gather == [0] * len(watch.alive_at_each_gather)


def test_other_ranks_write_nothing_and_keep_no_gathered_tensor(tmp_path, tiny_vlm_dir, monkeypatch):
    """A rank other than 0 only takes part in the gathers: what it receives is dropped at once."""
    folder = tiny_vlm_dir("qwen2_5_vl")
    model, processor = load_policy(folder, dtype="float32"), load_processor(folder)
    watch = BucketWatch(monkeypatch)
    handed_out = []
    watched = PolicyWeights._materialise

    def recording(weights, entry, device):
        tensor = watched(weights, entry, device)
        handed_out.append((tensor.device.type, tuple(tensor.shape)))
        return tensor

    monkeypatch.setattr(PolicyWeights, "_materialise", recording)
    save_policy_streamed(model, processor, tmp_path / "rank1", is_main=False, gather=watch.gather,
                         shard_bytes=1 << 16)
    assert not (tmp_path / "rank1").exists()
    assert len(watch.alive_at_each_gather) > 3
    assert watch.alive_at_each_gather == [0] * len(watch.alive_at_each_gather)
    expected = {tuple(p.shape) for p in model.state_dict().values()}
    assert handed_out and all(kind == "meta" for kind, _ in handed_out)
    assert {shape for _, shape in handed_out} <= expected
