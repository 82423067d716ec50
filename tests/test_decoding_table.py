"""The hf engine's decoder is chosen in one place (vlrft.decoding.table), and the plan counts the decoder's sizes."""

import pytest
import torch

from vlrft.decoding import VARIANTS, choose

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def pick(lean=True, device=CPU, max_new_tokens=16, cuda_graph=None, static_cache=None, autocast_on=False,
         one_prefill=True, sliding_window=False):
    return choose(lean=lean, device=device, max_new_tokens=max_new_tokens, cuda_graph=cuda_graph,
                  static_cache=static_cache, autocast_on=autocast_on, one_prefill=one_prefill,
                  sliding_window=sliding_window)


@pytest.mark.parametrize("options, expected", [
    (dict(), "lean"),
    (dict(device=CUDA), "cuda_graph"),
    (dict(device=CUDA, cuda_graph=False), "lean"),
    (dict(device=CUDA, max_new_tokens=2), "lean"),  # too short for the capture's warm-up steps
    (dict(cuda_graph=True), "fixed_rows"),  # the graph's steps, eager, off CUDA
    (dict(lean=False), "transformers_dynamic"),
    (dict(lean=False, device=CUDA), "transformers_static"),
    (dict(lean=False, static_cache=True), "transformers_static"),
    (dict(lean=False, device=CUDA, autocast_on=True), "transformers_dynamic"),
    (dict(lean=False, device=CUDA, one_prefill=False), "transformers_dynamic"),
    # Gemma 3's sliding-window layers: transformers' dynamic cache, whose sliding layers keep their window only
    (dict(lean=False, device=CUDA, sliding_window=True), "transformers_dynamic"),
    (dict(lean=False, static_cache=True, sliding_window=True), "transformers_dynamic"),
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_the_table_chooses_by_model_device_and_options(options, expected):
    assert pick(**options) == expected


def test_every_variant_says_where_it_is_the_default_and_what_keeps_it():
    for name, variant in VARIANTS.items():
        assert variant.default and variant.figure, name


def test_the_plan_imports_the_decoders_sizes_rather_than_copying_them():
    import vlrft.plan.engine as engine  # the plan's rollout-engine terms
    import vlrft.sampling as sampling

    assert engine.PREFILL_TOKENS is sampling.PREFILL_TOKENS and engine.shares_prompt is sampling.shares_prompt
    assert engine.hf_decoder is sampling.hf_decoder  # which decoder a family samples with: the engine's own table
    assert not hasattr(engine, "SHARED_PROMPT_TOKENS")  # read through shares_prompt, not a copy
