"""Multi-turn rollouts with tools: one tokenization across turns, images mid-trajectory, sampled-token-only training."""

from pathlib import Path

import pytest
import torch

from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.data.processor import _pixel_bounds
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_policy, load_processor
from vlrft.rollout.base import FINISH_LENGTH, SamplingParams
from vlrft.rollout.hf import HFEngine
from vlrft.rollout.multiturn import MultiTurnEngine, Trajectories, install_tool_prompt
from vlrft.tokens import TokenSpec
from vlrft.tools import Tool, ToolCall, ToolOutput, ToolSet
from vlrft.tools.builtin import zoom

TOOLS = Path(__file__).parent / "data" / "multiturn_tools.py"
DATA = DataConfig(min_pixels=784, max_pixels=3136)


class RecordingEngine:
    """The real transformers engine, recording every request it is given and what it sampled."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, batch, sampling):
        out = self.inner.generate(batch, sampling)
        self.calls.append((batch, out))
        return out


def scripted(call, context):
    """Image for sample 'a' (then text), text for 'b', an error for 'c' on turn 2, done for 'd'."""
    sid = context.sample.id
    if sid == "a" and context.turn == 1:
        return zoom(ToolCall("zoom", {"region": "center"}), context)
    if sid == "c" and context.turn == 2:
        raise ValueError("the region is outside the image")
    if sid == "d":
        return ToolOutput(text="done", reward=0.5, done=True)
    return f"turn {context.turn} of {sid}"


@pytest.fixture(scope="module")
def setup(tiny_vlm_dir, tmp_path_factory):
    from PIL import Image

    folder = tiny_vlm_dir("qwen2_vl")
    processor = load_processor(folder)
    model = load_policy(folder).eval()
    bias = torch.zeros(model.lm_head.weight.shape[0])  # turns of a few tokens that end with the end-of-turn token
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    bias[list(tokens.eos_ids)] = 6.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    root = tmp_path_factory.mktemp("imgs")
    Image.new("RGB", (112, 112), (220, 30, 30)).save(root / "red.png")
    encoder = PromptEncoder(processor, DATA)
    tools = ToolSet([Tool("look", scripted, "look closer", {"type": "object", "properties": {}})], timeout_s=5)
    install_tool_prompt(encoder, tools.schemas)
    samples = [Sample(id="a", prompt="<image>What is it?", images=[str(root / "red.png")]),
               Sample(id="b", prompt="Say something."),
               Sample(id="c", prompt="<image>Which colour?", images=[str(root / "red.png")]),
               Sample(id="d", prompt="Count.")]
    batch = encoder.encode(samples).batch
    recorder = RecordingEngine(HFEngine(lambda: model, processor, tokens))
    engine = MultiTurnEngine(recorder, processor, tokens, tools, max_turns=3, max_trajectory_tokens=400,
                             image_bounds=_pixel_bounds(processor.image_processor, DATA), merge_size=2,
                             parse_call=lambda text: ToolCall("look", {}))
    torch.manual_seed(0)
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=8))
    return processor, model, tokens, batch, out, recorder.calls


@pytest.mark.slow
def test_the_tools_are_described_in_the_prompt(setup):
    processor, _, _, batch, _, _ = setup
    # the tiny model's template has no tool support: the Qwen-style tool text goes into the system turn
    assert '<tools>\n{"type": "function", "function": {"name": "look"' in processor.tokenizer.decode(batch.prompt_ids[1])


def test_every_turn_is_sampled_from_exactly_the_ids_and_images_the_trainer_sees(setup):
    processor, _, tokens, batch, out, calls = setup
    assert isinstance(out, Trajectories) and len(out) == 8
    assert len(calls) == max(out.turns)
    assert len(set(out.turns)) > 1  # different turn counts in one batch, and nothing hung
    spans = [[] for _ in range(len(out))]
    for k, (context, sampled) in enumerate(calls):
        rows = [r for r in range(len(out)) if out.turns[r] > k]  # live rows, in row order
        # the first turn samples n per prompt (the prompt shared by its group), later turns one per live row
        assert len(rows) == (len(context) * out.n if k == 0 else len(context)) == len(sampled)
        for j, r in enumerate(rows):
            prompt = batch.prompt_ids[out.prompt_index[r]]
            full = prompt + out.completion_ids[r]
            c = out.prompt_index[r] if k == 0 else j
            ctx = context.prompt_ids[c]
            assert full[:len(ctx)] == ctx  # the engine ran our ids, byte for byte
            ids = sampled.completion_ids[j]
            start = len(ctx) - len(prompt)
            assert out.completion_ids[r][start:start + len(ids)] == ids  # and we kept what it sampled
            assert out.logprobs[r][start:start + len(ids)] == sampled.logprobs[j]
            spans[r].extend(range(start, start + len(ids)))
            # its images: the prompt's, then the tools' so far, with grids that match the placeholders
            seen = context.visual.select([c])
            seen.check([ctx], tokens.image_token_id, tokens.video_token_id, ["row"])
            final = out.row_visual(batch, r)
            if seen.pixel_values is not None:
                assert torch.equal(final.pixel_values[:seen.pixel_values.shape[0]], seen.pixel_values)
    for r in range(len(out)):
        assert [i for i, m in enumerate(out.sampled_mask[r]) if m] == spans[r]  # mask = sampled tokens, nothing else
        out.row_visual(batch, r).check([batch.prompt_ids[out.prompt_index[r]] + out.completion_ids[r]],
                                       tokens.image_token_id, tokens.video_token_id, ["row"])


def test_tool_outputs_errors_rewards_and_done_are_recorded(setup):
    processor, _, _, batch, out, _ = setup
    decoded = [processor.tokenizer.decode(ids) for ids in out.completion_ids]
    rows_a, rows_c, rows_d = [0, 1], [4, 5], [6, 7]
    assert all(out.observation_visual[r] is not None and len(out.observation_images[r]) == 1 for r in rows_a)
    assert all(out.observation_visual[r] is None for r in range(2, 8))
    for r in rows_c:
        if out.turns[r] == 3:  # its second turn called the tool, which failed: the model read the error
            assert "Error: ValueError: the region is outside the image" in decoded[r]
            assert out.tool_stats[r].errors == 1
    assert sum(out.tool_stats[r].errors for r in rows_c) >= 1  # the run went on past the failing tool
    assert all(out.turns[r] == 1 and out.tool_rewards[r] == 0.5 for r in rows_d if out.tool_stats[r].calls)
    assert "<tool_response>" not in out.texts[2]  # rewards read the model's own turns only
    metrics = out.metrics()
    assert metrics["tools/turns"] == (float(sum(out.turns)), 8.0)


def _logprobs_of_full_forward(model, tokens, ids, visual, start, count):
    """Logprobs of ids[start:start+count] from one plain forward over the whole conversation (no padding)."""
    from vlrft.vision import mm_token_type_ids

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                       mm_token_type_ids=mm_token_type_ids(input_ids, tokens.image_token_id, tokens.video_token_id),
                       **visual.model_inputs()).logits[0].float()
    logits[:, list(tokens.suppressed_ids)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[start + t - 1, ids[start + t]] for t in range(count)])


def test_training_logprobs_equal_the_engine_and_a_single_forward_over_the_conversation(setup):
    processor, model, tokens, batch, out, _ = setup
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    # groups sharing their prompt with tool images / without / one row per prompt (a full forward per row)
    for rows in (list(range(len(out))), [2, 3, 6, 7], [0, 2, 4]):
        seqs = out.sequences(batch, rows, tokens.pad_id)
        with torch.no_grad():
            lp = actor.logprobs(seqs).logprobs
        for i, r in enumerate(rows):
            mask = torch.tensor(out.sampled_mask[r], dtype=torch.bool)
            assert torch.allclose(lp[i, :len(mask)][mask], torch.tensor(out.logprobs[r])[mask], atol=1e-4), r
            assert torch.all(lp[i, :len(mask)][~mask] == 0)
    r = 0  # a row with an image that arrived after generated text
    prompt = batch.prompt_ids[out.prompt_index[r]]
    full = prompt + out.completion_ids[r]
    single = _logprobs_of_full_forward(model, tokens, full, out.row_visual(batch, r), len(prompt),
                                       len(out.completion_ids[r]))
    mask = torch.tensor(out.sampled_mask[r], dtype=torch.bool)
    assert torch.allclose(single[mask], torch.tensor(out.logprobs[r])[mask], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llava_onevision", "internvl", "smolvlm", "gemma3"])
def test_image_tools_in_a_batch_of_image_prompts_sample_what_the_trainer_scores(arch, tiny_vlm_dir, tmp_path):
    """The 1-D-position families (sampled through the group decoder at 1-D positions), two image prompts each getting a tool image: every second
    turn samples from the prompt's image and the tool's (each encoded as its processor encodes them: LLaVA-OneVision
    crops an image alone by anyres, so a trajectory holds two groups of crops), and the trainer's logprobs of the
    sampled tokens over the whole trajectory equal the engine's."""
    from PIL import Image

    folder = tiny_vlm_dir(arch)
    processor, model = load_processor(folder), load_policy(folder).eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    encoder = PromptEncoder(processor, DATA)
    tools = ToolSet([Tool("look", lambda call, context: zoom(ToolCall("zoom", {"region": "center"}), context),
                          "look closer", {"type": "object", "properties": {}})], timeout_s=5)
    samples = [Sample(id="wide", prompt="<image>What is it?", images=[Image.effect_noise((224, 112), 60).convert("RGB")]),
               Sample(id="tall", prompt="<image>Where?", images=[Image.effect_noise((112, 224), 50).convert("RGB")])]
    batch = encoder.encode(samples).batch
    engine = MultiTurnEngine(HFEngine(lambda: model, processor, tokens), processor, tokens, tools, max_turns=2,
                             max_trajectory_tokens=400, image_bounds=_pixel_bounds(processor.image_processor, DATA),
                             merge_size=encoder.merge_size, parse_call=lambda text: ToolCall("look", {}))
    # every token ends a turn, so each first turn is one token long and calls the tool
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=4, stop_token_ids=tuple(range(model.config.get_text_config().vocab_size))))
    assert out.turns == [2, 2, 2, 2] and out.metrics()["tools/images_returned"][0] == 4
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    with torch.no_grad():
        lp = actor.logprobs(out.sequences(batch, list(range(len(out))), tokens.pad_id)).logprobs
    for r in range(len(out)):
        mask = torch.tensor(out.sampled_mask[r], dtype=torch.bool)
        assert torch.allclose(lp[r, :len(mask)][mask], torch.tensor(out.logprobs[r])[mask], atol=1e-4), r


