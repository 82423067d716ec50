"""The CPU demos' own code, outside the library: data generators (shapes.py, zoom_marks.py) and the recipes that
build the demos' starting models (demo_models.py, named by `model.build_recipe` in configs/demo.yaml and
configs/zoom_demo.yaml). Run from the repository root; `datasets/make_*.py` are their command lines."""
