"""Readers and presets: each layout on a small fixture written here, auto-detection, bad rows by file/row/field."""

import io
import json

import numpy as np
import pytest

from _data_helpers import noise_image, write_png
from vlrft.data import BadSampleError, read_dataset, read_files, read_samples
from vlrft.data.media import load_image
from vlrft.data.sample import build_messages
from vlrft.errors import UserError


def png_bytes(seed: int) -> bytes:
    buffer = io.BytesIO()
    noise_image(28, 28, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def hf_image_dataset(rows, image_column="images"):
    """A `datasets.Dataset` whose image column uses the Image feature, as Hub datasets store images."""
    import datasets

    features = {}
    sample_row = rows[0]
    for key, value in sample_row.items():
        if key == image_column:
            features[key] = datasets.List(datasets.Image()) if isinstance(value, list) else datasets.Image()
    ds = datasets.Dataset.from_list(rows)
    for key, feature in features.items():
        ds = ds.cast_column(key, feature)
    return ds


def test_native_jsonl_with_relative_paths_and_extra_columns(tmp_path):
    write_png(tmp_path / "img" / "a.png", noise_image(28, 28))
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"id": "q1", "prompt": "<image>What color?", "images": ["img/a.png"], "answer": "red", "label": "color",
         "difficulty": 3},
        {"prompt": "What is 2+2?", "answer": 4},
    ])
    result = read_dataset(path)
    assert result.formats == {str(path): "native"}
    first, second = result.samples
    assert first.id == "q1" and first.images == [str(tmp_path / "img" / "a.png")]
    assert first.answer == "red" and first.label == "color" and first.extra == {"difficulty": 3}
    assert first.source == "train.jsonl line 1"
    assert second.id == "train-1" and second.answer == "4" and second.images == []
    # image_root overrides the data file's folder
    other = tmp_path / "elsewhere"
    assert read_samples(path, image_root=str(other))[0].images == [str(other / "img" / "a.png")]


def test_easyr1_parquet_with_embedded_image_bytes(tmp_path):
    ds = hf_image_dataset([{"problem": "<image>Find x.", "answer": "3", "images": [{"bytes": png_bytes(1),
                                                                                    "path": None}]}])
    ds.to_parquet(str(tmp_path / "geo.parquet"))
    result = read_dataset(tmp_path / "geo.parquet")
    assert result.formats[str(tmp_path / "geo.parquet")] == "easyr1"
    (sample,) = result.samples
    assert sample.prompt == "<image>Find x." and sample.answer == "3" and sample.id == "geo-0"
    assert sample.source == "geo.parquet row 0"
    assert np.array_equal(np.asarray(load_image(sample.images[0])), np.asarray(noise_image(28, 28, seed=1)))


def test_verl_parquet_layout(tmp_path):
    import datasets

    rows = [{
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>Find the angle. Put the answer in \\boxed{}."}],
        "images": [{"bytes": png_bytes(2), "path": None}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "45"},
        "extra_info": {"split": "train", "index": 0},
    }]
    ds = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
    ds.to_parquet(str(tmp_path / "verl.parquet"))
    (sample,) = read_samples(tmp_path / "verl.parquet")
    assert sample.answer == "45" and sample.label == "hiyouga/geometry3k"
    assert sample.prompt == rows[0]["prompt"]
    assert sample.extra["extra_info"] == {"split": "train", "index": 0} and sample.extra["ability"] == "math"
    messages = build_messages(sample)
    assert [p["type"] for p in messages[0]["content"]] == ["image", "text"]


def test_trl_save_to_disk_folder_puts_images_first(tmp_path):
    ds = hf_image_dataset([
        {"prompt": "How many shapes?", "image": {"bytes": png_bytes(3), "path": None}, "solution": "2"},
        {"prompt": "Count them.", "image": {"bytes": png_bytes(4), "path": None}, "solution": "5"},
    ], image_column="image")
    ds.save_to_disk(str(tmp_path / "trl_ds"))
    result = read_dataset(tmp_path / "trl_ds")
    assert result.formats[str(tmp_path / "trl_ds")] == "trl"
    first = result.samples[0]
    assert first.answer == "2" and first.source == "trl_ds row 0" and first.extra["solution"] == "2"
    # TRL inserts the image at the start of the first user turn when the prompt has no placeholder
    assert first.prompt == "<image>How many shapes?"
    assert np.array_equal(np.asarray(load_image(result.samples[1].images[0])), np.asarray(noise_image(28, 28, 4)))


def test_trl_conversational_prompt_with_image_part(tmp_path):
    ds = hf_image_dataset([{"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": "Color?"}]}],
                            "images": [{"bytes": png_bytes(5), "path": None}], "solution": "red"}])
    ds.save_to_disk(str(tmp_path / "conv"))
    (sample,) = read_samples(tmp_path / "conv", format="trl")
    assert len(sample.images) == 1 and sample.answer == "red"
    assert [p["type"] for p in build_messages(sample)[0]["content"]] == ["image", "text"]