def test_tool_output_tokens_get_no_gradient(setup):
    _, model, tokens, batch, out, _ = setup
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    rows = list(range(len(out)))
    seqs = out.sequences(batch, rows, tokens.pad_id)
    result = actor.logprobs(seqs)
    observation = torch.zeros_like(seqs.completion_mask, dtype=torch.bool)
    for i, r in enumerate(rows):
        observation[i, :len(out.sampled_mask[r])] = torch.tensor(out.sampled_mask[r]) == 0
    assert observation.sum() > 100  # tool outputs, templates and image placeholders
    params = [p for p in model.parameters() if p.requires_grad]
    leak = result.logprobs[observation].sum() + result.entropy[observation].sum()
    grads = torch.autograd.grad(leak, params, allow_unused=True, retain_graph=True)
    assert all(g is None or not g.any() for g in grads)
    sampled = result.logprobs[~observation & seqs.completion_mask.bool()].sum()
    assert any(g is not None and g.any() for g in torch.autograd.grad(sampled, params, allow_unused=True))


def test_the_token_budget_truncates_a_trajectory(setup):
    processor, model, tokens, batch, _, _ = setup
    tools = ToolSet([Tool("look", lambda call, ctx: "x " * 30, "d", {"type": "object", "properties": {}})])
    engine = MultiTurnEngine(HFEngine(lambda: model, processor, tokens), processor, tokens, tools, max_turns=5,
                             max_trajectory_tokens=60, merge_size=2, parse_call=lambda text: ToolCall("look", {}))
    out = engine.generate(batch.select([1]), SamplingParams(n=2, max_new_tokens=8))
    assert all(len(ids) <= 60 for ids in out.completion_ids)
    assert all(reason == FINISH_LENGTH for reason in out.finish_reasons)
    assert all(t < 5 for t in out.turns)


