"""Programs around the method, none of which the method needs: the benchmark (bench.py) with its tables (tables.py),
its GPU presets (presets.py) and its prompt sets (prompts.py), and the drafter trainer (train.py).
Run them from the repository's root: `python tools/bench.py ...`."""
