"""VisualBatch: row slicing by cumulative prod(thw), repeats, concat, device/dtype moves, consistency checks.

The batches here are built by hand so every expected row is known: pixel row r holds the value r,
so a selection's rows can be written down directly.
"""

import dataclasses

import pytest
import torch

from vlrft.vision import SLICING_RULES, VisualBatch, VisualMismatchError, mm_token_type_ids

IMG, VID = 6, 7  # token ids used for image / video placeholders in these tests


def rows(start: int, stop: int, width: int = 3) -> torch.Tensor:
    """Pixel rows whose every entry is the row number (so slices are easy to check)."""
    return torch.arange(start, stop, dtype=torch.float32)[:, None].repeat(1, width)


@pytest.fixture
def batch() -> VisualBatch:
    # sample 0: text only; sample 1: one 1x2x2 image (4 rows); sample 2: images 1x2x4 and 1x4x2 (8 + 8 rows)
    # plus one 2x2x2 video (8 rows); sample 3: text only.
    return VisualBatch(
        pixel_values=rows(0, 20),
        image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 2]]),
        pixel_values_videos=rows(100, 108),
        video_grid_thw=torch.tensor([[2, 2, 2]]),
        images_per_sample=(0, 1, 2, 0),
        videos_per_sample=(0, 0, 1, 0),
        merge_size=2,
        extra={"second_per_grid_ts": torch.tensor([0.5])},
    )


def test_tokens_per_sample_are_rows_over_merge_size_squared(batch):
    # sample 1: 4 rows / 4 = 1 token; sample 2: (8 + 8) / 4 = 4 image tokens and 8 / 4 = 2 video tokens
    assert batch.image_tokens_per_sample() == [0, 1, 4, 0]
    assert batch.video_tokens_per_sample() == [0, 0, 2, 0]
    assert batch.num_samples == 4 and batch.num_images == 3 and batch.num_videos == 1


def test_select_reorders_rows_grids_and_per_video_keys(batch):
    sel = batch.select([2, 0, 1])
    assert sel.images_per_sample == (2, 0, 1) and sel.videos_per_sample == (1, 0, 0)
    assert torch.equal(sel.pixel_values, torch.cat([rows(4, 20), rows(0, 4)]))
    assert torch.equal(sel.image_grid_thw, torch.tensor([[1, 2, 4], [1, 4, 2], [1, 2, 2]]))
    assert torch.equal(sel.pixel_values_videos, rows(100, 108))
    assert torch.equal(sel.extra["second_per_grid_ts"], torch.tensor([0.5]))
    assert sel.image_tokens_per_sample() == [4, 0, 1]


def test_select_repeats_by_index_for_groups(batch):
    group = batch.select([1, 1, 1])  # one prompt, three completions: its 4 rows three times
    assert torch.equal(group.pixel_values, torch.cat([rows(0, 4)] * 3))
    assert torch.equal(group.image_grid_thw, torch.tensor([[1, 2, 2]] * 3))
    assert group.pixel_values_videos.shape[0] == 0 and group.video_grid_thw.shape[0] == 0


def test_contiguous_select_is_a_view_and_scattered_select_a_copy(batch):
    view = batch.select([1, 2])  # rows 0..19 in order
    assert view.pixel_values.data_ptr() == batch.pixel_values.data_ptr()
    tail = batch.select([2, 3])  # rows 4..19: same storage, offset by 4 rows
    assert tail.pixel_values.data_ptr() == batch.pixel_values[4:].data_ptr()
    copy = batch.select([2, 1])
    assert copy.pixel_values.data_ptr() != batch.pixel_values.data_ptr()
    copy.pixel_values.add_(1)  # writing into a scattered selection never touches the source
    assert torch.equal(batch.pixel_values, rows(0, 20))


def test_select_text_only_samples_and_empty(batch):
    text = batch.select([0, 3])
    assert text.images_per_sample == (0, 0) and text.pixel_values.shape == (0, 3)
    assert text.model_inputs() == {}  # no empty grids handed to the model (Qwen-VL forwards fail on them)
    images_only = batch.select([1])
    assert sorted(images_only.model_inputs()) == ["image_grid_thw", "pixel_values"]
    empty = VisualBatch.empty(2, merge_size=2)
    assert empty.model_inputs() == {}
    assert empty.image_tokens_per_sample() == [0, 0]
    assert empty.select([1, 0, 1]).num_samples == 3


def test_select_rejects_out_of_range(batch):
    with pytest.raises(IndexError, match="out of range for 4 samples"):
        batch.select([4])


def test_concat_select_round_trip(batch):
    parts = [batch.select([0, 1]), batch.select([2]), VisualBatch.empty(1, merge_size=2)]
    whole = VisualBatch.concat(parts)
    assert whole.images_per_sample == batch.images_per_sample
    for key, value in batch.model_inputs().items():
        assert torch.equal(whole.model_inputs()[key], value), key
    # concat of arbitrary selections == one selection of the concatenated indices
    mixed = VisualBatch.concat([batch.select([2, 1]), batch.select([1, 0, 2])])
    direct = batch.select([2, 1, 1, 0, 2])
    for key, value in direct.model_inputs().items():
        assert torch.equal(mixed.model_inputs()[key], value), key


def test_concat_refuses_different_merge_sizes(batch):
    with pytest.raises(ValueError, match="different merge sizes"):
        VisualBatch.concat([batch, VisualBatch.empty(1, merge_size=1)])


def test_to_casts_only_pixels(batch):
    moved = batch.to("cpu", dtype=torch.bfloat16)
    assert moved.pixel_values.dtype == torch.bfloat16 and moved.pixel_values_videos.dtype == torch.bfloat16
    assert moved.image_grid_thw.dtype == torch.long and moved.video_grid_thw.dtype == torch.long
    assert moved.extra["second_per_grid_ts"].dtype == torch.float32  # a timing, not pixels
    assert batch.pixel_values.dtype == torch.float32  # the source is untouched