def test_groups_are_selected_and_concatenated_whole(setup):
    _, _, _, _, out, _ = setup
    part = out.select_groups([3, 0])
    assert isinstance(part, Trajectories) and part.completion_ids == [out.completion_ids[r] for r in (6, 7, 0, 1)]
    assert part.sampled_mask[2] == out.sampled_mask[0] and part.observation_visual[1] is None
    both = Trajectories.concat([part, out.select_groups([1])])
    assert len(both) == 6 and both.turns[4:] == out.turns[2:4]


def _config(tmp_path, model_dir, shapes, *overrides):
    from vlrft.config import load_config

    rewards = Path(__file__).parent / "data" / "trainer_rewards.py"
    stops = ",".join(str(i) for i in range(100, 160))  # short turns from an untrained model
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
        "data.min_pixels=784", "data.max_pixels=3136", "rollout.n=2", "rollout.global_batch_completions=4",
        "rollout.max_new_tokens=6", f"rollout.stop_token_ids=[{stops}]",
        f"rollout.tools=[{{name: '{TOOLS}:look'}}]", f"rollout.tool_parser={TOOLS}:always_call", "rollout.max_turns=3",
        "rollout.max_trajectory_tokens=300", f"reward.functions=[{{name: '{rewards}:text_hash'}}]",
        f"train.output_dir={tmp_path / 'run'}", "train.total_steps=2", "train.lr=1e-3",
        "train.micro_batch_completions_per_rank=4", "train.eval_every=0", "logging.progress=false",
        "logging.completions_every=0", *overrides])


