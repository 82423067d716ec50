"""Reward model: a real (tiny, random-weight) transformers sequence classifier scoring prompt + completion."""

from __future__ import annotations

import pytest
import torch

from vlrft.config import RewardConfig
from vlrft.config import RewardFunctionConfig as F
from vlrft.errors import ConfigError
from vlrft.rewards import RewardError, RewardSet

PROMPTS = ["What color is the shape?", "How many shapes are there?", "Which shape is in the image?"]
COMPLETIONS = ["red", "<think>one two three</think><answer>3</answer>", "The shape in the image is a small blue triangle."]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from vlrft.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    folder = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _score_one_by_one(folder, texts: list[str], max_length: int | None = None) -> list[float]:
    """Expected values: each text alone (no padding), optionally keeping its last `max_length` tokens."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if max_length is not None:
            ids = ids[-max_length:]
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


def test_batched_scores_equal_single_forward_passes(rm_dir):
    rs = RewardSet.from_config(RewardConfig(functions=[F(
        "reward_model", kwargs={"path": str(rm_dir), "batch_size": 2, "use_chat_template": False}
    )]))
    result = rs.score(COMPLETIONS, prompts=PROMPTS)
    expected = _score_one_by_one(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert result.per_function["reward_model"].tolist() == pytest.approx(expected, abs=1e-4)
    assert len(set(expected)) == 3  # the model really tells the texts apart


def test_chat_template_is_applied_when_the_tokenizer_has_one(rm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
             for p, c in zip(PROMPTS, COMPLETIONS)]
    assert all("<|im_start|>assistant" in t for t in texts)
    rs = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={"path": str(rm_dir)})]))
    result = rs.score(COMPLETIONS, prompts=PROMPTS)
    assert result.total.tolist() == pytest.approx(_score_one_by_one(rm_dir, texts), abs=1e-4)


def test_long_texts_keep_their_end(rm_dir):
    rs = RewardSet.from_config(RewardConfig(functions=[F(
        "reward_model", kwargs={"path": str(rm_dir), "max_length": 6, "use_chat_template": False}
    )]))
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rs.score(COMPLETIONS, prompts=PROMPTS).total.tolist() == pytest.approx(_score_one_by_one(rm_dir, texts, 6), abs=1e-4)


def test_model_loads_lazily_and_once(rm_dir):
    rs = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={"path": str(rm_dir)})]))
    rm = rs.callables["reward_model"].fn
    assert rm._model is None  # building the reward set loads nothing
    rs.score(COMPLETIONS[:1], prompts=PROMPTS[:1])
    model = rm._model
    rs.score(COMPLETIONS, prompts=PROMPTS)
    assert rm._model is model
    assert not any(p.requires_grad and p.grad is not None for p in model.parameters())
    rs.close()
    assert rm._model is None


def test_reward_model_config_errors(rm_dir):
    with pytest.raises(ConfigError, match="needs kwargs.path"):
        RewardSet.from_config(RewardConfig(functions=[F("reward_model")]))
    rs = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={"path": str(rm_dir), "label_index": 3})]))
    with pytest.raises(RewardError, match="label_index=3 but .* has 1 label"):
        rs.score(["a"], prompts=["b"])


@pytest.mark.slow
def test_a_slow_load_does_not_count_against_the_scoring_timeout(rm_dir, monkeypatch):
    """A large reward model read from shared storage can take longer than reward.timeout_s: loaded by `prepare`
    (the trainer and the reward server call it at start), scoring is not timed out by the load."""
    import time

    from vlrft.rewards.reward_model import RewardModel

    load = RewardModel._load

    def slow(self):
        time.sleep(1.5)
        load(self)

    monkeypatch.setattr(RewardModel, "_load", slow)
    config = RewardConfig(functions=[F("reward_model", kwargs={"path": str(rm_dir)})], timeout_s=1.0)
    lazy = RewardSet.from_config(config)
    with pytest.raises(RewardError, match="did not finish within reward.timeout_s=1"):
        lazy.score(COMPLETIONS[:1], prompts=PROMPTS[:1])
    prepared = RewardSet.from_config(config)
    prepared.prepare()
    assert prepared.callables["reward_model"].fn._model is not None
    assert len(prepared.score(COMPLETIONS, prompts=PROMPTS).total) == 3


def test_the_default_dtype_is_bfloat16_on_a_gpu_and_float32_on_the_cpu(rm_dir):
    from vlrft.rewards.reward_model import load_dtype

    assert load_dtype("auto", "cuda:3") == "bfloat16" and load_dtype("auto", "cpu") == "float32"
    assert load_dtype("float16", "cuda:0") == "float16"  # an explicit dtype wins
    rs = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={"path": str(rm_dir)})]))
    rs.prepare()
    assert next(rs.callables["reward_model"].fn._model.parameters()).dtype == torch.float32  # this machine: CPU



def _device_of_each_call(rm) -> list[list[torch.Tensor]]:
    """The reward model's parameters as each forward saw them."""
    seen = []
    rm._model.register_forward_pre_hook(lambda module, args: seen.append([p.data for p in module.parameters()]))
    return seen