def test_check_passes_when_token_counts_match(batch):
    ids = [[1, 2], [1, IMG, 2], [IMG] * 4 + [VID] * 2 + [3], [5]]
    batch.check(ids, IMG, VID)
    padded = torch.tensor([[0, 0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 1, IMG, 2], [IMG] * 4 + [VID] * 2 + [3],
                           [0, 0, 0, 0, 0, 0, 5]])  # left-padded with 0
    batch.check(padded, IMG, VID)


def test_check_names_the_sample_whose_counts_disagree(batch):
    ids = [[1, 2], [1, IMG, 2], [IMG] * 3 + [VID] * 2, [5]]  # sample 2 lost one image token
    with pytest.raises(VisualMismatchError, match=r"sample row-12: its prompt ids hold 3 image tokens but its 2 "
                                                  r"image\(s\) need 4"):
        batch.check(ids, IMG, VID, sample_names=["row-10", "row-11", "row-12", "row-13"])
    padded = torch.tensor([[0, 0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 1, IMG, 2], [IMG] * 4 + [VID] * 2 + [3],
                           [0, 0, 0, 0, 0, 0, IMG]])  # sample 3 has a stray image token
    with pytest.raises(VisualMismatchError, match="sample #3: its prompt ids hold 1 image tokens but its 0"):
        batch.check(padded, IMG, VID)


def test_construction_refuses_rows_that_do_not_match_grids():
    with pytest.raises(VisualMismatchError, match=r"has 5 rows but the grids need sum\(prod\(thw\)\) = 4"):
        VisualBatch(rows(0, 5), torch.tensor([[1, 2, 2]]), None, None, (1,), (0,), merge_size=2)
    with pytest.raises(VisualMismatchError, match="image_grid_thw has 1 rows but the samples own 2"):
        VisualBatch(rows(0, 4), torch.tensor([[1, 2, 2]]), None, None, (1, 1), (0, 0), merge_size=2)


def test_unknown_extra_key_needs_a_slicing_rule():
    assert "second_per_grid_ts" in SLICING_RULES
    with pytest.raises(ValueError, match="add it to vlrft.vision.SLICING_RULES"):
        VisualBatch(None, None, None, None, (0,), (0,), merge_size=2, extra={"tiles": torch.zeros(1)})


def test_per_image_extra_keys_follow_their_images():
    b = VisualBatch(torch.zeros(3, 2, 1, 1), None, None, None, (1, 2), (0, 0), merge_size=1,
                    extra={"image_sizes": torch.tensor([[10, 20], [30, 40], [50, 60]])})
    sel = b.select([1, 0])  # no grid: one pixel entry per image (LLaVA-style)
    assert torch.equal(sel.extra["image_sizes"], torch.tensor([[30, 40], [50, 60], [10, 20]]))
    assert sel.pixel_values.shape[0] == 3


def test_mm_token_type_ids():
    ids = torch.tensor([[1, IMG, IMG, 2, VID, 3]])
    assert mm_token_type_ids(ids, IMG, VID).tolist() == [[0, 1, 1, 0, 2, 0]]


def test_tiled_pixels_keep_their_real_tiles_and_bad_tiles_are_one_line():
    """SmolVLM's layout, built by hand: [samples, max tiles, C, H, W] padded per sample (a text-only sample all
    padding) becomes one row per real tile; its token counts are tiles x tile_tokens; a tiled batch without its
    pixel_attention_mask, without tile_tokens, or with tiles where its sample has no image is refused in one line,
    and batches whose tiles stand for different token counts do not concatenate."""
    pixels = torch.zeros(3, 2, 3, 4, 4)
    mask = torch.zeros(3, 2, 4, 4, dtype=torch.long)
    pixels[0, :2], mask[0, :2] = 1.0, 1  # two tiles, none, one
    pixels[2, :1], mask[2, :1] = 2.0, 1
    out = {"input_ids": [[1], [2], [3]], "pixel_values": pixels, "pixel_attention_mask": mask}
    visual = VisualBatch.from_processor_output(out, [1, 0, 1], [0, 0, 0], 1, tile_tokens=4)
    assert visual.images_per_sample == (2, 0, 1) and visual.image_tokens_per_sample() == [8, 0, 4]
    assert torch.equal(visual.pixel_values, torch.cat([pixels[0], pixels[2, :1]]))
    padded = visual.select([2, 1, 0]).model_inputs()
    assert torch.equal(padded["pixel_values"], pixels[[2, 1, 0]]) and torch.equal(padded["pixel_attention_mask"],
                                                                                   mask[[2, 1, 0]])
    with pytest.raises(ValueError, match="need a pixel_attention_mask .* and the tokens a tile stands for"):
        VisualBatch.from_processor_output({"pixel_values": pixels}, [1, 0, 1], [0, 0, 0], 1, tile_tokens=4)
    with pytest.raises(ValueError, match="tile_tokens"):
        VisualBatch.from_processor_output(out, [1, 0, 1], [0, 0, 0], 1)
    with pytest.raises(VisualMismatchError, match=r"tiles \[2, 0, 1\] do not follow their images \[1, 1, 1\]"):
        VisualBatch.from_processor_output(out, [1, 1, 1], [0, 0, 0], 1, tile_tokens=4)
    other = dataclasses.replace(visual, tile_tokens=9)
    with pytest.raises(ValueError, match=r"tiles stand for \[4, 9\] tokens"):
        VisualBatch.concat([visual, other])