def test_two_training_steps_with_a_tool(tmp_path, tiny_vlm_dir, monkeypatch):
    from examples.shapes import ShapesSpec, make_shapes
    from vlrft.trainer import Trainer, trainer as trainer_module

    shapes = make_shapes(tmp_path / "shapes", ShapesSpec(train_size=8, test_size=2))
    seen = []
    real = trainer_module.make_experience

    def recording(trainer, collected):
        exp = real(trainer, collected)
        seen.append((collected, exp))
        return exp

    monkeypatch.setattr(trainer_module, "make_experience", recording)
    trainer = Trainer(_config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "logging.completions_every=2",
                              "logging.completions_rows=4"))
    history = trainer.fit()
    # the completions table holds whole trajectories: every turn, the calls, what the tools answered, their images
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    table = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(table) == 4 and all(row["turns"] == sum(s["role"] == "assistant" for s in row["trajectory"])
                                   for row in table)
    zoomed = [s for row in table for s in row["trajectory"] if s["role"] == "tool" and s["images"]]
    assert zoomed and all(s["call"]["name"] == "look" and "Zoomed into" in s["text"] for s in zoomed)
    assert all(len(s["image_files"]) == s["images"] and (tmp_path / "run" / s["image_files"][0]).exists()
               for s in zoomed)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "[tool look" in text and "Zoomed into" in text and "[image]" in text
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history if "loss" in h)
    assert history[-1]["tools/calls"] > 0 and "tools/errors" in history[-1] and history[-1]["tools/turns"] > 1
    for collected, exp in seen:
        rollouts = collected.rollouts
        assert isinstance(rollouts, Trajectories)
        assert any(v is not None for v in rollouts.observation_visual)  # images arrived mid-trajectory
        for r, sampled in enumerate(rollouts.sampled_mask):
            sampled = torch.tensor(sampled, dtype=torch.float32)
            assert torch.equal(exp.token_mask[r, :len(sampled)], sampled)  # only sampled tokens count
            assert exp.mask[r].sum() <= sampled.sum() and exp.mask[r, len(sampled):].sum() == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_with_different_turn_counts_stay_in_step(tmp_path, tiny_vlm_dir):
    """Two ranks (torchrun, gloo): each rank's trajectories take their own number of turns; training stays in step."""
    import json

    from _torchrun import failure_output, torchrun
    from examples.shapes import ShapesSpec, make_shapes

    shapes = make_shapes(tmp_path / "shapes", ShapesSpec(train_size=8, test_size=2))
    cfg = _config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes)
    overrides = [f"model.path={cfg.model.path}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
                 "data.min_pixels=784", "data.max_pixels=3136", "rollout.n=2", "rollout.global_batch_completions=8",
                 "rollout.max_new_tokens=6", f"rollout.stop_token_ids={cfg.rollout.stop_token_ids}",
                 f"rollout.tools=[{{name: '{TOOLS}:look'}}]", f"rollout.tool_parser={TOOLS}:always_call",
                 "rollout.max_turns=3", "rollout.max_trajectory_tokens=300",
                 f"reward.functions=[{{name: '{Path(__file__).parent / 'data' / 'trainer_rewards.py'}:text_hash'}}]",
                 f"train.output_dir={tmp_path / 'run'}",
                 "train.total_steps=2", "train.lr=1e-3", "train.micro_batch_completions_per_rank=2",
                 "train.eval_every=0", "train.strategy=ddp", "logging.progress=false", "logging.completions_every=0"]
    out, base = tmp_path / "result.json", tmp_path / "base.yaml"
    base.write_text("{}\n")
    proc = torchrun("dist_train_worker.py", str(base), str(out), *overrides, cwd=tmp_path, outputs=(out, tmp_path / "run"))
    assert proc.returncode == 0, failure_output(proc)
    result = json.loads(out.read_text())
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    steps = [h for h in result["history"] if h.get("step", 0) > 0]
    assert [h["step"] for h in steps] == [1, 2] and all(h["tools/calls"] > 0 for h in steps)


def test_vllm_and_sglang_requests_carry_the_images_that_arrived_mid_trajectory(setup):
    """The later turns' requests (pure Python, no engine): each tool image is one more item, in order."""
    from vlrft.rollout.requests import expand_vision_placeholders, sglang_requests, tokens_per_item, vllm_requests

    _, _, tokens, _, out, calls = setup
    context = calls[1][0]  # the second turn's requests: rows of sample 'a' carry the zoomed image
    with_tool_image = [j for j in range(len(context)) if len(context.images[j]) == 2]
    assert with_tool_image
    for j, request in zip(range(len(context)), vllm_requests(context, tokens)):
        assert request.payload.get("multi_modal_data", {}).get("image", []) == list(context.images[j])
        visual = context.visual.select([j])
        assert expand_vision_placeholders(request.payload["prompt_token_ids"], tokens.image_token_id,
                                          tokens.video_token_id, tokens_per_item(visual.image_grid_thw, 2), []) \
            == context.prompt_ids[j]
    for j, request in zip(range(len(context)), sglang_requests(context)):
        assert request.payload["input_ids"] == context.prompt_ids[j]
        if j in with_tool_image:
            item = request.payload["image_data"][0]
            assert item["image_grid_thw"].shape[0] == 2
            assert torch.equal(item["pixel_values"], context.visual.select([j]).pixel_values)


