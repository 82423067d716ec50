"""Check, convert or prepare datasets: `vlrft data check|convert|prepare`.

  vlrft data check train.jsonl --model runs/tiny     every bad row with its reason, then a summary;
                                                      exit code 1 when any row is bad
  vlrft data convert geo3k/train.parquet out/train.jsonl
                                                      any supported layout -> native JSONL + media files
  vlrft data prepare clevr --source raw/CLEVR_v1.0 --out data/clevr [--embed-images] [--model PATH]
                                                      a public dataset's raw release -> native splits
                                                      + summary.json (tasks: geometry3k, mathvista,
                                                      clevr, refcoco, chartqa, videoqa; docs/prepare.md)

Layouts (--format): auto, native, easyr1, verl, trl, openrlhf; see vlrft/data/presets.py.
"""

from __future__ import annotations

import argparse

# What --source must hold per task (docs/prepare.md has the details; each task module's docstring the schema).
PREPARE_LAYOUTS = """layouts --source must hold (docs/prepare.md):
  geometry3k  train/<id>/data.json (problem_text, choices, answer letter) + train/<id>/img_diagram.png;
              val/, test/ alike (the Inter-GPS geometry3k.zip)
  mathvista   MathVista's GitHub clone: data/testmini.json (pid -> row) + data/images/ (query.json and
              source.json there are not rows); the Hub's data/testmini-*.parquet; MathVision's
              data/test-*.parquet or test.jsonl
  clevr       CLEVR / CoGenT: questions/CLEVR_<split>_questions.json + images/<split>/;
              SuperCLEVR: superCLEVR_questions_*.json + images/ (one split: add --val-fraction)
  refcoco     refs(unc).p (or refs(umd).p, refs(google).p) + instances.json; COCO train2014/ beside it
              or --image-dir
  chartqa     train/train_human.json, train/train_augmented.json, train/png/; val/, test/ alike
  videoqa     Video-R1: Video-R1-260k.json (-> train) with the media its `path`s name, relative to
              --source (Video-R1-COT-*.json, the same questions for SFT, is left out); MSRVTT-QA:
              train_qa.json / val_qa.json / test_qa.json + videos/video<id>.mp4"""

FORMATS = ("auto", "native", "easyr1", "verl", "trl", "openrlhf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    check = sub.add_parser("check", help="report every bad row and summarise a dataset (exit 1 if any row is bad)")
    check.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl, .json, .parquet or save_to_disk folder")
    check.add_argument("--model", help="model folder whose processor counts prompt tokens (vision tokens included)")
    check.add_argument("--config", help="take data settings (and model.path) from this training config")
    check.add_argument("--format", choices=FORMATS, help="dataset layout (default: auto-detect)")
    check.add_argument("--image-root", help="folder that relative image paths resolve against")
    check.add_argument("--max-prompt-length", type=int, help="token limit to check against (default: the config's)")
    check.add_argument("--system-prompt", help="system prompt added to prompts without one")
    check.add_argument("--prompt-suffix", help="text appended to every user prompt")
    check.add_argument("--allow-missing-answer", action="store_true",
                       help="rows without a reference answer are fine (rewards that do not need one)")

    convert = sub.add_parser("convert", help="convert a dataset to native JSONL with images written as files")
    convert.add_argument("source", metavar="SRC")
    convert.add_argument("target", metavar="DST", help="output .jsonl path; media go to <DST stem>_media/ beside it")
    convert.add_argument("--format", choices=FORMATS, default="auto", help="layout of SRC (default: auto-detect)")
    convert.add_argument("--image-root", help="folder that relative image paths in SRC resolve against")
    convert.add_argument("--skip-bad", action="store_true", help="leave bad rows out (counted) instead of failing")

    # Task names are listed here rather than imported, so building the parser stays light.
    prepare = sub.add_parser("prepare", help="prepare a public visual-RL dataset from its raw release files",
                             epilog=PREPARE_LAYOUTS, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("task", choices=("geometry3k", "mathvista", "clevr", "refcoco", "chartqa", "videoqa"))
    prepare.add_argument("--source", required=True, help="folder of the unpacked raw release (see docs/prepare.md)")
    prepare.add_argument("--out", required=True, help="output folder: <split>.jsonl (or .parquet) + summary.json")
    prepare.add_argument("--embed-images", action="store_true",
                         help="write <split>.parquet with image bytes inside instead of JSONL referencing the files")
    prepare.add_argument("--model", help="model folder whose processor measures prompt lengths in tokens")
    prepare.add_argument("--config", help="training config whose data settings (pixels, prompt suffix, max prompt "
                                          "length) the token count uses; its model.path when --model is not given")
    prepare.add_argument("--image-dir", help="folder holding the images when not where the release puts them")
    prepare.add_argument("--templates", help="YAML overriding the task's prompt template (layout of templates.yaml)")
    prepare.add_argument("--box-format", choices=("xywh", "xyxy"),
                         help="refcoco: how the annotation writes boxes (default: COCO's xywh)")
    prepare.add_argument("--all-questions", action="store_true",
                         help="clevr: keep every question (default: the counting ones, as R1-V)")
    prepare.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                         help="a release with one split (SuperCLEVR's 'new', a Video-R1 file): write train and val, "
                              "F of the images/videos (with all their questions) in val, the same on every run")


def run(args: argparse.Namespace) -> int:
    return {"check": _check, "convert": _convert, "prepare": _prepare}[args.data_command](args)


def _check(args: argparse.Namespace) -> int:
    import dataclasses

    from vlrft.config import DataConfig, load_config
    from vlrft.data.check import check_dataset

    cfg, model = DataConfig(), args.model
    if args.config:
        full = load_config(args.config, validate=False)
        cfg, model = full.data, model or full.model.path or None
    overrides = {"format": args.format, "image_root": args.image_root, "max_prompt_length": args.max_prompt_length,
                 "system_prompt": args.system_prompt, "prompt_suffix": args.prompt_suffix}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    processor = None
    if model:
        from vlrft.models.loading import load_processor

        processor = load_processor(model)
    any_bad = False
    for path in args.paths:
        report = check_dataset(path, cfg, processor, require_answer=not args.allow_missing_answer)
        print(report.summary())
        any_bad |= not report.ok
    return 1 if any_bad else 0


def _convert(args: argparse.Namespace) -> int:
    from vlrft.data.convert import convert_dataset

    report = convert_dataset(args.source, args.target, args.format, args.image_root,
                             on_bad_sample="skip" if args.skip_bad else "error")
    for skipped in report.skipped:
        print(f"SKIPPED {skipped}")
    print(f"converted {report.source} ({report.layout} layout) -> {report.target}: {report.written} rows, "
          f"{report.media_files} media files, {len(report.skipped)} rows skipped")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vlrft.data.prepare import Options, prepare

    processor, data, model = None, None, args.model
    if args.config:
        from vlrft.config import load_config

        full = load_config(args.config, validate=False)
        data, model = full.data, model or full.model.path or None
    if model:
        from vlrft.models.loading import load_processor

        processor = load_processor(model)
    options = Options(image_dir=Path(args.image_dir) if args.image_dir else None, box_format=args.box_format,
                      all_questions=args.all_questions, val_fraction=args.val_fraction)
    summary = prepare(args.task, args.source, args.out, embed_images=args.embed_images, options=options,
                      templates=args.templates, processor=processor, model=model, data=data)
    print(summary.text())
    print(f"  summary: {Path(args.out) / 'summary.json'}")
    return 0
