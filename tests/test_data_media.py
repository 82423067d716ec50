"""Media loading: every image reference form, RGB/EXIF handling, refusals, pixel bounds, video sampling."""

import base64
import io
import threading

import numpy as np
import pytest
from PIL import Image, ImageFile

from _data_helpers import noise_image, png_with_huge_icc_profile, write_mp4, write_png, write_png_bomb
from vlrft.data.media import (MediaError, MediaLimits, PixelBounds, fit_image, frame_indices, load_image,
                              load_video)

QWEN_BOUNDS = PixelBounds(factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 16)


def test_every_reference_form_gives_the_same_pixels(tmp_path):
    original = noise_image(30, 40, seed=1)
    path = write_png(tmp_path / "sub dir" / "a.png", original)
    data = path.read_bytes()
    refs = {
        "path": str(path),
        "file url": path.as_uri(),
        "bytes": data,
        "data uri": "data:image/png;base64," + base64.b64encode(data).decode(),
        "pil": original,
        "numpy": np.asarray(original),
        "image dict": {"image": str(path)},
        "hf image struct": {"bytes": data, "path": "ignored.png"},
        "hf image path": {"bytes": None, "path": str(path)},
    }
    expected = np.asarray(original)
    for name, ref in refs.items():
        image = load_image(ref)
        assert image.mode == "RGB", name
        assert np.array_equal(np.asarray(image), expected), name


def test_transparency_becomes_white_and_grey_becomes_rgb():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((0, 0), (0, 0, 255, 255))  # one opaque blue pixel
    out = np.asarray(load_image(rgba))
    assert out[1, 1].tolist() == [255, 255, 255] and out[0, 0].tolist() == [0, 0, 255]
    grey = load_image(Image.new("L", (2, 2), 77))
    assert grey.mode == "RGB" and np.asarray(grey)[0, 0].tolist() == [77, 77, 77]


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (4, 2), (0, 0, 0))
    image.putpixel((3, 0), (255, 0, 0))  # red at top-right
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rot.jpg"
    image.save(path, format="JPEG", exif=exif, quality=100)
    out = load_image(str(path))
    assert out.size == (2, 4)  # width and height swapped


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(MediaError, match=r"image file not found: '.*nope\.png' \(relative paths resolve against "
                                         r"data\.image_root"):
        load_image(str(tmp_path / "nope.png"))


def test_a_directory_given_as_media_is_called_a_directory(tmp_path):
    """A folder where an image or a video file belongs was reported as "file not found" (it is there)."""
    from vlrft.data import Sample
    from vlrft.data.validate import find_bad_media

    folder = tmp_path / "frames"
    folder.mkdir()
    with pytest.raises(MediaError, match=rf"^image path '{folder}' is a directory, not a file; reference one image "
                                         r"file in it"):
        load_image(str(folder))
    with pytest.raises(MediaError, match=rf"^video path '{folder}' is a directory, not a file; .*or give the video's "
                                         r"frames as a list of image files"):
        load_video(str(folder), fps=2.0, max_frames=4)
    sample = Sample("s", "<image><video>hi", images=[str(folder)], videos=[str(folder)])
    problems = find_bad_media([sample], MediaLimits(), use_cache=False)
    assert [(p.field, "is a directory, not a file" in p.reason) for p in problems] == [("images[0]", True),
                                                                                       ("videos[0]", True)]