def test_a_template_that_renders_tools_gets_the_schemas_through_tools(tiny_vlm_dir):
    """Where the chat template supports `tools`, the schemas go through it (no system text is added)."""
    import copy

    processor = copy.deepcopy(load_processor(tiny_vlm_dir("qwen2_vl")))
    template = processor.chat_template
    processor.chat_template = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}"
                               "{% endfor %}<|im_end|>\n{% endif %}" + template)
    encoder = PromptEncoder(processor, DATA)
    schemas = [{"type": "function", "function": {"name": "zoom", "description": "d", "parameters": {}}}]
    install_tool_prompt(encoder, schemas)
    assert encoder.tools == schemas and encoder.tool_prompt is None
    ids = encoder.encode([Sample(id="x", prompt="Hello?")]).batch.prompt_ids[0]
    assert processor.tokenizer.decode(ids).startswith("<|im_start|>system\nTOOLS: zoom<|im_end|>")


def test_describe_tools_false_keeps_the_schemas_out_of_every_prompt(tiny_vlm_dir):
    """`rollout.describe_tools: false` (the zoom demo's one-word calls): the prompt is the question alone, not
    hundreds of tokens of JSON schema; true (the default) puts the schemas in the system text."""
    from types import SimpleNamespace

    from vlrft.config import load_config

    processor = load_processor(tiny_vlm_dir("qwen2_vl"))
    lengths = {}
    for describe in (True, False):
        cfg = load_config(None, ["rollout.tools=[{name: zoom}]", f"rollout.describe_tools={str(describe).lower()}"])
        encoder = PromptEncoder(processor, DATA)
        deps = SimpleNamespace(encoder=encoder, processor=processor, tokens=None, strategy=None)
        MultiTurnEngine.from_deps(cfg, deps, engine=None)
        ids = encoder.encode([Sample(id="x", prompt="Hello?")]).batch.prompt_ids[0]
        text = processor.tokenizer.decode(ids)
        assert ('"name": "zoom"' in text) is describe
        lengths[describe] = len(ids)
    assert lengths[False] < lengths[True] / 5


def test_a_rank_whose_trajectories_ended_keeps_calling_the_engine_while_another_goes_on(setup):
    """Ranks sharing an engine (tensor-parallel vLLM/SGLang, a gathered policy) call it together: a rank whose
    trajectories are done calls it on an empty batch for as long as any rank's go on, then all stop together."""
    processor, model, tokens, batch, _, _ = setup
    tools = ToolSet([Tool("look", lambda call, ctx: ToolOutput(text="ok", done=True), "d",
                          {"type": "object", "properties": {}})])
    for others_going, expected_calls in ((True, 4), (False, 1)):
        recorder = RecordingEngine(HFEngine(lambda: model, processor, tokens))
        asked = []

        def any_rank_going(going, others=others_going):
            asked.append(going)
            return going or others

        engine = MultiTurnEngine(recorder, processor, tokens, tools, max_turns=4, max_trajectory_tokens=400,
                                 merge_size=2, parse_call=lambda text: ToolCall("look", {}),
                                 any_rank_going=any_rank_going)
        out = engine.generate(batch.select([1, 3]), SamplingParams(n=2, max_new_tokens=4))
        assert out.turns == [1, 1, 1, 1]  # this rank's trajectories all ended after their first turn
        assert len(recorder.calls) == expected_calls and asked[0] is False
        assert all(len(b) == 0 and len(o) == 0 for b, o in recorder.calls[1:])  # the lockstep calls: empty


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_text_tool_rows_in_mixed_width_classes_equal_a_plain_forward_of_each_conversation(arch, tiny_vlm_dir):
    """Rows whose tools answered with text only: no tool images, so the shared forward splits the completions into
    width classes. A row's width is its last sampled position, not its count of sampled tokens (the observation holes
    in the middle count too): logprobs, entropies and gradients equal a plain transformers forward of each whole
    conversation."""
    folder = tiny_vlm_dir(arch)
    processor = load_processor(folder)
    model = load_policy(folder)
    tokens = TokenSpec.from_model(processor, model.config)
    batch = PromptEncoder(processor, DataConfig()).encode([Sample(id="t", prompt="Count the apples")]).batch
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(10, 200, (n,), generator=gen).tolist()  # noqa: E731  ordinary text tokens
    # 40 sampled + 20 observation + 40 sampled tokens; a 3-token answer; 5 + 30 observation + 2
    masks = [[1] * 40 + [0] * 20 + [1] * 40, [1] * 3, [1] * 5 + [0] * 30 + [1] * 2]
    out = Trajectories(n=3, completion_ids=[ids(len(m)) for m in masks], finish_reasons=["stop"] * 3,
                       sampled_mask=masks, observation_visual=[None] * 3, observation_images=[[]] * 3,
                       turns=[2, 1, 2], tool_rewards=[0.0] * 3, tool_stats=[None] * 3)
    seqs = out.sequences(batch, [0, 1, 2], tokens.pad_id)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    classes = actor._width_classes(seqs)
    assert classes is not None and len(classes) > 1  # the path under test: several completion calls
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.rand(seqs.completion_mask.shape, generator=gen)

    result = actor.logprobs(seqs)
    got_grads = torch.autograd.grad(((result.logprobs + 0.1 * result.entropy) * weights).sum(), params,
                                    allow_unused=True)

    prompt = batch.prompt_ids[0]
    ref_lp, ref_ent, ref_loss = torch.zeros_like(weights), torch.zeros_like(weights), 0.0
    for i, completion in enumerate(out.completion_ids):
        full = torch.tensor([prompt + completion])
        logits = model(input_ids=full, attention_mask=torch.ones_like(full)).logits[0].float()
        log_p = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        lp = log_p.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        ent = -(log_p.exp() * log_p).sum(-1)
        mask = torch.tensor(masks[i], dtype=torch.float32)
        ref_lp[i, :len(completion)], ref_ent[i, :len(completion)] = lp * mask, ent * mask
        ref_loss = ref_loss + ((lp + 0.1 * ent) * mask * weights[i, :len(completion)]).sum()
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)

    sampled = seqs.completion_mask.bool()
    assert (result.logprobs.detach() - ref_lp)[sampled].abs().max() < 1e-5
    assert (result.entropy.detach() - ref_ent)[sampled].abs().max() < 1e-5
    for got, ref in zip(got_grads, ref_grads):
        if ref is None:
            assert got is None or not got.any()
            continue
        assert got is not None and (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())