def test_offloaded_weights_are_copied_for_each_call_and_dropped_after(rm_dir):
    """`offload` (on by default on a GPU): between calls the weights are the host copies; each call scores on fresh
    device copies (real copies here, CPU to CPU) and gives the same scores as a resident model."""
    kwargs = {"path": str(rm_dir), "batch_size": 2, "use_chat_template": False}
    resident = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs=kwargs)]))
    offloaded = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={**kwargs, "offload": True})]))
    resident.prepare()
    offloaded.prepare()
    assert resident.callables["reward_model"].fn._host_weights is None  # CPU: off by default
    rm = offloaded.callables["reward_model"].fn
    host = [p.data for p in rm._model.parameters()]
    seen = _device_of_each_call(rm)
    expected = resident.score(COMPLETIONS, prompts=PROMPTS).total.tolist()
    assert offloaded.score(COMPLETIONS, prompts=PROMPTS).total.tolist() == pytest.approx(expected, abs=1e-6)
    assert len(seen) == 2  # two batches of 2, 1
    for copies in seen:
        assert all(c.data_ptr() != h.data_ptr() for c, h in zip(copies, host))
        assert [c.tolist() for c in copies[:2]] == [h.tolist() for h in host[:2]]
    assert [p.data_ptr() for p in rm._model.parameters()] == [h.data_ptr() for h in host]  # back on the host copies


def test_host_resident_weights_copy_a_tied_weight_once_and_restore_buffers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlrft.rewards.reward_model import HostResidentWeights

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = HostResidentWeights(model, "cpu")
    rotary = model.model.rotary_emb.inv_freq
    with weights.on_device():
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # one copy
        assert model.lm_head.weight.data_ptr() != weights.parameters[0][1].data_ptr()
        assert model.model.rotary_emb.inv_freq is not rotary and torch.equal(model.model.rotary_emb.inv_freq, rotary)
    assert model.model.rotary_emb.inv_freq is rotary


@pytest.fixture(scope="module")
def wide_rm_dir(tmp_path_factory):
    """A reward model whose weights (137 MB in float32) outweigh what CUDA keeps after a first matmul (cuBLAS
    workspaces: 33 MiB per thread's handle on an H100), so memory held between calls tells the weights apart."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from vlrft.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide_rm")
    Qwen2ForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the reward model's GPU offload needs a CUDA device and none is visible")
def test_on_a_gpu_the_reward_model_takes_memory_only_while_it_scores(wide_rm_dir):
    kwargs = {"path": str(wide_rm_dir), "use_chat_template": False, "dtype": "float32"}
    on_cpu = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={**kwargs, "device": "cpu"})]))
    on_gpu = RewardSet.from_config(RewardConfig(functions=[F("reward_model", kwargs={**kwargs, "device": "cuda:0"})]))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    on_gpu.prepare()
    rm = on_gpu.callables["reward_model"].fn
    assert rm._host_weights is not None and torch.cuda.memory_allocated() == before  # offload is the GPU default
    assert all(p.is_pinned() for p in rm._model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in rm._model.parameters())
    seen = _device_of_each_call(rm)
    scores = on_gpu.score(COMPLETIONS, prompts=PROMPTS).total.tolist()
    assert scores == pytest.approx(on_cpu.score(COMPLETIONS, prompts=PROMPTS).total.tolist(), abs=1e-4)
    assert seen and all(p.is_cuda for p in seen[0])
    for call in range(3):
        if call:
            on_gpu.score(COMPLETIONS, prompts=PROMPTS)
        seen.clear()  # the hook's references to the call's copies
        torch.cuda.synchronize()
        # Kept after a call: cuBLAS workspaces of the scoring threads' handles (33 MiB each on an H100), not the
        # weights, which alone would be weight_bytes more.
        assert torch.cuda.memory_allocated() - before < weight_bytes