def test_corrupt_bytes_and_urls_are_refused(tmp_path):
    with pytest.raises(MediaError, match=r"the image bytes \(9 bytes\) are not an image"):
        load_image(b"not a png")
    with pytest.raises(MediaError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(MediaError, match="remote image 'https://x.org/a.png' is not downloaded"):
        load_image("https://x.org/a.png")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(io.BytesIO(write_png(tmp_path / "full.png", noise_image(64, 64)).read_bytes()).read()[:200])
    with pytest.raises(MediaError, match="truncated or corrupt"):
        load_image(str(truncated))


def test_every_error_pillow_raises_on_a_file_is_a_media_error(tmp_path, monkeypatch):
    """Pillow raises more than OSError on hostile files: a PNG whose ICC profile inflates past its limit gives
    ValueError('Decompressed data too large') while the header is read; decoders raise struct.error, IndexError,
    SyntaxError... Each becomes a MediaError naming the file (its callers add sample and field)."""
    icc = tmp_path / "icc.png"
    icc.write_bytes(png_with_huge_icc_profile())
    assert icc.stat().st_size < 100_000
    with pytest.raises(MediaError, match=r"cannot read image: ValueError: Decompressed [Dd]ata [Tt]oo [Ll]arge"):
        load_image(str(icc))
    with pytest.raises(MediaError, match=r"ValueError: Decompressed"):
        load_image(icc.read_bytes())
    good = write_png(tmp_path / "good.png", noise_image(32, 32))

    def hostile_decoder(self, *args, **kwargs):  # a mock: a decoder error of a kind Pillow does not document
        raise IndexError("tile index out of range")

    monkeypatch.setattr(ImageFile.ImageFile, "load", hostile_decoder)
    with pytest.raises(MediaError, match=r"good.png cannot be decoded: IndexError: tile index out of range"):
        load_image(str(good))


def test_a_symlink_to_an_image_outside_the_data_folder_is_followed(tmp_path):
    """Decided (docs/design.md, Media paths): media paths are not confined to the data folder. A row can name any
    absolute path, so file permissions, not the data folder, bound what a run reads."""
    from vlrft.data import read_samples

    store, data = tmp_path / "store", tmp_path / "data"
    store.mkdir()
    data.mkdir()
    write_png(store / "a.png", noise_image(32, 32))
    (data / "a.png").symlink_to(store / "a.png")
    (data / "d.jsonl").write_text('{"prompt": "<image>hi", "images": ["a.png"], "answer": "x"}\n')
    [sample] = read_samples(str(data / "d.jsonl"))
    assert load_image(sample.images[0]).size == (32, 32)


def test_concurrent_checks_cannot_swap_each_others_warning_filters(tmp_path, monkeypatch):
    """The media check runs in a thread pool. An over-limit image must get the same answer while another thread is
    decoding: PIL warns about it while reading the header, and that warning must never become an error there."""
    big = write_png_bomb(tmp_path / "big.png", 10000, 10000)  # over PIL's warning threshold, under its hard limit
    good = write_png(tmp_path / "good.png", noise_image(30, 40, seed=1))
    big_in_open, good_in_load, big_done = threading.Event(), threading.Event(), threading.Event()
    real_open, real_load = Image.open, ImageFile.ImageFile.load

    def slow_open(source, *args, **kwargs):  # a slow disk: big.png's header read waits for good.png's decode
        if str(source) == str(big):
            big_in_open.set()
            good_in_load.wait(timeout=1.0)
        return real_open(source, *args, **kwargs)

    def slow_load(image):
        if image.size == (40, 30):
            good_in_load.set()
            big_done.wait(timeout=1.0)
        return real_load(image)

    monkeypatch.setattr(Image, "open", slow_open)
    monkeypatch.setattr(ImageFile.ImageFile, "load", slow_load)
    answers = {}

    def check(name, path):
        try:
            answers[name] = load_image(str(path)).size
        except Exception as exc:  # noqa: BLE001 - the answer is what this test compares
            answers[name] = f"{type(exc).__name__}: {exc}"
        if name == "big":
            big_done.set()

    first = threading.Thread(target=check, args=("big", big))
    first.start()
    assert big_in_open.wait(timeout=5)
    second = threading.Thread(target=check, args=("good", good))
    second.start()
    first.join(timeout=10)
    second.join(timeout=10)
    assert answers["good"] == (40, 30)
    assert answers["big"].startswith("MediaError") and "data.max_source_pixels" in answers["big"], answers["big"]


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    # Headers of ~200-byte files claiming huge sizes: refused from the header, nothing is decoded.
    bomb = write_png_bomb(tmp_path / "bomb.png", 10000, 10000)
    assert bomb.stat().st_size < 1000
    with pytest.raises(MediaError, match=r"10000x10000 = 100000000 pixels, over the 89478485-pixel limit "
                                         r"\(a decompression bomb"):
        load_image(str(bomb))
    huge = write_png_bomb(tmp_path / "huge.png", 30000, 30000)  # beyond PIL's own hard limit
    with pytest.raises(MediaError, match=r"refused as a decompression bomb: Image size \(900000000 pixels\)"):
        load_image(str(huge))
    with pytest.raises(MediaError, match="over the 100-pixel limit"):
        load_image(noise_image(20, 20), MediaLimits(max_source_pixels=100))


def test_absurd_aspect_ratio_is_refused():
    with pytest.raises(MediaError, match=r"1000x4, an aspect ratio of 250:1 over the limit 200:1"):
        load_image(Image.new("RGB", (1000, 4)))
    assert load_image(Image.new("RGB", (400, 4))).size == (400, 4)  # 100:1 is fine


@pytest.mark.parametrize("size, expected", [
    ((56, 84), (56, 84)),  # already on the 28-grid and inside the bounds: untouched
    ((100, 30), (112, 28)),  # round(100/28)*28 = 112, round(30/28)*28 = 28; 112*28 = 3136 = min_pixels
    ((200, 100), (140, 56)),  # too big: scale by sqrt(20000/12544), floor to the grid: 5*28 x 2*28
    ((40, 20), (84, 56)),  # too small: scale by sqrt(3136/800), ceil to the grid: 3*28 x 2*28
])
def test_fit_image_follows_the_qwen_grid(size, expected):
    image = noise_image(size[1], size[0])
    fitted = fit_image(image, QWEN_BOUNDS)
    assert fitted.size == expected
    if size == expected:
        assert fitted is image


def test_frame_indices():
    # 16 frames at 8 fps = 2 s; 2 fps -> 4 frames spread over the clip
    assert frame_indices(16, 8.0, 2.0, max_frames=32, frame_factor=2).tolist() == [0, 5, 10, 15]
    assert frame_indices(16, 8.0, 2.0, max_frames=2, frame_factor=2).tolist() == [0, 15]
    # 5 frames wanted, rounded down to the temporal patch of 2
    assert frame_indices(40, 8.0, 1.0, max_frames=32, frame_factor=2).tolist() == [0, 13, 26, 39]
    assert frame_indices(1, 8.0, 2.0, max_frames=32, frame_factor=2).tolist() == [0]


def test_video_file_is_sampled_at_the_configured_fps(tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", num_frames=16, fps=8)
    video = load_video(str(path), fps=2.0, max_frames=32, frame_factor=2, bounds=QWEN_BOUNDS)
    assert video.metadata.frames_indices == [0, 5, 10, 15]
    assert video.frames.shape == (4, 56, 56, 3) and video.frames.dtype == np.uint8
    levels = video.frames.reshape(4, -1).mean(1)
    assert np.allclose(levels, [0, 50, 100, 150], atol=4)  # frame i was filled with grey 10*i (lossy codec)
    assert video.metadata.fps == 8.0 and video.metadata.total_num_frames == 16


def test_video_frames_list_and_its_errors(tmp_path):
    frames = [write_png(tmp_path / f"f{i}.png", noise_image(56, 56, seed=i)) for i in range(3)]
    video = load_video([str(f) for f in frames], fps=2.0, max_frames=32, frame_factor=2)
    assert video.frames.shape == (2, 56, 56, 3)  # 3 frames rounded down to the temporal patch of 2
    assert np.array_equal(video.frames[0], np.asarray(noise_image(56, 56, seed=0)))
    write_png(tmp_path / "odd.png", noise_image(28, 56))
    with pytest.raises(MediaError, match="frames differ in size"):
        load_video([str(frames[0]), str(tmp_path / "odd.png")], fps=2.0, max_frames=32)
    with pytest.raises(MediaError, match="video file not found"):
        load_video(str(tmp_path / "none.mp4"), fps=2.0, max_frames=32)
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 100)
    with pytest.raises(MediaError, match="cannot decode video"):
        load_video(str(tmp_path / "bad.mp4"), fps=2.0, max_frames=32)