class TextEngine:
    """Stand-in for sampling (nothing is sampled): turn k of sample `s` is the text `script[s][k - 1]`, ending with
    the end-of-turn token, or cut at max_new_tokens."""

    def __init__(self, tokenizer, eos, script):
        self.tokenizer, self.eos, self.script, self.turn = tokenizer, eos, script, 0

    def generate(self, batch, sampling):
        from vlrft.rollout.base import FINISH_STOP, Rollouts

        self.turn += 1
        ids, reasons = [], []
        for p in range(len(batch)):
            texts = self.script[batch.samples[p].id]
            turn = self.tokenizer.encode(texts[min(self.turn, len(texts)) - 1], add_special_tokens=False) + [self.eos]
            for _ in range(sampling.n):
                cut = len(turn) > sampling.max_new_tokens
                ids.append(turn[:sampling.max_new_tokens])
                reasons.append(FINISH_LENGTH if cut else FINISH_STOP)
        return Rollouts(n=sampling.n, completion_ids=ids, finish_reasons=reasons,
                        logprobs=[[0.0] * len(i) for i in ids],
                        texts=self.tokenizer.batch_decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def text_setup(tiny_vlm_dir):
    from transformers import AutoConfig

    folder = tiny_vlm_dir("qwen2_vl")
    processor = load_processor(folder)
    return processor, TokenSpec.from_model(processor, AutoConfig.from_pretrained(folder)), PromptEncoder(processor, DATA)


def _scripted_run(text_setup, script, tool, parser=None, max_turns=3, max_new_tokens=64):
    """Trajectories of the scripted turns (one per sample id in `script`), with one tool `look`."""
    from vlrft.tools import parse_qwen_tool_call

    processor, tokens, encoder = text_setup
    batch = encoder.encode([Sample(id=sid, prompt=f"Question {sid}?") for sid in script]).batch
    tools = ToolSet([Tool("look", tool, "look closer", {"type": "object", "properties": {}})], timeout_s=5)
    engine = MultiTurnEngine(TextEngine(processor.tokenizer, tokens.eos_ids[0], script), processor, tokens, tools,
                             max_turns=max_turns, max_trajectory_tokens=400, merge_size=2,
                             parse_call=parser or parse_qwen_tool_call)
    return engine.generate(batch, SamplingParams(n=1, max_new_tokens=max_new_tokens))


CALL = '<tool_call>{"name": "look", "arguments": {}}</tool_call>'


def test_a_parser_that_raises_or_returns_garbage_is_a_counted_error_the_model_reads(text_setup, caplog):
    def parser(text):
        if "oops" in text:
            raise KeyError("name")
        if "dict" in text:
            return {"name": "look", "arguments": {}}
        if "unhashable" in text:
            return ToolCall(["look"], {"region": {1, 2}})
        return ToolCall("look", {}) if "call" in text else None

    script = {"raises": ["oops", "oops", "the answer"], "dict": ["dict", "the answer"], "fine": ["call", "the answer"],
              "list": ["unhashable", "the answer"]}
    with caplog.at_level("WARNING", logger="vlrft.tools"):
        out = _scripted_run(text_setup, script, lambda call, ctx: "seen", parser=parser)
    processor = text_setup[0]
    decoded = [processor.tokenizer.decode(ids) for ids in out.completion_ids]
    assert out.turns == [3, 2, 2, 2] and out.texts == ["the answer"] * 4
    assert [s.parser_errors for s in out.tool_stats] == [2, 1, 0, 1]
    assert [s.calls for s in out.tool_stats] == [0, 0, 1, 0]
    assert decoded[0].count("<tool_response>\nError: ") == 2 and "KeyError" in decoded[0]
    assert "Error: " in decoded[1] and "dict" in decoded[1] and "seen" in decoded[2]
    warnings = [r.getMessage() for r in caplog.records if r.name == "vlrft.tools"]
    assert len(warnings) == 3 and all("tools/parser_errors" in w for w in warnings), warnings
    assert out.metrics()["tools/parser_errors"] == (4.0, 4.0)


def test_tool_rewards_that_are_not_finite_numbers_are_left_out_and_counted(text_setup):
    rewards = {"high": "high", "nan": float("nan"), "ok": 0.5}
    out = _scripted_run(text_setup, {sid: [CALL, "done"] for sid in rewards},
                        lambda call, ctx: ToolOutput(text="seen", reward=rewards[ctx.sample.id]))
    assert out.tool_rewards == [0.0, 0.0, 0.5]
    assert [s.bad_rewards for s in out.tool_stats] == [1, 1, 0] and out.turns == [2, 2, 2]


def test_a_call_left_at_max_turns_or_cut_at_max_new_tokens_is_counted_not_scored_silently(text_setup):
    """The last turn allowed still calling a tool ends the trajectory with finish reason "max_turns" and counts in
    tools/unanswered_calls; a call cut at max_new_tokens is not run (finish reason "length") and counts in
    tools/cut_calls."""
    from vlrft.rollout.multiturn import FINISH_MAX_TURNS

    long_call = '<tool_call>{"name": "look", "arguments": {"note": "' + "word " * 60 + '"}}</tool_call>'
    script = {"pending": [CALL, CALL], "answers": [CALL, "the answer"], "cut": [long_call], "plain": ["the answer"]}
    out = _scripted_run(text_setup, script, lambda call, ctx: "seen", max_turns=2, max_new_tokens=80)
    assert out.finish_reasons == [FINISH_MAX_TURNS, "stop", FINISH_LENGTH, "stop"]
    assert [s.unanswered_calls for s in out.tool_stats] == [1, 0, 0, 0]
    assert [s.cut_calls for s in out.tool_stats] == [0, 0, 1, 0]
    assert [s.calls for s in out.tool_stats] == [1, 1, 0, 0] and out.turns == [2, 2, 1, 1]
    metrics = out.metrics()
    assert metrics["tools/unanswered_calls"] == (1.0, 4.0) and metrics["tools/cut_calls"] == (1.0, 4.0)
    assert out.truncated == [False, False, True, False]


def test_whole_trajectories_are_recorded_turn_by_turn_and_only_shown_images_count(text_setup):
    """Each trajectory's transcript: every model turn, every call with its status, the observation's text and how many
    images the model was shown. An image the processor refuses (an aspect ratio over 200) is an Error: observation
    and not counted in tools/images_returned."""
    from PIL import Image

    def tool(call, ctx):
        if ctx.sample.id == "zooms":
            return [Image.new("RGB", (56, 56), (200, 10, 10)), "zoomed in"]
        return [Image.new("RGB", (2000, 4)), "a sliver"]

    out = _scripted_run(text_setup, {"zooms": [CALL, "red"], "refused": [CALL, "unknown"]}, tool)
    zoomed, refused = out.transcripts
    assert [step["role"] for step in zoomed] == ["assistant", "tool", "assistant"]
    assert zoomed[0]["text"] == CALL and zoomed[2]["text"] == "red"
    assert zoomed[1]["call"] == {"name": "look", "arguments": {}} and zoomed[1]["status"] == "ok"
    assert zoomed[1]["text"] == "zoomed in" and zoomed[1]["images"] == 1
    assert refused[1]["status"] == "bad_outputs" and refused[1]["images"] == 0
    assert refused[1]["text"].startswith("Error: image refused: image (RGB PIL image) is 2000x4")
    assert [s.images_returned for s in out.tool_stats] == [1, 0]
    assert [len(images) for images in out.observation_images] == [1, 0]
    part = Trajectories.concat([out.select_groups([1]), out.select_groups([0])])
    assert part.transcripts == [refused, zoomed]


def test_a_refused_tool_image_reaches_the_model_as_an_error_saying_why(text_setup, tmp_path):
    """An image the tool returns that cannot be used (an aspect ratio over 200:1, a truncated file) is an `Error:`
    observation carrying the refusal's one-line reason, as a tool's other failures are, not just its class name."""
    from PIL import Image

    whole = tmp_path / "whole.png"
    Image.new("RGB", (64, 64), (0, 90, 200)).save(whole)
    torn = tmp_path / "torn.png"
    torn.write_bytes(whole.read_bytes()[:60])  # the header survives, the pixel data does not

    def tool(call, ctx):
        return {"sliver": [Image.new("RGB", (2000, 4)), "a sliver"], "torn": [Image.open(torn), "a photo"],
                "whole": [Image.open(whole), "a photo"]}[ctx.sample.id]

    out = _scripted_run(text_setup, {sid: [CALL, "done"] for sid in ("sliver", "torn", "whole")}, tool)
    sliver, broken, fine = (trajectory[1]["text"] for trajectory in out.transcripts)
    assert sliver == ("Error: image refused: image (RGB PIL image) is 2000x4, an aspect ratio of 500:1 over the limit "
                      "200:1; crop or pad it")
    assert broken.startswith(f"Error: image refused: image {torn} is truncated or corrupt (") and "\n" not in broken
    assert fine == "a photo"
    assert [step[1]["status"] for step in out.transcripts] == ["bad_outputs", "bad_outputs", "ok"]
    assert [s.bad_outputs for s in out.tool_stats] == [1, 1, 0] and [s.images_returned for s in out.tool_stats] == \
        [0, 0, 1]
    decoded = [text_setup[0].tokenizer.decode(ids) for ids in out.completion_ids]
    assert sliver in decoded[0] and broken in decoded[1]  # what the model reads on its next turn
    from vlrft.rollout.multiturn import refusal

    assert refusal(ValueError("the template\nbroke")) == "the tool's output could not be processed (ValueError: the " \
        "template broke)"


def test_each_trajectory_has_its_own_id_for_tool_state(text_setup):
    """`context.trajectory_id`: the same on every call of one trajectory, different between trajectories, also from
    one rollout to the next (a tool keeps per-trajectory state under it)."""
    processor, tokens, encoder = text_setup
    seen: dict[str, list[int]] = {}

    def tool(call, ctx):
        seen.setdefault(ctx.trajectory_id, []).append(ctx.turn)
        return f"call {len(seen[ctx.trajectory_id])} of this trajectory"

    script = {"a": [CALL, CALL, "the answer"], "b": [CALL, CALL, "the answer"]}
    batch = encoder.encode([Sample(id=sid, prompt="Question?") for sid in script]).batch
    tools = ToolSet([Tool("look", tool, "look closer", {"type": "object", "properties": {}})])
    engine = MultiTurnEngine(TextEngine(processor.tokenizer, tokens.eos_ids[0], script), processor, tokens, tools,
                             max_turns=3, max_trajectory_tokens=400, merge_size=2)
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=64))
    assert len(seen) == 4 and all(turns == [1, 2] for turns in seen.values())
    assert all("call 2 of this trajectory" in processor.tokenizer.decode(ids) for ids in out.completion_ids)
    engine.engine.turn = 0
    engine.generate(batch, SamplingParams(n=2, max_new_tokens=64))
    assert len(seen) == 8


