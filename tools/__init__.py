"""Programs around the method, none of which the method needs: the benchmark (bench.py) with its tables (tables.py)
and its GPU presets (presets.py), and the drafter trainer (train.py). Their prompt sets (prompts.py) live at the
top level, since the checker sends them too (check.py --server).
Run them from the repository's root: `python tools/bench.py ...`."""