def test_openrlhf_label_is_the_answer(tmp_path):
    write_png(tmp_path / "x.png", noise_image(28, 28))
    path = write_jsonl(tmp_path / "orl.jsonl", [{"prompt": "<image>Count.", "images": ["x.png"], "label": "3",
                                                "datasource": "counting"}])
    (sample,) = read_samples(path)
    assert sample.answer == "3" and sample.label == "counting" and sample.images == [str(tmp_path / "x.png")]


def test_messages_with_embedded_image_references(tmp_path):
    write_png(tmp_path / "a.png", noise_image(28, 28))
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What?"}]},
    ], "answer": "x"}])
    (sample,) = read_samples(path)
    assert sample.images == [str(tmp_path / "a.png")]
    assert sample.prompt[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What?"}]


def test_hf_dataset_dict_folder_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}])}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"holds a DatasetDict with splits \['train'\]; pass one split's folder"):
        read_samples(tmp_path / "dd")
    assert read_samples(tmp_path / "dd" / "train")[0].answer == "b"


def test_bad_rows_raise_with_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "answer": "1"},
        "{not json",
        {"prompt": [{"content": "no role"}], "answer": "1"},
        {"prompt": "<image>x", "images": ["a.png"], "answer": ["a", "list"]},
    ])
    with pytest.raises(BadSampleError, match=r"bad\.jsonl line 2, field '<row>': not valid JSON"):
        read_samples(path)
    result = read_dataset(path, on_bad_sample="skip")
    assert [s.id for s in result.samples] == ["bad-0"]
    assert [(s.source, s.field) for s in result.skipped] == [
        ("bad.jsonl line 2", "<row>"), ("bad.jsonl line 3", "prompt[0]"), ("bad.jsonl line 4", "answer")]
    assert "each chat message needs 'role' and 'content'" in result.skipped[1].reason
    assert result.rows == 4


def test_missing_required_column_names_the_layout(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"problem": "<image>x", "answer": "1"}, {"answer": "2"}])
    with pytest.raises(BadSampleError, match=r"e\.jsonl line 2 \(id 'e-1'\), field 'problem': the column 'problem' "
                                             r"is missing or null; the easyr1 layout needs it"):
        read_samples(path)


def test_undetectable_layout_and_unknown_files(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "x"}])
    with pytest.raises(UserError, match=r"cannot tell the dataset layout from the columns \['question'\]"):
        read_samples(path)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown file type '.csv'"):
        read_samples(tmp_path / "d.csv")
    with pytest.raises(UserError, match="dataset '.*nothing.jsonl' not found"):
        read_samples(tmp_path / "nothing.jsonl")
    with pytest.raises(UserError, match="data.format='llava' is not known"):
        read_samples(path, format="llava")


def test_read_files_concatenates_and_limits(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": "x"} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": "x"} for i in range(3)])
    assert [s.prompt for s in read_files([a, b]).samples] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert [s.prompt for s in read_files([a, b], limit=4).samples] == ["a0", "a1", "a2", "b0"]


def test_read_split_uses_the_data_config(tmp_path, caplog):
    from vlrft.config import DataConfig
    from vlrft.data import read_split

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, "{broken", {"prompt": "b", "answer": "2"},
                                               {"prompt": "c", "answer": "3"}])
    cfg = DataConfig(train_files=[str(train)], on_bad_sample="skip", max_train_samples=2)
    with caplog.at_level("WARNING", logger="vlrft.data.readers"):
        result = read_split(cfg, "train")
    assert [s.prompt for s in result.samples] == ["a", "b"] and len(result.skipped) == 1
    assert "t.jsonl: skipped 1 bad row(s) of 3 (data.on_bad_sample=skip)" in caplog.text
    assert read_split(cfg, "eval").samples == []
    with pytest.raises(UserError, match="data.train_files is empty"):
        read_split(DataConfig(), "train")


def test_a_non_utf8_byte_names_file_and_line_or_is_skipped(tmp_path):
    from vlrft.data.readers import read_dataset as read

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n'
                     b'{"prompt": "fine", "answer": "3"}\n')
    with pytest.raises(UserError, match=r"latin1.jsonl line 2, field '<row>': not valid UTF-8 \(byte 0xe9 at column 16\)"):
        read(path)
    result = read(path, on_bad_sample="skip")
    assert [s.answer for s in result.samples] == ["1", "3"] and result.skipped[0].source == "latin1.jsonl line 2"
    listing = tmp_path / "latin1.json"
    listing.write_bytes(b'[\n{"prompt": "caf\xe9", "answer": "2"}]')
    with pytest.raises(UserError, match=r"latin1.json' is not valid UTF-8 \(byte 0xe9 on line 2\)"):
        read(listing)