def test_long_tool_output_is_cut_to_tool_max_output_tokens_and_the_trajectory_goes_on(text_setup, tiny_vlm_dir):
    """`rollout.tool_max_output_tokens`: a tool's text longer than that is cut (a note says how much) and counted in
    tools/truncated_outputs, and the model answers after it; without the cap the same output ends the trajectory."""
    from types import SimpleNamespace

    from vlrft.config import load_config

    processor, tokens, encoder = text_setup
    script = {"long": [CALL, "the answer"], "short": [CALL, "the answer"]}
    batch = encoder.encode([Sample(id=sid, prompt="Question?") for sid in script]).batch
    outputs = {"long": "line of a log file " * 100, "short": "fine"}
    results = {}
    for cap in (0, 50):
        cfg = load_config(None, [f"rollout.tools=[{{name: '{TOOLS}:look'}}]", f"rollout.tool_max_output_tokens={cap}",
                                 "rollout.max_trajectory_tokens=600", "rollout.describe_tools=false"])
        deps = SimpleNamespace(encoder=encoder, processor=processor, tokens=tokens, strategy=None)
        engine = MultiTurnEngine.from_deps(cfg, deps, TextEngine(processor.tokenizer, tokens.eos_ids[0], script))
        engine.tools = ToolSet([Tool("look", lambda call, ctx: outputs[ctx.sample.id], "d",
                                     {"type": "object", "properties": {}})])
        results[cap] = engine.generate(batch, SamplingParams(n=1, max_new_tokens=64))
    uncapped, capped = results[0], results[50]
    assert uncapped.finish_reasons == [FINISH_LENGTH, "stop"] and uncapped.turns == [1, 2]
    assert capped.finish_reasons == ["stop", "stop"] and capped.turns == [2, 2] and capped.texts[0] == "the answer"
    assert [s.truncated_outputs for s in capped.tool_stats] == [1, 0]
    shown = capped.transcripts[0][1]["text"]
    assert shown.startswith("line of a log file") and "more tokens cut" in shown
    assert len(processor.tokenizer.encode(shown.split("\n")[0], add_special_tokens=False)) <= 50
    assert capped.transcripts[1][1]["text"] == "fine"
