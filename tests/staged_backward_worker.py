"""Run under torchrun (2 CPU ranks) by tests/test_staged_backward.py: a tiny policy under FSDP2, one shared-prompt
training backward with the backward in stages (`vlrft.models.staged_backward`) and one without.

`python staged_backward_worker.py MODEL_FOLDER OUT`: rank 0 saves to OUT, for each way, whether every decoder-layer
parameter had its sharded gradient when the prompt pass's backward started, and the gradients (gathered) after.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _prompt_pass_watch import layer_gradients_when_the_prompt_pass_starts  # noqa: E402

from vlrft.batch import build_sequences  # noqa: E402
from vlrft.config import DataConfig  # noqa: E402
from vlrft.data import PromptEncoder, Sample  # noqa: E402
from vlrft.models.actor import ActorVL  # noqa: E402
from vlrft.models.loading import load_processor  # noqa: E402
from vlrft.parallel import make_strategy  # noqa: E402
from vlrft.parallel.process_exit import exit_process  # noqa: E402
from vlrft.parallel.strategy import ModelSource  # noqa: E402
from vlrft.tokens import TokenSpec  # noqa: E402


def rows(folder: str, rank: int, image: Path, tokens: TokenSpec):
    """Two prompts (an image; text), two rows each, completions of this rank's own lengths."""
    from PIL import Image

    Image.new("RGB", (56, 84), (200, 40 + 100 * rank, 40)).save(image)
    samples = [Sample(id="img", prompt="<image>Color?", images=[str(image)]),
               Sample(id="text", prompt="A longer text-only prompt here")]
    batch = PromptEncoder(load_processor(folder), DataConfig(min_pixels=784, max_pixels=6272)).encode(samples).batch
    completions = [[100 + 7 * rank + i for i in range(n)] for n in (3, 1 + rank, 4, 2)]
    return build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1], tokens.pad_id)


def backward(root, seqs, stages: bool, strategy) -> dict[str, bool]:
    """One training backward; whether each decoder-layer parameter had its sharded gradient when the prompt pass's
    backward started (`layer_gradients_when_the_prompt_pass_starts`)."""
    for module in root.modules():
        if hasattr(module, "backward_in_stages"):
            module.backward_in_stages = stages

    def forward_backward():
        out = root(seqs)
        strategy.backward(out.logprobs.sum() + 0.1 * out.entropy.sum(), root)

    return layer_gradients_when_the_prompt_pass_starts(root, forward_backward)


def main(folder: str, out: str) -> None:
    strategy = make_strategy("fsdp2")
    model = strategy.load_model(ModelSource(folder, "float32"), trainable=True)
    tokens = TokenSpec.from_model(load_processor(folder), model.config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id)
    root, _ = strategy.prepare_trainable(actor, lambda params: torch.optim.SGD(params, lr=0.0))
    strategy.balance_vision_calls([root])
    assert actor.backward_in_stages  # FSDP2 turns it on
    seqs = rows(folder, strategy.rank, Path(out).with_name(f"image{strategy.rank}.png"), tokens)
    reduced, grads = {}, {}
    for way, stages in (("staged", True), ("plain", False)):
        reduced[way] = backward(root, seqs, stages, strategy)
        grads[way] = {name: p.grad.full_tensor() for name, p in root.named_parameters() if p.grad is not None}
    if strategy.is_main:
        assert grads["staged"].keys() == grads["plain"].keys()
        torch.save({"reduced_at_prompt_start": reduced, "layers": len(reduced["staged"]),
                    "grads": {name: (grads["staged"][name], grads["plain"][name]) for name in grads["plain"]}}, out)
    strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
